"""Dense pieces of the MoE layer: parameter helpers, fp32-accumulated projections, and the dense
SwiGLU FFN the shared experts use (in the compute dtype, or in DeepSeek-V3's blockwise FP8:
`swiglu_fp8`, from master weights or from the stored FP8 weights of `Fp8SwiGLU`).

Legend (shape suffixes): T tokens, D model width, F hidden width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from moe_jax.experts import swiglu_experts_fp8
from moe_jax.layers.checks import float_dtype
from moe_jax.ops import Fp8Copies
from moe_jax.ops.fp8 import Fp8Weights, quantize_weights
from moe_jax.ops.platform import BackendName
from moe_jax.validation import check_int

__all__ = ["SWIGLU_WEIGHTS", "Fp8Stored", "Fp8SwiGLU", "SwiGLU", "dot_precision", "expert_init", "init", "linear", "param", "stored",
           "swiglu_fp8"]

# The weights of a SwiGLU, one per projection (the routed experts' separate stacks are named alike).
SWIGLU_WEIGHTS = ("w_gate", "w_up", "w_down")

# Truncated normal with variance 1/fan_in (LeCun) on the last axis, the input axis of every
# weight here ([out, in] and [E, out, in]); the down projections therefore start at 1/sqrt(F),
# keeping the output scale of an expert independent of its hidden width. Jitted (shape and dtype
# static) so eager construction compiles one program per weight shape, not one per primitive.
init = jax.jit(
    jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2),
    static_argnums=(1, 2),
)
expert_init = jax.jit(
    jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2, batch_axis=(0,)),
    static_argnums=(1, 2),
)


def dot_precision(dtype, precision):
    """Dense projections follow `grouped_linear`: full fp32 products unless asked otherwise."""
    if precision is not None:
        return precision
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def param(value: jax.Array, spec: tuple, mesh: Mesh | None) -> nnx.Param:
    """A parameter carrying its mesh layout as metadata (placed on the mesh when there is one)."""
    if mesh is None:
        return nnx.Param(value)
    return nnx.Param(value, out_sharding=spec, mesh=mesh)


class Fp8Stored(nnx.Variable):
    """Stored FP8 weights of `Fp8Blockwise(weights="stored")`: e4m3 values (`[E, N, K]` routed
    experts, `[N, K]` shared experts) or their fp32 block scales (`[..., ceil(N/128),
    ceil(K/128)]`). Not an `nnx.Param`: optimizers filtering on `nnx.Param` never see them, and
    nothing differentiates them."""


def stored(value: jax.Array, spec: tuple | None, mesh: Mesh | None) -> Fp8Stored:
    """`value` as an `Fp8Stored` carrying its mesh layout (placed on the mesh when there is one), as `param`."""
    if mesh is None:
        return Fp8Stored(value)
    return Fp8Stored(value, out_sharding=spec, mesh=mesh)


def linear(x, w_OI, dtype, precision):
    """`x @ w_OI^T` on `dtype` operands, accumulated in fp32 (like the grouped GEMMs); fp32 result."""
    return jnp.dot(
        x.astype(dtype), w_OI.astype(dtype).T, precision=dot_precision(dtype, precision),
        preferred_element_type=jnp.float32,
    )


def swiglu_fp8(
    x_TD: jax.Array, w_gate_FD: jax.Array | Fp8Weights, w_up_FD: jax.Array | Fp8Weights,
    w_down_DF: jax.Array | Fp8Weights, *, backend: BackendName = "xla", input_gradient: str = "fp8",
    copies: tuple[Fp8Copies, ...] | None = None,
) -> jax.Array:
    """The dense SwiGLU with its three projections in DeepSeek-V3's blockwise FP8 (arXiv:2412.19437,
    section 3.3, which runs every linear layer of its blocks so): `swiglu_experts_fp8` with one
    expert that holds every row (the weights as `[1, ...]` stacks, one group of T rows). The rows
    are quantized per 1 x 128 tile. Master weights (bf16/fp16/fp32 `[F, D]`, `[D, F]`) are
    quantized per 128 x 128 block in each call (or read from `copies`:
    `moe_jax.ops.fp8_weight_copies` of the three weights' `[1, ...]` stacks), and their gradients
    pass the quantization straight through, in their dtype; stored weights (three `Fp8Weights` of
    e4m3 `[F, D]`, `[D, F]` values and their fp32 `[ceil(F/128), ceil(D/128)]`-style block
    scales) are used as they are and get no gradient. `x_TD` bf16/fp16/fp32 `[T, D]`; returns
    `[T, D]` in its dtype. `backend` and `input_gradient`: `moe_jax.ops.fp8_grouped_linear`'s."""
    group_sizes = jnp.full((1,), x_TD.shape[0], jnp.int32)
    w_gate, w_up, w_down = (jax.tree.map(lambda a: a[None], w) for w in (w_gate_FD, w_up_FD, w_down_DF))
    return swiglu_experts_fp8(x_TD, group_sizes, w_gate, w_up, w_down, backend=backend,
                              input_gradient=input_gradient, copies=copies)


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
        d_model = check_int("d_model", d_model)
        d_ff = check_int("d_ff", d_ff)
        param_dtype = float_dtype("param_dtype", param_dtype)
        self.dtype = float_dtype("dtype", dtype, allow_none=True)
        self.precision = precision
        replicated = (None, None)
        self.w_gate = param(init(rngs.params(), (d_ff, d_model), param_dtype), replicated, mesh)
        self.w_up = param(init(rngs.params(), (d_ff, d_model), param_dtype), replicated, mesh)
        self.w_down = param(init(rngs.params(), (d_model, d_ff), param_dtype), replicated, mesh)

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The master `(w_gate, w_up, w_down)` in `param_dtype`."""
        return tuple(getattr(self, n)[...] for n in SWIGLU_WEIGHTS)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype if self.dtype is None else self.dtype
        gate = linear(x, self.w_gate[...], dtype, self.precision)
        up = linear(x, self.w_up[...], dtype, self.precision)
        return linear(jax.nn.silu(gate) * up, self.w_down[...], dtype, self.precision).astype(dtype)


class Fp8SwiGLU(nnx.Module):
    """The dense SwiGLU of `SwiGLU` with stored blockwise FP8 weights (the shared experts of a layer
    with `Fp8Blockwise(weights="stored")`): e4m3 `w_gate`, `w_up` `[F, D]` and `w_down` `[D, F]`
    with fp32 block scales `w_gate_scale`, `w_up_scale` `[ceil(F/128), ceil(D/128)]` and
    `w_down_scale` `[ceil(D/128), ceil(F/128)]` (`Fp8Stored` variables; a Hugging Face FP8
    checkpoint's `weight`/`weight_scale_inv` pairs).

    Built from master weights `w_gate_FD`, `w_up_FD`, `w_down_DF` (any float dtype), quantized
    once per 128 x 128 block (`moe_jax.ops.fp8.quantize_weights`); `mesh`: replicated on it.
    `__call__(x[..., D]) -> [..., D]` in `x.dtype`: `swiglu_fp8` on `backend` (rows quantized per
    1 x 128 tile), input gradients through the stored weights, none to them.
    """

    def __init__(self, w_gate_FD: jax.Array, w_up_FD: jax.Array, w_down_DF: jax.Array, *,
                 backend: BackendName = "xla", mesh: Mesh | None = None):
        masters = (w_gate_FD, w_up_FD, w_down_DF)
        for name, w in zip(SWIGLU_WEIGHTS, masters):
            if jnp.ndim(w) != 2:
                raise ValueError(f"Fp8SwiGLU: {name} must be a 2-D weight matrix; got shape {jnp.shape(w)}.")
        f, d = jnp.shape(w_gate_FD)
        if jnp.shape(w_up_FD) != (f, d) or jnp.shape(w_down_DF) != (d, f):
            raise ValueError(f"Fp8SwiGLU: w_gate_FD {jnp.shape(w_gate_FD)}, w_up_FD {jnp.shape(w_up_FD)} and "
                             f"w_down_DF {jnp.shape(w_down_DF)} must be [F, D], [F, D] and [D, F].")
        self.backend = backend
        for name, w in zip(SWIGLU_WEIGHTS, masters):
            values, scale = quantize_weights(jnp.asarray(w)[None])
            setattr(self, name, stored(values[0], (None, None), mesh))
            setattr(self, name + "_scale", stored(scale[0], (None, None), mesh))

    def weights(self) -> tuple[Fp8Weights, Fp8Weights, Fp8Weights]:
        """The stored `(w_gate, w_up, w_down)`, each an `Fp8Weights` of values and block scales."""
        return tuple(Fp8Weights(getattr(self, n)[...], getattr(self, n + "_scale")[...]) for n in SWIGLU_WEIGHTS)

    def __call__(self, x: jax.Array) -> jax.Array:
        x_TD = x.reshape(-1, x.shape[-1])
        return swiglu_fp8(x_TD, *self.weights(), backend=self.backend).reshape(x.shape)
