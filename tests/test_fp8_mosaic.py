"""The Mosaic GPU FP8 kernel (`moe_jax.ops.gmm.mosaic_gpu.fp8_kernel`) behind `gmm_fp8(backend=
"mosaic_gpu")`: against the recipe's fp32 reference, compiled on a GPU and in Pallas's GPU interpret
mode off GPU (slow there: the cases are small); its shared-memory model against Mosaic GPU's own
count when lowering for an H200 from this host; `auto`'s choice between the FP8 kernels; errors.

Legend: M rows, K contraction, N outputs, E experts, T source rows."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import TileConfig, device_facts, fp8_grouped_linear
from moe_jax.ops.fp8 import Fp8Rows, Fp8Weights, quantize_rows, quantize_weights
from moe_jax.ops.gmm.fp8_api import MOSAIC_MIN_ROWS, fp8_backend, fp8_kernel, gmm_fp8
from moe_jax.ops.gmm.mosaic_gpu.config import RESERVED_BYTES
from moe_jax.ops.gmm.mosaic_gpu.fp8_kernel import (Fp8MosaicTiles, fp8_mosaic_smem_bytes, fp8_mosaic_support,
                                                   fp8_mosaic_tiles, gmm_fp8_mosaic)
from moe_jax.ops.gmm.reference import gmm_fp8_reference
from moe_jax.ops.gmm.triton import have_jax_triton
from tests.helpers import ON_GPU, h200_mesh, lower_for_gpu

INTERPRETED_SLOW = [] if ON_GPU else [pytest.mark.slow]
# Compiled, a step's e4m3 products are summed on the tensor cores, whose accumulation within the
# step is not fp32 (why the recipe promotes every 128): about 1e-3 of the reference's fp32 sums, as
# for the Triton kernel (tests/test_fp8_api.py). Interpreted, the sums are fp32.
TOL = dict(rtol=2e-3, atol=2e-3) if ON_GPU else dict(rtol=2e-5, atol=2e-5)
LINEAR_TOL = dict(rtol=2e-3, atol=2e-3) if ON_GPU else dict(rtol=1e-4, atol=1e-4)


def _operands(m, k, n, e, seed=0, t=None):
    kx, kw = jax.random.split(jax.random.key(seed))
    rows = quantize_rows(jax.random.normal(kx, (t or m, k), jnp.float32))
    wq = quantize_weights(jax.random.normal(kw, (e, n, k), jnp.float32) / np.sqrt(k))
    return rows, wq


def _poison_past(rows: Fp8Rows, total: int) -> Fp8Rows:
    """NaN values and scales in the rows past the groups: never stored, so never seen."""
    keep = (jnp.arange(rows.values_MK.shape[0]) < total)[:, None]
    nan8 = jnp.full((), jnp.nan, rows.values_MK.dtype)
    return Fp8Rows(jnp.where(keep, rows.values_MK, nan8), jnp.where(keep, rows.scale_MKb, jnp.nan))


@pytest.mark.parametrize("sizes,m,k,n,tiles,out_dtype", [
    # ragged groups, an empty one, rows past the sum; 256-wide items (two blocks, two scales a step)
    pytest.param((70, 0, 33, 80), 200, 256, 512, Fp8MosaicTiles(tile_n=256, stages=2), jnp.float32,
                 id="ragged-n256"),
    # 128-wide items, more K steps than stages, bf16 output
    pytest.param((70, 0, 33, 80), 200, 640, 256, Fp8MosaicTiles(stages=2), jnp.bfloat16, id="ragged-n128-long-k",
                 marks=INTERPRETED_SLOW),
    # one hot group over every row: two full tiles and a partial one
    pytest.param((0, 296, 0), 296, 128, 256, Fp8MosaicTiles(tile_n=256, stages=2), jnp.float32, id="one-hot",
                 marks=INTERPRETED_SLOW),
    # no rows in any group: zeros, from the zero-fill tiles alone
    pytest.param((0, 0), 136, 128, 256, Fp8MosaicTiles(tile_n=256, stages=2), jnp.float32, id="all-empty",
                 marks=INTERPRETED_SLOW),
])
def test_mosaic_fp8_matches_the_recipe(sizes, m, k, n, tiles, out_dtype):
    rows, wq = _operands(m, k, n, len(sizes))
    total = sum(sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(lambda r, w, g: gmm_fp8(r, w, g, backend="mosaic_gpu", config=tiles, out_dtype=out_dtype))(
        _poison_past(rows, total), wq, gs)
    assert out.dtype == out_dtype and np.isfinite(np.asarray(out, np.float32)).all()
    assert not np.asarray(out[total:], np.float32).any()
    want = gmm_fp8_reference(rows, wq, gs)
    tol = TOL if out_dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(out[:total], np.float32), want[:total], **tol)


def test_mosaic_fp8_input_gradient_layout_and_row_ids():
    """The input-gradient orientation (the weights' `[E, K, N]` copy read as `[E, N, K]`) and rows
    read through ids (gathered in FP8 first; ids outside `[0, T)` read zeros)."""
    rows, wq = _operands(200, 256, 256, 3)
    gs = jnp.array([120, 0, 64], jnp.int32)
    dy = quantize_rows(jax.random.normal(jax.random.key(3), (200, 256), jnp.float32))
    dx = gmm_fp8(dy, wq, gs, transpose_rhs=False, backend="mosaic_gpu")
    np.testing.assert_allclose(dx, gmm_fp8_reference(dy, wq, gs, transpose_rhs=False), **TOL)
    ids = jnp.asarray(np.random.default_rng(0).integers(-3, 60, size=200), jnp.int32)
    source = quantize_rows(jax.random.normal(jax.random.key(4), (50, 256), jnp.float32))
    got = gmm_fp8(source, wq, gs, backend="mosaic_gpu", row_ids=ids)
    np.testing.assert_allclose(got, gmm_fp8(source, wq, gs, backend="xla", row_ids=ids), **TOL)


@pytest.mark.parametrize("stored", [False, True], ids=["master", "stored"])
def test_fp8_linear_on_the_mosaic_kernel_equals_the_reference_path(stored):
    """`fp8_grouped_linear(backend="mosaic_gpu")`: forward and both gradients equal the reference
    path's (the weight gradient's `tgmm` runs on `auto`'s 16-bit choice)."""
    kx, kw, kd = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (256, 256), jnp.float32)
    w = jax.random.normal(kw, (2, 256, 256), jnp.float32) / 16
    w = quantize_weights(w) if stored else w
    gs = jnp.array([150, 90], jnp.int32)
    dy = jax.random.normal(kd, (256, 256), jnp.float32)

    def run(backend):
        y, vjp = jax.vjp(lambda x, w: fp8_grouped_linear(x, w, gs, backend=backend), x, w)
        return y, vjp(dy)

    (y, (dx, dw)), (y_ref, (dx_ref, dw_ref)) = run("mosaic_gpu"), run("xla")
    for got, want in ((y, y_ref), (dx, dx_ref)) + (() if stored else ((dw, dw_ref),)):
        np.testing.assert_allclose(got, want, **LINEAR_TOL)


@pytest.mark.parametrize("n,k,out_dtype,tiles", [
    (1536, 2048, jnp.bfloat16, None), (2048, 768, jnp.bfloat16, None), (1536, 2048, jnp.float32, None),
    (1408, 2048, jnp.bfloat16, None), (2048, 768, jnp.bfloat16, Fp8MosaicTiles(stages=5))],
    ids=["qwen3-gate-up", "qwen3-down", "fp32-out", "n128-items", "n128-five-stages"])
def test_tiles_lower_for_h200_and_the_model_is_mosaics_count(n, k, out_dtype, tiles):
    """The rule's tiles (None) and another at prefill shapes go through Mosaic GPU's lowering
    for an H200 from this host; one stage more than fits is refused by Mosaic with exactly the
    model's bytes (less the reserve the model keeps), so the model counts what Mosaic allocates."""
    m, e = 4096, 16
    if tiles is None:
        tiles = fp8_mosaic_tiles(n)
        assert tiles.tile_n == (256 if n % 256 == 0 else 128)
    f8, S = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    avals = (S((m, k), f8), S((m, k // 128), jnp.float32), S((e, n, k), f8), S((e, n // 128, k // 128), jnp.float32),
             S((e,), jnp.int32))

    def lower(t):
        return lower_for_gpu(lambda a, a_s, b, b_s, gs: gmm_fp8(Fp8Rows(a, a_s), Fp8Weights(b, b_s), gs,
                                                                backend="mosaic_gpu", config=t, out_dtype=out_dtype),
                             *avals)

    assert "mosaic_gpu" in lower(tiles)
    limit = 232448  # an H200's shared memory per block
    over = next(t for t in (dataclasses.replace(tiles, stages=s) for s in range(1, 9))
                if fp8_mosaic_smem_bytes(t, out_dtype) - RESERVED_BYTES > limit)
    assert fp8_mosaic_support(m, n, k, over, out_dtype, limit) is not None
    with pytest.raises(Exception, match="exceeds available shared memory") as info:
        lower_for_gpu(lambda a, a_s, b, b_s, gs: _unchecked(a, a_s, b, b_s, gs, over, out_dtype), *avals)
    counted = int(re.search(r"smem_bytes=(\d+)", str(info.value)).group(1))
    assert counted == fp8_mosaic_smem_bytes(over, out_dtype) - RESERVED_BYTES


def test_auto_on_a_hopper_without_jax_triton_runs_mosaic_at_prefill_and_warns_at_decode():
    """Lowered for an H200 from this host: `auto` keeps its kernels where only the Mosaic one runs
    (no jax_triton): prefill lowers the Mosaic kernel; decode, which only the Triton kernel takes,
    lowers the reference path with a warning naming why; a Triton `config` under `auto` is a
    ValueError naming why its kernel cannot run. Where jax_triton imports, decode is the Triton
    kernel's."""
    f8, S = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    e, n, k = 16, 256, 256

    def lower(m, config=None):
        avals = (S((m, k), f8), S((m, k // 128), jnp.float32), S((e, n, k), f8), S((e, n // 128, k // 128), jnp.float32),
                 S((e,), jnp.int32))
        return lower_for_gpu(lambda a, a_s, b, b_s, gs: gmm_fp8(Fp8Rows(a, a_s), Fp8Weights(b, b_s), gs, config=config,
                                                                out_dtype=jnp.bfloat16), *avals)

    with jax.sharding.use_abstract_mesh(h200_mesh((1,), ("aot",))):
        assert fp8_backend("auto") == "auto"
        assert fp8_kernel(MOSAIC_MIN_ROWS * e, n, k, e) == "mosaic_gpu"
        if have_jax_triton():
            assert fp8_kernel(64, n, k, e) == "triton"
            return
        with pytest.warns(UserWarning, match=r"64 rows .* reference path .*jax_triton"):
            assert fp8_kernel(64, n, k, e) == "xla"
    assert "mosaic_gpu" in lower(MOSAIC_MIN_ROWS * e)
    with pytest.raises(ValueError, match=r"config=TileConfig.* triton FP8 kernel's, which cannot run here.*jax_triton"):
        lower(64, TileConfig(block_m=16, block_n=128, block_k=128))
    with pytest.warns(UserWarning, match="reference path"):
        decode = lower(64)
    assert "mosaic_gpu" not in decode and "triton" not in decode


def _unchecked(a, a_s, b, b_s, gs, tiles, out_dtype):
    """The kernel launched without `gmm_fp8`'s shared-memory check, so Mosaic's own count speaks."""
    return gmm_fp8_mosaic(Fp8Rows(a, a_s), Fp8Weights(b, b_s), gs, out_dtype=out_dtype, num_ctas=132, tiles=tiles)


def test_auto_takes_the_mosaic_kernel_for_prefill_problems_it_runs():
    """Where the Mosaic kernel runs (Hopper, or interpreted here), `auto` takes it for problems of
    at least `MOSAIC_MIN_ROWS` rows per group on average, packed rows, N and K multiples of 128;
    the Triton kernel otherwise (decode, row ids, other widths)."""
    capability = device_facts().capability
    if ON_GPU and (capability is None or capability[0] != 9):
        assert fp8_kernel(32768, 1536, 2048, 128) == "triton"
        return
    assert fp8_kernel(32768, 1536, 2048, 128) == "mosaic_gpu"
    assert fp8_kernel(8192, 14336, 4096, 8) == "mosaic_gpu"
    assert fp8_kernel(MOSAIC_MIN_ROWS * 128 - 8, 1536, 2048, 128) == "triton"  # under a tile per group
    assert fp8_kernel(1024, 1536, 2048, 128) == "triton"  # decode
    assert fp8_kernel(32768, 1536, 2048, 128, gather=True) == "triton"
    assert fp8_kernel(32768, 1500, 2048, 128) == "triton"


def test_mosaic_errors_name_the_fix():
    rows, wq = _operands(200, 200, 256, 2)
    gs = jnp.array([100, 100], jnp.int32)
    with pytest.raises(ValueError, match="backend='mosaic_gpu': .*K % 128 == 0.*backend='auto'"):
        gmm_fp8(rows, wq, gs, backend="mosaic_gpu")
    rows, wq = _operands(64, 256, 256, 2)
    with pytest.raises(ValueError, match="M >= 128"):
        gmm_fp8(rows, wq, jnp.array([32, 32], jnp.int32), backend="mosaic_gpu")
    with pytest.raises(TypeError, match="takes an Fp8MosaicTiles"):
        gmm_fp8(rows, wq, jnp.array([32, 32], jnp.int32), backend="mosaic_gpu", config=TileConfig(block_k=128))
    with pytest.raises(ValueError, match="tile_n 128 or 256"):
        Fp8MosaicTiles(tile_n=64)
    with pytest.raises(ValueError, match=r"stages in \[1, 8\]"):
        Fp8MosaicTiles(stages=0)


@pytest.mark.skipif(not ON_GPU, reason="a prefill shape, compiled: the interpreted cases above cover the CPU")
@pytest.mark.parametrize("n", [1536, 1408], ids=["n256-items", "n128-items"])
def test_mosaic_fp8_at_a_prefill_shape_on_gpu(n):
    """Both branches of the tile rule at 8192 rows over 16 ragged groups (the last rows past them),
    forward and input-gradient orientations, against the recipe's fp32 reference."""
    m, k, e = 8192, 2048, 16
    rows, wq = _operands(m, k, n, e, seed=7)
    gs = jnp.asarray(np.random.default_rng(1).multinomial(m - 300, np.ones(e) / e), jnp.int32)
    y = gmm_fp8(rows, wq, gs, backend="mosaic_gpu", out_dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(y, np.float32), _reference_by_group(rows, wq, gs), rtol=2e-2, atol=2e-2)
    dy = quantize_rows(jax.random.normal(jax.random.key(8), (m, n), jnp.float32))
    dx = gmm_fp8(dy, wq, gs, transpose_rhs=False, backend="mosaic_gpu")
    np.testing.assert_allclose(dx, _reference_by_group(dy, wq, gs, transpose_rhs=False), **TOL)


def _reference_by_group(rows: Fp8Rows, wq: Fp8Weights, gs, *, transpose_rhs=True, chunk=512):
    """`gmm_fp8_reference` one group and at most `chunk` rows at a time (whole, its per-row weights
    would take tens of GiB at a prefill shape); rows past the groups are zero."""
    parts, start = [], 0
    for e, size in enumerate(np.asarray(gs).tolist()):
        w_e = Fp8Weights(wq.values_ENK[e:e + 1], wq.scale_ENbKb[e:e + 1])
        for lo in range(start, start + size, chunk):
            hi = min(lo + chunk, start + size)
            part = Fp8Rows(rows.values_MK[lo:hi], rows.scale_MKb[lo:hi])
            parts.append(np.asarray(gmm_fp8_reference(part, w_e, jnp.array([hi - lo], jnp.int32),
                                                      transpose_rhs=transpose_rhs)))
        start += size
    width = parts[0].shape[1]
    parts.append(np.zeros((rows.values_MK.shape[0] - start, width), np.float32))
    return np.concatenate(parts)
