"""`fp8_grouped_linear` (`moe_jax.ops.fp8_linear`): the forward and the input gradient against
`gmm_fp8_reference` (the recipe in fp32), the straight-through weight gradient against
`tgmm_reference` on the dequantized FP8 rows, stored `Fp8Weights`, group-size edges (empty
experts, one hot expert, zero rows, rows past the sum), K and N not multiples of 128, bf16 and fp32
x, argument errors, and one small case on `pallas_triton` (interpret mode on CPU).

Legend: M rows, K contraction, N outputs, E experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import fp8_grouped_linear, gmm_fp8_reference, tgmm_reference
from moe_jax.ops.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows, quantize_weights

# The op scales each product term, the reference each 128-wide partial sum: fp32 rounding only.
FP32_TOL = dict(rtol=2e-5, atol=2e-5)


def _case(m, k, n, e, dtype=jnp.float32, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x_MK = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w_ENK = jax.random.normal(kw, (e, n, k), jnp.float32) / np.sqrt(k)
    return x_MK, w_ENK


def _expected(x_MK, w_ENK, group_sizes, dy_MN):
    """The recipe by the references: output, input gradient and the STE weight gradient."""
    rows, wq = quantize_rows(x_MK), quantize_weights(w_ENK)
    y = gmm_fp8_reference(rows, wq, group_sizes)
    dy = dy_MN.astype(x_MK.dtype)
    dx = gmm_fp8_reference(quantize_rows(dy), wq, group_sizes, transpose_rhs=False)
    dw = tgmm_reference(dequantize_rows(rows).astype(x_MK.dtype), dy, group_sizes)
    return y, dx, dw


def _check(x_MK, w_ENK, group_sizes, *, backend="xla", tol=FP32_TOL):
    dy_MN = jax.random.normal(jax.random.key(7), (x_MK.shape[0], w_ENK.shape[1]), jnp.float32).astype(x_MK.dtype)
    y, vjp = jax.vjp(lambda x, w: fp8_grouped_linear(x, w, group_sizes, backend=backend), x_MK, w_ENK)
    dx, dw = vjp(dy_MN)
    assert y.dtype == x_MK.dtype and dx.dtype == x_MK.dtype and dw.dtype == w_ENK.dtype
    want_y, want_dx, want_dw = _expected(x_MK, w_ENK, group_sizes, dy_MN)
    # Outputs are rounded to x's dtype; compare against the fp32 reference rounded the same way.
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y.astype(x_MK.dtype), np.float32), **tol)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(want_dx.astype(x_MK.dtype), np.float32), **tol)
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(want_dw, np.float32), **tol)
    return y, dx, dw


@pytest.mark.parametrize("m, k, n, sizes", [
    (12, 256, 128, [5, 0, 7]),  # an empty expert, block-aligned
    (9, 200, 130, [0, 9, 0]),  # one hot expert, K and N not multiples of 128
    (10, 70, 40, [3, 2, 1]),  # rows past the sum: zero output, gradient, no weight update
])
def test_fp32_matches_recipe(m, k, n, sizes):
    x, w = _case(m, k, n, len(sizes))
    gs = jnp.array(sizes, jnp.int32)
    y, dx, dw = _check(x, w, gs)
    total = sum(sizes)
    assert np.all(np.asarray(y)[total:] == 0) and np.all(np.asarray(dx)[total:] == 0)
    for e, size in enumerate(sizes):
        if size == 0:
            assert np.all(np.asarray(dw[e]) == 0)


def test_bf16_matches_recipe():
    x, w = _case(16, 300, 140, 2, dtype=jnp.bfloat16)
    # bf16 outputs: one bf16 rounding apart where the fp32 sums differ in their last bits.
    _check(x, w.astype(jnp.bfloat16), jnp.array([10, 6], jnp.int32), tol=dict(rtol=1e-2, atol=1e-2))


def test_zero_rows():
    x, w = _case(0, 130, 64, 2)
    y, dx, dw = _check(x, w, jnp.array([0, 0], jnp.int32))
    assert y.shape == (0, 64) and dx.shape == (0, 130) and np.all(np.asarray(dw) == 0)


def test_jit_and_close_to_fp32():
    x, w = _case(64, 256, 256, 4)
    gs = jnp.array([20, 4, 0, 40], jnp.int32)
    y = jax.jit(lambda x, w: fp8_grouped_linear(x, w, gs))(x, w)
    exact = jax.vmap(lambda e: x @ w[e].T)(jnp.arange(4))
    g = np.repeat(np.arange(4), np.asarray(gs))
    exact = np.asarray(exact)[g, np.arange(64)]
    rel = float(np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact))
    # e4m3 keeps 3 mantissa bits: a few percent on unit-scale products, never more.
    assert rel < 0.06, f"FP8 vs fp32 relative error {rel:.4f}"


def test_stored_weights_equal_master_and_are_frozen():
    x, w = _case(11, 200, 150, 3)
    gs = jnp.array([4, 0, 7], jnp.int32)
    wq = quantize_weights(w)
    assert wq.values_ENK.dtype == FP8_DTYPE
    y_master = fp8_grouped_linear(x, w, gs)
    y_stored, vjp = jax.vjp(lambda x, wq: fp8_grouped_linear(x, wq, gs), x, wq)
    np.testing.assert_array_equal(np.asarray(y_stored), np.asarray(y_master))
    dy = jnp.ones_like(y_stored)
    dx, dwq = vjp(dy)
    dx_master = jax.vjp(lambda x: fp8_grouped_linear(x, w, gs), x)[1](dy)[0]
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_master))
    assert not np.any(np.asarray(dwq.values_ENK, np.float32)) and not np.any(np.asarray(dwq.scale_ENbKb))


@pytest.mark.slow
def test_pallas_triton_interpret():
    x, w = _case(8, 128, 64, 2)
    _check(x, w, jnp.array([3, 5], jnp.int32), backend="pallas_triton")


def test_errors():
    x, w = _case(4, 128, 64, 2)
    gs = jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="backend='mosaic_gpu'.*one of"):
        fp8_grouped_linear(x, w, gs, backend="mosaic_gpu")
    with pytest.raises(ValueError, match="K = x.shape"):
        fp8_grouped_linear(x, w[:, :, :64], gs)
    with pytest.raises(TypeError, match="quantize_weights"):
        fp8_grouped_linear(x, quantize_weights(w)._replace(scale_ENbKb=jnp.ones((2, 1, 1), jnp.bfloat16)), gs)
    with pytest.raises(ValueError, match="scale_ENbKb"):
        fp8_grouped_linear(x, quantize_weights(w)._replace(scale_ENbKb=jnp.ones((2, 2, 1))), gs)
    with pytest.raises(TypeError, match="x:"):
        fp8_grouped_linear(x.astype(FP8_DTYPE), w, gs)
