"""The row gather fused into the grouped GEMMs (`gmm(row_ids=)`, `tgmm(row_ids=)`,
`grouped_linear(rows=)`, the layer's `row_gather`): equal, bit for bit, to gathering the rows
first, on every backend; no packed copy is written; bad input names the argument.

The same bodies run compiled on a GPU and interpreted on CPU.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import GemmOptions, MoE
from moe_jax.ops import AUTO_FUSED_GATHER, RowGather, TileConfig, gather_rows, gmm, gmm_reference, grouped_linear, tgmm
from moe_jax.permute import pack, pack_rows, packed_row_source
from moe_jax.testing import assert_close
from tests.helpers import ON_GPU, lower_for_gpu

BACKENDS = ["pallas_triton", "xla"] + (["triton", "mosaic_gpu"] if ON_GPU else [])
SMALL = None if ON_GPU else TileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)


def _routed(seed, tokens, top_k, experts, width, dtype, *, drop_expert=None):
    """Token rows (NaN in the tokens no route reads), a packing of random top-k routes (no route
    to `drop_expert`), and its row source."""
    kx, ki = jax.random.split(jax.random.PRNGKey(seed))
    x_TD = jax.random.normal(kx, (tokens, width), jnp.float32).astype(dtype)
    idx_TK = jax.random.randint(ki, (tokens, top_k), 0, experts)
    if drop_expert is not None:
        idx_TK = jnp.where(idx_TK == drop_expert, (drop_expert + 1) % experts, idx_TK)
    mask_T = jnp.arange(tokens) % 5 != 3  # masked tokens: their routes sort past the groups
    x_TD = jnp.where(mask_T[:, None], x_TD, jnp.nan)
    packing = pack(idx_TK, experts, mask_T=mask_T)
    return x_TD, packing, packed_row_source(x_TD, packing)


# mosaic_gpu takes bf16/fp16 only (tests/test_mosaic_gpu.py checks its dtype error).
CASES = [(b, d) for b in BACKENDS for d in (jnp.float32, jnp.bfloat16) if not (b == "mosaic_gpu" and d == jnp.float32)]
TOKENS = 96 if ON_GPU else 20  # 192 packed rows on GPU: at least one of Mosaic's 128-row tiles


@pytest.mark.parametrize("backend,dtype", CASES, ids=[f"{b}-{jnp.dtype(d).name}" for b, d in CASES])
@pytest.mark.parametrize("transpose_rhs", [True, False], ids=["nt", "nn"])
def test_gmm_row_ids_equal_gmm_on_gathered_rows(backend, dtype, transpose_rhs):
    """Rows read through ids (an empty expert, masked tokens NaN and never read, rows past the
    groups zero) equal the same backend's GEMM on the gathered rows, bit for bit."""
    k, n = (256, 256) if ON_GPU else (40, 24)
    x_TD, packing, rows = _routed(0, TOKENS, 2, 4, k, dtype, drop_expert=2)
    w = jax.random.normal(jax.random.PRNGKey(1), (4, n, k) if transpose_rhs else (4, k, n)).astype(dtype) / 8
    gs = packing.group_sizes_E
    opts = dict(transpose_rhs=transpose_rhs, backend=backend, config=SMALL if backend == "pallas_triton" else None)
    fused = jax.jit(lambda x, w, gs, ids: gmm(x, w, gs, row_ids=ids, **opts))(x_TD, w, gs, rows.ids_M)
    x_MD = gather_rows(x_TD, rows.ids_M, backend="xla")
    packed = jax.jit(lambda x, w, gs: gmm(x, w, gs, **opts))(x_MD, w, gs)
    np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(packed, np.float32))
    total = int(gs.sum())
    assert np.isfinite(np.asarray(fused, np.float32)).all() and (np.asarray(fused[total:], np.float32) == 0).all()
    assert_close(fused[:total], gmm_reference(x_MD[:total], w, gs, transpose_rhs=transpose_rhs), dtype, "fused gmm")


@pytest.mark.parametrize("backend,dtype", CASES, ids=[f"{b}-{jnp.dtype(d).name}" for b, d in CASES])
def test_tgmm_row_ids_equal_tgmm_on_gathered_rows(backend, dtype):
    """The weight gradient reading rows through ids equals it on the gathered rows, bit for bit;
    the empty expert's gradient is exactly zero and the NaN tokens never reach it."""
    k, n = (256, 128) if ON_GPU else (40, 24)
    x_TD, packing, rows = _routed(8, TOKENS, 2, 4, k, dtype, drop_expert=3)
    dy = jax.random.normal(jax.random.PRNGKey(9), (rows.ids_M.shape[0], n)).astype(dtype)
    gs = packing.group_sizes_E
    config = SMALL if backend == "pallas_triton" else None
    fused = jax.jit(lambda x, d, gs, ids: tgmm(x, d, gs, backend=backend, config=config, row_ids=ids))(
        x_TD, dy, gs, rows.ids_M)
    packed = jax.jit(lambda x, d, gs: tgmm(x, d, gs, backend=backend, config=config))(
        gather_rows(x_TD, rows.ids_M, backend="xla"), dy, gs)
    np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(packed, np.float32))
    assert np.isfinite(np.asarray(fused, np.float32)).all() and (np.asarray(fused[3], np.float32) == 0).all()


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_gmm_row_ids_at_decode_gathers_first_on_the_group_major_kernel(backend):
    """A decode-sized GEMM runs the group-major family, which reads packed rows: the rows are
    gathered first there, with the same result."""
    x_TD, packing, rows = _routed(2, 3, 2, 8, 64, jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(3), (8, 32, 64)) / 8
    fused = gmm(x_TD, w, packing.group_sizes_E, row_ids=rows.ids_M, backend=backend)
    packed = gmm(gather_rows(x_TD, rows.ids_M), w, packing.group_sizes_E, backend=backend)
    np.testing.assert_array_equal(fused, packed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_linear_rows_gradients_equal_the_packed_path(backend):
    """Value, input gradient (each token's readers summed in fp32, fixed order) and weight
    gradient equal `grouped_linear` on `pack_rows`, bit for bit; masked tokens get zero gradient."""
    dtype = jnp.bfloat16 if backend == "mosaic_gpu" else jnp.float32
    k, n = (256, 256) if ON_GPU else (40, 24)
    x_TD, packing, rows = _routed(4, TOKENS, 2, 4, k, dtype, drop_expert=1)
    x_TD = jnp.nan_to_num(x_TD)
    w = (jax.random.normal(jax.random.PRNGKey(5), (4, n, k)) / 8).astype(dtype)
    gs = packing.group_sizes_E
    cfg = dict(fwd_config=SMALL, dgrad_config=SMALL) if backend == "pallas_triton" else {}

    def loss(fused):
        def f(x, w):
            y = (grouped_linear(x, w, gs, backend=backend, rows=rows, **cfg) if fused else
                 grouped_linear(pack_rows(x, packing, backend="xla"), w, gs, backend=backend, **cfg))
            return jnp.sum(jnp.sin(y.astype(jnp.float32))), y
        return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(x_TD, w)

    (_, y_f), (dx_f, dw_f) = loss(True)
    (_, y_p), (dx_p, dw_p) = loss(False)
    for got, want in ((y_f, y_p), (dx_f, dx_p), (dw_f, dw_p)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    masked = np.arange(x_TD.shape[0]) % 5 == 3
    assert (np.asarray(dx_f, np.float32)[masked] == 0).all()


def test_fused_path_writes_no_packed_rows_and_lowers_for_h200():
    """Lowered for an H200: the fused forward and backward run the three GEMM kernels alone, no
    row-gather kernel: no packed copy is written at any point."""
    t, k, n, e, top_k = 4096, 2048, 1536, 128, 8
    avals = (jax.ShapeDtypeStruct((t, k), jnp.bfloat16), jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16),
             jax.ShapeDtypeStruct((e,), jnp.int32),
             RowGather(jax.ShapeDtypeStruct((t * top_k,), jnp.int32), jax.ShapeDtypeStruct((t, top_k), jnp.int32)))
    fwd = lower_for_gpu(lambda x, w, gs, rows: grouped_linear(x, w, gs, backend="pallas_triton", rows=rows), *avals)
    assert re.findall(r'name = "(moe_jax_\w+)"', fwd) == ["moe_jax_gmm"]

    def grads(x, w, gs, rows):
        loss = lambda x, w: jnp.sum(grouped_linear(x, w, gs, backend="pallas_triton", rows=rows).astype(jnp.float32))
        return jax.value_and_grad(loss, (0, 1))(x, w)

    names = re.findall(r'name = "(moe_jax_\w+)"', lower_for_gpu(grads, *avals))
    assert sorted(names) == ["moe_jax_gmm", "moe_jax_gmm", "moe_jax_tgmm"], names


# The fused gate/up layout in the slow lane: the row gather it reads is the same.
@pytest.mark.parametrize("fused_gate_up", [pytest.param(True, id="fused-gate-up", marks=pytest.mark.slow),
                                           pytest.param(False, id="gate-and-up")])
def test_layer_row_gather_fused_equals_separate(fused_gate_up):
    """The layer's output and every gradient are the same bits with the gather fused into the
    gate/up GEMM or run first (`auto` is one of the two, `AUTO_FUSED_GATHER`), but for the input gradient with
    separate gate and up weights: fused, each GEMM's readers are summed on its own and the two
    token gradients added, a different (still fixed) order of the same fp32 additions."""
    d, f, e, k = 32, 24, 4, 2
    x = jax.random.normal(jax.random.PRNGKey(6), (2, 6, d), jnp.float32)

    def run(row_gather):
        gemm = GemmOptions(backend="pallas_triton", row_gather=row_gather, fused_gate_up=fused_gate_up)
        model = MoE(d, f, e, k, gemm=gemm, rngs=nnx.Rngs(7))

        @nnx.jit
        def step(model, x):
            def loss(model, x):
                y, _ = model(x)
                return jnp.sum(jnp.sin(y))
            return nnx.value_and_grad(loss, argnums=(0, 1))(model, x)

        value, (g_model, g_x) = step(model, x)
        return (value, *jax.tree.leaves(nnx.state(g_model, nnx.Param))), g_x

    (fused, dx_fused), (separate, dx_separate), (auto, dx_auto) = run("fused"), run("separate"), run("auto")
    for a, b, c in zip(fused, separate, auto):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(dx_auto, dx_fused if "pallas_triton" in AUTO_FUSED_GATHER else dx_separate)
    if fused_gate_up:
        np.testing.assert_array_equal(dx_fused, dx_separate)
    else:
        np.testing.assert_allclose(dx_fused, dx_separate, rtol=1e-5, atol=1e-6)


def test_bad_row_gather_input_names_the_argument():
    x = jnp.ones((6, 8), jnp.float32)
    w = jnp.ones((2, 4, 8), jnp.float32)
    gs = jnp.array([3, 2], jnp.int32)
    with pytest.raises(TypeError, match="row_ids must be an integer array"):
        gmm(x, w, gs, row_ids=jnp.zeros((5,), jnp.float32))
    with pytest.raises(ValueError, match="row_ids must be 1-D"):
        gmm(x, w, gs, row_ids=jnp.zeros((5, 1), jnp.int32))
    with pytest.raises(ValueError, match="group_sizes sum to 5 but lhs has only 4 rows"):
        gmm(x, w, gs, row_ids=jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="row_ids has 4 rows but dout has 5"):
        tgmm(x, jnp.ones((5, 4), jnp.float32), gs, row_ids=jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="rows must be a moe_jax.ops.RowGather"):
        grouped_linear(x, w, gs, rows=(jnp.zeros((5,), jnp.int32), jnp.zeros((6, 1), jnp.int32)))
    with pytest.raises(ValueError, match=r"rows.readers_TK must be \[T, K\] with T = x.shape\[0\] = 6"):
        grouped_linear(x, w, gs, rows=RowGather(jnp.zeros((5,), jnp.int32), jnp.zeros((5, 1), jnp.int32)))
    with pytest.raises(ValueError, match="GemmOptions.row_gather='packed'"):
        GemmOptions(row_gather="packed")
