"""The Flax NNX Mixture-of-Experts layer: routed SwiGLU experts, shared experts, LatentMoE.

Legend (shape suffixes): B batch, S sequence, T = B*S tokens, D model width, L latent width,
Din routed-expert width (L with a latent, else D), F expert hidden width, E experts, K experts
per token.

`MoE.__call__` runs one seam per stage:

1. router (fp32 always): `logits_TE = x @ W_r^T`, `routing = router.route(logits_TE, bias)`; or
   an injected `Routing` (skips the router).
2. routed experts at width Din (`x @ W_ld^T` first for LatentMoE): `routed.single_device` or,
   with a mesh, `routed.routed_on_mesh` (data parallel, or expert parallel through
   `moe_jax.parallel.ep_moe`); all GEMMs in the compute `dtype`.
3. `y = routed @ W_lu^T (LatentMoE) + g(x) * shared(x)`, summed in fp32 and rounded once
   (`g = sigmoid(x W_sg^T)` with `shared_expert_gate`, Qwen2-MoE; else 1).
4. statistics over real tokens (`stats.moe_stats`).

Everything outside stage 2 is ordinary `jnp`; with a mesh it is partitioned by XLA on the
token-sharded activations, so router math is local to each shard, and the statistics are global
reductions equal to the single-device values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from moe_jax import routing as routing_lib
from moe_jax.experts import fuse_gate_up
from moe_jax.layers.checks import (
    check_axis_rules,
    check_layer_mesh,
    check_router,
    check_routing,
    check_token_split,
    flatten_inputs,
    float_dtype,
)
from moe_jax.layers.dense import SwiGLU, expert_init, init, linear, param
from moe_jax.layers.routed import ExpertStage, routed_on_mesh, single_device
from moe_jax.layers.stats import MoEStats, moe_stats
from moe_jax.ops import BackendTable, resolve_backend
from moe_jax.parallel import AxisRules, EPOptions
from moe_jax.parallel.transports import check_strategy
from moe_jax.validation import check_bool, check_int

__all__ = ["GEMM_KERNELS", "MoE", "ROW_GATHERS", "SelectionBias"]

GEMM_KERNELS = ("auto", "static")
ROW_GATHERS = ("auto", "fused", "separate")

_HI = lax.Precision.HIGHEST


class SelectionBias(nnx.Variable):
    """Loss-free balancing bias `[E]` f32 (DeepSeek-V3). Not an `nnx.Param`: optimizers filtering
    on `nnx.Param` never see it; `MoE.update_selection_bias` changes it outside the gradient."""


def _ep_options(expert_parallel, ep_strategy, capacity_factor) -> EPOptions:
    if expert_parallel is None:
        strategy = "padded" if ep_strategy is None else check_strategy(ep_strategy, "ep_strategy")
        return EPOptions(strategy=strategy, capacity_factor=capacity_factor)
    if not isinstance(expert_parallel, EPOptions):
        raise TypeError(f"expert_parallel must be a moe_jax.parallel.EPOptions; got {type(expert_parallel).__name__}.")
    if ep_strategy is not None or capacity_factor is not None:
        raise ValueError("pass the EP options once: either expert_parallel=EPOptions(...) or ep_strategy=/"
                         "capacity_factor=, not both.")
    return expert_parallel


class MoE(nnx.Module):
    """Mixture-of-Experts FFN with SwiGLU experts on grouped GEMMs.

    Args:
      d_model: D. d_ff: F, the routed experts' hidden width. num_experts: E. top_k: K.
      router: a `moe_jax.routing` router (`SelectedSoftmax`, `SoftmaxTopK`, `SigmoidGroupedTopK`)
        whose `top_k` equals `top_k`; default `SoftmaxTopK(top_k, renormalize=True)`.
      num_shared_experts: shared experts (DeepSeekMoE), merged into one SwiGLU of width
        `shared_d_ff` (default `d_ff * num_shared_experts`) that sees every real token.
      shared_expert_gate: scale the shared experts' output per token by `sigmoid(x W_sg^T)`,
        `w_shared_gate [1, D]` (Qwen2-MoE's `shared_expert_gate`); needs shared experts.
      latent_dim: L for LatentMoE: routed experts work at width L between a shared down
        projection `w_latent_down [L, D]` and up projection `w_latent_up [D, L]`.
      fused_gate_up: store gate and up as one `w_gate_up [E, 2F, Din]` (gate rows first).
      dtype: compute dtype of every GEMM except the router (default: the input's dtype).
      param_dtype: parameter dtype.
      backend: grouped-GEMM backend: `"auto"` (on GPU per kernel from `moe_jax.ops.H200_BACKENDS`;
        XLA elsewhere), `"pallas_triton"`, `"triton"` (official Triton through jax_triton, GPU
        only), `"mosaic_gpu"` (Pallas Mosaic GPU grouped GEMMs) or `"xla"`; the row
        gathers and EP's send plan use it too (on `pallas_triton` where the backend has no kernel
        of its own). A `moe_jax.ops.BackendTable` is `"auto"` with a per-kernel table of its own,
        e.g. `H200_BACKENDS.replace({("gmm_nn", "prefill"): ("mosaic_gpu", "triton", "pallas_triton")})`
        to run the input gradient on Mosaic GPU where it takes the shapes.
      gemm_kernel: how the Pallas backend picks each grouped GEMM's kernel: `"auto"` (default),
        the per-device tuned selector (`moe_jax.ops.gmm.pallas_triton.selector`: from the packed rows and, where
        the table says it pays, the routing histogram, on device); `"static"`, the shape table
        (`moe_jax.ops.gmm_config`; reproducible across histograms). `MoEStats.kernel_counts_C`
        says which ran.
      row_gather: how the routed rows reach the gate/up GEMM: `"fused"`, the GEMM reads each
        row through the packing's ids inside its kernel (no packed copy in memory;
        `moe_jax.ops.grouped_linear(rows=...)`): the token rows off expert parallelism, the
        receive buffer under it (`ep_moe(fuse_regroup=True)`; the pairwise transport's two
        sources are still regrouped first); `"separate"`, a row gather writes the packed rows
        first; `"auto"` (default), fused on the backends where that measured faster
        (`moe_jax.ops.AUTO_FUSED_GATHER`, none on the H200 yet). Equal results.
      precision: dot precision for the expert/shared/latent GEMMs (default: HIGHEST for fp32).
      mesh: a `jax.sharding.Mesh` (Auto or Explicit axes) for data/expert parallelism: the
        parameters are placed on it and the routed stage runs in `jax.shard_map` over it
        (`routed`). None (default): no mesh of the layer's own; under an ambient mesh
        (`jax.set_mesh`) the routed stage follows `axis_rules`, or the Explicit sharding of the
        input's token dimension (data parallel), and otherwise runs on the arrays as they are.
      axis_rules: `moe_jax.parallel.AxisRules`, which mesh axes split tokens and which one splits
        experts (default `AxisRules()`: tokens over `("data", "ep")`, experts over `"ep"`, the
        axes of `make_mesh`); other mesh axes are left alone.
      expert_parallel: `moe_jax.parallel.EPOptions` (strategy, capacity factor, transport) used
        when the mesh splits experts; default `EPOptions()` (padded, dropless, auto transport).
      ep_strategy, capacity_factor: the same two options passed one by one (the older spelling;
        not together with `expert_parallel`). With ep > 1, rows per (source, destination) rank
        pair are capped at `capacity_for(tokens_per_device, K, ep, capacity_factor,
        local_experts=E // ep)`; dropped routes are counted in `MoEStats.dropped`; None is
        dropless. Without expert parallelism nothing is exchanged, so nothing is dropped.
      rngs: parameter initialisation keys.

    Params: `w_router [E, D]`, `w_gate`/`w_up [E, F, Din]` (or `w_gate_up [E, 2F, Din]`),
    `w_down [E, Din, F]`, optionally `w_latent_down`, `w_latent_up`, `shared` (a `SwiGLU`) and
    `w_shared_gate [1, D]`.
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
        shared_expert_gate: bool = False,
        latent_dim: int | None = None,
        fused_gate_up: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        backend: str | BackendTable = "auto",
        gemm_kernel: str = "auto",
        row_gather: str = "auto",
        precision: lax.Precision | None = None,
        mesh: Mesh | None = None,
        axis_rules: AxisRules | None = None,
        expert_parallel: EPOptions | None = None,
        ep_strategy: str | None = None,
        capacity_factor: float | None = None,
        rngs: nnx.Rngs,
    ):
        self.d_model = d = check_int("d_model", d_model)
        self.d_ff = f = check_int("d_ff", d_ff)
        self.num_experts = e = check_int("num_experts", num_experts)
        self.top_k = check_int("top_k", top_k)
        if self.top_k > e:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={e}; set top_k <= num_experts.")
        self.router = check_router(router, self.top_k, e)
        num_shared_experts = check_int("num_shared_experts", num_shared_experts, minimum=0)
        if shared_d_ff is not None:
            shared_d_ff = check_int("shared_d_ff", shared_d_ff)
            if num_shared_experts == 0:
                raise ValueError(f"shared_d_ff={shared_d_ff} was given but num_shared_experts=0; set "
                                 "num_shared_experts >= 1 to add shared experts, or drop shared_d_ff.")
        self.shared_expert_gate = check_bool("shared_expert_gate", shared_expert_gate)
        if self.shared_expert_gate and num_shared_experts == 0:
            raise ValueError("shared_expert_gate=True gates the shared experts, but num_shared_experts=0; set "
                             "num_shared_experts >= 1 or drop shared_expert_gate.")
        self.latent_dim = None if latent_dim is None else check_int("latent_dim", latent_dim)
        self.fused_gate_up = check_bool("fused_gate_up", fused_gate_up)
        self.dtype = float_dtype("dtype", dtype, allow_none=True, compute=True)
        param_dtype = float_dtype("param_dtype", param_dtype)
        resolve_backend(backend)  # ValueError naming the choices for an unknown backend
        self.backend = backend
        if gemm_kernel not in GEMM_KERNELS:
            raise ValueError(f"gemm_kernel={gemm_kernel!r}: use one of {GEMM_KERNELS} ('auto': the tuned on-device "
                             "selector picks each GEMM's kernel from the routing histogram; 'static': from the shape).")
        self.gemm_kernel = gemm_kernel
        if row_gather not in ROW_GATHERS:
            raise ValueError(f"row_gather={row_gather!r}: use one of {ROW_GATHERS} ('fused': the gate/up GEMM reads "
                             "token rows through the packing's ids; 'separate': pack the rows first).")
        self.row_gather = row_gather
        self.precision = precision
        self.axis_rules = check_axis_rules(axis_rules)
        self.ep = check_layer_mesh(mesh, self.rules, e, backend)
        self.mesh = mesh
        self.expert_parallel = _ep_options(expert_parallel, ep_strategy, capacity_factor)
        if self.ep > 1 and self.expert_parallel.strategy == "ragged" and mesh.devices.flat[0].platform != "gpu":
            raise ValueError(
                f"ep_strategy='ragged' needs GPUs (XLA:{mesh.devices.flat[0].platform.upper()} has no "
                "ragged_all_to_all), but this mesh's devices are not; use ep_strategy='padded'."
            )

        d_in = self.latent_dim or d
        experts, replicated = (self.rules.experts, None, None), (None, None)
        self.w_router = param(init(rngs.params(), (e, d), param_dtype), replicated, mesh)
        w_gate = expert_init(rngs.params(), (e, f, d_in), param_dtype)
        w_up = expert_init(rngs.params(), (e, f, d_in), param_dtype)
        if self.fused_gate_up:
            self.w_gate_up = param(fuse_gate_up(w_gate, w_up), experts, mesh)
        else:
            self.w_gate = param(w_gate, experts, mesh)
            self.w_up = param(w_up, experts, mesh)
        self.w_down = param(expert_init(rngs.params(), (e, d_in, f), param_dtype), experts, mesh)
        if self.latent_dim is not None:
            self.w_latent_down = param(init(rngs.params(), (self.latent_dim, d), param_dtype), replicated, mesh)
            self.w_latent_up = param(init(rngs.params(), (d, self.latent_dim), param_dtype), replicated, mesh)
        self.shared = (
            SwiGLU(d, shared_d_ff or f * num_shared_experts, dtype=dtype, param_dtype=param_dtype, precision=precision,
                   mesh=mesh, rngs=rngs)
            if num_shared_experts else None
        )
        if self.shared_expert_gate:
            self.w_shared_gate = param(init(rngs.params(), (1, d), param_dtype), replicated, mesh)
        self.selection_bias = SelectionBias(jnp.zeros((e,), jnp.float32))

    @property
    def rules(self) -> AxisRules:
        """The axis rules in force: `axis_rules`, or the defaults of `make_mesh`'s mesh."""
        return AxisRules() if self.axis_rules is None else self.axis_rules

    @property
    def ep_strategy(self) -> str:
        return self.expert_parallel.strategy

    @property
    def capacity_factor(self) -> float | None:
        return self.expert_parallel.capacity_factor

    def __call__(
        self, x: jax.Array, *, mask: jax.Array | None = None, routing: routing_lib.Routing | None = None,
        return_routing: bool = False,
    ) -> tuple[jax.Array, MoEStats] | tuple[jax.Array, MoEStats, routing_lib.Routing]:
        """`y, stats = moe(x, mask=..., routing=...)`.

        x: `[B, S, D]` or `[T, D]`. mask: bool with the leading shape of `x`, True = real token;
        masked tokens reach nothing: their output is zero (routed and shared), they count in no
        statistic and get exactly zero gradient.
        routing: optional `Routing` of the T = B*S flattened tokens; skips the router (z_loss is
        then 0) and gradients reach `routing.weights_TK`.
        return_routing: also return the `Routing` the layer used (expert indices, combine weights,
        router probabilities of the T flattened tokens), for logging, analysis or distillation.
        Returns `y` (shape of `x`, compute dtype) and `MoEStats` (and the `Routing`).
        """
        x_TD, mask_T, seq_BS, dtype = flatten_inputs(x, mask, self.d_model, self.dtype)
        placement = self._placement(x_TD)
        # Padding tokens may hold anything: zero them (where, so NaN cannot leak into gradients)
        # before they reach the router and the routed experts.
        real_TD = x_TD if mask_T is None else jnp.where(mask_T[:, None], x_TD, jnp.zeros((), x_TD.dtype))

        if routing is None:
            logits_TE = jnp.dot(real_TD.astype(jnp.float32), self.w_router[...].astype(jnp.float32).T, precision=_HI)
            routing = self.router.route(logits_TE, selection_bias_E=self.selection_bias[...])
            z_loss = routing_lib.z_loss(logits_TE, mask_T=mask_T)
        else:
            check_routing(routing, x_TD.shape[0], self.top_k, self.num_experts)
            z_loss = jnp.zeros((), jnp.float32)

        routed_in_TD = real_TD.astype(dtype)
        if self.latent_dim is not None:
            routed_in_TD = linear(routed_in_TD, self.w_latent_down[...], dtype, self.precision).astype(dtype)
        stage = ExpertStage(self.num_experts, self.latent_dim or self.d_model, self.d_ff, self.fused_gate_up,
                            self.backend, self.precision, self.gemm_kernel, self.row_gather)
        args = (routed_in_TD, routing.expert_idx_TK, routing.weights_TK, mask_T, self._expert_weights(dtype))
        if placement is None:
            routed = single_device(stage, *args)
        else:
            routed = routed_on_mesh(stage, *placement, self.expert_parallel, *args)
        y_TD = routed.y_TD.astype(jnp.float32)
        if self.latent_dim is not None:
            y_TD = linear(routed.y_TD, self.w_latent_up[...], dtype, self.precision)
        if self.shared is not None:
            shared_TD = self.shared(real_TD).astype(jnp.float32)
            if self.shared_expert_gate:
                gate_T1 = jax.nn.sigmoid(linear(real_TD, self.w_shared_gate[...], dtype, self.precision))
                shared_TD = gate_T1 * shared_TD
            y_TD = y_TD + shared_TD
        stats = moe_stats(routing, z_loss=z_loss, mask_T=mask_T, seq_BS=seq_BS, num_experts=self.num_experts,
                          gemm=routed.gemm, dropped=routed.dropped,
                          kept_E=routed.kept_E)
        y = y_TD.astype(dtype).reshape(x.shape[:-1] + (self.d_model,))
        return (y, stats, routing) if check_bool("return_routing", return_routing) else (y, stats)

    def update_selection_bias(self, counts_E: jax.Array, step_size) -> None:
        """Loss-free balancing step: `bias += step_size * sign(mean(counts) - counts)` (outside the
        gradient; pass `stats.counts_E`, already global)."""
        self.selection_bias[...] = routing_lib.update_selection_bias(self.selection_bias[...], counts_E, step_size)

    def _placement(self, x_TD) -> tuple[object, AxisRules] | None:
        """`(mesh, rules)` the routed stage runs `shard_map` over, or None to run it on the arrays."""
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
            return None
        elif self.axis_rules is not None:
            mesh, rules = context, self.axis_rules
        else:
            # No rules: follow an Explicit sharding of the token dimension, data parallel.
            spec = jax.typeof(x_TD).sharding.spec
            axes = spec[0] if len(spec) else None
            if axes is None:
                return None
            mesh, rules = context, AxisRules(tokens=(axes,) if isinstance(axes, str) else tuple(axes), experts=None)
        check_token_split(x_TD.shape[0], mesh, rules)
        return mesh, rules

    def _expert_weights(self, dtype) -> tuple[jax.Array, ...]:
        """Expert weights in the compute dtype: `(w_gate_up, w_down)` or `(w_gate, w_up, w_down)`."""
        names = ("w_gate_up", "w_down") if self.fused_gate_up else ("w_gate", "w_up", "w_down")
        return tuple(getattr(self, n)[...].astype(dtype) for n in names)
