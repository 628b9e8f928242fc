"""The MoE layer's routed stage, per mesh case: pack, grouped SwiGLU, combine.

Legend (shape suffixes): T tokens, D routed-expert width, K top-k, E experts, El = E/P local
experts on one of P ep ranks, M packed rows.

- No mesh: the stage runs on the caller's arrays (`single_device`), also per device inside a
  caller's own `jax.shard_map`.
- A mesh whose expert axis has size 1 (or rules without one): every device runs all E experts on
  its own tokens inside `jax.shard_map` (tokens split over `AxisRules.tokens`, weights
  replicated).
- A mesh with ep > 1: `moe_jax.parallel.ep_moe` on each rank: dispatch, this rank's El experts
  (weights split over `AxisRules.experts`), combine.

Gradients through `shard_map` need no hand-written reductions: the transpose of a replicated
input sums its cotangents over the mesh axes it is replicated on and that its tokens vary over
(the token axes for dense weights, the token axes but the expert axis for expert shards), once
the weights are cast to varying over them. Mesh axes outside the rules see replicated tokens and
weights and are left alone.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from moe_jax.experts import swiglu_experts, swiglu_experts_fused
from moe_jax.ops import (AUTO_FUSED_GATHER, CANDIDATES, candidate_index, gemm_backend, gmm_config, select,
                         selector_table, triton_candidate)
from moe_jax.ops.gmm import histogram_features
from moe_jax.ops.gmm.mosaic import group_tiles, mosaic_config
from moe_jax.ops.platform import BackendTable
from moe_jax.ops.sharding import vary_to_union
from moe_jax.parallel import AxisRules, EPOptions, ep_moe, is_explicit
from moe_jax.parallel.capacity import resolve_capacity
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

    def experts(self, x_MD, group_sizes, weights, rows=None):
        """The SwiGLU experts on packed rows `x_MD`, or with `rows` (a `RowGather`) on the
        token rows `x_MD` `[T, D]` read through `rows.ids_M`."""
        fn = swiglu_experts_fused if self.fused_gate_up else swiglu_experts
        return fn(x_MD, group_sizes, *weights, backend=self.backend, precision=self.precision,
                  kernel="auto" if self.kernel == "auto" else None, rows=rows)

    @property
    def gate_up_cols(self) -> int:
        """Output columns of the gate/up GEMM: 2F fused, F for each of the two otherwise."""
        return 2 * self.d_ff if self.fused_gate_up else self.d_ff

    def gate_up_backend(self, num_rows: int, num_groups: int, dtype) -> str:
        """The backend of the gate/up GEMM (`gmm_nt`) on `num_rows` packed `dtype` rows."""
        return gemm_backend("gmm_nt", self.backend, num_rows, num_groups,
                            operands=(self.gate_up_cols, self.d_in, jnp.dtype(dtype), jnp.dtype(dtype)))

    def fuses_gather(self, num_rows: int, dtype) -> bool:
        """Whether the gate/up GEMM reads the token rows through the packing's ids (no packed
        copy): always with `row_gather="fused"`, never with `"separate"`; with `"auto"` where
        the gate/up GEMM's backend is one of `AUTO_FUSED_GATHER` (measured faster fused)."""
        if self.row_gather != "auto":
            return self.row_gather == "fused"
        return self.gate_up_backend(num_rows, self.num_experts, dtype) in AUTO_FUSED_GATHER

    def telemetry(self, group_sizes, num_rows: int, dtype) -> GemmTelemetry:
        """One device's gate/up GEMM on `dtype` rows: on the Pallas backend the candidate that runs
        (the selector's pick, or the shape table's) and its executed rows; on the triton backend
        its row-tile candidate (`triton_candidate`); on the mosaic_gpu backend the rows of its
        aligned tiles and no candidate (its tiles are its own); on the xla backend the useful rows
        and no candidate (XLA's tiling is its own, so no tile padding is claimed)."""
        num_c = len(CANDIDATES)
        num_groups = group_sizes.shape[0]
        gate_up_cols = self.gate_up_cols
        backend = self.gate_up_backend(num_rows, num_groups, dtype)
        no_candidate = jnp.zeros((num_c,), jnp.int32)
        if backend == "xla":
            useful = jnp.sum(group_sizes, dtype=jnp.int32)
            return GemmTelemetry(useful, useful, useful, useful, no_candidate)
        if backend == "mosaic_gpu":
            useful = histogram_features(group_sizes, num_rows).useful_rows
            tile_m = mosaic_config(self.d_in, dtype).tile_m
            executed = tile_m * jnp.sum(group_tiles(group_sizes, num_rows=num_rows, tile_m=tile_m)[:-1])
            return GemmTelemetry(executed, executed, useful, useful, no_candidate)
        if backend == "triton":
            features = histogram_features(group_sizes, num_rows)
            chosen = candidate_index(triton_candidate(num_rows, gate_up_cols, self.d_in, num_groups))
        elif self.kernel == "auto":
            pick = select(group_sizes, num_rows, selector_table(gate_up_cols, self.d_in, num_groups))
            features, chosen = pick.features, pick.candidate
        else:
            features = histogram_features(group_sizes, num_rows)
            chosen = candidate_index(gmm_config(num_rows, gate_up_cols, self.d_in, num_groups))
        executed, useful = features.executed_C[chosen], features.useful_rows
        counts_C = (jnp.arange(num_c) == chosen).astype(jnp.int32)
        return GemmTelemetry(executed, executed, useful, useful, counts_C)


def _local(stage: ExpertStage, x_TD, idx_TK, w_TK, mask_T, weights):
    """Pack, grouped SwiGLU and combine on one device's tokens with all E experts."""
    packing = pack(idx_TK, stage.num_experts, mask_T=mask_T)
    if stage.fuses_gather(idx_TK.size, x_TD.dtype):
        y_RD = stage.experts(x_TD, packing.group_sizes_E, weights, rows=packed_row_source(x_TD, packing))
    else:
        y_RD = stage.experts(pack_rows(x_TD, packing, backend=stage.backend), packing.group_sizes_E, weights)
    y_TD = combine(y_RD, w_TK, packing)  # pack(mask_T=...) already left masked routes out
    return y_TD, stage.telemetry(packing.group_sizes_E, idx_TK.size, x_TD.dtype)


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
    if mask_T is None:
        mask_T = jnp.ones(x_TD.shape[:1], jnp.bool_)

    def data_parallel(x_TD, idx_TK, w_TK, mask_T, *weights):
        weights = _varying(weights, rules.dense_replicas)  # replicated: gradients sum over the token axes
        y_TD, gemm = _local(stage, x_TD, idx_TK, w_TK, mask_T, weights)
        return y_TD, gemm.reduce(rules.tokens), jnp.zeros((), jnp.int32)

    def expert_parallel(x_TD, idx_TK, w_TK, mask_T, *weights):
        weights = _varying(weights, rules.expert_replicas)  # an ep shard's replicas sum its gradients
        num_tokens, top_k = idx_TK.shape
        local = stage.num_experts // ep
        # Masked tokens are never sent and never count as dropped.
        capacity = options.capacity(num_tokens, top_k, ep, local)
        packed_rows = ep * resolve_capacity(capacity, num_tokens * top_k, local)  # P*C, as ep_dispatch lays out
        y_TD, stats = ep_moe(
            x_TD, idx_TK, w_TK, lambda x, sizes_El, rows=None: stage.experts(x, sizes_El, weights, rows=rows),
            num_experts=stage.num_experts, axis_name=rules.experts, strategy=options.strategy,
            capacity=capacity, mask_T=mask_T, backend=stage.backend, transport=options.transport,
            fuse_regroup=stage.fuses_gather(packed_rows, x_TD.dtype),
        )
        gemm = stage.telemetry(stats.group_sizes_El, ep * stats.capacity, x_TD.dtype).reduce(rules.tokens)
        # stats.dropped is already the ep-group total; the groups of the replicas add up.
        return (y_TD, gemm, lax.psum(stats.dropped, rules.expert_replicas), lax.psum(stats.kept_E, rules.tokens))

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
