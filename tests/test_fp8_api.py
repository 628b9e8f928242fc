"""`gmm_fp8` (`moe_jax.ops.gmm.fp8_api`): the recipe's grouped GEMM behind its backend seam. The
reference path (`xla`) against `gmm_fp8_reference` in both orientations and with row ids; the
backend choice (`auto` is the reference path without the kernel; `triton` names why it cannot
run); the kernel's tiles fitted to the device; argument errors naming the argument. The kernel
itself runs interpreted in tests/test_triton_kernels.py.

Legend: M rows, K contraction, N outputs, E experts, T source rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import TileConfig
from moe_jax.ops.fp8 import Fp8Rows, Fp8Weights, quantize_rows, quantize_weights
from moe_jax.ops import device_facts
from moe_jax.ops.gmm.fp8_api import FP8_GEMM_BACKENDS, FP8_KERNEL_CAPABILITY, fp8_backend, fp8_tiles, gmm_fp8
from moe_jax.ops.gmm.reference import gmm_fp8_reference
from moe_jax.ops.gmm.triton.backend import BACKEND as TRITON
from tests.helpers import ON_GPU

TOL = dict(rtol=2e-5, atol=2e-5)


def _operands(m=40, k=200, n=136, e=3, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    rows = quantize_rows(jax.random.normal(kx, (m, k), jnp.float32))
    wq = quantize_weights(jax.random.normal(kw, (e, n, k), jnp.float32) / np.sqrt(k))
    return rows, wq


@pytest.mark.parametrize("sizes", [(10, 0, 25), (0, 40, 0), (0, 0, 0)], ids=["ragged", "one-hot", "empty"])
def test_reference_path_is_the_recipe_in_both_orientations(sizes):
    rows, wq = _operands()
    gs = jnp.asarray(sizes, jnp.int32)
    y = gmm_fp8(rows, wq, gs, backend="xla")
    np.testing.assert_allclose(y, gmm_fp8_reference(rows, wq, gs), **TOL)
    assert not np.asarray(y[sum(sizes):]).any()  # rows past the groups are zero
    dy_rows = quantize_rows(jax.random.normal(jax.random.key(3), (40, 136), jnp.float32))
    dx = jax.jit(lambda r, w, g: gmm_fp8(r, w, g, transpose_rhs=False, backend="xla"))(dy_rows, wq, gs)
    np.testing.assert_allclose(dx, gmm_fp8_reference(dy_rows, wq, gs, transpose_rhs=False), **TOL)


def test_row_ids_read_source_rows_and_out_of_range_ids_read_zeros():
    rows, wq = _operands(m=12)
    ids = jnp.array([3, 3, 0, 11, -1, 7, 12, 5, 1, 2], jnp.int32)
    gs = jnp.array([4, 0, 6], jnp.int32)
    y = gmm_fp8(rows, wq, gs, backend="xla", out_dtype=jnp.bfloat16, row_ids=ids)
    ok = (ids >= 0) & (ids < 12)
    packed = Fp8Rows(jnp.where(ok[:, None], rows.values_MK[jnp.clip(ids, 0, 11)], 0).astype(rows.values_MK.dtype),
                     jnp.where(ok[:, None], rows.scale_MKb[jnp.clip(ids, 0, 11)], 1.0))
    assert y.dtype == jnp.bfloat16 and y.shape == (10, 136)
    np.testing.assert_allclose(np.asarray(y, np.float32), gmm_fp8_reference(packed, wq, gs), rtol=1e-2, atol=1e-2)


def test_auto_takes_the_kernel_where_it_runs_and_triton_says_why_where_not():
    """`auto` is a kernel on a GPU with e4m3 tensor cores and jax_triton, or on a Hopper (there the
    kernels equal the recipe, their in-step sums on the tensor cores), else the reference path,
    where `triton` is a ValueError naming why."""
    capability = device_facts().capability
    kernel_runs = ON_GPU and capability is not None and (
        capability[0] == 9 or TRITON.available() is None and capability >= FP8_KERNEL_CAPABILITY)
    rows, wq = _operands()
    gs = jnp.array([10, 0, 25], jnp.int32)
    if not kernel_runs:
        assert fp8_backend("auto") == "xla"
        with pytest.raises(ValueError, match="backend='triton'.*backend='auto'"):
            fp8_backend("triton")
        with pytest.raises(ValueError, match="backend='triton'"):
            gmm_fp8(rows, wq, gs, backend="triton")
        return
    assert fp8_backend("auto") == "auto"  # each problem takes `fp8_kernel`'s choice (tests/test_fp8_mosaic.py)
    np.testing.assert_allclose(gmm_fp8(rows, wq, gs), gmm_fp8_reference(rows, wq, gs), rtol=2e-3, atol=2e-3)
    dy_rows = quantize_rows(jax.random.normal(jax.random.key(3), (40, 136), jnp.float32))
    np.testing.assert_allclose(gmm_fp8(dy_rows, wq, gs, transpose_rhs=False),
                               gmm_fp8_reference(dy_rows, wq, gs, transpose_rhs=False), rtol=2e-3, atol=2e-3)


def test_tiles_step_k_by_the_scale_block_and_fit_the_device():
    rule = fp8_tiles(32768, 1536, 2048, 128)
    assert rule.block_k == 128
    assert fp8_tiles(8, 1536, 2048, 128).block_m == 16  # decode: rows per expert, not the prefill tile
    mine = TileConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=2, group_m=1)
    assert fp8_tiles(256, 256, 256, 2, mine) == mine
    with pytest.raises(ValueError, match="block_k=128"):
        fp8_tiles(256, 256, 256, 2, TileConfig(block_k=64))
    with pytest.raises(TypeError, match="config="):
        fp8_tiles(256, 256, 256, 2, {"block_m": 64})
    with pytest.raises(ValueError, match="shared memory|B of"):
        fp8_tiles(256, 256, 256, 2, TileConfig(block_m=256, block_n=256, block_k=128, num_stages=8))


def test_bad_arguments_name_themselves():
    rows, wq = _operands()
    gs = jnp.array([10, 0, 25], jnp.int32)
    with pytest.raises(ValueError, match="backend='bf16'.*one of"):
        gmm_fp8(rows, wq, gs, backend="bf16")
    assert set(FP8_GEMM_BACKENDS) >= {"auto", "triton", "mosaic_gpu", "xla"}
    with pytest.raises(TypeError, match="lhs: expected moe_jax.ops.fp8.Fp8Rows"):
        gmm_fp8(rows.values_MK, wq, gs)
    with pytest.raises(TypeError, match="rhs: expected"):
        gmm_fp8(rows, wq.values_ENK, gs)
    with pytest.raises(TypeError, match="lhs.values_MK: expected 2-D float8_e4m3fn"):
        gmm_fp8(Fp8Rows(rows.values_MK.astype(jnp.bfloat16), rows.scale_MKb), wq, gs)
    with pytest.raises(TypeError, match="rhs.scale_ENbKb: expected float32"):
        gmm_fp8(rows, Fp8Weights(wq.values_ENK, wq.scale_ENbKb.astype(jnp.bfloat16)), gs)
    with pytest.raises(ValueError, match="check transpose_rhs"):
        gmm_fp8(rows, wq, gs, transpose_rhs=False)
    with pytest.raises(ValueError, match="lhs.scale_MKb: expected"):
        gmm_fp8(Fp8Rows(rows.values_MK, rows.scale_MKb[:, :1]), wq, gs)
    with pytest.raises(ValueError, match="rhs.scale_ENbKb: expected"):
        gmm_fp8(rows, Fp8Weights(wq.values_ENK, wq.scale_ENbKb[:, :1]), gs)
    with pytest.raises(ValueError, match="config=.*takes none"):
        gmm_fp8(rows, wq, gs, backend="xla", config=TileConfig(block_k=128))
    with pytest.raises(ValueError, match="group_sizes"):
        gmm_fp8(rows, wq, jnp.array([10, 0], jnp.int32))
