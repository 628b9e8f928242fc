"""`fp8_grouped_linear`: the differentiable grouped linear layer of the FP8 recipe; its products run
`moe_jax.ops.gmm.fp8_api.gmm_fp8` (the FP8 kernel on a GPU that has one, the reference path
elsewhere).

Legend: M packed rows, K input width, N output width, E groups (experts).

The recipe is DeepSeek-V3's blockwise FP8 (DeepSeek-AI, "DeepSeek-V3 Technical Report",
arXiv:2412.19437, section 3.3; the quantization itself is `moe_jax.ops.fp8`):

- Forward: `x` quantized per 1 x 128 tile of K (`quantize_rows`), the weights per 128 x 128 block
  (`quantize_weights`, or given already quantized), `y = rows @ w^T` by the recipe. In a
  differentiated call the forward also writes the quantized master weights as `[E, K, N]`
  (`transpose_weights`), the layout the input gradient's product reads: XLA fuses that second
  output into the quantization's pass over the weights (no extra read), and the backward keeps it
  instead of the forward's layout (the same bytes), so it transposes nothing.
- Input gradient: `dy` quantized per 1 x 128 tile of N, `dx = dy @ w` by the recipe with the same
  128 x 128 weight blocks read in the other orientation.
- Weight gradient: `dw = dy^T @ rows` in x's dtype from the dequantized FP8 rows (the recipe keeps
  the FP8 rows, not `x`, for the backward: that is its activation-memory saving) and the
  unquantized `dy`: bf16 when `x` is (an FP8 weight gradient is for the kernels to measure).
- The weight quantization is passed through by a straight-through estimator: `dw` is the gradient
  of the master weights as if `quantize_weights` were the identity (as is the rows' quantization
  for `dx`).

Products: `gmm_fp8` on the caller's backend (`FP8_LINEAR_BACKENDS`): `triton` is the FP8 kernel
(e4m3 tensor-core products promoted every 128 of the contraction: `gmm_fp8_reference`'s value up
to fp32 summation order within a step); `xla` and `pallas_triton` dequantize the operands and run
an fp32 `gmm` at `Precision.HIGHEST` (the reference path, slower than bf16); `auto` is the kernel
where it runs, else `xla`. The weight gradient's `tgmm` runs in x's dtype on the backend `auto`
picks for it (`triton`: its 16-bit kernel).

Group sizes follow `grouped_linear`'s contract: empty groups are legal, rows past
`sum(group_sizes)` get zero output and zero input gradient and add nothing to the weight gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_jax.ops.fp8 import (BLOCK, FP8_DTYPE, Fp8Weights, dequantize_rows, quantize_rows, quantize_weights,
                             transpose_weights)
from moe_jax.ops.gmm import SUPPORTED_DTYPES, tgmm
from moe_jax.ops.gmm.fp8_api import FP8_GEMM_BACKENDS, fp8_backend, gmm_fp8

__all__ = ["FP8_LINEAR_BACKENDS", "fp8_grouped_linear"]

FP8_LINEAR_BACKENDS = FP8_GEMM_BACKENDS

_HI = jax.lax.Precision.HIGHEST


def _forward(backend, x, wq, group_sizes):
    rows = quantize_rows(x)
    return gmm_fp8(rows, wq, group_sizes, backend=backend, out_dtype=x.dtype), rows


def _dgrad(backend, dy, wq_t, group_sizes, x_dtype):
    """`dx[M, K]` by the recipe: `dy` quantized per 1 x 128 tile of N, the weight blocks as
    `[E, K, N]` (`transpose_weights`)."""
    return gmm_fp8(quantize_rows(dy.astype(x_dtype)), wq_t, group_sizes, backend=backend, out_dtype=x_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _master_linear(backend, x, w, group_sizes):
    return _forward(backend, x, quantize_weights(w), group_sizes)[0]


def _master_linear_fwd(backend, x, w, group_sizes):
    wq = quantize_weights(w)
    wq_t = transpose_weights(wq)
    y, rows = _forward(backend, x, wq, group_sizes)
    # The master weights are not kept: only a zero-size witness of their dtype for the cotangent.
    return y, (rows, wq_t, group_sizes, jnp.zeros((0,), w.dtype), jnp.zeros((0,), x.dtype))


def _master_linear_bwd(backend, res, dy):
    rows, wq_t, group_sizes, w_dtype, x_dtype = res
    dx = _dgrad(backend, dy, wq_t, group_sizes, x_dtype.dtype)
    dw = tgmm(dequantize_rows(rows).astype(x_dtype.dtype), dy.astype(x_dtype.dtype), group_sizes,
              backend=backend, precision=_HI)
    return dx, dw.astype(w_dtype.dtype), None


_master_linear.defvjp(_master_linear_fwd, _master_linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stored_linear(backend, x, values, scale, group_sizes):
    return _forward(backend, x, Fp8Weights(values, scale), group_sizes)[0]


def _stored_linear_fwd(backend, x, values, scale, group_sizes):
    y, rows = _forward(backend, x, Fp8Weights(values, scale), group_sizes)
    return y, (rows, values, scale, group_sizes, jnp.zeros((0,), x.dtype))


def _stored_linear_bwd(backend, res, dy):
    rows, values, scale, group_sizes, x_dtype = res
    dx = _dgrad(backend, dy, transpose_weights(Fp8Weights(values, scale)), group_sizes, x_dtype.dtype)
    # Stored FP8 weights are frozen (inference): their cotangents are zero, never an update.
    return dx, jnp.zeros_like(values), jnp.zeros_like(scale), None


_stored_linear.defvjp(_stored_linear_fwd, _stored_linear_bwd)


def fp8_grouped_linear(
    x: jax.Array,
    w: jax.Array | Fp8Weights,
    group_sizes: jax.Array,
    *,
    backend: str = "xla",
) -> jax.Array:
    """Differentiable grouped linear layer of the FP8 recipe: `y[M, N]`, rows of group e are
    `x_e @ w[e]^T` with both operands blockwise FP8 (module docstring).

    Args:
      x: `[M, K]` bf16/fp16/fp32 rows grouped contiguously by group; the output has its dtype.
      w: either master weights `[E, N, K]` (bf16/fp16/fp32; quantized per 128 x 128 block in each
        call, gradient by the straight-through estimator, in w's dtype), or an `Fp8Weights`
        (`values_ENK` e4m3, `scale_ENbKb` fp32) used as they are, with zero gradient.
      group_sizes: `[E]` integer rows per group (not differentiated), as for `grouped_linear`.
      backend: where the recipe's products run (`gmm_fp8`'s `backend`): one of `FP8_LINEAR_BACKENDS`.
    """
    fp8_backend(backend)  # ValueError naming the choices, or why the kernel cannot run here
    x = jnp.asarray(x)
    if x.ndim != 2 or jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"x: expected [M, K] rows of bfloat16/float16/float32, got shape {x.shape} dtype {x.dtype}.")
    if isinstance(w, Fp8Weights):
        values, scale = w
        if values.ndim != 3 or values.shape[2] != x.shape[1]:
            raise ValueError(f"w.values_ENK: expected [E, N, K] with K = x.shape[1] = {x.shape[1]}, got "
                             f"{values.shape}.")
        if values.dtype != FP8_DTYPE or scale.dtype != jnp.float32:
            raise TypeError(f"w: expected Fp8Weights of float8_e4m3fn values and float32 scales, got "
                            f"{values.dtype} and {scale.dtype}; quantize master weights with "
                            f"moe_jax.ops.fp8.quantize_weights.")
        want = (values.shape[0], -(-values.shape[1] // BLOCK), -(-values.shape[2] // BLOCK))
        if tuple(scale.shape) != want:
            raise ValueError(f"w.scale_ENbKb: expected {want} (one scale per {BLOCK} x {BLOCK} block), got "
                             f"{tuple(scale.shape)}.")
        return _stored_linear(backend, x, values, scale, group_sizes)
    w = jnp.asarray(w)
    if w.ndim != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"w: expected [E, N, K] master weights with K = x.shape[1] = {x.shape[1]}, got {w.shape}.")
    if jnp.dtype(w.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"w: expected bfloat16/float16/float32 master weights or an Fp8Weights, got {w.dtype}.")
    return _master_linear(backend, x, w, group_sizes)
