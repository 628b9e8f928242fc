"""Grouped-GEMM ops: schedule invariants, forward, both gradients, edge cases, bad input.

The same bodies run compiled on a GPU and interpreted on CPU (`moe_jax.ops` picks). Sizes are
small on CPU, larger on GPU.
"""

import functools
import re

import hypothesis.strategies as st
import jax
import jax.test_util  # noqa: F401  (check_grads)
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from moe_jax.ops import (
    GmmConfig,
    TileConfig,
    clamp_group_sizes,
    gmm,
    gmm_config,
    gmm_reference,
    grouped_linear,
    make_group_metadata,
    max_tiles,
    resolve_backend,
    tgmm,
    tgmm_config,
    tgmm_reference,
)
from moe_jax.ops.gmm.triton import tgmm_tiles as triton_tgmm_tiles
from moe_jax.testing import assert_close, rel_err
from tests.helpers import ON_GPU, h200_mesh, lower_for_gpu, sharded_aval

BACKENDS = ["pallas_triton", "xla"] + (["triton"] if ON_GPU else [])  # triton: jax_triton needs a GPU
DTYPES = [jnp.float32, jnp.bfloat16]
# Small tiles on CPU keep the interpreter quick while still exercising multi-tile groups.
SMALL = TileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)
CFG = None if ON_GPU else SMALL
WCFG = None if ON_GPU else TileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=1)


def _on(backend, config):
    """`config` where `backend` takes tiles (the Triton-compiled backends); xla takes none."""
    return config if backend in ("pallas_triton", "triton") else None
# (M, K, N): deliberately not multiples of the tiles.
SHAPE = (1000, 200, 300) if ON_GPU else (150, 72, 80)


def _inputs(seed, m, k, n, e, dtype, transpose_rhs=True):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    shape = (e, n, k) if transpose_rhs else (e, k, n)
    w = (jax.random.normal(kw, shape, jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, w


def _sizes(*s):
    return jnp.array(s, jnp.int32)


def _split(total, e, seed, zeros=()):
    """Random group sizes summing to `total`, with the listed groups empty."""
    rng = np.random.default_rng(seed)
    p = rng.random(e)
    p[list(zeros)] = 0
    counts = rng.multinomial(total, p / p.sum())
    return jnp.asarray(counts, jnp.int32)


# ---------------------------------------------------------------------------------------------
# Schedule


def _fill(sizes, rows, fill):
    """`sizes` clipped in order to fit `rows` (later groups come up short or empty when earlier
    ones take all the rows); with `fill` the last group also takes every row left over, so no
    rows lie past the groups."""
    left, out = rows, []
    for size in sizes:
        out.append(min(size, left))
        left -= out[-1]
    if fill:
        out[-1] += left
    return np.asarray(out, np.int32)


@functools.cache
def _schedule(num_rows, block_m):
    return jax.jit(functools.partial(make_group_metadata, num_rows=num_rows, block_m=block_m))


def _check_schedule(sizes, m, bm):
    sizes_np = np.asarray(sizes)
    meta = _schedule(m, bm)(jnp.asarray(sizes_np, jnp.int32))
    e = len(sizes_np)
    g, s, t = (np.asarray(a) for a in (meta.tile_group_W, meta.tile_start_W, meta.tile_end_W))
    n = int(meta.num_tiles)
    assert len(g) == max_tiles(m, e, bm) >= n
    offsets = np.concatenate([[0], np.cumsum(sizes_np)])
    expected = int(sum(-(-c // bm) for c in sizes_np)) + -(-(m - offsets[-1]) // bm)
    assert n == expected
    # Tiles in use partition [0, M) in order; each lies in one group, starting at that group's
    # first row plus a multiple of block_m.
    assert s[0] == 0 if n else True
    assert (s[1:n] == t[: n - 1]).all() and (n == 0 or t[n - 1] == m)
    assert ((t[:n] > s[:n]) & (t[:n] - s[:n] <= bm)).all()
    bounds = np.concatenate([offsets, [m]])
    assert ((s[:n] - bounds[g[:n]]) % bm == 0).all()
    assert (t[:n] <= bounds[g[:n] + 1]).all()
    # Unused tiles are empty and point past the end.
    assert (g[n:] == e).all() and (s[n:] == m).all() and (t[n:] == m).all()


@settings(derandomize=True, max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=9, max_size=9),
    groups=st.sampled_from([1, 2, 9]),
    fill=st.booleans(),
    bm=st.sampled_from([1, 2, 16, 32]),
)
def test_schedule_invariants(sizes, groups, fill, bm):
    """M = 160 rows and E in {1, 2, 9} (one compile per E and block_m; the sizes are data): empty
    groups, groups of one row, groups that fill M exactly or leave rows past them."""
    _check_schedule(_fill(sizes[:groups], 160, fill), 160, bm)


def test_schedule_bound_is_tight_for_worst_case():
    # Every group one row past a tile boundary is the worst case the bound describes.
    sizes = [17] * 8
    m = sum(sizes) + 1
    meta = make_group_metadata(_sizes(*sizes), num_rows=m, block_m=16)
    assert int(meta.num_tiles) == 8 * 2 + 1 == max_tiles(m, 8, 16)


def test_schedule_clamps_bad_traced_sizes():
    # Under jit the sizes cannot be checked; the schedule clamps instead of reading past M.
    meta = jax.jit(lambda s: make_group_metadata(s, num_rows=20, block_m=8))(_sizes(-5, 30, 4))
    assert np.asarray(meta.group_offsets_E1).tolist() == [0, 0, 20, 20]
    assert int(np.asarray(meta.tile_end_W).max()) <= 20


@pytest.mark.parametrize("config", [None, GmmConfig("row_tile", TileConfig(16, 16, 16, 4, 2, 1)),
                                    GmmConfig("group_major", TileConfig(16, 16, 16, 4, 2, 1))],
                         ids=["xla", "row_tile", "group_major"])
def test_traced_sizes_whose_sum_overflows_int32_are_clamped(config):
    """Sizes near 2**31 under jit: a plain cumsum wrapped negative (offsets [0, 10, -2, 3], a tile
    starting at row -2). Clamped, group 0 owns all 10 rows on every backend and family."""
    big = 2**31 - 1
    sizes = _sizes(big, big, 5)
    np.testing.assert_array_equal(jax.jit(lambda s: clamp_group_sizes(s, 10))(sizes), [0, 10, 10, 10])
    meta = jax.jit(lambda s: make_group_metadata(s, num_rows=10, block_m=8))(sizes)
    assert int(np.asarray(meta.tile_start_W).min()) >= 0 and int(np.asarray(meta.tile_end_W).max()) <= 10
    x, w = _inputs(21, 10, 16, 24, 3, jnp.float32)
    want = gmm_reference(x, w, _sizes(10, 0, 0))
    backend = "xla" if config is None else "pallas_triton"
    assert_close(jax.jit(lambda s: gmm(x, w, s, backend=backend, config=config))(sizes), want, jnp.float32, "gmm")
    dy = jax.random.normal(jax.random.PRNGKey(22), (10, 24))
    dw = jax.jit(lambda s: tgmm(x, dy, s, backend=backend, config=None if config is None else config.tiles))(sizes)
    assert_close(dw, tgmm_reference(x, dy, _sizes(10, 0, 0)), jnp.float32, "tgmm")
    assert (np.asarray(dw[1:]) == 0).all()


# ---------------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_gmm_matches_reference(backend, dtype, transpose_rhs):
    m, k, n = SHAPE
    e = 6
    x, w = _inputs(0, m, k, n, e, dtype, transpose_rhs)
    sizes = _split(m - 7, e, seed=1, zeros=(2,))  # an empty group and 7 rows past the last group
    out = gmm(x, w, sizes, transpose_rhs=transpose_rhs, backend=backend, config=_on(backend, CFG))
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, gmm_reference(x, w, sizes, transpose_rhs=transpose_rhs), dtype, "gmm")
    assert (np.asarray(out[m - 7 :], np.float32) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param((0, 0, 150, 0), id="one-hot-expert"),
        pytest.param((1, 0, 0, 0), id="one-row"),
        pytest.param((0, 0, 0, 0), id="all-empty"),
        pytest.param((16, 32, 48, 54), id="tile-multiples"),
        pytest.param((15, 17, 1, 117), id="ragged"),
    ],
)
def test_gmm_edge_groupings(backend, sizes):
    m, k, n = 150, 40, 48
    x, w = _inputs(1, m, k, n, 4, jnp.float32)
    gs = _sizes(*sizes)
    out = gmm(x, w, gs, backend=backend, config=_on(backend, CFG))
    assert_close(out, gmm_reference(x, w, gs), jnp.float32, f"gmm {sizes}")
    assert (np.asarray(out[sum(sizes) :]) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gmm_zero_rows(backend):
    x = jnp.zeros((0, 32), jnp.float32)
    w = jnp.ones((3, 16, 32), jnp.float32)
    out = gmm(x, w, _sizes(0, 0, 0), backend=backend)
    assert out.shape == (0, 16)
    dw = tgmm(x, jnp.zeros((0, 16), jnp.float32), _sizes(0, 0, 0), backend=backend)
    assert dw.shape == (3, 16, 32) and (np.asarray(dw) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gmm_nan_rows_past_groups_do_not_leak(backend):
    # Rows past sum(group_sizes) hold NaN: outputs there must be exact zeros and nothing may leak
    # into valid rows or weight gradients.
    m, k, n = 96, 64, 32
    x, w = _inputs(2, m, k, n, 3, jnp.float32)
    gs = _sizes(20, 0, 50)
    x = x.at[70:].set(jnp.nan)
    out = gmm(x, w, gs, backend=backend, config=_on(backend, CFG))
    assert np.isfinite(np.asarray(out)).all()
    assert (np.asarray(out[70:]) == 0).all()
    assert_close(out[:70], gmm_reference(x[:70], w, gs), jnp.float32, "valid rows")
    dy = jnp.ones((m, n), jnp.float32).at[70:].set(jnp.nan)
    dw = tgmm(x, dy, gs, backend=backend, config=_on(backend, WCFG))
    assert np.isfinite(np.asarray(dw)).all()
    assert (np.asarray(dw[1]) == 0).all()


@pytest.mark.parametrize("config", [
    GmmConfig("row_tile", TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, group_m=1)),
    GmmConfig("row_tile", TileConfig(block_m=32, block_n=64, block_k=16, num_warps=4, num_stages=2, group_m=3)),
    GmmConfig("row_tile", TileConfig(block_m=64, block_n=16, block_k=64, num_warps=4, num_stages=2, group_m=8)),
    GmmConfig("group_major", TileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=1)),
    GmmConfig("group_major", TileConfig(block_m=32, block_n=16, block_k=64, num_warps=4, num_stages=2, group_m=1)),
], ids=["tiles16", "tiles32-swizzle3", "tiles64-swizzle8", "group-major16", "group-major32"])
def test_gmm_tile_configs(config):
    # Different families, swizzles and tile shapes (including groups wider than the tiles) agree.
    m, k, n = 130, 48, 40
    x, w = _inputs(3, m, k, n, 5, jnp.float32)
    gs = _sizes(0, 70, 3, 0, 50)
    assert_close(gmm(x, w, gs, backend="pallas_triton", config=config), gmm_reference(x, w, gs),
                 jnp.float32, config.name)
    dy = jax.random.normal(jax.random.PRNGKey(9), (m, n))
    assert_close(tgmm(x, dy, gs, backend="pallas_triton", config=config.tiles), tgmm_reference(x, dy, gs),
                 jnp.float32, config.name)


@pytest.mark.parametrize("sizes,m", [((20, 0, 33, 1), 70), ((0, 0, 0, 0), 24), ((5, 5, 5, 5), 20), ((0, 61, 0, 0), 61)])
def test_every_output_element_is_written(sizes, m):
    """Each kernel writes every element of its output: launched into a NaN-filled buffer (aliased
    as the output), the result has no NaN and matches the reference."""
    from moe_jax.ops.gmm.pallas_triton.group_major import gmm_group_major_pallas
    from moe_jax.ops.gmm.pallas_triton.row_tile import gmm_row_tile_pallas
    from moe_jax.ops.gmm.pallas_triton.wgrad import tgmm_pallas

    k, n, e = 40, 24, len(sizes)
    x, w = _inputs(14, m, k, n, e, jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    common = dict(out_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST, interpret=not ON_GPU)
    nan_out = jnp.full((m, n), jnp.nan, jnp.float32)
    ref = gmm_reference(x, w, gs)
    tiles = TileConfig(16, 16, 16, 4, 2, 2)
    out = gmm_row_tile_pallas(x, w, gs, transpose_rhs=True, tiles=tiles, out_init=nan_out, **common)
    assert_close(out, ref, jnp.float32, "row-tile kernel")
    out = gmm_group_major_pallas(x, w, gs, transpose_rhs=True, tiles=TileConfig(16, 16, 16, 4, 2, 1),
                                 out_init=nan_out, num_fill=2, **common)
    assert_close(out, ref, jnp.float32, "group-major kernel")
    dy = jax.random.normal(jax.random.PRNGKey(15), (m, n))
    dw = tgmm_pallas(x, dy, clamp_group_sizes(gs, m), tiles=TileConfig(16, 16, 16, 4, 2, 1),
                     out_init=jnp.full((e, n, k), jnp.nan, jnp.float32), **common)
    assert_close(dw, tgmm_reference(x, dy, gs), jnp.float32, "weight-gradient kernel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [True, False])
@pytest.mark.parametrize("sizes,k,splits", [
    ((1, 0, 0, 2, 0, 0, 0, 1), 72, 3),  # decode: few rows, empty experts; 5 K blocks over 3 splits (2, 2, 1)
    ((0, 0, 0, 0), 48, 2),  # nothing routed: every row is a zero-fill row
    ((3, 0, 9, 0), 40, 8),  # more splits than K blocks (3): five empty splits write zeros
], ids=["decode", "empty", "splits_past_k"])
def test_split_k_matches_reference(dtype, transpose_rhs, sizes, k, splits):
    """Split-K against the fp32 reference, rows past the groups zero, the same bits on a rerun."""
    e, n = len(sizes), 40
    m = sum(sizes) + 3
    x, w = _inputs(41, m, k, n, e, dtype, transpose_rhs)
    gs = jnp.asarray(sizes, jnp.int32)
    config = GmmConfig("split_k", TileConfig(16, 16, 16, 4, 2, 1), splits=splits)
    run = jax.jit(lambda x, w, gs: gmm(x, w, gs, transpose_rhs=transpose_rhs, config=config, backend="pallas_triton"))
    out = run(x, w, gs)
    assert out.dtype == dtype
    assert_close(out, gmm_reference(x, w, gs, transpose_rhs=transpose_rhs), dtype, config.name)
    assert (np.asarray(out[sum(sizes):], np.float32) == 0).all()
    np.testing.assert_array_equal(np.asarray(run(x, w, gs), np.float32), np.asarray(out, np.float32))


def test_split_k_writes_every_partial():
    """Launched into NaN-filled partial planes, every element of every plane is written."""
    from moe_jax.ops.gmm.pallas_triton.group_major import gmm_group_major_pallas

    sizes, k, n, splits = (4, 0, 11, 2), 56, 24, 3
    m = sum(sizes) + 5
    x, w = _inputs(42, m, k, n, len(sizes), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    out = gmm_group_major_pallas(x, w, gs, transpose_rhs=True, tiles=TileConfig(16, 16, 16, 4, 2, 1),
                                 out_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST, interpret=not ON_GPU,
                                 num_fill=2, splits=splits, out_init=jnp.full((splits, m, n), jnp.nan, jnp.float32))
    assert_close(out, gmm_reference(x, w, gs), jnp.float32, "split-K into NaN partials")


def test_split_k_lowers_for_h200_at_decode():
    """Split-K at decode (8 rows over 128 experts, K = 2048) lowers through Pallas to Triton IR."""
    config = GmmConfig("split_k", TileConfig(16, 32, 256, 4, 3, 1), splits=4)
    text = lower_for_gpu(lambda x, w, gs: gmm(x, w, gs, config=config, backend="pallas_triton"),
                         jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((128, 1536, 2048), jnp.bfloat16),
                         jax.ShapeDtypeStruct((128,), jnp.int32))
    assert re.findall(r'name = "(moe_jax_\w+)"', text) == ["moe_jax_gmm_split_k"]


# ---------------------------------------------------------------------------------------------
# Weight gradient


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tgmm_matches_reference(backend, dtype):
    m, k, n = SHAPE
    e = 5
    x, _ = _inputs(4, m, k, n, e, dtype)
    dy = jax.random.normal(jax.random.PRNGKey(5), (m, n), jnp.float32).astype(dtype)
    sizes = _split(m - 3, e, seed=2, zeros=(0, 3))
    dw = tgmm(x, dy, sizes, backend=backend, config=_on(backend, WCFG))
    assert dw.dtype == dtype and dw.shape == (e, n, k)
    assert_close(dw, tgmm_reference(x, dy, sizes), dtype, "tgmm")
    assert (np.asarray(dw[0], np.float32) == 0).all() and (np.asarray(dw[3], np.float32) == 0).all()


# ---------------------------------------------------------------------------------------------
# Differentiable op


def _ref_linear(x, w, gs):
    return gmm_reference(x, w, gs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_gradients(backend, dtype):
    m, k, n = SHAPE
    e = 4
    x, w = _inputs(6, m, k, n, e, dtype)
    gs = _split(m - 5, e, seed=3, zeros=(1,))
    ct = jax.random.normal(jax.random.PRNGKey(7), (m, n), jnp.float32)
    cfg = {} if ON_GPU or backend == "xla" else dict(fwd_config=SMALL, dgrad_config=SMALL, wgrad_config=WCFG)

    def loss(x, w):
        return jnp.sum(grouped_linear(x, w, gs, backend=backend, **cfg).astype(jnp.float32) * ct)

    def loss_ref(x, w):
        return jnp.sum(_ref_linear(x, w, gs) * ct)

    dx, dw = jax.grad(loss, (0, 1))(x, w)
    dx_ref, dw_ref = jax.grad(loss_ref, (0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    assert dx.dtype == dtype and dw.dtype == dtype
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dw")
    assert (np.asarray(dw[1], np.float32) == 0).all(), "empty group's weight gradient must be exactly zero"
    assert (np.asarray(dx[m - 5 :], np.float32) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_linear_check_grads(backend):
    x, w = _inputs(8, 40, 24, 20, 3, jnp.float32)
    gs = _sizes(12, 0, 25)
    cfg = {} if ON_GPU or backend == "xla" else dict(fwd_config=SMALL, dgrad_config=SMALL, wgrad_config=WCFG)
    f = lambda x, w: grouped_linear(x, w, gs, backend=backend, **cfg)
    jax.test_util.check_grads(f, (x, w), order=1, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_with_traced_sizes_and_scan(backend):
    # Traced group sizes under jit, and the op inside lax.scan over a stack of layers.
    m, k = 64, 32
    layers, e = 3, 4
    x, _ = _inputs(10, m, k, k, e, jnp.float32)
    ws = jax.random.normal(jax.random.PRNGKey(11), (layers, e, k, k)) / np.sqrt(k)
    cfg = {} if ON_GPU or backend == "xla" else dict(fwd_config=SMALL, dgrad_config=SMALL, wgrad_config=WCFG)

    @jax.jit
    def run(x, ws, gs):
        def layer(h, w):
            return jnp.tanh(grouped_linear(h, w, gs, backend=backend, **cfg)), None

        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h**2)

    def run_ref(x, ws, gs):
        h = x
        for i in range(layers):
            h = jnp.tanh(gmm_reference(h, ws[i], gs))
        return jnp.sum(h**2)

    gs = _sizes(10, 30, 0, 24)
    val, (dx, dws) = jax.value_and_grad(run, (0, 1))(x, ws, gs)
    val_ref, (dx_ref, dws_ref) = jax.value_and_grad(run_ref, (0, 1))(x, ws, gs)
    assert abs(float(val) - float(val_ref)) <= 1e-4 * abs(float(val_ref))
    assert rel_err(dx, dx_ref) < 1e-4 and rel_err(dws, dws_ref) < 1e-4
    # A second grouping reuses the compiled program (sizes are data, not shapes).
    gs2 = _sizes(0, 0, 64, 0)
    assert abs(float(run(x, ws, gs2)) - float(run_ref(x, ws, gs2))) <= 1e-4 * float(run_ref(x, ws, gs2))


@functools.cache
def _random_grouping_ops():
    gmm_ = jax.jit(lambda x, w, gs: gmm(x, w, gs, backend="pallas_triton", config=CFG))
    tgmm_ = jax.jit(lambda x, dy, gs: tgmm(x, dy, gs, backend="pallas_triton", config=WCFG))
    return gmm_, tgmm_


@settings(derandomize=True, max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=6, max_size=6), groups=st.sampled_from([1, 6]), fill=st.booleans())
def test_gmm_property_random_groupings(sizes, groups, fill):
    """Random group sizes (empty groups, one-row groups, rows past the groups or none) over M = 128
    rows and E in {1, 6}: the sizes are data, so each E compiles once."""
    m, e = 128, groups
    gs = jnp.asarray(_fill(sizes[:e], m, fill))
    x, w = _inputs(12, m, 40, 24, e, jnp.float32)
    gmm_, tgmm_ = _random_grouping_ops()
    sizes = np.asarray(gs).tolist()
    assert_close(gmm_(x, w, gs), gmm_reference(x, w, gs), jnp.float32, f"gmm sizes={sizes} M={m}")
    dy = jax.random.normal(jax.random.PRNGKey(13), (m, 24))
    assert_close(tgmm_(x, dy, gs), tgmm_reference(x, dy, gs), jnp.float32, f"tgmm sizes={sizes} M={m}")


# ---------------------------------------------------------------------------------------------
# GPU lowering, checked from any host


def _kernel_for(m, n, k, e):
    """Name of the forward/input-gradient kernel `gmm_config` picks for this per-device shape."""
    return "moe_jax_gmm_group_major" if gmm_config(m, n, k, e).family == "group_major" else "moe_jax_gmm"


@pytest.mark.parametrize("m,n,k,e", [(32768, 1536, 2048, 128), (8, 1536, 2048, 128), (8192, 14336, 4096, 8),
                                     (300, 200, 72, 5)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_triton_for_h200(m, n, k, e, dtype):
    """Forward, input-gradient and weight-gradient kernels lower through Pallas to Triton IR for an
    H200 with the table's configs, for prefill, decode and odd shapes."""

    def f(x, w, gs):
        loss = lambda x, w: jnp.sum(grouped_linear(x, w, gs, backend="pallas_triton").astype(jnp.float32) ** 2)
        return jax.grad(loss, (0, 1))(x, w)

    text = lower_for_gpu(
        f, jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((e, n, k), dtype),
        jax.ShapeDtypeStruct((e,), jnp.int32),
    )
    names = re.findall(r'name = "(moe_jax_\w+)"', text)
    assert sorted(names) == sorted([_kernel_for(m, n, k, e), _kernel_for(m, k, n, e), "moe_jax_tgmm"]), names
    assert "__gpu$xla.gpu.triton" in text


# Per device: m rows over e experts; 64 rows per expert get the row-tile kernel, 8 and 1/8 group-major.
@pytest.mark.parametrize("m,e,fwd_kernel", [(512, 8, "moe_jax_gmm"), (64, 8, "moe_jax_gmm_group_major"),
                                            (16, 128, "moe_jax_gmm_group_major")])
def test_kernels_lower_for_h200_inside_shard_map(m, e, fwd_kernel):
    """The MoE layer runs the kernels inside `jax.shard_map(check_vma=True)` on a mesh: Pallas then
    needs the output's varying mesh axes (this failed on 2 H200s on 2026-11-30). Forward and both
    gradient kernels lower for a 2-GPU ep mesh, with the weights replicated then cast to varying as
    the layer does, for both forward kernels. (Interpret mode on CPU cannot run there: JAX's
    Pallas interpreter pads with invariant constants; `auto` picks the xla backend on CPU.)"""
    from jax.sharding import AxisType, PartitionSpec

    k, n = 64, 32
    assert _kernel_for(m, n, k, e) == fwd_kernel, "the config table moved: pick shapes that cover both kernels"
    mesh = h200_mesh((2,), ("ep",), axis_types=(AxisType.Explicit,))

    def body(x, w, gs):
        w = jax.lax.pcast(w, ("ep",), to="varying")
        return grouped_linear(x, w, gs, backend="pallas_triton")

    layer = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec("ep"), PartitionSpec(), PartitionSpec("ep")),
                          out_specs=PartitionSpec("ep"))

    def loss_and_grads(x, w, gs):
        return jax.value_and_grad(lambda x, w: jnp.sum(layer(x, w, gs).astype(jnp.float32) ** 2), (0, 1))(x, w)

    args = (sharded_aval(mesh, (2 * m, k), jnp.bfloat16, PartitionSpec("ep")),
            sharded_aval(mesh, (e, n, k), jnp.bfloat16, PartitionSpec()),
            sharded_aval(mesh, (2 * e,), jnp.int32, PartitionSpec("ep")))
    text = lower_for_gpu(loss_and_grads, *args, mesh=mesh)
    names = re.findall(r'name = "(moe_jax_\w+)"', text)
    assert sorted(names)[-1] == "moe_jax_tgmm"
    assert len(names) == 3
    assert sorted(names) == sorted([_kernel_for(m, n, k, e), _kernel_for(m, k, n, e), "moe_jax_tgmm"]), names
    assert "__gpu$xla.gpu.triton" in text


# ---------------------------------------------------------------------------------------------
# Configs, backends and bad input


def test_config_table_and_validation():
    assert gmm_config(8, 1536, 2048, 128).family == "group_major"  # decode
    assert gmm_config(8, 1536, 2048, 128).tiles.block_m == 16
    assert gmm_config(32768, 1536, 2048, 128).family == "row_tile"  # prefill
    assert gmm_config(32768, 1536, 2048, 128).tiles.block_m >= 64
    assert tgmm_config(32768, 1536, 2048, 128).block_n >= 64
    # The Triton weight gradient's own rule: 32-row steps on 4 warps while groups are small, 64-row
    # steps over 128 x 256 blocks from 768 rows per group.
    assert triton_tgmm_tiles(32768, 1536, 2048, 128) == TileConfig(32, 128, 128, 4, 4, 1)
    assert triton_tgmm_tiles(16384, 14336, 4096, 8) == TileConfig(64, 128, 256, 8, 3, 1)
    with pytest.raises(ValueError, match="block_m"):
        TileConfig(block_m=48)
    with pytest.raises(ValueError, match="block_k"):
        TileConfig(block_k=8)
    with pytest.raises(ValueError, match="num_warps"):
        TileConfig(num_warps=3)
    with pytest.raises(ValueError, match="group_m"):
        TileConfig(group_m=0)
    assert TileConfig(block_m=np.int64(32)).block_m == 32  # numpy integers are ints
    with pytest.raises(ValueError, match="family"):
        GmmConfig("split_everything")
    with pytest.raises(ValueError, match="the split_k family takes splits >= 2"):
        GmmConfig("split_k")
    with pytest.raises(ValueError, match="the split_k family takes splits >= 2, the others splits=1"):
        GmmConfig("row_tile", splits=2)
    assert GmmConfig("split_k", splits=4).name.startswith("split_k4 ")
    with pytest.raises(ValueError, match=r"config='row_tile': use None \(the backend's static choice\), 'auto'"):
        gmm(jnp.ones((4, 8)), jnp.ones((2, 4, 8)), _sizes(2, 2), config="row_tile")
    with pytest.raises(TypeError, match=r"is no configuration of a tgmm kernel; pallas_triton takes TileConfig"):
        tgmm(jnp.ones((4, 8)), jnp.ones((4, 4)), _sizes(2, 2), config=GmmConfig())


def test_vmap_over_a_leading_axis(backend="xla"):
    """gmm, tgmm and grouped_linear's gradients under jax.vmap (XLA's ragged_dot has no batching
    rule but over dim 0; the ops map element by element), against a Python loop."""
    x = jax.random.normal(jax.random.PRNGKey(31), (3, 20, 8))
    w = jax.random.normal(jax.random.PRNGKey(32), (2, 6, 8))
    gs = jnp.array([[5, 15], [20, 0], [0, 7]], jnp.int32)  # batched sizes too
    out = jax.vmap(lambda x, gs: gmm(x, w, gs, backend=backend))(x, gs)
    for b in range(3):
        assert_close(out[b], gmm_reference(x[b], w, gs[b]), jnp.float32, f"gmm {b}")
    dy = jax.random.normal(jax.random.PRNGKey(33), (3, 20, 6))
    dw = jax.vmap(lambda x, dy, gs: tgmm(x, dy, gs, backend=backend))(x, dy, gs)
    for b in range(3):
        assert_close(dw[b], tgmm_reference(x[b], dy[b], gs[b]), jnp.float32, f"tgmm {b}")
    loss = lambda x, w: jnp.sum(jax.vmap(lambda x, gs: grouped_linear(x, w, gs, backend=backend))(x, gs) ** 2)
    ref = lambda x, w: sum(jnp.sum(gmm_reference(x[b], w, gs[b]) ** 2) for b in range(3))
    for g, r in zip(jax.grad(loss, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)):
        assert_close(g, r, jnp.float32, "vmapped grouped_linear gradient")


@pytest.mark.parametrize("op", ["gmm", "tgmm"])
def test_autodiff_of_the_raw_ops_names_the_fix(op):
    x, w, gs = jnp.ones((6, 8)), jnp.ones((2, 4, 8)), _sizes(3, 3)
    f = (lambda x: jnp.sum(gmm(x, w, gs))) if op == "gmm" else (lambda x: jnp.sum(tgmm(x, jnp.ones((6, 4)), gs)))
    with pytest.raises(TypeError, match=f"moe_jax.ops.{op} is not differentiable; use moe_jax.ops.grouped_linear"):
        jax.grad(f)(x)


def test_bad_input_errors():
    x = jnp.ones((10, 8), jnp.float32)
    w = jnp.ones((2, 4, 8), jnp.float32)
    gs = _sizes(3, 4)
    with pytest.raises(ValueError, match="lhs must be 2-D"):
        gmm(x[None], w, gs)
    with pytest.raises(ValueError, match="rhs must be 3-D"):
        gmm(x, w[0], gs)
    with pytest.raises(ValueError, match="K=8 columns but rhs"):
        gmm(x, jnp.ones((2, 4, 6), jnp.float32), gs)
    with pytest.raises(TypeError, match="lhs.dtype=bfloat16 and rhs.dtype=float32"):
        gmm(x.astype(jnp.bfloat16), w, gs)
    with pytest.raises(TypeError, match="lhs.dtype=int32"):
        gmm(x.astype(jnp.int32), w.astype(jnp.int32), gs)
    with pytest.raises(ValueError, match="group_sizes has 3 entries but rhs has 2"):
        gmm(x, w, _sizes(1, 2, 3))
    with pytest.raises(TypeError, match="group_sizes must be an integer"):
        gmm(x, w, jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="group_sizes must be >= 0"):
        gmm(x, w, _sizes(-1, 2))
    with pytest.raises(ValueError, match="sum to 11 but lhs has only 10 rows"):
        gmm(x, w, _sizes(5, 6))
    with pytest.raises(ValueError, match="lhs has 10 rows but dout has 9"):
        tgmm(x, jnp.ones((9, 4), jnp.float32), gs)
    with pytest.raises(ValueError, match="zero groups"):
        gmm(x, jnp.ones((0, 4, 8), jnp.float32), jnp.zeros((0,), jnp.int32))
