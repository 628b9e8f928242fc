"""The FP8 recipe (`moe_jax.ops.fp8`, DeepSeek-V3's blockwise scaling) and its fp32 grouped-GEMM
reference (`gmm_fp8_reference`): the quantization's error bound, scales, edges (zero tiles, K and
N not multiples of 128, values that would overflow e4m3, non-finite inputs), the reference against
a dequantize-then-multiply computation, FP8's error against fp32 beside bf16's, and the rows'
byte layout for a collective.

Legend: M rows, K contraction, N outputs, E groups; Kb, Nb the 128-wide blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import gmm_fp8_reference, gmm_reference
from moe_jax.ops.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    Fp8Rows,
    Fp8Weights,
    dequantize_rows,
    dequantize_weights,
    quantize_rows,
    quantize_weights,
    row_bytes,
    rows_from_bytes,
    rows_to_bytes,
)
from tests.helpers import count_where_round_trips_removed


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _within_e4m3_rounding(x, deq, scale_of_x):
    """e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value; below 2^-6 (normal
    minimum) values are subnormal, spaced 2^-9, scaled by their tile's scale."""
    x, deq, scale = (np.asarray(v, np.float64) for v in (x, deq, scale_of_x))
    bound = np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * scale) * (1 + 1e-6)
    assert np.all(np.abs(deq - x) <= bound), float(np.max(np.abs(deq - x) / bound))


@pytest.mark.parametrize("m, k", [(5, 128), (3, 200), (4, 384), (1, 1)])
def test_rows_round_trip_within_one_e4m3_rounding_and_tile_amax_maps_to_448(m, k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(1e-3, 1e3, size=(m, 1)).astype(np.float32)
    rows = quantize_rows(jnp.asarray(x))
    kb = -(-k // BLOCK)
    assert rows.values_MK.dtype == FP8_DTYPE and rows.values_MK.shape == (m, k)
    assert rows.scale_MKb.dtype == jnp.float32 and rows.scale_MKb.shape == (m, kb)
    pad = np.pad(np.abs(x), ((0, 0), (0, kb * BLOCK - k))).reshape(m, kb, BLOCK)
    np.testing.assert_allclose(rows.scale_MKb, pad.max(axis=2) / FP8_MAX, rtol=3e-7)  # XLA may divide by a reciprocal: an ulp or two
    tile_max = np.pad(np.abs(np.asarray(rows.values_MK, np.float32)), ((0, 0), (0, kb * BLOCK - k))).reshape(m, kb, BLOCK).max(axis=2)
    np.testing.assert_array_equal(tile_max, FP8_MAX)  # every tile uses e4m3's whole range
    scale_MK = np.repeat(np.asarray(rows.scale_MKb), BLOCK, axis=1)[:, :k]
    _within_e4m3_rounding(x, dequantize_rows(rows), scale_MK)


def test_weights_blocks_are_128_by_128_with_narrow_edges():
    rng = np.random.default_rng(0)
    e, n, k = 3, 200, 300
    w = rng.standard_normal((e, n, k)).astype(np.float32)
    w[1, 130:, :128] *= 1000.0  # one block far larger than its neighbours keeps them fine
    q = quantize_weights(jnp.asarray(w))
    assert q.values_ENK.shape == (e, n, k) and q.scale_ENbKb.shape == (e, 2, 3)
    pad = np.pad(np.abs(w), ((0, 0), (0, 56), (0, 84))).reshape(e, 2, BLOCK, 3, BLOCK)
    np.testing.assert_allclose(q.scale_ENbKb, pad.max(axis=(2, 4)) / FP8_MAX, rtol=3e-7)  # XLA may divide by a reciprocal: an ulp or two
    scale_ENK = np.repeat(np.repeat(np.asarray(q.scale_ENbKb), BLOCK, 1), BLOCK, 2)[:, :n, :k]
    _within_e4m3_rounding(w, dequantize_weights(q), scale_ENK)


def test_zero_tiles_overflow_and_non_finite_inputs():
    x = np.zeros((3, 256), np.float32)
    x[1, :] = 1e30  # far past e4m3's range: scaled, not saturated to NaN by the cast
    x[2, 3] = np.nan  # poisons its own tile only
    x[2, 200] = 5.0
    rows = quantize_rows(jnp.asarray(x))
    deq = np.asarray(dequantize_rows(rows))
    assert np.all(np.isfinite(rows.scale_MKb[0])) and np.all(deq[0] == 0.0)  # all-zero tiles
    np.testing.assert_allclose(deq[1], 1e30, rtol=2.0 ** -4)
    assert np.all(np.isnan(deq[2, :128])) and deq[2, 200] == 5.0 and np.all(deq[2, 128:200] == 0)


@pytest.mark.parametrize("k", [128, 200, 7])
def test_rows_cross_a_byte_buffer_bit_for_bit(k):
    """`rows_to_bytes` packs each row's e4m3 values and fp32 scales into row_bytes(k) bytes (the
    FP8 dispatch's payload) and `rows_from_bytes` gives back the same bits, non-finite tiles and
    zero tiles included, under jit."""
    x = np.random.default_rng(k).standard_normal((5, k)).astype(np.float32) * 3
    x[1] = 0.0
    x[2, 0] = np.nan
    x[3, -1] = np.inf
    rows = quantize_rows(jnp.asarray(x))
    wire = jax.jit(rows_to_bytes)(rows)
    assert wire.dtype == jnp.uint8 and wire.shape == (5, row_bytes(k)) == (5, k + 4 * -(-k // BLOCK))
    back = jax.jit(rows_from_bytes, static_argnums=1)(wire, k)
    for got, want in zip(back, rows):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)),
                                      np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint8)))
    with pytest.raises(ValueError, match=r"bytes_MB: expected uint8 \[M, 132\]"):
        rows_from_bytes(jnp.zeros((2, 135), jnp.uint8), 128)


def test_bad_input_is_refused_naming_the_argument():
    with pytest.raises(TypeError, match="x_MK.*int32"):
        quantize_rows(jnp.ones((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="x_MK.*float8"):
        quantize_rows(jnp.ones((2, 4), FP8_DTYPE))
    with pytest.raises(ValueError, match=r"w_ENK.*\[E, N, K\]"):
        quantize_weights(jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="Fp8Rows.scale_MKb"):
        dequantize_rows(Fp8Rows(jnp.ones((2, 130), FP8_DTYPE), jnp.ones((2, 1))))
    rows = quantize_rows(jnp.ones((4, 64)))
    with pytest.raises(ValueError, match="does not contract"):
        gmm_fp8_reference(rows, quantize_weights(jnp.ones((2, 8, 32))), jnp.array([2, 2]))


def _problem(m, k, n, e, sizes, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((e, n, k)) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("sizes", [[3, 0, 9, 4], [16, 0, 0, 0], [0, 0, 0, 0], [2, 5, 1, 1]])
def test_reference_is_dequantize_then_multiply_both_orientations(sizes):
    """Per-step scaling equals multiplying the dequantized operands (exact products, fp32 sums):
    empty groups, one hot group, no rows, and rows past the groups' sum (zero)."""
    m, k, n, e = 16, 200, 136, 4
    x, w, gs = _problem(m, k, n, e, sizes)
    qw = quantize_weights(w)
    fwd = gmm_fp8_reference(quantize_rows(x), qw, gs)
    want = gmm_reference(dequantize_rows(quantize_rows(x)), dequantize_weights(qw), gs)
    np.testing.assert_allclose(fwd, want, rtol=2e-6, atol=2e-6)
    dy = x[:, :n]  # the input gradient contracts over N, its rows tiled along N
    dgrad = gmm_fp8_reference(quantize_rows(dy), qw, gs, transpose_rhs=False)
    want = gmm_reference(dequantize_rows(quantize_rows(dy)), dequantize_weights(qw), gs, transpose_rhs=False)
    np.testing.assert_allclose(dgrad, want, rtol=2e-6, atol=2e-6)
    assert np.all(np.asarray(fwd)[int(np.sum(sizes)):] == 0)


def test_fp8_error_against_fp32_beside_bf16():
    """On unit-normal rows and 1/sqrt(K)-scaled weights, the recipe's relative error against the
    fp32 product is a few percent (e4m3's 2^-4 rounding, averaged over K); bf16's is about 2^-8.
    Both figures are asserted loosely and reported by the message."""
    m, k, n, e = 64, 512, 256, 4
    x, w, gs = _problem(m, k, n, e, [16, 16, 16, 16], seed=1)
    exact = gmm_reference(x, w, gs)
    fp8 = _rel(gmm_fp8_reference(quantize_rows(x), quantize_weights(w), gs), exact)
    bf16 = _rel(gmm_reference(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gs), exact)
    assert bf16 < 1e-2 and fp8 < 6e-2 and fp8 > bf16, (fp8, bf16)


def test_quantization_under_jit_and_vmap_matches_eager():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 160))
    eager = [quantize_rows(xi) for xi in x]
    batched = jax.jit(jax.vmap(quantize_rows))(x)
    for i, r in enumerate(eager):
        np.testing.assert_array_equal(np.asarray(batched.values_MK[i], np.float32), np.asarray(r.values_MK, np.float32))
        np.testing.assert_array_equal(batched.scale_MKb[i], r.scale_MKb)


def rounded_rows_mismatches() -> int:
    """How many e4m3 values and scales `quantize_rows` (the XLA path) gives for rows that the same
    program rounded to bf16 from an fp32-accumulated product differ from those of the same bf16
    rows made in a program of their own."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((96, 320)), jnp.bfloat16)

    def rows(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    together = jax.jit(lambda a, b: quantize_rows(rows(a, b)))(a, b)
    alone = jax.jit(quantize_rows)(jax.jit(rows)(a, b))
    values = jax.lax.bitcast_convert_type(together.values_MK, jnp.uint8) != jax.lax.bitcast_convert_type(
        alone.values_MK, jnp.uint8)
    return int(np.sum(np.asarray(values))) + int(np.sum(np.asarray(together.scale_MKb != alone.scale_MKb)))


def test_rows_rounded_in_the_same_program_quantize_as_their_bf16_values():
    assert rounded_rows_mismatches() == 0


@pytest.mark.slow  # a child process (the flag is read when the backend starts)
def test_rows_quantize_as_their_bf16_values_where_the_compiler_removes_the_rounding():
    """`quantize_rows` of bf16 rows quantizes their bf16 values, also where the compiler would keep
    the fp32 precision of the product they were rounded from (`tests.helpers.ROUND_TRIPS_REMOVED`):
    the e4m3 bits must not depend on the compiler's choices."""
    assert count_where_round_trips_removed("tests.test_fp8:rounded_rows_mismatches") == 0


def test_a_checkpoint_block_pair_is_an_fp8_weights_of_one_expert():
    """Hugging Face FP8 checkpoints store `weight` (e4m3 [N, K]) and `weight_scale_inv` ([Nb, Kb],
    the dequantizing multiplier): stacked over experts they are `Fp8Weights` as they are."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 256, 128)).astype(np.float32)
    q = quantize_weights(jnp.asarray(w))
    per_expert = [dict(weight=np.asarray(q.values_ENK[i]), weight_scale_inv=np.asarray(q.scale_ENbKb[i])) for i in range(2)]
    restacked = Fp8Weights(jnp.stack([p["weight"] for p in per_expert]), jnp.stack([p["weight_scale_inv"] for p in per_expert]))
    hf_dequant = np.stack([p["weight"].astype(np.float32) * np.kron(p["weight_scale_inv"], np.ones((BLOCK, BLOCK), np.float32))
                           for p in per_expert])
    np.testing.assert_array_equal(dequantize_weights(restacked), hf_dequant)
