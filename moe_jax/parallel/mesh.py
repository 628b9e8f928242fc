"""Device meshes for the MoE layer: axis rules, construction, checks and sharding specs.

Any `jax.sharding.Mesh` (Auto or Explicit axes) works. An `AxisRules` value says which of its
axes split the layer's tokens and which one splits its experts; other axes are left alone
(tokens and weights are replicated over them, as a tensor- or pipeline-parallel axis of the
user's model expects):

* the expert axis (default `"ep"`) is an expert-parallel (EP) group: its P ranks partition the
  E expert weights (E/P local experts each) and exchange token rows in dispatch/combine;
* the token axes (default `("data", "ep")`) split the tokens: every device along them holds
  distinct tokens. They must include the expert axis. Devices that differ only along the token
  axes other than the expert axis hold the same expert shard, so their expert gradients are
  summed over those axes; dense (router, shared-expert) gradients are summed over all token axes.

The three process groups of expert parallelism are therefore axis sets (`AxisRules.experts`,
`.expert_replicas`, `.dense_replicas`): a collective over an axis set runs within each group of
devices that differ only along those axes, which is exactly `torch.distributed.new_group` per
group, without creating the groups in a consistent order by hand.

`make_mesh(ep=..., data=...)` builds the default `("data", "ep")` mesh.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec

from moe_jax.validation import check_int

__all__ = [
    "DATA_AXIS",
    "DENSE_DP_AXES",
    "EP_AXIS",
    "EP_GROUP_AXES",
    "EXPERT_DP_AXES",
    "MESH_AXES",
    "AxisRules",
    "activation_spec",
    "check_mesh",
    "dense_spec",
    "expert_spec",
    "is_explicit",
    "make_mesh",
]

DATA_AXIS = "data"
EP_AXIS = "ep"
MESH_AXES = (DATA_AXIS, EP_AXIS)

# The process groups of the default mesh as axis sets (collective `axis_name`s).
EP_GROUP_AXES = (EP_AXIS,)  # dispatch/combine exchanges
EXPERT_DP_AXES = (DATA_AXIS,)  # reduce expert-weight gradients across replicas of one shard
DENSE_DP_AXES = (DATA_AXIS, EP_AXIS)  # reduce router/dense gradients: every device


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Which mesh axes shard the MoE layer's tokens and which one shards its experts.

    tokens: the axes the token (batch) dimension is split over, major to minor, as in a
      `PartitionSpec` entry; must include `experts` when that is set.
    experts: the axis the expert dimension is split over (expert parallelism), or None for none:
      every device then runs all experts on its own tokens.
    """

    tokens: tuple[str, ...] = MESH_AXES
    experts: str | None = EP_AXIS

    def __post_init__(self):
        tokens = (self.tokens,) if isinstance(self.tokens, str) else tuple(self.tokens)
        if not tokens or not all(isinstance(a, str) for a in tokens) or len(set(tokens)) != len(tokens):
            raise ValueError(f"AxisRules.tokens={self.tokens!r}: must be one or more distinct mesh axis names.")
        if self.experts is not None and (not isinstance(self.experts, str) or self.experts not in tokens):
            raise ValueError(
                f"AxisRules.experts={self.experts!r}: must be one of the token axes {tokens} (each expert-parallel "
                "rank needs its own tokens), or None for no expert parallelism."
            )
        object.__setattr__(self, "tokens", tokens)

    @property
    def expert_replicas(self) -> tuple[str, ...]:
        """Axes over which devices hold the same expert shard (their expert gradients are summed)."""
        return tuple(a for a in self.tokens if a != self.experts)

    @property
    def dense_replicas(self) -> tuple[str, ...]:
        """Axes over which dense weights see different tokens (their gradients are summed)."""
        return self.tokens

    def activation_spec(self) -> PartitionSpec:
        """Spec of token activations and per-token routing arrays (`[T, ...]`)."""
        return PartitionSpec(self.tokens)

    def expert_spec(self) -> PartitionSpec:
        """Spec of an expert weight stack `[E, ...]`: experts split over the expert axis."""
        return PartitionSpec(self.experts)

    def check(self, mesh, num_experts: int) -> int:
        """ValueError unless every rule's axis is one of `mesh`'s and E divides over the expert
        axis; returns the ep size (1 without an expert axis)."""
        names = tuple(mesh.axis_names)
        missing = [a for a in self.tokens if a not in names]
        if missing:
            raise ValueError(
                f"axis rules name {missing}, which the mesh (axes {names}) does not have; pass "
                f"axis_rules=AxisRules(tokens=..., experts=...) with axes of this mesh."
            )
        if self.experts is None:
            return 1
        ep = operator.index(mesh.shape[self.experts])
        if num_experts % ep:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the '{self.experts}' axis size {ep}; every EP "
                f"rank must hold the same number of experts (choose ep from the divisors of {num_experts})."
            )
        return ep

    def token_shards(self, mesh) -> int:
        """How many pieces the token dimension is cut into on `mesh`."""
        return math.prod(operator.index(mesh.shape[a]) for a in self.tokens)


def is_explicit(mesh) -> bool:
    """Whether any axis of `mesh` (a `Mesh` or `AbstractMesh`) has `AxisType.Explicit`."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def make_mesh(*, ep: int, data: int | None = None, devices: Sequence | None = None,
              axis_type: AxisType = AxisType.Auto) -> Mesh:
    """A `("data", "ep")` mesh of shape `(data, ep)` over `devices` (default: all global devices).

    `data` defaults to `len(devices) // ep`; when given, `data * ep` devices are used: all of
    `devices` when they are exactly that many (pass a slice such as `devices=jax.devices()[:8]` to
    use fewer). Uses the global `jax.devices()`, so it works unchanged after
    `jax.distributed.initialize()` on many hosts; `"ep"` is the minor (fastest-varying) axis, so
    with devices in process order an EP group stays within one host whenever `ep` divides the
    devices per host.

    `axis_type` applies to both axes: `AxisType.Auto` (default; `jax.shard_map` reshards its
    inputs and sharding annotations act as constraints) or `AxisType.Explicit` (shardings are
    part of the array types, as `jax.make_mesh` makes them by default).
    """
    ep = check_int("ep", ep)
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n == 0:
        raise ValueError("make_mesh got an empty device list.")
    if data is None:
        if n % ep:
            raise ValueError(
                f"ep={ep} does not divide the {n} devices; pick ep from the divisors of {n} "
                "or pass devices=... with a multiple of ep devices."
            )
        data = n // ep
    else:
        data = check_int("data", data)
        if data * ep > n:
            raise ValueError(
                f"data * ep = {data} * {ep} = {data * ep} devices are needed but only {n} were given; lower data or "
                f"ep (data * ep <= {n}), or leave data=None to use all {n} devices."
            )
        if data * ep != n:
            raise ValueError(
                f"data * ep = {data} * {ep} = {data * ep} but {n} devices were given; pass "
                f"devices=jax.devices()[:{data * ep}] or leave data=None to use all of them."
            )
    if axis_type not in (AxisType.Auto, AxisType.Explicit):
        raise ValueError(f"axis_type={axis_type!r}: use jax.sharding.AxisType.Auto or AxisType.Explicit.")
    return jax.make_mesh((data, ep), MESH_AXES, axis_types=(axis_type, axis_type), devices=devices)


def check_mesh(mesh, num_experts: int, rules: AxisRules = AxisRules()) -> int:
    """Validate `mesh` (a `Mesh` or `AbstractMesh`) for `num_experts` experts under `rules`;
    return the ep size. ValueError when a rule names an axis the mesh lacks or E does not divide."""
    return rules.check(mesh, check_int("num_experts", num_experts))


def expert_spec() -> PartitionSpec:
    """Spec of an expert weight stack `[E, ...]` on the default mesh: experts split over `"ep"`,
    replicated over `"data"` (trailing dimensions unsplit). Each rank sees its `[E/P, ...]` shard."""
    return AxisRules().expert_spec()


def dense_spec() -> PartitionSpec:
    """Spec of router and other dense parameters: replicated on every device."""
    return PartitionSpec()


def activation_spec() -> PartitionSpec:
    """Spec of token activations and per-token routing arrays (`[B, S, D]`, `[T, D]`, `[T, K]`) on
    the default mesh: the leading (batch/token) dimension split over `("data", "ep")`, so every
    device holds distinct tokens; it must be divisible by the device count."""
    return AxisRules().activation_spec()
