"""Device mesh for expert parallelism: axis names, construction, checks and sharding rules.

The mesh is 2-D with axes `("data", "ep")`:

* `"ep"` -- an expert-parallel (EP) group: its P ranks partition the E expert weights
  (E/P local experts each) and exchange token rows in dispatch/combine.
* `"data"` -- expert data parallelism: ranks with the same `"ep"` index hold the same expert
  shard, so their expert gradients are reduced over this axis.

The three process groups of expert parallelism (EP groups, expert data-parallel groups, dense
data-parallel groups) are therefore three axis sets (`EP_GROUP_AXES`,
`EXPERT_DP_AXES`, `DENSE_DP_AXES`): a collective over an axis set runs within each group of
devices that differ only along those axes, which is exactly `dist.new_group` per group, without
having to create the groups in a consistent order by hand.

Tokens are split over both axes (every device holds distinct tokens), expert weights over `"ep"`
only, and dense/router parameters are replicated.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec

from moe_jax.validation import check_int

__all__ = [
    "DATA_AXIS",
    "EP_AXIS",
    "MESH_AXES",
    "EP_GROUP_AXES",
    "EXPERT_DP_AXES",
    "DENSE_DP_AXES",
    "make_mesh",
    "check_mesh",
    "expert_spec",
    "dense_spec",
    "activation_spec",
]

DATA_AXIS = "data"
EP_AXIS = "ep"
MESH_AXES = (DATA_AXIS, EP_AXIS)

# The process groups as mesh-axis sets (collective `axis_name`s).
EP_GROUP_AXES = (EP_AXIS,)  # dispatch/combine exchanges
EXPERT_DP_AXES = (DATA_AXIS,)  # reduce expert-weight gradients across replicas of one shard
DENSE_DP_AXES = (DATA_AXIS, EP_AXIS)  # reduce router/dense gradients: every device


def make_mesh(*, ep: int, data: int | None = None, devices: Sequence | None = None) -> Mesh:
    """A `("data", "ep")` mesh of shape `(data, ep)` over `devices` (default: all global devices).

    `data` defaults to `len(devices) // ep`; when given, `data * ep` must equal the number of
    devices (pass a slice such as `devices=jax.devices()[:data * ep]` to use fewer). Uses the
    global `jax.devices()`, so it works unchanged after `jax.distributed.initialize()` on many
    hosts; `"ep"` is the minor (fastest-varying) axis, so with devices in process order an EP group
    stays within one host whenever `ep` divides the devices per host.

    Both axes are `AxisType.Auto`: `jax.shard_map` reshards its inputs to the requested specs and
    sharding annotations (e.g. Flax NNX param metadata) work as constraints under `jit`.
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
        if data * ep != n:
            raise ValueError(
                f"data * ep = {data} * {ep} = {data * ep} but {n} devices were given; pass "
                f"devices=jax.devices()[:{data * ep}] or leave data=None to use all of them."
            )
    return jax.make_mesh((data, ep), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def check_mesh(mesh, num_experts: int) -> int:
    """Validate `mesh` (a `Mesh` or `AbstractMesh`) for `num_experts` experts; return the ep size.

    Raises ValueError when the mesh has no `"ep"` axis or `num_experts` is not a multiple of it.
    """
    num_experts = check_int("num_experts", num_experts)
    names = tuple(mesh.axis_names)
    if EP_AXIS not in names:
        raise ValueError(
            f"mesh has axes {names} but no '{EP_AXIS}' axis; build it with make_mesh(ep=...)."
        )
    ep = operator.index(mesh.shape[EP_AXIS])
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the '{EP_AXIS}' axis size {ep}; "
            f"every EP rank must hold the same number of experts (choose ep from the divisors "
            f"of {num_experts})."
        )
    return ep


def expert_spec() -> PartitionSpec:
    """Spec of an expert weight stack `[E, ...]`: experts split over `"ep"`, replicated over
    `"data"` (trailing dimensions unsplit). Each rank sees its `[E/P, ...]` local shard."""
    return PartitionSpec(EP_AXIS)


def dense_spec() -> PartitionSpec:
    """Spec of router and other dense parameters: replicated on every device."""
    return PartitionSpec()


def activation_spec() -> PartitionSpec:
    """Spec of token activations and per-token routing arrays (`[B, S, D]`, `[T, D]`, `[T, K]`):
    the leading (batch/token) dimension split over `("data", "ep")`, so every device holds
    distinct tokens; it must be divisible by the device count."""
    return PartitionSpec(MESH_AXES)
