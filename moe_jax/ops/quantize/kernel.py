"""The quantization kernels (`pallas_triton` backends of `quantize_master_weights` and
`quantize_activations`): master weights `[E, N, K]` to the FP8 recipe's e4m3 blocks, and rows
`[M, K]` to its 1 x 128 tiles, each in one pass over its input.

Legend: E experts, N output width, K input width; Nb = ceil(N / 128), Kb = ceil(K / 128).

One program per 128 x 128 block `(e, nb, kb)`: it loads the block once (zeros past a ragged N or
K edge, which cannot raise a magnitude), takes its amax and scale, and stores the e4m3 values, the
scale and, with `transposed`, the values again as the `[K, N]` block of an `[E, K, N]` output
(and the scale at `[e, kb, nb]`). XLA needs two passes for the same outputs (the block amax, then
the divide and cast), so the kernel reads the weights once where XLA reads them twice.

Rows: one program per `BLOCK_M` rows x 128 columns `(mb, kb)`: it loads the block once, takes each
row's amax over its 128 columns (a ragged K edge is narrower, its missing columns zero), and
stores the e4m3 values and the column of scales `[mb * BLOCK_M: ..., kb]`. XLA takes the tiles'
amax in one pass and divides and casts in another.

The arithmetic is `moe_jax.ops.fp8`'s, so the result is `quantize_weights`'s (and
`quantize_rows`') bit for bit:
`scale = amax * fp32(1/448)` (1 for an all-zero block), `values = e4m3(clip(w / scale, +-448))`.
Compiled, each step is the instruction XLA's GPU backend emits for it: the fp32 division is
`div.full.f32` in both (XLA sets LLVM's `-nvptx-prec-divf32=1`; Triton lowers `/` so), not the
correctly rounded `div.rn.f32`, and the cast is `cvt.rn.satfinite.e4m3x2.f32` in both. Interpreted,
it is XLA:CPU's arithmetic, as is the reference there. One difference is undone here: Triton's
float max and min drop NaN (`maxnumf`) where XLA's propagate it, so a block's NaN is found by a sum
(NaN exactly when an element is: the magnitudes cannot cancel) and a NaN quotient is passed around
the clip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.fp8 import BLOCK, FP8_DTYPE, FP8_MAX, Fp8Rows, Fp8Weights, tile_scale
from moe_jax.ops.pallas_triton import cdiv, launch, masked_load, outer_and

__all__ = ["quantize_rows_pallas", "quantize_weights_pallas"]


def _to_fp8(x, axis):
    """e4m3 values and scales of `x` (fp32) with one tile per line along `axis`: the recipe's
    `tile_scale` of the amax, NaN found by a sum (Triton's max drops it) and kept past the clip."""
    mag = jnp.abs(x)
    amax = jnp.where(jnp.isnan(jnp.sum(mag, axis=axis)), jnp.float32(jnp.nan), jnp.max(mag, axis=axis))
    scale = tile_scale(amax)
    scaled = x / (scale if axis is None else jnp.expand_dims(scale, axis))  # `fp8._to_fp8`
    return jnp.where(jnp.isnan(scaled), scaled, jnp.clip(scaled, -FP8_MAX, FP8_MAX)).astype(FP8_DTYPE), scale


def _kernel(w_ref, values_ref, scale_ref, *transposed_refs, n: int, k: int):
    """Quantize block `(e, nb, kb)` of `w_ref` `[E, N, K]` into `values_ref` `[E, N, K]` and
    `scale_ref` `[E, Nb, Kb]`; `transposed_refs`, if given, are `[E, K, N]` values and `[E, Kb, Nb]`
    scales."""
    e, nb, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n0, k0 = pl.multiple_of(nb * BLOCK, BLOCK), pl.multiple_of(kb * BLOCK, BLOCK)
    lanes = jnp.arange(BLOCK, dtype=jnp.int32)
    rows_ok = (n0 + lanes < n) if n % BLOCK else None
    cols_ok = (k0 + lanes < k) if k % BLOCK else None
    mask_NK = outer_and(rows_ok, cols_ok, (BLOCK, BLOCK))
    w_NK = masked_load(w_ref.at[e, pl.ds(n0, BLOCK), pl.ds(k0, BLOCK)], mask_NK).astype(jnp.float32)
    q_NK, scale = _to_fp8(w_NK, None)
    plgpu.store(values_ref.at[e, pl.ds(n0, BLOCK), pl.ds(k0, BLOCK)], q_NK, mask=mask_NK)
    scale_ref[e, nb, kb] = scale
    if transposed_refs:
        values_t_ref, scale_t_ref = transposed_refs
        plgpu.store(values_t_ref.at[e, pl.ds(k0, BLOCK), pl.ds(n0, BLOCK)], q_NK.T,
                    mask=None if mask_NK is None else mask_NK.T)
        scale_t_ref[e, kb, nb] = scale


def quantize_weights_pallas(
    w_ENK: jax.Array, *, transposed: bool, num_warps: int, interpret: bool, out_init: tuple | None = None,
) -> tuple[Fp8Weights, Fp8Weights | None]:
    """Launch the kernel on validated master weights `w_ENK` (bf16/fp16/fp32, E, N, K > 0,
    any size: Pallas addresses the blocks with 64-bit offsets). Returns `(Fp8Weights [E, N, K] with
    scales [E, Nb, Kb], the [E, K, N] transposed Fp8Weights with scales [E, Kb, Nb] or None)`.
    `out_init`: one array per output, in that order (`pallas_triton.launch`)."""
    e, n, k = w_ENK.shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    out_shape = (jax.ShapeDtypeStruct((e, n, k), FP8_DTYPE), jax.ShapeDtypeStruct((e, nb, kb), jnp.float32))
    if transposed:
        out_shape += (jax.ShapeDtypeStruct((e, k, n), FP8_DTYPE), jax.ShapeDtypeStruct((e, kb, nb), jnp.float32))
    outs = launch(functools.partial(_kernel, n=n, k=k), (w_ENK,), out_shape=out_shape,
                  grid=(e, nb, kb), num_warps=num_warps, num_stages=1, interpret=interpret,
                  name="moe_jax_quantize_weights", out_init=out_init)
    return Fp8Weights(*outs[:2]), Fp8Weights(*outs[2:]) if transposed else None


def _rows_kernel(x_ref, values_ref, scale_ref, *, m: int, k: int, block_m: int):
    """Quantize rows `[mb * block_m, ...)` x columns `[128 kb, 128 (kb + 1))` of `x_ref` `[M, K]` into
    `values_ref` `[M, K]` and the scale column `kb` of `scale_ref` `[M, Kb]`."""
    mb, kb = pl.program_id(0), pl.program_id(1)
    m0, k0 = pl.multiple_of(mb * block_m, block_m), pl.multiple_of(kb * BLOCK, BLOCK)
    rows_ok = (m0 + jnp.arange(block_m, dtype=jnp.int32) < m) if m % block_m else None
    cols_ok = (k0 + jnp.arange(BLOCK, dtype=jnp.int32) < k) if k % BLOCK else None
    mask_MK = outer_and(rows_ok, cols_ok, (block_m, BLOCK))
    x_MK = masked_load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, BLOCK)], mask_MK).astype(jnp.float32)
    q_MK, scale_M = _to_fp8(x_MK, 1)
    plgpu.store(values_ref.at[pl.ds(m0, block_m), pl.ds(k0, BLOCK)], q_MK, mask=mask_MK)
    plgpu.store(scale_ref.at[pl.ds(m0, block_m), kb], scale_M, mask=rows_ok)


def quantize_rows_pallas(
    x_MK: jax.Array, *, block_m: int, num_warps: int, interpret: bool, out_init: tuple | None = None,
) -> Fp8Rows:
    """Launch the rows kernel on validated rows `x_MK` (bf16/fp16/fp32, M, K > 0, e4m3 values of at
    most 2**31 elements). Returns `Fp8Rows(values [M, K] e4m3, scale [M, Kb] fp32)`.
    `out_init`: one array per output, in that order (`pallas_triton.launch`)."""
    m, k = x_MK.shape
    out_shape = (jax.ShapeDtypeStruct((m, k), FP8_DTYPE), jax.ShapeDtypeStruct((m, cdiv(k, BLOCK)), jnp.float32))
    outs = launch(functools.partial(_rows_kernel, m=m, k=k, block_m=block_m), (x_MK,), out_shape=out_shape,
                  grid=(cdiv(m, block_m), cdiv(k, BLOCK)), num_warps=num_warps, num_stages=1, interpret=interpret,
                  name="moe_jax_quantize_rows", out_init=out_init)
    return Fp8Rows(*outs)
