"""The MoE layer's routed stage, per mesh case: pack, grouped SwiGLU, combine.

Legend (shape suffixes): T tokens, D routed-expert width, K top-k, E experts, El = E/P local
experts on one of P ep ranks, M packed rows.

- No mesh: the stage runs on the caller's arrays (`single_device`), also per device inside a
  caller's own `jax.shard_map`.
- A mesh whose expert axis has size 1 (or rules without one): every device runs all E experts on
  its own tokens inside `jax.shard_map` (tokens split over `AxisRules.tokens`, weights
  replicated).
- A mesh with ep > 1: `moe_jax.parallel.ep_moe` on each rank: dispatch, this rank's El experts
  (weights split over `AxisRules.experts`), combine. With `EPOptions(placement=...)` the "experts"
  are the placement's R*S physical slots (El = S): routes go to replicas
  (`moe_jax.parallel.replicas.route_to_replicas`), replicas' gradients are summed
  (`sum_replica_grads`), and the delivered counts are summed back per logical expert.

Gradients through `shard_map` need no hand-written reductions: the transpose of a replicated
input sums its cotangents over the mesh axes it is replicated on and that its tokens vary over
(the token axes for dense weights, the token axes but the expert axis for expert shards), once
the weights are cast to varying over them. Mesh axes outside the rules see replicated tokens and
weights and are left alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from moe_jax.experts import ExpertPlans, expert_plans, swiglu_experts, swiglu_experts_fused
from moe_jax.ops import AUTO_FUSED_GATHER, CANDIDATES, executed
from moe_jax.ops.platform import BackendTable
from moe_jax.ops.sharding import vary_to_union
from moe_jax.parallel import AxisRules, EPOptions, ep_moe, is_explicit
from moe_jax.parallel.capacity import resolve_capacity
from moe_jax.parallel.replicas import logical_counts, route_to_replicas, sum_replica_grads
from moe_jax.permute import combine, pack, pack_rows, packed_row_source

__all__ = ["ExpertStage", "Routed", "routed_on_mesh", "single_device"]


class Routed(NamedTuple):
    """What the routed stage returns."""

    y_TD: jax.Array  # routed output at width D, compute dtype
    gemm: "GemmTelemetry"  # the gate/up GEMM's rows and kernel, over devices
    dropped: jax.Array  # int32, capacity drops, global
    kept_E: jax.Array | None  # int32 [E], delivered routes per expert, global (None: nothing can drop)


class GemmTelemetry(NamedTuple):
    """The gate/up grouped GEMM of each device: rows executed P (at the chosen kernel's tile
    height), useful rows U, and which `CANDIDATES` member ran; sums and maxima over devices."""

    executed_rows: jax.Array  # int32, sum over devices
    executed_rows_max: jax.Array  # int32, the largest device's
    useful_rows: jax.Array  # int32, sum over devices
    useful_rows_max: jax.Array  # int32
    kernel_counts_C: jax.Array  # int32 [C], devices whose GEMM ran each candidate

    def reduce(self, axes) -> "GemmTelemetry":
        """Over the mesh axes `axes` (inside `shard_map`)."""
        return GemmTelemetry(lax.psum(self.executed_rows, axes), lax.pmax(self.executed_rows_max, axes),
                             lax.psum(self.useful_rows, axes), lax.pmax(self.useful_rows_max, axes),
                             lax.psum(self.kernel_counts_C, axes))


@dataclasses.dataclass(frozen=True)
class ExpertStage:
    """The routed experts' static configuration, shared by every mesh case.

    `weights` handed to the methods are `(w_gate_up, w_down)` with `fused_gate_up`, else
    `(w_gate, w_up, w_down)`, in the compute dtype (the `[El, ...]` shard inside `shard_map`).
    """

    num_experts: int
    d_in: int  # the experts' input/output width (D, or L with a latent)
    d_ff: int
    fused_gate_up: bool
    backend: str | BackendTable  # a backend name or `auto` with a table of its own
    precision: lax.Precision | None

    kernel: str  # "auto" (the tuned on-device selector) or "static" (the shape table)
    row_gather: str = "auto"  # "fused", "separate" or "auto" (`fuses_gather`)

    def plans(self, num_rows: int, dtype, num_experts: int | None = None) -> ExpertPlans:
        """The grouped GEMMs' plans on `num_rows` packed `dtype` rows of `num_experts` experts (the
        local experts of an ep rank; default all), decided once per call site:
        the experts run them and the telemetry reads the gate/up forward plan. The gate/up GEMMs
        read the token rows through the packing's ids (no packed copy) with `row_gather="fused"`,
        never with `"separate"`, and with `"auto"` where the gate/up GEMM's backend is one of
        `AUTO_FUSED_GATHER` (measured faster fused)."""
        make = functools.partial(expert_plans, num_rows, self.d_in, self.d_ff, num_experts or self.num_experts, dtype,
                                 fused_gate_up=self.fused_gate_up, backend=self.backend, precision=self.precision,
                                 kernel="auto" if self.kernel == "auto" else None)
        if self.row_gather == "auto":
            separate = make(gather=False)
            return make(gather=True) if separate.gate_up.fwd.backend in AUTO_FUSED_GATHER else separate
        return make(gather=self.row_gather == "fused")

    def experts(self, x_MD, group_sizes, weights, plans: ExpertPlans, rows=None):
        """The SwiGLU experts on packed rows `x_MD`, or with `rows` (a `RowGather`) on the
        token rows `x_MD` `[T, D]` read through `rows.ids_M`, running `plans`."""
        fn = swiglu_experts_fused if self.fused_gate_up else swiglu_experts
        return fn(x_MD, group_sizes, *weights, rows=rows, plans=plans)

    @staticmethod
    def telemetry(plans: ExpertPlans, group_sizes) -> GemmTelemetry:
        """One device's gate/up GEMM: the rows its plan executes on `group_sizes` and which
        `CANDIDATES` member ran (the backend's own rule, `moe_jax.ops.executed`: the selector's pick
        or the static candidate on `pallas_triton`; the tiles' rows and no candidate on `triton`
        and `mosaic_gpu`; the useful rows and no candidate on `xla`, whose tiling is its own)."""
        rows = executed(plans.gate_up.fwd, group_sizes)
        counts_C = (jnp.arange(len(CANDIDATES)) == rows.candidate).astype(jnp.int32)
        return GemmTelemetry(rows.executed_rows, rows.executed_rows, rows.useful_rows, rows.useful_rows, counts_C)


def _local(stage: ExpertStage, x_TD, idx_TK, w_TK, mask_T, weights):
    """Pack, grouped SwiGLU and combine on one device's tokens with all E experts."""
    packing = pack(idx_TK, stage.num_experts, mask_T=mask_T)
    plans = stage.plans(idx_TK.size, x_TD.dtype)
    if plans.gate_up.fwd.problem.gather:
        y_RD = stage.experts(x_TD, packing.group_sizes_E, weights, plans, rows=packed_row_source(x_TD, packing))
    else:
        y_RD = stage.experts(pack_rows(x_TD, packing, backend=stage.backend), packing.group_sizes_E, weights, plans)
    y_TD = combine(y_RD, w_TK, packing)  # pack(mask_T=...) already left masked routes out
    return y_TD, stage.telemetry(plans, packing.group_sizes_E)


def single_device(stage: ExpertStage, x_TD, idx_TK, w_TK, mask_T, weights) -> Routed:
    """The routed stage without a mesh of its own. Inside a caller's `shard_map` it runs on each
    device's tokens; replicated weights are cast to vary with the tokens, so their gradients sum
    over the caller's token axes (and the statistics are per device)."""
    _, weights = vary_to_union(weights, (x_TD, idx_TK, w_TK))
    y_TD, gemm = _local(stage, x_TD, idx_TK, w_TK, mask_T, weights)
    return Routed(y_TD, gemm, jnp.zeros((), jnp.int32), None)


def _varying(weights: tuple[jax.Array, ...], axes: tuple[str, ...]) -> tuple[jax.Array, ...]:
    """Weights replicated over the mesh axes `axes`, cast to varying over them (inside `shard_map`):
    the grouped GEMM's custom VJP returns a per-device weight gradient, and the cast's transpose
    is a `psum` over `axes`, exactly the sum of the gradients of a weight's replicas."""
    return tuple(lax.pcast(w, axes, to="varying") for w in weights)


def routed_on_mesh(stage: ExpertStage, mesh, rules: AxisRules, options: EPOptions, x_TD, idx_TK, w_TK, mask_T,
                   weights) -> Routed:
    """The routed stage inside `jax.shard_map` over `mesh` (a `Mesh` or the ambient
    `AbstractMesh`, Auto or Explicit axes) with tokens and experts placed by `rules`."""
    ep = rules.check(mesh, stage.num_experts)
    placement = options.placement  # with one, stage.num_experts counts its physical slots
    if mask_T is None:
        mask_T = jnp.ones(x_TD.shape[:1], jnp.bool_)

    def data_parallel(x_TD, idx_TK, w_TK, mask_T, *weights):
        weights = _varying(weights, rules.dense_replicas)  # replicated: gradients sum over the token axes
        y_TD, gemm = _local(stage, x_TD, idx_TK, w_TK, mask_T, weights)
        return y_TD, gemm.reduce(rules.tokens), jnp.zeros((), jnp.int32)

    def expert_parallel(x_TD, idx_TK, w_TK, mask_T, *weights):
        if placement is not None:
            # Before the cast below, so its transpose (the sum over the data replicas) comes first
            # and the replica sum then copies one result to every replica: identical bits.
            weights = tuple(sum_replica_grads(w, placement, rules.experts) for w in weights)
            idx_TK = route_to_replicas(idx_TK, placement, lax.axis_index(rules.experts), mask_T)
        weights = _varying(weights, rules.expert_replicas)  # an ep shard's replicas sum its gradients
        num_tokens, top_k = idx_TK.shape
        local = stage.num_experts // ep
        # Masked tokens are never sent and never count as dropped.
        capacity = options.capacity(num_tokens, top_k, ep, local)
        packed_rows = ep * resolve_capacity(capacity, num_tokens * top_k, local)  # P*C, as ep_dispatch lays out
        plans = stage.plans(packed_rows, x_TD.dtype, local)
        y_TD, stats = ep_moe(
            x_TD, idx_TK, w_TK, lambda x, sizes_El, rows=None: stage.experts(x, sizes_El, weights, plans, rows=rows),
            num_experts=stage.num_experts, axis_name=rules.experts, strategy=options.strategy,
            capacity=capacity, mask_T=mask_T, backend=stage.backend, transport=options.transport,
            fuse_regroup=plans.gate_up.fwd.problem.gather,
        )
        gemm = stage.telemetry(plans, stats.group_sizes_El).reduce(rules.tokens)
        kept = lax.psum(stats.kept_E, rules.tokens)
        if placement is not None:
            kept = logical_counts(kept, placement)  # statistics are per logical expert
        # stats.dropped is already the ep-group total; the groups of the replicas add up.
        return y_TD, gemm, lax.psum(stats.dropped, rules.expert_replicas), kept

    act, rep = rules.activation_spec(), P()
    body, weight_spec = (data_parallel, rep) if ep == 1 else (expert_parallel, rules.expert_spec())
    out_specs = (act, GemmTelemetry(*(rep,) * len(GemmTelemetry._fields)), rep) + (() if ep == 1 else (rep,))
    inputs = (x_TD, idx_TK, w_TK, mask_T, *weights)
    specs = (act,) * 4 + (weight_spec,) * len(weights)
    if is_explicit(mesh):
        # Explicit axes: shard_map takes inputs laid out as its specs say (Auto axes reshard).
        inputs = tuple(jax.sharding.reshard(a, spec) for a, spec in zip(inputs, specs))
    outputs = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs)(*inputs)
    return Routed(*outputs, *(() if ep > 1 else (None,)))
