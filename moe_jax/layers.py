"""Flax NNX Mixture-of-Experts layers: routed SwiGLU experts, shared experts, LatentMoE.

Legend (shape suffixes): B batch, S sequence, T = B*S tokens, D model width, L latent width,
Din routed-expert width (L with a latent, else D), F expert hidden width, Fs shared hidden width,
E experts, El = E/P local experts on one of P ep ranks, K experts per token, R = T*K routes,
M packed rows.

`MoE.__call__` runs one seam per stage:

1. router (fp32 always): `logits_TE = x @ W_r^T`, `routing = router.route(logits_TE, bias)`;
   or an injected `Routing` (skips the router).
2. statistics over real tokens: aux / sequence-aux / z losses, expert counts.
3. routed experts at width Din (`x @ W_ld^T` first for LatentMoE): pack by expert, grouped SwiGLU,
   combine with the routing weights (`moe_jax.permute`, `moe_jax.experts`); all GEMMs in the
   compute `dtype`. With a mesh this stage runs inside `jax.shard_map` (below).
4. `y = routed @ W_lu^T (LatentMoE) + shared(x)`.

Everything outside stage 3 is ordinary `jnp`; with a mesh it is partitioned by XLA on the
token-sharded activations, so router math is local to each shard, and the statistics are global
reductions equal to the single-device values.

Meshes (`moe_jax.parallel.make_mesh`, axes `("data", "ep")`):

* ep = 1: stage 3 runs per device on its own tokens (`activation_spec()`), weights replicated.
* ep > 1: stage 3 is `ep_dispatch` -> local grouped SwiGLU on this rank's El experts (weights
  split by `expert_spec()`) -> `ep_combine`. `capacity_factor` bounds the rows one rank sends to
  another (`capacity_for`); routes past it are dropped and counted in `MoEStats.dropped`.

Gradients through `shard_map` need no hand-written reductions: the transpose of a replicated
input sums its cotangents over the mesh axes it is replicated on (all axes for router/shared/
latent, and for expert weights with ep = 1; `"data"` for `expert_spec()` shards).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from moe_jax import routing as routing_lib
from moe_jax.experts import fuse_gate_up, swiglu_experts, swiglu_experts_fused
from moe_jax.ops.backends import resolve_backend
from moe_jax.ops.config import gmm_config
from moe_jax.padding import executed_rows
from moe_jax.parallel.exchange import STRATEGIES, capacity_for, check_capacity_factor, ep_combine, ep_dispatch
from moe_jax.parallel.mesh import (
    DENSE_DP_AXES,
    EP_AXIS,
    EXPERT_DP_AXES,
    MESH_AXES,
    activation_spec,
    check_mesh,
    dense_spec,
    expert_spec,
)
from moe_jax.permute import combine, gather_rows, pack

__all__ = ["MoEStats", "SelectionBias", "SwiGLU", "MoE"]

_HI = lax.Precision.HIGHEST
_ROUTERS = (routing_lib.SelectedSoftmax, routing_lib.SoftmaxTopK, routing_lib.SigmoidGroupedTopK)

# Truncated normal with variance 1/fan_in (LeCun) on the last axis, the input axis of every
# weight here ([out, in] and [E, out, in]); the down projections therefore start at 1/sqrt(F),
# keeping the output scale of an expert independent of its hidden width. Jitted (shape and dtype
# static) so eager construction compiles one program per weight shape, not one per primitive.
_init = jax.jit(
    jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2),
    static_argnums=(1, 2),
)
_expert_init = jax.jit(
    jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2, batch_axis=(0,)
    ),
    static_argnums=(1, 2),
)


class MoEStats(NamedTuple):
    """What one MoE call reports for logging and auxiliary losses (global over all devices).

    aux_loss: f32 scalar, Switch/Megatron balance loss over real tokens (`routing.aux_loss`).
    seq_aux_loss: f32 scalar, DeepSeek-V3 sequence-wise loss; a `[T, D]` input is one sequence.
    z_loss: f32 scalar, router z-loss (0 with an injected routing: there are no logits).
    counts_E: int32 `[E]`, real routes per expert (masked tokens excluded).
    tokens: int32 scalar, real tokens.
    executed_rows: int32 scalar, rows the grouped GEMMs execute at the active tile height
      (`gmm_config(...).block_m` of the packed shape): sum over every device's GEMM of
      `sum_e ceil(t_e / bm) * bm`. Under a mesh this is per-device grouping, so it can exceed the
      single-device figure.
    padding_fraction: f32 scalar, (executed_rows - rows fed to the GEMMs) / executed_rows.
    dropped: int32 scalar, routes dropped by EP capacity (0 when dropless or without ep > 1).
    """

    aux_loss: jax.Array
    seq_aux_loss: jax.Array
    z_loss: jax.Array
    counts_E: jax.Array
    tokens: jax.Array
    executed_rows: jax.Array
    padding_fraction: jax.Array
    dropped: jax.Array


class SelectionBias(nnx.Variable):
    """Loss-free balancing bias `[E]` f32 (DeepSeek-V3). Not an `nnx.Param`: optimizers filtering
    on `nnx.Param` never see it; `MoE.update_selection_bias` changes it outside the gradient."""


# ----------------------------------------------------------------------------- validation


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an int >= 1.")
    return value


def _float_dtype(name: str, dtype, allow_none: bool):
    if dtype is None and allow_none:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{name}={dtype!r} is not a dtype; use e.g. jnp.float32 or jnp.bfloat16.") from exc
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name}={dt.name} must be a floating dtype (float32, bfloat16, float16).")
    return dt


def _dot_precision(dtype, precision):
    """Dense projections follow `grouped_linear`: full fp32 products unless asked otherwise."""
    if precision is not None:
        return precision
    return _HI if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _param(value: jax.Array, spec: tuple, mesh: Mesh | None) -> nnx.Param:
    """A parameter carrying its mesh layout as metadata (placed on the mesh when there is one)."""
    if mesh is None:
        return nnx.Param(value)
    return nnx.Param(value, out_sharding=spec, mesh=mesh)


def _varying(weights: tuple[jax.Array, ...], axes: tuple[str, ...]) -> tuple[jax.Array, ...]:
    """Weights replicated over the mesh axes `axes`, cast to varying over them (inside `shard_map`).

    They enter `shard_map` invariant over those axes, but the grouped GEMM's custom VJP returns a
    per-device (varying) weight gradient, so they are cast to varying first. The transpose of
    that cast is a `psum` over `axes`: exactly the sum of the per-device gradients of a weight's
    replicas.
    """
    return tuple(lax.pcast(w, axes, to="varying") for w in weights)


def _linear(x, w_OI, dtype, precision):
    """`x @ w_OI^T` on `dtype` operands, accumulated in fp32 (like the grouped GEMMs); fp32 result."""
    return jnp.dot(
        x.astype(dtype), w_OI.astype(dtype).T, precision=_dot_precision(dtype, precision),
        preferred_element_type=jnp.float32,
    )


# ----------------------------------------------------------------------------- modules


class SwiGLU(nnx.Module):
    """Dense SwiGLU FFN `y = (silu(x W_g^T) * (x W_u^T)) W_d^T` (DeepSeekMoE shared experts).

    Params: `w_gate`, `w_up` `[F, D]`, `w_down` `[D, F]`. `__call__(x[..., D]) -> [..., D]` in
    `dtype` (default: `x.dtype`).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        precision: lax.Precision | None = None,
        mesh: Mesh | None = None,
        rngs: nnx.Rngs,
    ):
        d_model = _positive_int("d_model", d_model)
        d_ff = _positive_int("d_ff", d_ff)
        param_dtype = _float_dtype("param_dtype", param_dtype, allow_none=False)
        self.dtype = _float_dtype("dtype", dtype, allow_none=True)
        self.precision = precision
        replicated = (None, None)
        self.w_gate = _param(_init(rngs.params(), (d_ff, d_model), param_dtype), replicated, mesh)
        self.w_up = _param(_init(rngs.params(), (d_ff, d_model), param_dtype), replicated, mesh)
        self.w_down = _param(_init(rngs.params(), (d_model, d_ff), param_dtype), replicated, mesh)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype if self.dtype is None else self.dtype
        gate = _linear(x, self.w_gate[...], dtype, self.precision)
        up = _linear(x, self.w_up[...], dtype, self.precision)
        return _linear(jax.nn.silu(gate) * up, self.w_down[...], dtype, self.precision).astype(dtype)


class _Routed(NamedTuple):
    """Output of the routed-expert stage (stage 3)."""

    y_TD: jax.Array  # routed output at width Din, compute dtype
    executed_rows: jax.Array  # int32, summed over devices
    gemm_rows: jax.Array  # int32, rows fed to the grouped GEMMs, summed over devices
    dropped: jax.Array  # int32, capacity drops, global


class MoE(nnx.Module):
    """Mixture-of-Experts FFN with SwiGLU experts on grouped GEMMs.

    Args:
      d_model: D. d_ff: F, the routed experts' hidden width. num_experts: E. top_k: K.
      router: a `moe_jax.routing` router (`SelectedSoftmax`, `SoftmaxTopK`, `SigmoidGroupedTopK`)
        whose `top_k` equals `top_k`; default `SoftmaxTopK(top_k, renormalize=True)`.
      num_shared_experts: shared experts (DeepSeekMoE), merged into one SwiGLU of width
        `shared_d_ff` (default `d_ff * num_shared_experts`) that sees every token.
      latent_dim: L for LatentMoE: routed experts work at width L between a shared down
        projection `w_latent_down [L, D]` and up projection `w_latent_up [D, L]`.
      fused_gate_up: store gate and up as one `w_gate_up [E, 2F, Din]` (gate rows first).
      dtype: compute dtype of every GEMM except the router (default: the input's dtype).
      param_dtype: parameter dtype.
      backend: grouped-GEMM backend (`"auto"`, `"pallas_triton"`, `"xla"`); the row gathers and EP's send
        plan use it too.
      precision: dot precision for the expert/shared/latent GEMMs (default: HIGHEST for fp32).
      mesh: a `make_mesh` mesh for data/expert parallelism (see the module docstring).
      ep_strategy: EP exchange strategy, `"padded"` (default, fastest measured) or `"ragged"`
        (GPU only; slow unless XLA's ragged all-to-all decomposer flag is set, see
        `moe_jax.parallel.exchange`).
      capacity_factor: with ep > 1, rows per (source, destination) rank pair are capped at
        `capacity_for(tokens_per_device, K, ep, capacity_factor, local_experts=E // ep)`, never
        below one row per local expert (small decode batches hit that floor); dropped routes
        are counted in `MoEStats.dropped`; None is dropless. Without
        expert parallelism nothing is exchanged, so nothing is dropped and it has no effect.
      rngs: parameter initialisation keys.

    Params: `w_router [E, D]`, `w_gate`/`w_up [E, F, Din]` (or `w_gate_up [E, 2F, Din]`),
    `w_down [E, Din, F]`, optionally `w_latent_down`, `w_latent_up`, and `shared` (a `SwiGLU`).
    State: `selection_bias` (`SelectionBias`, zeros `[E]`).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        *,
        router: routing_lib.Router | None = None,
        num_shared_experts: int = 0,
        shared_d_ff: int | None = None,
        latent_dim: int | None = None,
        fused_gate_up: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        backend: str = "auto",
        precision: lax.Precision | None = None,
        mesh: Mesh | None = None,
        ep_strategy: str = "padded",
        capacity_factor: float | None = None,
        rngs: nnx.Rngs,
    ):
        self.d_model = _positive_int("d_model", d_model)
        self.d_ff = _positive_int("d_ff", d_ff)
        self.num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}; set top_k <= num_experts.")
        self.router = self._check_router(router)
        if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={num_shared_experts!r}: must be an int >= 0.")
        if shared_d_ff is not None:
            _positive_int("shared_d_ff", shared_d_ff)
            if num_shared_experts == 0:
                raise ValueError(
                    f"shared_d_ff={shared_d_ff} was given but num_shared_experts=0; set num_shared_experts >= 1 "
                    "to add shared experts, or drop shared_d_ff."
                )
        self.latent_dim = None if latent_dim is None else _positive_int("latent_dim", latent_dim)
        if not isinstance(fused_gate_up, bool):
            raise ValueError(f"fused_gate_up={fused_gate_up!r}: must be a bool.")
        self.fused_gate_up = fused_gate_up
        self.dtype = _float_dtype("dtype", dtype, allow_none=True)
        param_dtype = _float_dtype("param_dtype", param_dtype, allow_none=False)
        resolve_backend(backend)  # ValueError naming the choices for an unknown backend
        self.backend = backend
        self.precision = precision
        self.ep = self._check_mesh(mesh)
        self.mesh = mesh
        if mesh is not None and backend == "pallas_triton" and mesh.devices.flat[0].platform != "gpu":
            # JAX's Pallas interpreter pads with mesh-invariant constants, which shard_map's
            # varying-axis check rejects; compiled GPU kernels are fine.
            raise ValueError(
                "backend='pallas_triton' on a mesh of CPU devices would run the kernels in interpret "
                "mode inside shard_map, which JAX cannot do; use backend='auto' or 'xla' on CPU meshes."
            )
        if ep_strategy not in STRATEGIES:
            raise ValueError(f"ep_strategy={ep_strategy!r}: use one of {STRATEGIES}.")
        self.ep_strategy = ep_strategy
        if capacity_factor is not None:
            check_capacity_factor(capacity_factor)
        self.capacity_factor = capacity_factor

        e, f, d = self.num_experts, self.d_ff, self.d_model
        d_in = self.latent_dim or d
        experts = (EP_AXIS, None, None)
        replicated = (None, None)
        self.w_router = _param(_init(rngs.params(), (e, d), param_dtype), replicated, mesh)
        w_gate = _expert_init(rngs.params(), (e, f, d_in), param_dtype)
        w_up = _expert_init(rngs.params(), (e, f, d_in), param_dtype)
        if fused_gate_up:
            self.w_gate_up = _param(fuse_gate_up(w_gate, w_up), experts, mesh)
        else:
            self.w_gate = _param(w_gate, experts, mesh)
            self.w_up = _param(w_up, experts, mesh)
        self.w_down = _param(_expert_init(rngs.params(), (e, d_in, f), param_dtype), experts, mesh)
        if self.latent_dim is not None:
            self.w_latent_down = _param(_init(rngs.params(), (self.latent_dim, d), param_dtype), replicated, mesh)
            self.w_latent_up = _param(_init(rngs.params(), (d, self.latent_dim), param_dtype), replicated, mesh)
        self.shared = (
            SwiGLU(
                d, shared_d_ff or f * num_shared_experts, dtype=dtype, param_dtype=param_dtype,
                precision=precision, mesh=mesh, rngs=rngs,
            )
            if num_shared_experts
            else None
        )
        self.selection_bias = SelectionBias(jnp.zeros((e,), jnp.float32))

    # ------------------------------------------------------------------------- config checks

    def _check_router(self, router):
        if router is None:
            return routing_lib.SoftmaxTopK(self.top_k, renormalize=True)
        if not isinstance(router, _ROUTERS):
            raise TypeError(
                f"router={router!r}: must be a moe_jax.routing router "
                "(SelectedSoftmax, SoftmaxTopK or SigmoidGroupedTopK)."
            )
        if router.top_k != self.top_k:
            raise ValueError(
                f"router.top_k={router.top_k} differs from top_k={self.top_k}; build the router with "
                f"top_k={self.top_k}."
            )
        # The router checks itself against E (e.g. n_group must divide E) when it sees logits;
        # tracing it abstractly runs those checks now, at construction.
        jax.eval_shape(lambda: router.route(jnp.zeros((1, self.num_experts), jnp.float32)))
        return router

    def _check_mesh(self, mesh) -> int:
        if mesh is None:
            return 1
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh={mesh!r}: must be a jax.sharding.Mesh from moe_jax.parallel.make_mesh.")
        if tuple(mesh.axis_names) != MESH_AXES:
            raise ValueError(
                f"mesh has axes {tuple(mesh.axis_names)}; the MoE layer needs {MESH_AXES} "
                "(build it with moe_jax.parallel.make_mesh(ep=..., data=...))."
            )
        return check_mesh(mesh, self.num_experts)

    # ------------------------------------------------------------------------- forward

    def __call__(
        self, x: jax.Array, *, mask: jax.Array | None = None, routing: routing_lib.Routing | None = None
    ) -> tuple[jax.Array, MoEStats]:
        """`y, stats = moe(x, mask=..., routing=...)`.

        x: `[B, S, D]` or `[T, D]`. mask: bool with the leading shape of `x`, True = real token;
        masked tokens get no routed output (only the shared experts') and count in no statistic.
        routing: optional `Routing` of the T = B*S flattened tokens; skips the router (z_loss is
        then 0) and gradients reach `routing.weights_TK`.
        Returns `y` (shape of `x`, compute dtype) and `MoEStats`.
        """
        x_TD, mask_T, seq_BS = self._check_inputs(x, mask)
        num_tokens = x_TD.shape[0]
        dtype = x.dtype if self.dtype is None else self.dtype
        # Padding tokens may hold anything: zero them (where, so NaN cannot leak into gradients)
        # before they reach the router and the routed experts.
        real_TD = x_TD if mask_T is None else jnp.where(mask_T[:, None], x_TD, jnp.zeros((), x_TD.dtype))

        if routing is None:
            logits_TE = jnp.dot(
                real_TD.astype(jnp.float32), self.w_router[...].astype(jnp.float32).T, precision=_HI
            )
            routing = self.router.route(logits_TE, selection_bias_E=self.selection_bias[...])
            z_loss = routing_lib.z_loss(logits_TE, mask_T=mask_T)
        else:
            self._check_routing(routing, num_tokens)
            z_loss = jnp.zeros((), jnp.float32)

        idx_TK, probs_TE = routing.expert_idx_TK, routing.probs_TE
        seq_mask = None if mask_T is None else mask_T.reshape(seq_BS)
        counts_E = routing_lib.expert_counts(idx_TK, self.num_experts, mask_T=mask_T)

        routed_in_TD = real_TD.astype(dtype)
        if self.latent_dim is not None:
            routed_in_TD = _linear(routed_in_TD, self.w_latent_down[...], dtype, self.precision).astype(dtype)
        routed = self._routed(routed_in_TD, idx_TK, routing.weights_TK, mask_T, dtype)
        y_TD = routed.y_TD.astype(jnp.float32)  # the branches are summed in fp32, rounded once
        if self.latent_dim is not None:
            y_TD = _linear(routed.y_TD, self.w_latent_up[...], dtype, self.precision)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD).astype(jnp.float32)
        y_TD = y_TD.astype(dtype)

        executed = routed.executed_rows
        stats = MoEStats(
            aux_loss=routing_lib.aux_loss(probs_TE, idx_TK, mask_T=mask_T),
            seq_aux_loss=routing_lib.seq_aux_loss(
                probs_TE.reshape(seq_BS + (self.num_experts,)),
                idx_TK.reshape(seq_BS + (self.top_k,)),
                mask_BS=seq_mask,
            ),
            z_loss=z_loss,
            counts_E=counts_E,
            tokens=jnp.asarray(num_tokens if mask_T is None else jnp.sum(mask_T, dtype=jnp.int32), jnp.int32),
            executed_rows=executed,
            padding_fraction=jnp.where(
                executed > 0, (executed - routed.gemm_rows) / jnp.maximum(executed, 1), 0.0
            ).astype(jnp.float32),
            dropped=routed.dropped,
        )
        return y_TD.reshape(x.shape[:-1] + (self.d_model,)), stats

    def update_selection_bias(self, counts_E: jax.Array, step_size) -> None:
        """Loss-free balancing step: `bias += step_size * sign(mean(counts) - counts)` (outside the
        gradient; pass `stats.counts_E`, already global)."""
        self.selection_bias[...] = routing_lib.update_selection_bias(self.selection_bias[...], counts_E, step_size)

    # ------------------------------------------------------------------------- helpers

    def _check_inputs(self, x, mask):
        if not hasattr(x, "ndim") or x.ndim not in (2, 3) or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must be [B, S, D] or [T, D] with D = d_model = {self.d_model}; got shape "
                f"{tuple(getattr(x, 'shape', ()))}."
            )
        x_TD = x.reshape(-1, self.d_model)
        seq_BS = tuple(x.shape[:2]) if x.ndim == 3 else (1, x.shape[0])  # [T, D] is one sequence
        mask_T = None
        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.shape != x.shape[:-1]:
                raise ValueError(
                    f"mask must have shape {tuple(x.shape[:-1])} (x without its last axis); got {tuple(mask.shape)}."
                )
            mask_T = mask.reshape(-1).astype(jnp.bool_)
        if self.mesh is not None and x_TD.shape[0] % self.mesh.size:
            raise ValueError(
                f"{x_TD.shape[0]} tokens cannot be split over the mesh's {self.mesh.size} devices; pad the "
                f"batch to a multiple of {self.mesh.size} tokens (mask the padding)."
            )
        return x_TD, mask_T, seq_BS

    def _check_routing(self, routing, num_tokens: int) -> None:
        expected = {
            "expert_idx_TK": (num_tokens, self.top_k),
            "weights_TK": (num_tokens, self.top_k),
            "probs_TE": (num_tokens, self.num_experts),
        }
        for name, shape in expected.items():
            got = tuple(getattr(routing, name).shape)
            if got != shape:
                raise ValueError(f"routing.{name} must have shape {shape} for {num_tokens} tokens; got {got}.")

    def _expert_weights(self, dtype) -> tuple[jax.Array, ...]:
        """Expert weights in the compute dtype: `(w_gate_up, w_down)` or `(w_gate, w_up, w_down)`."""
        names = ("w_gate_up", "w_down") if self.fused_gate_up else ("w_gate", "w_up", "w_down")
        return tuple(getattr(self, n)[...].astype(dtype) for n in names)

    def _experts(self, x_MD, group_sizes, weights):
        fn = swiglu_experts_fused if self.fused_gate_up else swiglu_experts
        return fn(x_MD, group_sizes, *weights, backend=self.backend, precision=self.precision)

    def _executed_rows(self, group_sizes, num_rows: int) -> jax.Array:
        """Rows the grouped GEMM runs at the tile height `gmm_config` picks for this shape."""
        gate_up_cols = 2 * self.d_ff if self.fused_gate_up else self.d_ff
        block_m = gmm_config(num_rows, gate_up_cols, self.latent_dim or self.d_model, group_sizes.shape[0]).block_m
        return jnp.sum(executed_rows(group_sizes, block_m), dtype=jnp.int32)

    def _local(self, x_TD, idx_TK, w_TK, mask_T, weights):
        """Stage 3 on one device's tokens with all E experts: pack, grouped SwiGLU, combine."""
        packing = pack(idx_TK, self.num_experts, mask_T=mask_T)
        y_RD = self._experts(gather_rows(x_TD, packing, backend=self.backend), packing.group_sizes_E, weights)
        y_TD = combine(y_RD, w_TK, packing)  # pack(mask_T=...) already left masked routes out
        sizes = packing.group_sizes_E
        return y_TD, self._executed_rows(sizes, idx_TK.size), jnp.sum(sizes)

    def _routed(self, x_TD, idx_TK, w_TK, mask_T, dtype) -> _Routed:
        """Stage 3: on one device, or inside `shard_map` over the mesh (token-sharded inputs)."""
        weights = self._expert_weights(dtype)
        if self.mesh is None:
            y_TD, executed, rows = self._local(x_TD, idx_TK, w_TK, mask_T, weights)
            return _Routed(y_TD, executed, rows, jnp.zeros((), jnp.int32))
        if mask_T is None:
            mask_T = jnp.ones(x_TD.shape[:1], jnp.bool_)
        act, rep = activation_spec(), dense_spec()
        body, weight_spec = (self._dp_body, rep) if self.ep == 1 else (self._ep_body, expert_spec())
        outputs = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(act, act, act, act) + (weight_spec,) * len(weights),
            out_specs=(act, rep, rep, rep),
        )(x_TD, idx_TK, w_TK, mask_T, *weights)
        return _Routed(*outputs)

    def _dp_body(self, x_TD, idx_TK, w_TK, mask_T, *weights):
        """Stage 3 with ep = 1 (inside shard_map): each device runs all experts on its tokens."""
        weights = _varying(weights, DENSE_DP_AXES)  # replicated: gradients sum over every device
        y_TD, executed, rows = self._local(x_TD, idx_TK, w_TK, mask_T, weights)
        return y_TD, lax.psum(executed, MESH_AXES), lax.psum(rows, MESH_AXES), jnp.zeros((), jnp.int32)

    def _ep_body(self, x_TD, idx_TK, w_TK, mask_T, *weights):
        """Stage 3 on one ep rank (inside shard_map): dispatch, local experts, combine."""
        num_tokens, top_k = idx_TK.shape
        capacity = None
        if self.capacity_factor is not None and num_tokens * top_k:  # no routes: nothing to bound
            capacity = capacity_for(num_tokens, top_k, self.ep, self.capacity_factor,
                                    local_experts=self.num_experts // self.ep)
        # Masked tokens are never sent and never count as dropped.
        packed_MD, sizes_El, plan = ep_dispatch(
            x_TD, idx_TK, num_experts=self.num_experts, axis_name=EP_AXIS, strategy=self.ep_strategy,
            capacity=capacity, mask_T=mask_T, backend=self.backend,
        )
        weights = _varying(weights, EXPERT_DP_AXES)  # an ep shard's replicas sum its gradients
        y_TD = ep_combine(self._experts(packed_MD, sizes_El, weights), w_TK, plan, axis_name=EP_AXIS,
                          backend=self.backend)
        executed = lax.psum(self._executed_rows(sizes_El, packed_MD.shape[0]), MESH_AXES)
        rows = lax.psum(jnp.sum(sizes_El), MESH_AXES)
        # plan.dropped is already the ep-group total; the groups of the data replicas add up.
        dropped = lax.psum(plan.dropped, EXPERT_DP_AXES)
        return y_TD, executed, rows, dropped
