"""FP8 blockwise quantization: DeepSeek-V3's recipe and the layout the FP8 grouped GEMMs read.

Legend: M rows, K reduction width, N output width, E groups (experts); Kb = ceil(K / 128) and
Nb = ceil(N / 128) blocks.

The recipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 3.3, FP8
training): values in e4m3 (`float8_e4m3fn`, largest finite 448, no infinities); one fp32 scale
per 1x128 activation tile (a row's 128 consecutive channels of K) and one per 128x128 weight block
(128 output channels x 128 of K); a tile's scale maps its largest magnitude onto 448, so fine
grained tiles keep an outlier from flattening the rest of a row. A GEMM on such operands sums each
128-wide K step's partial products in fp32 and multiplies the partial sum by the two scales of
that step before adding it to the fp32 accumulator (`moe_jax.ops.gmm.reference.gmm_fp8_reference`
is that recipe in fp32).

`scale` is the multiplier that dequantizes: `x ~= values * scale` tile by tile. Hugging Face FP8
checkpoints (DeepSeek-V3/R1, the Qwen3 FP8 releases) store a linear layer's `weight` (e4m3,
`[N, K]`) with `weight_scale_inv` (fp32, `[Nb, Kb]`) in exactly this sense, so a checkpoint's
`(weight, weight_scale_inv)` is an `Fp8Weights` of one expert without any conversion.

Non-finite inputs stay in their own tile: a NaN or infinity dequantizes to NaN and no other tile
changes; the tile's scale is NaN or inf too (except that XLA:CPU's maximum over a 128 x 128
weight block can drop a NaN, leaving that block's scale finite and only the NaN element NaN). Magnitudes past e4m3's range cannot occur after scaling, except by rounding of
`x / scale` just above 448, which is clipped (a cast to e4m3 would turn it into NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Rows",
    "Fp8Weights",
    "check_rows",
    "check_weights",
    "dequantize_rows",
    "dequantize_weights",
    "exact_float32",
    "quantize_rows",
    "quantize_weights",
    "row_bytes",
    "rows_from_bytes",
    "rows_to_bytes",
    "tile_scale",
    "transpose_weights",
]

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
BLOCK = 128  # the recipe's tile width (activations 1 x BLOCK, weights BLOCK x BLOCK)


class Fp8Rows(NamedTuple):
    """Activations `values_MK` (e4m3) with `scale_MKb` (fp32): row m, channels `[128 b, 128 (b + 1))`
    dequantize as `values * scale[m, b]`."""

    values_MK: jax.Array
    scale_MKb: jax.Array


class Fp8Weights(NamedTuple):
    """Expert weights `values_ENK` (e4m3, the `[E, N, K]` layout of `gmm`'s rhs) with `scale_ENbKb`
    (fp32, one per 128 x 128 block of each expert)."""

    values_ENK: jax.Array
    scale_ENbKb: jax.Array


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def check_rows(rows, name: str) -> tuple[int, int]:
    """`(M, K)` of `rows` if it is an `Fp8Rows` of 2-D e4m3 values and fp32 scales, one per 1 x 128
    tile; else a TypeError or ValueError naming `name` (the argument as the caller calls it)."""
    if not isinstance(rows, Fp8Rows):
        raise TypeError(f"{name}: expected moe_jax.ops.fp8.Fp8Rows (quantize_rows), got {type(rows).__name__}.")
    values, scale = rows
    if values.dtype != FP8_DTYPE or values.ndim != 2:
        raise TypeError(f"{name}.values_MK: expected 2-D float8_e4m3fn, got {values.dtype} of shape "
                        f"{tuple(values.shape)}.")
    if scale.dtype != jnp.float32:
        raise TypeError(f"{name}.scale_MKb: expected float32 scales, got {scale.dtype}.")
    m, k = values.shape
    if tuple(scale.shape) != (m, _blocks(k)):
        raise ValueError(f"{name}.scale_MKb: expected {(m, _blocks(k))} (one scale per 1 x {BLOCK} tile), got "
                         f"{tuple(scale.shape)}.")
    return m, k


def check_weights(w, name: str) -> tuple[int, int, int]:
    """`(E, N, K)` of `w` if it is an `Fp8Weights` of 3-D e4m3 values and fp32 scales, one per
    128 x 128 block; else a TypeError or ValueError naming `name` (the argument as the caller
    calls it)."""
    if not isinstance(w, Fp8Weights):
        raise TypeError(f"{name}: expected Fp8Weights (moe_jax.ops.fp8: quantize_weights), got {type(w).__name__}.")
    values, scale = w
    how = "; quantize master weights with moe_jax.ops.fp8.quantize_weights"
    if values.dtype != FP8_DTYPE or values.ndim != 3:
        raise TypeError(f"{name}.values_ENK: expected 3-D float8_e4m3fn, got {values.dtype} of shape "
                        f"{tuple(values.shape)}{how}.")
    if scale.dtype != jnp.float32:
        raise TypeError(f"{name}.scale_ENbKb: expected float32 scales, got {scale.dtype}{how}.")
    e, n, k = values.shape
    want = (e, _blocks(n), _blocks(k))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}.scale_ENbKb: expected {want} (one scale per {BLOCK} x {BLOCK} block), got "
                         f"{tuple(scale.shape)}.")
    return e, n, k


def _check_float(x, name: str, ndim: int, layout: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == FP8_DTYPE:
        raise TypeError(f"{name}: expected a float32/bfloat16/float16 array to quantize, got {x.dtype}.")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {layout} ({ndim} dims), got shape {x.shape}.")
    return x


# A tile's scale is amax times the fp32-rounded reciprocal of 448, written as a product: XLA's
# algebraic simplifier turns a division by the constant into exactly this, and the correctly
# rounded quotient differs from it by one ulp in about half the tiles (enough to flip e4m3
# rounding ties), so the product is the definition every backend and the torch reference share.
_INV_FP8_MAX = np.float32(1 / FP8_MAX)  # NumPy's: a JAX scalar here would start the backend at import


def tile_scale(amax: jax.Array) -> jax.Array:
    """The dequantizing scale of a tile whose largest magnitude is `amax` (fp32, any shape):
    `amax * fp32(1 / 448)`; 1 for an all-zero tile (any positive value dequantizes its zeros); NaN
    and inf stay."""
    return jnp.where(amax == 0, jnp.float32(1), amax * _INV_FP8_MAX)


def exact_float32(a: jax.Array) -> jax.Array:
    """`a` in float32 holding exactly its own values, also where a bfloat16 `a` is an fp32 value
    the program rounded: XLA:GPU removes f32 -> bf16 -> f32 round trips (`SimplifyFPConversions`,
    run under `xla_allow_excess_precision`, its default), which would hand the arithmetic after
    them the unrounded value. Where that arithmetic feeds an e4m3 quantization, one bf16 step across
    an e4m3 rounding boundary moves the element by a whole e4m3 step, so the rounding is pinned:
    `reduce_precision` to bfloat16's 8 exponent and 7 mantissa bits equals the cast on every
    float32 (NaN, inf and subnormals included), and the compiler keeps it. Other dtypes are cast
    (float16's `reduce_precision` would flush its subnormals)."""
    if a.dtype == jnp.bfloat16:
        return jax.lax.reduce_precision(a.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)
    return a.astype(jnp.float32)


def _to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_rows(x_MK: jax.Array) -> Fp8Rows:
    """e4m3 values and one fp32 scale per 1 x 128 tile of each row (the last tile of a K that is not
    a multiple of 128 is narrower; its scale is its own channels')."""
    x_MK = _check_float(x_MK, "x_MK", 2, "[M, K] rows")
    m, k = x_MK.shape
    kb = _blocks(k)
    x = jnp.pad(exact_float32(x_MK), ((0, 0), (0, kb * BLOCK - k))).reshape(m, kb, BLOCK)
    scale_MKb = tile_scale(jnp.max(jnp.abs(x), axis=2))
    values = _to_fp8(x, scale_MKb[:, :, None]).reshape(m, kb * BLOCK)[:, :k]
    return Fp8Rows(values, scale_MKb)


def quantize_weights(w_ENK: jax.Array) -> Fp8Weights:
    """e4m3 values and one fp32 scale per 128 x 128 block of each expert's `[N, K]` matrix (edge
    blocks are narrower)."""
    w_ENK = _check_float(w_ENK, "w_ENK", 3, "[E, N, K] expert weights")
    e, n, k = w_ENK.shape
    nb, kb = _blocks(n), _blocks(k)
    w = jnp.pad(exact_float32(w_ENK), ((0, 0), (0, nb * BLOCK - n), (0, kb * BLOCK - k)))
    w = w.reshape(e, nb, BLOCK, kb, BLOCK)
    scale_ENbKb = tile_scale(jnp.max(jnp.abs(w), axis=(2, 4)))
    values = _to_fp8(w, scale_ENbKb[:, :, None, :, None]).reshape(e, nb * BLOCK, kb * BLOCK)[:, :n, :k]
    return Fp8Weights(values, scale_ENbKb)


def transpose_weights(weights: Fp8Weights) -> Fp8Weights:
    """The same quantized weights as the operand of the transposed product: values `[E, K, N]`,
    scales `[E, Kb, Nb]` (a 128 x 128 block's scale is its transpose's: no value changes)."""
    return Fp8Weights(jnp.swapaxes(weights.values_ENK, 1, 2), jnp.swapaxes(weights.scale_ENbKb, 1, 2))


def _check_scale(scale, want: tuple[int, ...], name: str) -> None:
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: expected shape {want} (one scale per {BLOCK}-wide block), got {tuple(scale.shape)}.")


def dequantize_rows(rows: Fp8Rows) -> jax.Array:
    """fp32 `[M, K]`: `values * scale` tile by tile."""
    m, k = rows.values_MK.shape
    _check_scale(rows.scale_MKb, (m, _blocks(k)), "Fp8Rows.scale_MKb")
    scale_MK = jnp.repeat(rows.scale_MKb, BLOCK, axis=1)[:, :k]
    return rows.values_MK.astype(jnp.float32) * scale_MK


def dequantize_weights(weights: Fp8Weights) -> jax.Array:
    """fp32 `[E, N, K]`: `values * scale` block by block."""
    e, n, k = weights.values_ENK.shape
    _check_scale(weights.scale_ENbKb, (e, _blocks(n), _blocks(k)), "Fp8Weights.scale_ENbKb")
    scale_ENK = jnp.repeat(jnp.repeat(weights.scale_ENbKb, BLOCK, axis=1), BLOCK, axis=2)[:, :n, :k]
    return weights.values_ENK.astype(jnp.float32) * scale_ENK


def row_bytes(k: int) -> int:
    """Bytes of one row of width `k` as `rows_to_bytes` writes it: K values and 4 bytes per scale."""
    return k + 4 * _blocks(k)


def rows_to_bytes(rows: Fp8Rows) -> jax.Array:
    """`rows` as one byte row each, for a collective to move: uint8 `[M, row_bytes(K)]`, the e4m3
    values' bytes followed by the fp32 scales' (in the platform's byte order). A bf16 row of K
    values is 2K bytes; this is K + 4 ceil(K/128), about half."""
    m = rows.values_MK.shape[0]
    values = jax.lax.bitcast_convert_type(rows.values_MK, jnp.uint8)
    scales = jax.lax.bitcast_convert_type(rows.scale_MKb, jnp.uint8).reshape(m, -1)
    return jnp.concatenate([values, scales], axis=1)


def rows_from_bytes(bytes_MB: jax.Array, k: int) -> Fp8Rows:
    """The `Fp8Rows` of width `k` that `rows_to_bytes` wrote into `bytes_MB`."""
    m, width = bytes_MB.shape
    kb = _blocks(k)
    if bytes_MB.dtype != jnp.uint8 or width != row_bytes(k):
        raise ValueError(f"bytes_MB: expected uint8 [M, {row_bytes(k)}] (rows_to_bytes of width {k}), got "
                         f"{bytes_MB.dtype} {tuple(bytes_MB.shape)}.")
    values = jax.lax.bitcast_convert_type(bytes_MB[:, :k], FP8_DTYPE)
    scales = jax.lax.bitcast_convert_type(bytes_MB[:, k:].reshape(m, kb, 4), jnp.float32)
    return Fp8Rows(values, scales)
