"""Dense pieces of the MoE layer: parameter helpers, fp32-accumulated projections, and the dense
SwiGLU FFN the shared experts use (in the compute dtype, or in DeepSeek-V3's blockwise FP8:
`swiglu_fp8`).

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
from moe_jax.ops.platform import BackendName
from moe_jax.validation import check_int

__all__ = ["SwiGLU", "dot_precision", "expert_init", "init", "linear", "param", "swiglu_fp8"]

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


def linear(x, w_OI, dtype, precision):
    """`x @ w_OI^T` on `dtype` operands, accumulated in fp32 (like the grouped GEMMs); fp32 result."""
    return jnp.dot(
        x.astype(dtype), w_OI.astype(dtype).T, precision=dot_precision(dtype, precision),
        preferred_element_type=jnp.float32,
    )


def swiglu_fp8(
    x_TD: jax.Array, w_gate_FD: jax.Array, w_up_FD: jax.Array, w_down_DF: jax.Array, *,
    backend: BackendName = "xla", input_gradient: str = "fp8", copies: tuple[Fp8Copies, ...] | None = None,
) -> jax.Array:
    """The dense SwiGLU with its three projections in DeepSeek-V3's blockwise FP8 (arXiv:2412.19437,
    section 3.3, which runs every linear layer of its blocks so): `swiglu_experts_fp8` with one
    expert that holds every row (the master weights as `[1, ...]` stacks, one group of T rows).
    The rows are quantized per 1 x 128 tile, the master weights per 128 x 128 block in each call
    (or read from `copies`: `moe_jax.ops.fp8_weight_copies` of the three weights' `[1, ...]`
    stacks), and the weight gradients pass the quantization straight through, in the weights'
    dtype. `x_TD` bf16/fp16/fp32 `[T, D]`; returns `[T, D]` in its dtype. `backend` and `input_gradient`: `moe_jax.ops.fp8_grouped_linear`'s."""
    group_sizes = jnp.full((1,), x_TD.shape[0], jnp.int32)
    return swiglu_experts_fp8(x_TD, group_sizes, w_gate_FD[None], w_up_FD[None], w_down_DF[None],
                              backend=backend, input_gradient=input_gradient, copies=copies)


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

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype if self.dtype is None else self.dtype
        gate = linear(x, self.w_gate[...], dtype, self.precision)
        up = linear(x, self.w_up[...], dtype, self.precision)
        return linear(jax.nn.silu(gate) * up, self.w_down[...], dtype, self.precision).astype(dtype)
