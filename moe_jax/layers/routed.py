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
- Either of the last two with an expert-tensor axis (`AxisRules.expert_tensor`, ETP): every rank
  of an ETP group sees the same tokens, runs its F/ETP slice of every (local) expert's hidden
  width (gate/up rows and down columns) to a partial output, and the partial outputs `[T, D]` are
  summed over the ETP axis after the combine (`lax.psum`, an all-reduce: the tokens and so the
  output are replicated over that axis, and T rows are K times fewer than the routes' rows).
  This is the tensor-parallel MLP split of Megatron-LM (Shoeybi et al., 2019: gate/up split by
  output rows, down by input columns, one all-reduce) applied to every expert. Under EP the
  dispatch and combine run within each ETP slice of the EP group (the ranks of one ETP index),
  as Megatron-Core's MoE layer does with `--expert-tensor-parallel-size` (Megatron-Core MoE
  docs). docs/expert-tensor-parallelism.md has the layout and the bytes.

Gradients through `shard_map` need no hand-written reductions: the transpose of a replicated
input sums its cotangents over the mesh axes it is replicated on and that its tokens vary over
(the token axes for dense weights, the token axes but the expert axis for expert shards), once
the weights are cast to varying over them. Mesh axes outside the rules see replicated tokens and
weights and are left alone. Under ETP the tokens and combine weights are cast to varying over the
ETP axis, so the cast's transpose sums their partial gradients over the hidden slices; the psum's
transpose hands every slice the whole output gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from moe_jax.experts import ExpertPlans, expert_plans, swiglu_experts, swiglu_experts_fp8, swiglu_experts_fused
from moe_jax.layers.options import Fp8Blockwise
from moe_jax.ops import AUTO_FUSED_GATHER, CANDIDATES, Fp8Copies, executed, fp8_weight_copies
from moe_jax.ops.fp8 import Fp8Weights
from moe_jax.ops.platform import BackendTable
from moe_jax.ops.sharding import vary_like
from moe_jax.parallel import AxisRules, EPOptions, ep_moe, is_explicit
from moe_jax.parallel.capacity import resolve_capacity
from moe_jax.parallel.chunks import token_chunks
from moe_jax.parallel.replicas import logical_counts, route_to_replicas, sum_replica_grads
from moe_jax.permute import combine, pack, pack_rows, packed_row_source

__all__ = ["ExpertStage", "Routed", "copies_on_mesh", "dense_on_mesh", "routed_copies", "routed_on_mesh",
           "single_device"]


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
    `(w_gate, w_up, w_down)`, in the compute dtype (the `[El, ...]` shard inside `shard_map`); with
    stored FP8 weights (`Fp8Blockwise(weights="stored")`) each is an e4m3 values, fp32 block scales
    pair, flat: `(w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale)`.
    """

    num_experts: int
    d_in: int  # the experts' input/output width (D, or L with a latent)
    d_ff: int
    fused_gate_up: bool
    backend: str | BackendTable  # a backend name or `auto` with a table of its own
    precision: lax.Precision | None

    kernel: str  # "auto" (the tuned on-device selector) or "static" (the shape table)
    row_gather: str = "auto"  # "fused", "separate" or "auto" (`fuses_gather`)
    quantization: Fp8Blockwise | None = None  # FP8 experts (unfused gate/up)

    def plans(self, num_rows: int, dtype, num_experts: int | None = None, *, gather: bool | None = None) -> ExpertPlans:
        """The grouped GEMMs' plans on `num_rows` packed `dtype` rows of `num_experts` experts (the
        local experts of an ep rank; default all), decided once per call site:
        the experts run them and the telemetry reads the gate/up forward plan. The gate/up GEMMs
        read the token rows through the packing's ids (no packed copy) with `row_gather="fused"`,
        never with `"separate"`, and with `"auto"` where the gate/up GEMM's backend is one of
        `AUTO_FUSED_GATHER` (measured faster fused; always for FP8 experts). `gather` (a bool)
        overrides that choice: the chunks of one exchange share the largest chunk's. With
        `quantization` the plans only serve the telemetry (the FP8 op plans its own products)."""
        make = functools.partial(expert_plans, num_rows, self.d_in, self.d_ff, num_experts or self.num_experts, dtype,
                                 fused_gate_up=self.fused_gate_up, backend=self.backend, precision=self.precision,
                                 kernel="auto" if self.kernel == "auto" else None)
        if gather is None and self.quantization is not None and self.row_gather == "auto":
            # FP8 experts gather: the quantized token rows are gathered once into the packed layout,
            # and the weight gradient reads the packed dequantized rows (docs/decisions.md,
            # "FP8 experts: gate and up in one call, and the row gather").
            gather = True
        if gather is not None:
            return make(gather=gather)
        if self.row_gather == "auto":
            separate = make(gather=False)
            return make(gather=True) if separate.gate_up.fwd.backend in AUTO_FUSED_GATHER else separate
        return make(gather=self.row_gather == "fused")

    def experts(self, x_MD, group_sizes, weights, plans: ExpertPlans, rows=None, copies=None, quantized=None):
        """The SwiGLU experts on packed rows `x_MD`, or with `rows` (a `RowGather`) on the
        token rows `x_MD` `[T, D]` read through `rows.ids_M`, running `plans`. With `quantization`
        the FP8 experts run (`swiglu_experts_fp8`, which quantizes each token row once when given
        `rows`; `plans` then only serve the telemetry), reading FP8 master weights' `copies` (the
        three `Fp8Copies` of `routed_copies`) instead of quantizing the weights when given, and
        the rows' FP8 form `quantized` (as an FP8 exchange delivered them) instead of quantizing
        `x_MD` when given."""
        if self.quantization is not None:
            if self.quantization.stored:
                weights = [Fp8Weights(*weights[i:i + 2]) for i in range(0, len(weights), 2)]
            return swiglu_experts_fp8(x_MD, group_sizes, *weights, backend=self.backend, rows=rows,
                                      input_gradient=self.quantization.input_gradient, copies=copies,
                                      quantized=quantized)
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

    @staticmethod
    def chunked_telemetry(parts: list[GemmTelemetry]) -> GemmTelemetry:
        """One device's telemetry over its chunks' gate/up GEMMs: rows summed on the device (its
        maxima are the device's total, so a later maximum over devices compares whole devices, as
        unchunked), and a candidate counted once if any of its chunks ran it."""
        total = lambda field: functools.reduce(jnp.add, (getattr(t, field) for t in parts))  # noqa: E731
        kernels_C = functools.reduce(jnp.maximum, (t.kernel_counts_C for t in parts))
        return GemmTelemetry(total("executed_rows"), total("executed_rows_max"), total("useful_rows"),
                             total("useful_rows_max"), kernels_C)


def _local(stage: ExpertStage, x_TD, idx_TK, w_TK, mask_T, weights, copies):
    """Pack, grouped SwiGLU and combine on one device's tokens with all E experts."""
    packing = pack(idx_TK, stage.num_experts, mask_T=mask_T)
    plans = stage.plans(idx_TK.size, x_TD.dtype)
    if plans.gate_up.fwd.problem.gather:
        y_RD = stage.experts(x_TD, packing.group_sizes_E, weights, plans, rows=packed_row_source(x_TD, packing),
                             copies=copies)
    else:
        y_RD = stage.experts(pack_rows(x_TD, packing, backend=stage.backend), packing.group_sizes_E, weights, plans,
                             copies=copies)
    y_TD = combine(y_RD, w_TK, packing)  # pack(mask_T=...) already left masked routes out
    return y_TD, stage.telemetry(plans, packing.group_sizes_E)


def single_device(stage: ExpertStage, x_TD, idx_TK, w_TK, mask_T, weights, copies=None) -> Routed:
    """The routed stage without a mesh of its own. Inside a caller's `shard_map` it runs on each
    device's tokens; replicated weights (and FP8 `copies` of them, `routed_copies`) are cast to
    vary with the tokens, so their gradients sum over the caller's token axes (and the
    statistics are per device)."""
    weights, copies = vary_like((tuple(weights), copies), (x_TD, idx_TK, w_TK))
    y_TD, gemm = _local(stage, x_TD, idx_TK, w_TK, mask_T, weights, copies)
    return Routed(y_TD, gemm, jnp.zeros((), jnp.int32), None)


def _varying(tree, axes: tuple[str, ...]):
    """The arrays of `tree` (weights, or FP8 copies of them) replicated over the mesh axes `axes`,
    cast to varying over them (inside `shard_map`): the grouped GEMM's custom VJP returns a
    per-device weight gradient, and the cast's transpose is a `psum` over `axes`, exactly the sum
    of the gradients of a weight's replicas."""
    return jax.tree.map(lambda w: lax.pcast(w, axes, to="varying"), tree)


def dense_on_mesh(fn, mesh, rules: AxisRules, x_TD, inputs: tuple):
    """`fn(x_TD, *inputs) -> [T, D]` inside `jax.shard_map` over `mesh` as the data-parallel
    routed stage runs: each device on its tokens (split over `AxisRules.tokens`), `inputs` (pytrees
    of dense weights, or of their FP8 copies) replicated and cast to varying over the token axes
    (the weights' gradients sum there). For a dense FFN of custom-VJP kernels (the shared experts in
    FP8), which XLA's partitioner would otherwise run on gathered tokens."""
    def body(x_TD, *inputs):
        return fn(x_TD, *_varying(inputs, rules.dense_replicas))

    act = rules.activation_spec()
    return _shard_map(body, mesh, (act, *jax.tree.map(lambda _: P(), inputs)), act, (x_TD, *inputs))


def _shard_map(body, mesh, in_specs: tuple, out_specs, inputs: tuple):
    """`jax.shard_map(body)` over `mesh` on `inputs`; under Explicit axes the inputs are first laid
    out as `in_specs` say (shard_map takes them so; Auto axes reshard on their own)."""
    if is_explicit(mesh):
        inputs = tuple(jax.tree.map(jax.sharding.reshard, a, spec) for a, spec in zip(inputs, in_specs))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*inputs)


def _hidden_slices(x_TD, w_TK, axis: str | None):
    """Under ETP (`axis`): the tokens and combine weights, replicated over the ETP axis, cast to
    varying over it like the F-sliced expert weights they meet; the cast's transpose sums the
    partial gradients of the slices. Unchanged without ETP."""
    if axis is None:
        return x_TD, w_TK
    return lax.pcast(x_TD, axis, to="varying"), lax.pcast(w_TK, axis, to="varying")


def _sum_slices(y_TD, axis: str | None):
    """Under ETP: the full output, the sum of the F slices' partial outputs over the ETP axis."""
    return y_TD if axis is None else lax.psum(y_TD, axis)


def _weight_specs(stage: ExpertStage, mesh, rules: AxisRules) -> tuple[P, ...]:
    """The specs of the routed weights as `ExpertStage` takes them (stored FP8: values, then scales)."""
    # Without EP the weights hold every expert (replicated over the expert axis of size 1).
    weight_rules = rules if rules.check(mesh, stage.num_experts) > 1 else dataclasses.replace(rules, experts=None)
    gate_up, down = weight_rules.gate_up_spec(), weight_rules.down_spec()
    specs = (gate_up, down) if stage.fused_gate_up else (gate_up, gate_up, down)
    if stage.quantization is not None and stage.quantization.stored:
        # A block-scale stack [E, Nb, Kb] splits as its values [E, N, K] do: whole 128 x 128 blocks
        # per shard, which the layer checked for the hidden width under ETP.
        specs = tuple(spec for spec in specs for _ in range(2))
    return specs


def _copy_specs(specs: tuple[P, ...], transposed: bool) -> tuple[Fp8Copies, ...]:
    """The specs of `fp8_weight_copies` made per shard of weights laid out as `specs`: values and
    block scales split as their weight `[E, N, K]` is (each shard's blocks laid from its own first
    row and column), the `[E, K, N]` copy with the last two axes swapped."""
    def swap(spec):
        e, n, k = (*spec, None, None, None)[:3]
        return P(e, k, n)

    return tuple(Fp8Copies(Fp8Weights(s, s), Fp8Weights(swap(s), swap(s)) if transposed else None) for s in specs)


def copies_on_mesh(mesh, specs: tuple[P, ...] | None, weights: tuple, *, backend, input_gradient: str):
    """`fp8_weight_copies(weights, backend=, input_gradient=)` made where a call inside `jax.shard_map`
    over `mesh` quantizes the weights laid out as `specs`: each device quantizes its own shard, so
    the copies equal the call's quantization bit for bit (also where a shard's width is no multiple
    of 128). `mesh` None: on the arrays as they are."""
    make = functools.partial(fp8_weight_copies, backend=backend, input_gradient=input_gradient)
    if mesh is None:
        return make(tuple(weights))
    return _shard_map(lambda *ws: make(ws), mesh, specs, _copy_specs(specs, input_gradient == "fp8"), tuple(weights))


def routed_copies(stage: ExpertStage, placement: tuple | None, weights: tuple) -> tuple[Fp8Copies, ...]:
    """The FP8 master `weights` `(w_gate, w_up, w_down)` quantized as the routed stage on
    `placement` (`(mesh, rules)` for `routed_on_mesh`, None for `single_device`) quantizes them in
    each call: pass the result as its `copies`."""
    mesh, specs = (None, None) if placement is None else (placement[0], _weight_specs(stage, *placement))
    return copies_on_mesh(mesh, specs, weights, backend=stage.backend,
                          input_gradient=stage.quantization.input_gradient)


def routed_on_mesh(stage: ExpertStage, mesh, rules: AxisRules, options: EPOptions, x_TD, idx_TK, w_TK, mask_T,
                   weights, copies=None) -> Routed:
    """The routed stage inside `jax.shard_map` over `mesh` (a `Mesh` or the ambient
    `AbstractMesh`, Auto or Explicit axes) with tokens, experts and the experts' hidden width
    placed by `rules`; FP8 master weights' `copies` (`routed_copies` on the same placement) are
    read instead of quantizing the weights when given."""
    ep = rules.check(mesh, stage.num_experts)
    etp_axis = rules.expert_tensor
    # Inside shard_map each rank's experts are F/ETP wide: plan the GEMMs for that width.
    local_stage = dataclasses.replace(stage, d_ff=stage.d_ff // rules.check_expert_tensor(mesh, stage.d_ff))
    placement = options.placement  # with one, stage.num_experts counts its physical slots
    if mask_T is None:
        mask_T = jnp.ones(x_TD.shape[:1], jnp.bool_)

    def data_parallel(x_TD, idx_TK, w_TK, mask_T, weights, copies):
        # replicated: gradients sum over the token axes
        weights, copies = _varying((weights, copies), rules.dense_replicas)
        x_TD, w_TK = _hidden_slices(x_TD, w_TK, etp_axis)
        y_TD, gemm = _local(local_stage, x_TD, idx_TK, w_TK, mask_T, weights, copies)
        return _sum_slices(y_TD, etp_axis), gemm.reduce(rules.tokens), jnp.zeros((), jnp.int32)

    def expert_parallel(x_TD, idx_TK, w_TK, mask_T, weights, copies):
        if placement is not None:
            # Before the cast below, so its transpose (the sum over the data replicas) comes first
            # and the replica sum then copies one result to every replica: identical bits.
            weights = tuple(sum_replica_grads(w, placement, rules.experts) for w in weights)
            idx_TK = route_to_replicas(idx_TK, placement, lax.axis_index(rules.experts), mask_T)
        # an ep shard's replicas sum its gradients
        weights, copies = _varying((weights, copies), rules.expert_replicas)
        x_TD, w_TK = _hidden_slices(x_TD, w_TK, etp_axis)
        num_tokens, top_k = idx_TK.shape
        local = stage.num_experts // ep
        # Masked tokens are never sent and never count as dropped. C is each chunk's.
        capacity = options.capacity(num_tokens, top_k, ep, local)
        # P*C packed rows of each chunk, as ep_dispatch lays them out.
        chunk_rows = [ep * resolve_capacity(capacity, (b - a) * top_k, local)
                      for a, b in token_chunks(num_tokens, options.chunks)]
        # One row-gather choice for all chunks (ep_moe takes one fuse_regroup): the largest chunk's.
        gather = local_stage.plans(max(chunk_rows), x_TD.dtype, local).gate_up.fwd.problem.gather
        plans = {rows: local_stage.plans(rows, x_TD.dtype, local, gather=gather) for rows in set(chunk_rows)}

        def experts(x, sizes_El, rows=None, fp8_rows=None):
            packed = x.shape[0] if rows is None else rows.ids_M.shape[0]
            return local_stage.experts(x, sizes_El, weights, plans[packed], rows=rows, copies=copies,
                                       quantized=fp8_rows)

        y_TD, stats = ep_moe(
            x_TD, idx_TK, w_TK, experts, num_experts=stage.num_experts, axis_name=rules.experts,
            strategy=options.strategy, capacity=capacity, mask_T=mask_T, backend=stage.backend,
            transport=options.transport, fuse_regroup=gather, chunks=options.chunks,
            # FP8 experts quantize the rows per 1 x 128 tile anyway: they cross the exchange so, and
            # the experts compute on the e4m3 rows that arrive instead of quantizing them again.
            fp8_dispatch=stage.quantization is not None, fp8_rows=stage.quantization is not None,
        )
        gemm = local_stage.chunked_telemetry([local_stage.telemetry(plans[rows], sizes_El)
                                              for rows, sizes_El in zip(chunk_rows, stats.chunk_group_sizes_NEl)])
        gemm = gemm.reduce(rules.tokens)
        kept = lax.psum(stats.kept_E, rules.tokens)
        if placement is not None:
            kept = logical_counts(kept, placement)  # statistics are per logical expert
        # stats.dropped is already the ep-group total; the groups of the replicas add up.
        return _sum_slices(y_TD, etp_axis), gemm, lax.psum(stats.dropped, rules.expert_replicas), kept

    act, rep = rules.activation_spec(), P()
    weight_specs = _weight_specs(stage, mesh, rules)
    copy_specs = None if copies is None else _copy_specs(weight_specs, stage.quantization.input_gradient == "fp8")
    body = data_parallel if ep == 1 else expert_parallel
    out_specs = (act, GemmTelemetry(*(rep,) * len(GemmTelemetry._fields)), rep) + (() if ep == 1 else (rep,))
    outputs = _shard_map(body, mesh, (act,) * 4 + (weight_specs, copy_specs), out_specs,
                         (x_TD, idx_TK, w_TK, mask_T, tuple(weights), copies))
    return Routed(*outputs, *(() if ep > 1 else (None,)))
