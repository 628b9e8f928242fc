"""The Flax NNX Mixture-of-Experts layer: routed SwiGLU experts, shared experts, LatentMoE.

Legend (shape suffixes): B batch, S sequence, T = B*S tokens, D model width, L latent width,
Din routed-expert width (L with a latent, else D), F expert hidden width, E experts, K experts
per token.

`MoE.__call__` runs one seam per stage:

1. router (fp32 always): `logits_TE = x @ W_r^T` (`routing.router_logits`: exact products summed in fp32), `routing = router.route(logits_TE, bias)`; or
   an injected `Routing` (skips the router).
2. routed experts at width Din (`x @ W_ld^T` first for LatentMoE): `routed.single_device` or,
   with a mesh, `routed.routed_on_mesh` (data parallel, or expert parallel through
   `moe_jax.parallel.ep_moe`; either with the hidden width split over an expert-tensor axis);
   all GEMMs in the compute `dtype`.
3. `y = routed @ W_lu^T (LatentMoE) + g(x) * shared(x)`, summed in fp32 and rounded once
   (`g = sigmoid(x W_sg^T)` with `shared_expert_gate`, Qwen2-MoE; else 1).
4. statistics over real tokens (`stats.moe_stats`).

With `GemmOptions(quantization=Fp8Blockwise(weights="stored"))` the routed experts are held as
e4m3 values and fp32 128 x 128 block scales (`Fp8Stored` variables, `w_gate` + `w_gate_scale` and
so on) that stage 2 reads as they are, and the shared experts likewise (`dense.Fp8SwiGLU`);
`stored_fp8(moe)` quantizes a layer's master weights once. With FP8 (`Fp8Blockwise`) the shared
experts of stage 3 run the routed experts' recipe (`dense.swiglu_fp8`, from the master or the
stored weights; with a mesh inside `routed.dense_on_mesh`, on each device's tokens).

Everything outside stage 2 is ordinary `jnp`; with a mesh it is partitioned by XLA on the
token-sharded activations, so router math is local to each shard, and the statistics are global
reductions equal to the single-device values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_jax import routing as routing_lib
from moe_jax.experts import fuse_gate_up, split_gate_up
from moe_jax.layers.checks import (
    check_axis_rules,
    check_input,
    check_layer_mesh,
    check_mask,
    check_placement,
    check_router,
    check_routing,
    check_token_split,
    compute_dtype,
    float_dtype,
)
from moe_jax.layers.dense import SWIGLU_WEIGHTS, Fp8SwiGLU, SwiGLU, expert_init, init, linear, param, stored, swiglu_fp8
from moe_jax.layers.options import GEMM_KERNELS, ROW_GATHERS, Fp8Blockwise, GemmOptions, SharedExperts
from moe_jax.layers.routed import (ExpertStage, copies_on_mesh, dense_on_mesh, routed_copies, routed_on_mesh,
                                   single_device)
from moe_jax.layers.stats import MoEStats, moe_stats
from moe_jax.layers.tokens import explicit_mesh, on_tokens, split_axes, to_tokens, token_axes, unflatten
from moe_jax.ops import BackendTable, Fp8Copies
from moe_jax.ops.fp8 import BLOCK, quantize_weights
from moe_jax.ops.sharding import vary_like
from moe_jax.parallel import AxisRules, EPOptions, is_explicit
from moe_jax.parallel.replicas import physical_weights
from moe_jax.validation import check_bool, check_int

__all__ = ["GEMM_KERNELS", "MoE", "ROW_GATHERS", "Fp8LayerCopies", "SelectionBias", "stored_fp8"]


class SelectionBias(nnx.Variable):
    """Loss-free balancing bias `[E]` f32 (DeepSeek-V3). Not an `nnx.Param`: optimizers filtering
    on `nnx.Param` never see it; `MoE.update_selection_bias` changes it outside the gradient."""


class Fp8LayerCopies(NamedTuple):
    """An FP8 layer's master weights quantized ahead of its calls (`MoE.fp8_weight_copies()`, read
    by `MoE.__call__(..., fp8_copies=)`): `routed`, the `Fp8Copies` of `w_gate`, `w_up` and
    `w_down` (on a mesh, each device's shard quantized on its own, as the calls quantize it);
    `shared`, those of the shared experts' three weights, or None without shared experts. A
    pytree of arrays: pass it through `jax.jit` and `lax.scan` like any other."""

    routed: tuple[Fp8Copies, ...]
    shared: tuple[Fp8Copies, ...] | None


def _check_stored_split(stored: bool, d_ff: int, etp: int) -> None:
    """Stored block scales split over an expert-tensor axis only along whole 128-row blocks."""
    if stored and etp > 1 and d_ff % (BLOCK * etp):
        raise ValueError(
            f"Fp8Blockwise(weights='stored') under expert tensor parallelism of size {etp} needs d_ff={d_ff} to be a "
            f"multiple of {BLOCK} * {etp} (each rank holds whole {BLOCK} x {BLOCK} blocks of the hidden width and "
            "their scales); use an expert-tensor size that keeps the slices block-aligned, or no expert-tensor axis."
        )


def _option(name: str, value, cls, example: str):
    """`value` if it is a `cls` (None: `cls()`), else TypeError naming the argument."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__module__.rsplit('.', 1)[0]}.{cls.__name__} (e.g. {name}={example}); "
                        f"got {type(value).__name__} {value!r}.")
    return value


class MoE(nnx.Module):
    """Mixture-of-Experts FFN with SwiGLU experts on grouped GEMMs.

    Args:
      d_model: D. d_ff: F, the routed experts' hidden width. num_experts: E. top_k: K.
      router: a `moe_jax.routing` router (`SelectedSoftmax`, `SoftmaxTopK`, `SigmoidGroupedTopK`)
        whose `top_k` equals `top_k`; default `SoftmaxTopK(top_k, renormalize=True)`.
      shared_experts: `moe_jax.layers.SharedExperts(count, d_ff=None, gate=False)`: shared experts
        (DeepSeekMoE) merged into one SwiGLU `shared` of width `d_ff` (default `d_ff * count`)
        that sees every real token, optionally gated per token by `sigmoid(x W_sg^T)`,
        `w_shared_gate [1, D]` (Qwen2-MoE's `shared_expert_gate`). None (default): none.
      latent_dim: L for LatentMoE: routed experts work at width L between a shared down
        projection `w_latent_down [L, D]` and up projection `w_latent_up [D, L]`.
      dtype: compute dtype of every GEMM except the router (default: the input's dtype).
      param_dtype: parameter dtype.
      gemm: `moe_jax.layers.GemmOptions(backend, kernel, row_gather, precision, fused_gate_up,
        quantization)`:
        how the grouped GEMMs run (backend, kernel choice, row gather, dot precision), whether
        gate and up are one GEMM (`w_gate_up [E, 2F, Din]`, gate rows first) and whether the routed
        and shared experts run in blockwise FP8 (`Fp8Blockwise`: from master weights, or from
        stored e4m3 weights with `weights="stored"`, initialised as the quantized random master
        weights; the shared SwiGLU is then an `Fp8SwiGLU`);
        default `GemmOptions()` (auto backend and kernel, separate gate and up).
      mesh: a `jax.sharding.Mesh` (Auto or Explicit axes) for data/expert (tensor) parallelism: the
        parameters are placed on it and the routed stage runs in `jax.shard_map` over it
        (`routed`); the layer enters it itself when called outside `jax.set_mesh`. None
        (default): no mesh of the layer's own; under an ambient mesh (`jax.set_mesh`) the routed
        stage follows `axis_rules`, or the Explicit sharding of the input's tokens (data
        parallel), and otherwise runs on the arrays as they are.
      axis_rules: `moe_jax.parallel.AxisRules`, which mesh axes split tokens, which one splits
        experts and which one (`expert_tensor`, expert tensor parallelism) splits the routed
        experts' hidden width F (default `AxisRules()`: tokens over `("data", "ep")`, experts over
        `"ep"`, no expert-tensor axis, the axes of `make_mesh`); other mesh axes are left alone.
        With an expert-tensor axis of size n (F % n == 0) each of its ranks holds F/n of every
        expert's hidden units and the partial outputs are summed over it
        (docs/expert-tensor-parallelism.md); a fused `w_gate_up` is then stored in per-shard
        blocks (`moe_jax.experts.fuse_gate_up(..., shards=n)`).
      expert_parallel: `moe_jax.parallel.EPOptions(strategy, capacity_factor, transport, chunks)`,
        used when the mesh splits experts (ep > 1); default `EPOptions()` (padded, dropless, auto
        transport, one chunk). With a capacity factor, rows per (source, destination) rank pair are
        capped at `capacity_for(tokens_per_chunk, K, ep, capacity_factor, local_experts=E // ep)`
        (the largest chunk's tokens per device; all of them with `chunks=1`) and dropped routes
        are counted in `MoEStats.dropped`. `chunks=n` splits each device's tokens into n exchanges
        that XLA may overlap with the expert GEMMs (docs/expert-parallelism.md). Without expert
        parallelism nothing is exchanged, so nothing is dropped or chunked: a capacity factor or
        chunks there are ignored with a warning.
        `EPOptions(placement=p)` (needs `mesh` with ep = p.num_ranks): the routed experts'
        weights are p's R*S physical slots, each a copy of its logical expert
        (`moe_jax.parallel.replicas.physical_weights`; `logical_weights` reads them back), S
        per rank; statistics stay per logical expert (docs/placement.md).
      rngs: parameter initialisation keys.

    Params: `w_router [E, D]`, `w_gate`/`w_up [E, F, Din]` (or `w_gate_up [E, 2F, Din]`),
    `w_down [E, Din, F]` (R*S rows instead of E with a placement), optionally `w_latent_down`,
    `w_latent_up`, `shared` (a `SwiGLU`) and `w_shared_gate [1, D]`.
    State: `selection_bias` (`SelectionBias`, zeros `[E]`).
    Attributes read by callers: `ep` and `etp`, the sizes of `mesh`'s expert and expert-tensor
    axes under the rules (1 without a mesh or without the axis).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        *,
        router: routing_lib.Router | None = None,
        shared_experts: SharedExperts | None = None,
        latent_dim: int | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        gemm: GemmOptions | None = None,
        mesh: Mesh | None = None,
        axis_rules: AxisRules | None = None,
        expert_parallel: EPOptions | None = None,
        rngs: nnx.Rngs,
    ):
        self.d_model = d = check_int("d_model", d_model)
        self.d_ff = f = check_int("d_ff", d_ff)
        self.num_experts = e = check_int("num_experts", num_experts)
        self.top_k = check_int("top_k", top_k)
        if self.top_k > e:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={e}; set top_k <= num_experts.")
        self.router = check_router(router, self.top_k, e)
        if shared_experts is not None and not isinstance(shared_experts, SharedExperts):
            raise TypeError(f"shared_experts must be None or a moe_jax.layers.SharedExperts (e.g. "
                            f"shared_experts=SharedExperts(count=1)); got {type(shared_experts).__name__} "
                            f"{shared_experts!r}.")
        self.shared_experts = shared_experts
        self.latent_dim = None if latent_dim is None else check_int("latent_dim", latent_dim)
        self.dtype = float_dtype("dtype", dtype, allow_none=True, compute=True)
        param_dtype = float_dtype("param_dtype", param_dtype)
        self.gemm = _option("gemm", gemm, GemmOptions, "GemmOptions(backend='xla')")
        self.quantization = self.gemm.quantization
        self.axis_rules = check_axis_rules(axis_rules)
        self.expert_parallel = _option("expert_parallel", expert_parallel, EPOptions,
                                       "EPOptions(capacity_factor=1.25)")
        placement = self.expert_parallel.placement
        slots = check_placement(placement, mesh, self.rules, e)
        self.ep, self.etp = check_layer_mesh(mesh, self.rules, slots, f, self.gemm.backend)
        _check_stored_split(self.fp8_stored, f, self.etp)
        self.mesh = mesh
        if self.ep > 1 and self.expert_parallel.strategy == "ragged" and mesh.devices.flat[0].platform != "gpu":
            raise ValueError(
                f"expert_parallel=EPOptions(strategy='ragged') needs GPUs (XLA:{mesh.devices.flat[0].platform.upper()} "
                "has no ragged_all_to_all), but this mesh's devices are not; use EPOptions(strategy='padded')."
            )
        experts_may_split = self.ep > 1 if mesh is not None else (axis_rules is not None and axis_rules.experts)
        if not experts_may_split:
            self._warn_unused_ep_options()

        d_in = self.latent_dim or d
        gate_up, down, replicated = tuple(self.rules.gate_up_spec()), tuple(self.rules.down_spec()), (None, None)

        def experts(w_EX, spec):  # the logical weights, or every slot a copy of its expert's
            return param(w_EX if placement is None else physical_weights(w_EX, placement), spec, mesh)

        def quantized(name, w_EX, spec):  # the stored weights: values and block scales, copied per slot alike
            for suffix, value in zip(("", "_scale"), quantize_weights(w_EX)):
                value = value if placement is None else physical_weights(value, placement)
                setattr(self, name + suffix, stored(value, spec, mesh))

        self.w_router = param(init(rngs.params(), (e, d), param_dtype), replicated, mesh)
        w_gate = expert_init(rngs.params(), (e, f, d_in), param_dtype)
        w_up = expert_init(rngs.params(), (e, f, d_in), param_dtype)
        w_down = expert_init(rngs.params(), (e, d_in, f), param_dtype)
        if self.fp8_stored:
            for name, w_EX, spec in zip(SWIGLU_WEIGHTS, (w_gate, w_up, w_down), (gate_up, gate_up, down)):
                quantized(name, w_EX, spec)
        else:
            if self.fused_gate_up:
                self.w_gate_up = experts(fuse_gate_up(w_gate, w_up, shards=self.etp), gate_up)
            else:
                self.w_gate = experts(w_gate, gate_up)
                self.w_up = experts(w_up, gate_up)
            self.w_down = experts(w_down, down)
        if self.latent_dim is not None:
            self.w_latent_down = param(init(rngs.params(), (self.latent_dim, d), param_dtype), replicated, mesh)
            self.w_latent_up = param(init(rngs.params(), (d, self.latent_dim), param_dtype), replicated, mesh)
        self.shared = (
            SwiGLU(d, shared_experts.width(f), dtype=dtype, param_dtype=param_dtype, precision=self.precision,
                   mesh=mesh, rngs=rngs)
            if shared_experts is not None else None
        )
        if self.shared is not None and self.fp8_stored:  # its random master weights quantized
            self.shared = Fp8SwiGLU(*self.shared.weights(), backend=self.backend, mesh=mesh)
        if self.shared_expert_gate:
            self.w_shared_gate = param(init(rngs.params(), (1, d), param_dtype), replicated, mesh)
        self.selection_bias = SelectionBias(jnp.zeros((e,), jnp.float32))

    @property
    def rules(self) -> AxisRules:
        """The axis rules in force: `axis_rules`, or the defaults of `make_mesh`'s mesh."""
        return AxisRules() if self.axis_rules is None else self.axis_rules

    # Read by the routed stage (`ExpertStage`), `moe_jax.convert` and callers: the option groups' fields.
    @property
    def backend(self) -> str | BackendTable:
        return self.gemm.backend

    @property
    def gemm_kernel(self) -> str:
        return self.gemm.kernel

    @property
    def row_gather(self) -> str:
        return self.gemm.row_gather

    @property
    def precision(self) -> lax.Precision | None:
        return self.gemm.precision

    @property
    def fused_gate_up(self) -> bool:
        return self.gemm.fused_gate_up

    @property
    def shared_expert_gate(self) -> bool:
        return self.shared_experts is not None and self.shared_experts.gate

    @property
    def fp8_stored(self) -> bool:
        """True when the routed experts are stored FP8 weights (`Fp8Blockwise(weights="stored")`)."""
        return self.quantization is not None and self.quantization.stored

    def __call__(
        self, x: jax.Array, *, mask: jax.Array | None = None, routing: routing_lib.Routing | None = None,
        return_routing: bool = False, fp8_copies: Fp8LayerCopies | None = None,
    ) -> tuple[jax.Array, MoEStats] | tuple[jax.Array, MoEStats, routing_lib.Routing]:
        """`y, stats = moe(x, mask=..., routing=...)`.

        x: a JAX or NumPy array `[B, S, D]` or `[T, D]` (NumPy float64 is read as JAX reads it:
        float32 unless x64 is on). Under an Explicit mesh any sharding of x works; y has x's.
        mask: bool with the leading shape of `x`, True = real token; masked tokens reach nothing:
        their output is zero (routed and shared), they count in no statistic and get exactly zero
        gradient.
        routing: optional `moe_jax.routing.Routing` of the T = B*S flattened tokens; skips the
        router (z_loss is then 0) and gradients reach `routing.weights_TK`. Its expert ids must lie
        in `[0, E)`: concrete ids outside are a ValueError; traced ones (under jit) cannot be
        checked: their routes reach no expert, count in `MoEStats.dropped` and in no `counts_E` or
        `dropped_E` slot, on one device and on every mesh alike.
        return_routing: also return the `Routing` the layer used (expert indices, combine weights,
        router probabilities of the T flattened tokens), for logging, analysis or distillation.
        fp8_copies: with FP8 master weights (`Fp8Blockwise()`), their quantization made ahead by
        `self.fp8_weight_copies()` (e.g. once per step, outside a loop over micro-batches): read
        instead of quantizing the weights in this call, with the same result, the gradients still
        reaching the master weights. They must hold the weights' current values (make them again
        after each optimizer update; nothing here can tell stale copies from fresh ones); copies of
        another layout (another layer, mesh or `input_gradient`) are a ValueError.
        Returns `y` (shape of `x`, compute dtype) and `MoEStats` (and the `Routing`).

        Every argument is checked before anything is computed.
        """
        return_routing = check_bool("return_routing", return_routing)
        x = check_input(x, self.d_model)
        mask = check_mask(mask, x.shape[:-1])
        if routing is not None:
            check_routing(routing, math.prod(x.shape[:-1]), self.top_k, self.num_experts)
        dtype = compute_dtype(x, self.dtype)
        with self._mesh_context(x):
            if fp8_copies is not None:
                self._check_copies(fp8_copies)
            y, stats, routing = self._forward(x, mask, routing, dtype, fp8_copies)
        return (y, stats, routing) if return_routing else (y, stats)

    def fp8_weight_copies(self) -> Fp8LayerCopies:
        """The FP8 master weights quantized as each call quantizes them (`moe_jax.ops.fp8_weight_copies`,
        on a mesh per device shard), for `__call__(..., fp8_copies=)`: a step that calls the layer
        on several micro-batches makes them once, before its loop, and every call reads them
        (XLA's GPU compiler does not move the quantization out of the loop itself; docs/fp8.md).
        Not differentiated: the calls pass the gradient to the master weights. Call it where the
        layer is called (the same ambient mesh, the same `jax.shard_map`, if any).

        ValueError unless the layer computes from FP8 master weights (`Fp8Blockwise()`; stored FP8
        weights are quantized already)."""
        if self.quantization is None or self.quantization.stored:
            raise ValueError(
                "fp8_weight_copies(): this layer has no FP8 master weights to quantize ahead (its quantization is "
                f"{self.quantization!r}); build it with GemmOptions(quantization=Fp8Blockwise()).")
        with self._mesh_context(self.w_router[...]):
            return self._copies()

    def _copies(self) -> Fp8LayerCopies:
        placement = self._placement()
        routed = routed_copies(self._stage(), placement, self._expert_weights(None))
        shared = None
        if self.shared is not None:
            # As `swiglu_fp8` quantizes them: the `[1, ...]` stacks of one expert, replicated.
            stacks = tuple(w[None] for w in self.shared.weights())
            mesh = None if placement is None else placement[0]
            shared = copies_on_mesh(mesh, (P(),) * 3, stacks, backend=self.backend,
                                    input_gradient=self.quantization.input_gradient)
        return Fp8LayerCopies(routed, shared)

    def _check_copies(self, copies) -> None:
        """`fp8_copies` as `fp8_weight_copies()` makes them for this layer where it is called, else
        a TypeError or ValueError naming the difference."""
        if self.quantization is None or self.quantization.stored:
            raise ValueError(
                "fp8_copies: this layer has no FP8 master weights (its quantization is "
                f"{self.quantization!r}); pass fp8_copies only to layers built with "
                "GemmOptions(quantization=Fp8Blockwise()).")
        if not isinstance(copies, Fp8LayerCopies):
            raise TypeError(f"fp8_copies: expected the Fp8LayerCopies of this layer's fp8_weight_copies(); got "
                            f"{type(copies).__name__}.")
        want = jax.eval_shape(self._copies)
        if (copies.shared is None) != (want.shared is None):
            raise ValueError(f"fp8_copies.shared is {'None' if copies.shared is None else 'given'}, but this layer has "
                             f"{'no' if want.shared is None else ''} shared experts; make the copies with this layer's "
                             "fp8_weight_copies().")
        transposed = {c.transposed is None for c in jax.tree.leaves(copies, is_leaf=lambda c: isinstance(c, Fp8Copies))}
        if transposed != {want.routed[0].transposed is None}:
            raise ValueError(f"fp8_copies were not made for input_gradient={self.quantization.input_gradient!r}, this "
                             "layer's (which decides whether the [E, K, N] copies exist); make them with this "
                             "layer's fp8_weight_copies().")
        got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(copies)
        want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
        if got_tree != want_tree:
            raise ValueError(f"fp8_copies: not this layer's copies (their structure is {got_tree}, this layer makes "
                             f"{want_tree}); make them with this layer's fp8_weight_copies().")
        for (path, got), (_, exp) in zip(got_leaves, want_leaves):
            if (tuple(jnp.shape(got)), jnp.result_type(got)) != (exp.shape, exp.dtype):
                raise ValueError(
                    f"fp8_copies{jax.tree_util.keystr(path)}: {jnp.result_type(got)}{list(jnp.shape(got))}, but this "
                    f"layer's is {exp.dtype}{list(exp.shape)} (copies of another layer, or of another mesh layout); "
                    "make them with this layer's fp8_weight_copies(), called where the layer is.")

    def _stage(self) -> ExpertStage:
        """The routed stage's configuration (`routed.ExpertStage`)."""
        placed = self.expert_parallel.placement
        return ExpertStage(self.num_experts if placed is None else placed.num_slots,
                           self.latent_dim or self.d_model, self.d_ff, self.fused_gate_up,
                           self.backend, self.precision, self.gemm_kernel, self.row_gather, self.quantization)

    def _forward(self, x, mask, routing, dtype, fp8_copies):
        seq_BS = tuple(x.shape[:2]) if x.ndim == 3 else (1, x.shape[0])
        # Under Explicit axes: tokens split as x's are (whatever its sharding), then as the rules say.
        mesh = explicit_mesh()
        axes = None if mesh is None else token_axes(x)
        x_TD = to_tokens(x, x.ndim - 1, axes)
        mask_T = None if mask is None else to_tokens(mask, mask.ndim, axes)
        placement = self._placement(x_TD)
        if mesh is not None and placement is not None:
            axes = placement[1].tokens
            x_TD, mask_T = on_tokens((x_TD, mask_T), axes)
        # Padding tokens may hold anything: zero them (where, so NaN cannot leak into gradients)
        # before they reach the router and the routed experts.
        real_TD = x_TD if mask_T is None else jnp.where(mask_T[:, None], x_TD, jnp.zeros((), x_TD.dtype))

        injected = routing is not None
        if injected:
            routing = on_tokens(routing_lib.Routing(*(jnp.asarray(a) for a in routing)), axes)
            z_loss = jnp.zeros((), jnp.float32)
        else:
            logits_TE = routing_lib.router_logits(real_TD, self.w_router[...])
            routing = self.router.route(logits_TE, selection_bias_E=self.selection_bias[...])
            z_loss = routing_lib.z_loss(logits_TE, mask_T=mask_T)

        routed_in_TD = real_TD.astype(dtype)
        if self.latent_dim is not None:
            routed_in_TD = linear(routed_in_TD, self.w_latent_down[...], dtype, self.precision).astype(dtype)
        stage = self._stage()
        args = (routed_in_TD, routing.expert_idx_TK, routing.weights_TK, mask_T, self._expert_weights(dtype))
        copies = None if fp8_copies is None else fp8_copies.routed
        if placement is None:
            routed = single_device(stage, *args, copies=copies)
        else:
            routed = routed_on_mesh(stage, *placement, self.expert_parallel, *args, copies=copies)
        dropped = routed.dropped
        if injected and routed.kept_E is None:
            # Expert parallelism counts routes to ids outside [0, E) as undelivered; so does every other case.
            dropped = dropped + _invalid_routes(routing.expert_idx_TK, mask_T, self.num_experts)
        y_TD = routed.y_TD.astype(jnp.float32)
        if self.latent_dim is not None:
            y_TD = linear(routed.y_TD, self.w_latent_up[...], dtype, self.precision)
        if self.shared is not None:
            shared_copies = None if fp8_copies is None else fp8_copies.shared
            shared_TD = self._shared_output(real_TD, placement, dtype, shared_copies)
            if self.shared_expert_gate:
                gate_T1 = jax.nn.sigmoid(linear(real_TD, self.w_shared_gate[...], dtype, self.precision))
                shared_TD = gate_T1 * shared_TD
            y_TD = y_TD + shared_TD
        # The sequence-wise statistics read the per-token arrays as [B, S, ...]: on token axes that split so.
        stats_routing, stats_mask = routing, mask_T
        if mesh is not None and split_axes(axes, seq_BS, mesh) != axes:
            stats_routing, stats_mask = on_tokens((routing, mask_T), split_axes(axes, seq_BS, mesh))
        stats = moe_stats(stats_routing, z_loss=z_loss, mask_T=stats_mask, seq_BS=seq_BS,
                          num_experts=self.num_experts, gemm=routed.gemm, dropped=dropped, kept_E=routed.kept_E)
        return unflatten(y_TD.astype(dtype), x), stats, routing

    def update_selection_bias(self, counts_E: jax.Array, step_size) -> None:
        """Loss-free balancing step: `bias += step_size * sign(mean(counts) - counts)` (outside the
        gradient; pass `stats.counts_E`, already global). `step_size`: a number >= 0 or a float scalar
        array (e.g. a schedule's value)."""
        self.selection_bias[...] = routing_lib.update_selection_bias(self.selection_bias[...], counts_E, step_size)

    def _shared_output(self, x_TD, placement, dtype, copies) -> jax.Array:
        """The shared experts' output `[T, D]` in fp32: `self.shared` in the compute dtype, or with
        FP8 (`Fp8Blockwise`) its three projections by the same recipe as the routed experts'
        (`swiglu_fp8`: from the master weights, reading `copies` when given, or from the stored
        weights of an `Fp8SwiGLU`), on each device's tokens where the routed stage has a placement."""
        shared = self.shared
        if self.quantization is None:
            return shared(x_TD).astype(jnp.float32)

        def fn(x_TD, weights, copies):
            return swiglu_fp8(x_TD, *weights, backend=self.backend, input_gradient=self.quantization.input_gradient,
                              copies=copies)

        x_TD = x_TD.astype(dtype)  # the shared SwiGLU's dtype is the layer's
        weights = shared.weights()  # master arrays, or the stored `Fp8Weights` of an `Fp8SwiGLU`
        if placement is None:
            weights, copies = vary_like((weights, copies), (x_TD,))  # inside a caller's shard_map: per device
            return fn(x_TD, weights, copies).astype(jnp.float32)
        return dense_on_mesh(fn, *placement, x_TD, (weights, copies)).astype(jnp.float32)

    def _warn_unused_ep_options(self) -> None:
        options = self.expert_parallel
        unused = [f"{name}={value}" for name, value, default in (("capacity_factor", options.capacity_factor, None),
                                                                 ("chunks", options.chunks, 1)) if value != default]
        if unused:
            warnings.warn(
                f"expert_parallel=EPOptions({', '.join(unused)}) has no effect: this MoE layer's mesh does not "
                "split experts (no expert axis of size > 1), so no rows are exchanged (none dropped, nothing to "
                "chunk). Drop those options, or give the layer a mesh whose expert axis has size > 1.",
                UserWarning, stacklevel=3,
            )

    def _mesh_context(self, x):
        """The layer's own Explicit mesh as the ambient one, when the caller has not set it."""
        if self.mesh is None or not is_explicit(self.mesh):
            return contextlib.nullcontext()
        ambient = jax.sharding.get_abstract_mesh()
        if ambient.manual_axes:
            return contextlib.nullcontext()  # `_placement` refuses this with its own message
        if not ambient.empty:
            if ambient != self.mesh.abstract_mesh:
                raise ValueError(
                    f"this MoE layer was built on the mesh {dict(self.mesh.shape)} but is called under "
                    f"jax.set_mesh of another one ({dict(ambient.shape)}); call it under jax.set_mesh(layer.mesh), "
                    "or outside any jax.set_mesh (the layer enters its own mesh)."
                )
            return contextlib.nullcontext()
        tracing = any(isinstance(a, jax.core.Tracer) for a in (x, self.w_router.get_value()))
        # `jax.set_mesh` cannot be entered under `jit`; there the abstract mesh is what types the arrays.
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh) if tracing else jax.set_mesh(self.mesh)

    def _placement(self, x_TD=None) -> tuple[object, AxisRules] | None:
        """`(mesh, rules)` the routed stage runs `shard_map` over, or None to run it on the arrays.
        Without `x_TD` (the FP8 weights' copies, made before the tokens are known) a layer without
        rules of its own gets None: the tokens' sharding decides there, and the weights are
        replicated on every device alike."""
        context = jax.sharding.get_abstract_mesh()
        if context.manual_axes:
            if self.mesh is not None or self.axis_rules is not None:
                raise ValueError(
                    f"this MoE layer runs its own jax.shard_map (it has mesh= or axis_rules=), so it cannot be called "
                    f"inside another one (manual axes {tuple(context.manual_axes)}); build it with mesh=None and "
                    "axis_rules=None to run it per device on each shard's tokens, or call "
                    "moe_jax.parallel.ep_moe inside your shard_map for expert parallelism."
                )
            return None
        if self.mesh is not None:
            mesh, rules = self.mesh, self.rules
        elif context.empty:
            if self.axis_rules is not None and self.axis_rules.experts is not None:
                self._warn_unused_ep_options()
            return None
        elif self.axis_rules is not None:
            mesh, rules = context, self.axis_rules
            if rules.check(mesh, self.num_experts) == 1:
                self._warn_unused_ep_options()
            etp = rules.check_expert_tensor(mesh, self.d_ff)
            _check_stored_split(self.fp8_stored, self.d_ff, etp)
            if self.fused_gate_up and etp != self.etp:
                raise ValueError(
                    f"this layer's fused w_gate_up was laid out at construction for an expert-tensor size of "
                    f"{self.etp} (mesh=None), but the ambient mesh's '{rules.expert_tensor}' axis has size {etp}; "
                    "build the layer with mesh=<that mesh> (its fused rows are then in per-shard blocks, "
                    "moe_jax.experts.fuse_gate_up(..., shards=etp)), or use GemmOptions(fused_gate_up=False)."
                )
        elif x_TD is None:
            return None
        else:
            # No rules: follow an Explicit sharding of the token dimension, data parallel.
            spec = jax.typeof(x_TD).sharding.spec
            axes = spec[0] if len(spec) else None
            if axes is None:
                return None
            mesh, rules = context, AxisRules(tokens=(axes,) if isinstance(axes, str) else tuple(axes), experts=None)
        if x_TD is not None:
            check_token_split(x_TD.shape[0], mesh, rules)
        return mesh, rules

    def _expert_weights(self, dtype) -> tuple[jax.Array, ...]:
        """Expert weights in the compute dtype: `(w_gate_up, w_down)` or `(w_gate, w_up, w_down)`;
        FP8 master weights in `param_dtype` (quantized from their own values, in one pass over
        them: a compute-dtype cast first would be a second pass, and a second rounding); stored FP8
        weights as they are, each values array followed by its block scales."""
        if self.fp8_stored:
            return tuple(getattr(self, n + suffix)[...] for n in SWIGLU_WEIGHTS for suffix in ("", "_scale"))
        names = ("w_gate_up", "w_down") if self.fused_gate_up else SWIGLU_WEIGHTS
        if self.quantization is not None:
            return tuple(getattr(self, n)[...] for n in names)
        return tuple(getattr(self, n)[...].astype(dtype) for n in names)


def stored_fp8(moe: MoE) -> MoE:
    """A layer that computes with `moe`'s experts quantized once into stored FP8 weights
    (`GemmOptions(quantization=Fp8Blockwise(weights="stored"), fused_gate_up=False)`, the rest of
    `moe.gemm` kept): e4m3 values and fp32 128 x 128 block scales of its master weights in
    `param_dtype` (`moe_jax.ops.fp8.quantize_weights`; a fused `w_gate_up` is split first), e.g.
    to serve a bf16 checkpoint in FP8. Every other variable is `moe`'s own (not copied);
    `moe` itself is unchanged and keeps its master weights. Its shared experts, if any, are
    quantized alike into an `Fp8SwiGLU` (`moe_jax.layers.dense`).

    TypeError unless `moe` is an `MoE`; ValueError when its experts are stored FP8 already, when
    its backend runs no FP8 GEMM (`GemmOptions`' message), or when an expert-tensor split would cut
    a 128-row block.
    """
    if not isinstance(moe, MoE):
        raise TypeError(f"stored_fp8(moe): moe must be a moe_jax.layers.MoE; got {type(moe).__name__}.")
    if moe.fp8_stored:
        raise ValueError("stored_fp8(moe): moe already holds stored FP8 expert weights "
                         "(Fp8Blockwise(weights='stored')).")
    gemm = dataclasses.replace(moe.gemm, fused_gate_up=False, quantization=Fp8Blockwise(weights="stored"))
    _check_stored_split(True, moe.d_ff, moe.etp)
    if moe.fused_gate_up:
        w_gate_up = moe.w_gate_up
        masters = (*split_gate_up(w_gate_up[...], shards=moe.etp), moe.w_down[...])
        variables = (w_gate_up, w_gate_up, moe.w_down)
    else:
        variables = tuple(getattr(moe, n) for n in SWIGLU_WEIGHTS)
        masters = tuple(v[...] for v in variables)
    new = nnx.merge(*nnx.split(moe))  # the same arrays in a graph of its own
    if moe.fused_gate_up:
        del new.w_gate_up
    if moe.shared is not None:
        new.shared = Fp8SwiGLU(*moe.shared.weights(), backend=moe.backend, mesh=moe.mesh)
    for name, master, variable in zip(SWIGLU_WEIGHTS, masters, variables):
        # The master's layout (on a mesh): [E, N, K] values and their [E, Nb, Kb] scales split alike.
        spec = variable.get_value().sharding.spec if moe.mesh is not None else None
        for suffix, value in zip(("", "_scale"), quantize_weights(master)):
            setattr(new, name + suffix, stored(value, spec, moe.mesh))
    new.gemm, new.quantization = gemm, gemm.quantization
    return new


def _invalid_routes(idx_TK, mask_T, num_experts: int) -> jax.Array:
    """int32: routes of real tokens whose expert id lies outside `[0, E)`."""
    bad_TK = (idx_TK < 0) | (idx_TK >= num_experts)
    if mask_T is not None:
        bad_TK = bad_TK & mask_T[:, None]
    return jnp.sum(bad_TK, dtype=jnp.int32)
