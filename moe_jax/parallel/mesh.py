"""Device meshes for the MoE layer: axis rules, construction, checks and sharding specs.

Any `jax.sharding.Mesh` (Auto or Explicit axes) works. An `AxisRules` value says which of its
axes split the layer's tokens, which one splits its experts and which one (optionally) splits the
experts' hidden width; other axes are left alone (tokens and weights are replicated over them, as
a tensor- or pipeline-parallel axis of the user's model expects):

* the expert axis (default `"ep"`) is an expert-parallel (EP) group: its P ranks partition the
  E expert weights (E/P local experts each) and exchange token rows in dispatch/combine;
* the token axes (default `("data", "ep")`) split the tokens: every device along them holds
  distinct tokens. They must include the expert axis. Devices that differ only along the token
  axes other than the expert axis hold the same expert shard, so their expert gradients are
  summed over those axes; dense (router, shared-expert) gradients are summed over all token axes.
* the expert-tensor axis (`expert_tensor`, default None; `"etp"` in `make_mesh(etp=...)`) is an
  expert-tensor-parallel (ETP) group: its ranks see the same tokens (it is not a token axis) and
  each holds every local expert's F/ETP slice of the hidden width (gate/up rows, down columns);
  the partial down projections are summed over it (docs/expert-tensor-parallelism.md). Its ranks
  hold different weights and compute the same router and dense values, so no gradient is summed
  over it.

The three process groups of expert parallelism are therefore axis sets (`AxisRules.experts`,
`.expert_replicas`, `.dense_replicas`): a collective over an axis set runs within each group of
devices that differ only along those axes, which is exactly `torch.distributed.new_group` per
group, without creating the groups in a consistent order by hand.

`make_mesh(ep=..., data=...)` builds the default `("data", "ep")` mesh; `make_mesh(ep=...,
etp=..., data=...)` a `("data", "ep", "etp")` one.
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
    "ETP_AXIS",
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
ETP_AXIS = "etp"

# The process groups of the default mesh as axis sets (collective `axis_name`s).
EP_GROUP_AXES = (EP_AXIS,)  # dispatch/combine exchanges
EXPERT_DP_AXES = (DATA_AXIS,)  # reduce expert-weight gradients across replicas of one shard
DENSE_DP_AXES = (DATA_AXIS, EP_AXIS)  # reduce router/dense gradients: every device


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Which mesh axes shard the MoE layer's tokens, its experts and its experts' hidden width.

    tokens: the axes the token (batch) dimension is split over, major to minor, as in a
      `PartitionSpec` entry; must include `experts` when that is set.
    experts: the axis the expert dimension is split over (expert parallelism), or None for none:
      every device then runs all experts on its own tokens.
    expert_tensor: the axis the routed experts' hidden width F is split over (expert tensor
      parallelism, ETP), or None (default) for none. Not a token axis: tokens are replicated over
      it, as over a tensor-parallel axis of the user's model, and the partial outputs of its ranks
      are summed over it. Works alone (every rank holds all experts, F/ETP of each) or with
      `experts` (EP x ETP). Shared experts, router and latent projections stay replicated over it.
    """

    tokens: tuple[str, ...] = MESH_AXES
    experts: str | None = EP_AXIS
    expert_tensor: str | None = None

    def __post_init__(self):
        tokens = (self.tokens,) if isinstance(self.tokens, str) else tuple(self.tokens)
        if not tokens or not all(isinstance(a, str) for a in tokens) or len(set(tokens)) != len(tokens):
            raise ValueError(f"AxisRules.tokens={self.tokens!r}: must be one or more distinct mesh axis names.")
        if self.experts is not None and (not isinstance(self.experts, str) or self.experts not in tokens):
            raise ValueError(
                f"AxisRules.experts={self.experts!r}: must be one of the token axes {tokens} (each expert-parallel "
                "rank needs its own tokens), or None for no expert parallelism."
            )
        if self.expert_tensor is not None:
            if not isinstance(self.expert_tensor, str):
                raise ValueError(f"AxisRules.expert_tensor={self.expert_tensor!r}: must be a mesh axis name (e.g. "
                                 f"'{ETP_AXIS}'), or None for no expert tensor parallelism.")
            if self.expert_tensor in tokens:
                what = "the expert axis" if self.expert_tensor == self.experts else "a token axis"
                raise ValueError(
                    f"AxisRules.expert_tensor={self.expert_tensor!r} is {what} (tokens={tokens}, "
                    f"experts={self.experts!r}): its ranks must see the same tokens, since they split each "
                    "token's hidden width; name a mesh axis that is neither, e.g. "
                    f"AxisRules(tokens=('data', 'ep'), experts='ep', expert_tensor='{ETP_AXIS}')."
                )
        object.__setattr__(self, "tokens", tokens)

    @property
    def expert_replicas(self) -> tuple[str, ...]:
        """Axes over which devices hold the same expert shard and see different tokens (their
        expert gradients are summed): the token axes but the expert axis. The expert-tensor axis
        is never one: its ranks hold different F slices."""
        return tuple(a for a in self.tokens if a != self.experts)

    @property
    def dense_replicas(self) -> tuple[str, ...]:
        """Axes over which dense weights see different tokens (their gradients are summed): the
        token axes. Not the expert-tensor axis: its ranks see the same tokens and compute the same
        dense gradients."""
        return self.tokens

    def activation_spec(self) -> PartitionSpec:
        """Spec of token activations and per-token routing arrays (`[T, ...]`)."""
        return PartitionSpec(self.tokens)

    def expert_spec(self) -> PartitionSpec:
        """Spec of an expert weight stack `[E, ...]`: experts split over the expert axis (the
        trailing dimensions as `gate_up_spec` and `down_spec` say under expert tensor parallelism)."""
        return PartitionSpec(self.experts)

    def gate_up_spec(self) -> PartitionSpec:
        """Spec of the gate/up weights `[E, F, Din]` (and of a fused `[E, 2F, Din]`, whose rows are
        then in `moe_jax.experts.fuse_gate_up(..., shards=ETP)` order): experts over the expert
        axis, hidden rows over the expert-tensor axis."""
        return PartitionSpec(self.experts, self.expert_tensor, None)

    def down_spec(self) -> PartitionSpec:
        """Spec of the down weight `[E, Din, F]`: experts over the expert axis, hidden columns over
        the expert-tensor axis."""
        return PartitionSpec(self.experts, None, self.expert_tensor)

    def check(self, mesh, num_experts: int) -> int:
        """ValueError unless every rule's axis is one of `mesh`'s and E divides over the expert
        axis; returns the ep size (1 without an expert axis)."""
        names = tuple(mesh.axis_names)
        missing = [a for a in (*self.tokens, self.expert_tensor) if a is not None and a not in names]
        if missing:
            raise ValueError(
                f"axis rules name {missing}, which the mesh (axes {names}) does not have; pass "
                f"axis_rules=AxisRules(tokens=..., experts=..., expert_tensor=...) with axes of this mesh."
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

    def check_expert_tensor(self, mesh, d_ff: int) -> int:
        """ValueError unless the expert-tensor axis splits F evenly (after `check`, which finds the
        axis in `mesh`); returns the ETP size (1 without an expert-tensor axis)."""
        if self.expert_tensor is None:
            return 1
        etp = operator.index(mesh.shape[self.expert_tensor])
        if d_ff % etp:
            raise ValueError(
                f"d_ff={d_ff} is not divisible by the '{self.expert_tensor}' axis size {etp}; every expert-tensor "
                f"rank must hold the same slice of the hidden width (choose etp from the divisors of {d_ff})."
            )
        return etp

    def token_shards(self, mesh) -> int:
        """How many pieces the token dimension is cut into on `mesh`."""
        return math.prod(operator.index(mesh.shape[a]) for a in self.tokens)


def is_explicit(mesh) -> bool:
    """Whether any axis of `mesh` (a `Mesh` or `AbstractMesh`) has `AxisType.Explicit`."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def make_mesh(*, ep: int, data: int | None = None, etp: int | None = None, devices: Sequence | None = None,
              axis_type: AxisType = AxisType.Auto) -> Mesh:
    """A `("data", "ep")` mesh of shape `(data, ep)` over `devices` (default: all global devices),
    or with `etp` a `("data", "ep", "etp")` mesh of shape `(data, ep, etp)`.

    `data` defaults to `len(devices) // (ep * etp)`; when given, `data * ep * etp` devices are
    used: all of `devices` when they are exactly that many (pass a slice such as
    `devices=jax.devices()[:8]` to use fewer). Uses the global `jax.devices()`, so it works
    unchanged after `jax.distributed.initialize()` on many hosts. The minor (fastest-varying) axis
    is `"etp"`, then `"ep"`: with devices in process order an ETP group (whose all-reduce runs in
    every layer, forward and backward) stays within one host whenever etp divides the devices per
    host, and an EP group whenever ep * etp does. Pass the ETP axis to the layer as
    `AxisRules(expert_tensor="etp")`; `etp=None` (default) builds no such axis.

    `axis_type` applies to every axis: `AxisType.Auto` (default; `jax.shard_map` reshards its
    inputs and sharding annotations act as constraints) or `AxisType.Explicit` (shardings are
    part of the array types, as `jax.make_mesh` makes them by default).
    """
    ep = check_int("ep", ep)
    sizes, names = (ep,), MESH_AXES
    if etp is not None:
        sizes, names = (ep, check_int("etp", etp)), (*MESH_AXES, ETP_AXIS)
    group = math.prod(sizes)
    names_of_group = " * ".join(names[1:])
    # "ep=3" or "ep * etp = 3 * 2 = 6"; "data * ep = 3 * 2 = 6" or "data * ep * etp = 1 * 3 * 2 = 6".
    group_is = f"ep={ep}" if etp is None else f"ep * etp = {ep} * {etp} = {group}"
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n == 0:
        raise ValueError("make_mesh got an empty device list.")
    if data is None:
        if n % group:
            raise ValueError(
                f"{group_is} does not divide the {n} devices; pick {names_of_group} so that it divides {n} "
                f"or pass devices=... with a multiple of {group} devices."
            )
        data = n // group
    else:
        data = check_int("data", data)
        total_is = f"data * {names_of_group} = {' * '.join(map(str, (data, *sizes)))} = {data * group}"
        if data * group > n:
            raise ValueError(
                f"{total_is} devices are needed but only {n} were given; lower data or {names_of_group} "
                f"(data * {names_of_group} <= {n}), or leave data=None to use all {n} devices."
            )
        if data * group != n:
            raise ValueError(
                f"{total_is} but {n} devices were given; pass devices=jax.devices()[:{data * group}] or leave "
                "data=None to use all of them."
            )
    if axis_type not in (AxisType.Auto, AxisType.Explicit):
        raise ValueError(f"axis_type={axis_type!r}: use jax.sharding.AxisType.Auto or AxisType.Explicit.")
    return jax.make_mesh((data, *sizes), names, axis_types=(axis_type,) * len(names), devices=devices)


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
