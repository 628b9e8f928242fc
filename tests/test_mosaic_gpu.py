"""The `mosaic_gpu` backend's grouped GEMMs against the fp32 references: compiled on a GPU, and off
GPU in Pallas's GPU interpret mode (shared memory, warpgroups, barriers and TMA simulated on the
CPU; slow, so the CPU cases are few and small)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import gmm, gmm_reference, grouped_linear, plan, resolved_problem
from moe_jax.ops.gmm.mosaic_gpu.config import ROW_ALIGN, SHORT_K, MosaicConfig, mosaic_config, shape_support
from moe_jax.testing import assert_close
from tests.helpers import ON_GPU, lower_for_gpu

SMALL = MosaicConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
# The forward kernel's options, alone and together.
OPTIONS = {"plain": {}, "across-items": dict(pipeline_across_items=True), "half-buffer": dict(out_buffer_rows=64),
           "both": dict(pipeline_across_items=True, out_buffer_rows=64)}
# Off GPU the interpreter makes each case slow: one (plain options, the ragged case) runs on every
# pin, the rest in the slow lane.
INTERPRETED_SLOW = [] if ON_GPU else [pytest.mark.slow]


def _inputs(seed, m, k, n, e, transpose_rhs=True):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (e, n, k) if transpose_rhs else (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("options", [pytest.param(v, id=n, marks=INTERPRETED_SLOW if n != "plain" else [])
                                     for n, v in OPTIONS.items()])
@pytest.mark.parametrize("transpose_rhs,sizes,m,k,tile_m", [
    # ragged groups, an empty one, rows past the sum (NaN in lhs); one full tile, at row 0
    pytest.param(True, (70, 0, 33, 80), 200, 128, 64, id="ragged-nt"),
    # one hot group over all rows, the input-gradient layout; two full tiles, then a partial one
    pytest.param(False, (0, 136, 0), 136, 128, 64, id="one-hot-nn", marks=INTERPRETED_SLOW),
    # no rows in any group: all zeros, from one full zero-fill tile
    pytest.param(True, (0, 0), 64, 128, 64, id="all-empty", marks=INTERPRETED_SLOW),
    # a group of two full tiles of two sub-tiles each, more K steps than stages
    pytest.param(True, (256, 0, 40), 320, 256, 128, id="full-tiles", marks=INTERPRETED_SLOW),
    # ragged groups in 128-row tiles: tiles' rows split unevenly between 64-row halves
    pytest.param(True, (70, 0, 33, 97), 200, 128, 128, id="ragged-128", marks=INTERPRETED_SLOW),
])
def test_mosaic_gmm_matches_reference(transpose_rhs, sizes, m, k, tile_m, options):
    n = 128 if transpose_rhs else 256
    config = MosaicConfig(tile_m, SMALL.tile_n, SMALL.tile_k, SMALL.max_concurrent_steps, **options)
    x, w = _inputs(0, m, k, n, len(sizes), transpose_rhs)
    total = sum(sizes)
    x = x.at[total:].set(jnp.nan)  # never read into a stored row, and the rows there come out zero
    gs = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(lambda x, w, gs: gmm(x, w, gs, transpose_rhs=transpose_rhs, backend="mosaic_gpu", config=config,
                                       preferred_element_type=jnp.float32))(x, w, gs)
    assert np.isfinite(np.asarray(out)).all()
    assert (np.asarray(out[total:]) == 0).all()
    assert_close(out[:total], gmm_reference(x[:total], w, gs, transpose_rhs=transpose_rhs), jnp.float32, "mosaic gmm")


@pytest.mark.skipif(not ON_GPU, reason="a larger shape, compiled: the interpreted cases above cover the CPU")
def test_mosaic_gmm_default_tiles_and_gradients_on_gpu():
    m, k, n, e = 4096, 1024, 768 * 2, 16
    x, w = _inputs(1, m, k, n, e)
    gs = jnp.asarray(np.random.default_rng(0).multinomial(m - 100, np.ones(e) / e), jnp.int32)
    out = gmm(x, w, gs, backend="mosaic_gpu")
    assert_close(out, gmm_reference(x, w, gs), jnp.bfloat16, "forward")
    # One pipeline across items, forward and input-gradient layouts; rows past the groups hold NaN.
    x_nan = jnp.where(jnp.arange(m)[:, None] < gs.sum(), x, jnp.nan)
    g = jax.random.normal(jax.random.PRNGKey(3), (m, n), jnp.bfloat16)
    configs = {"across items": MosaicConfig(128, 128, 64, 2, pipeline_across_items=True),
               "across items, 4 stages, 64-row buffers": MosaicConfig(128, 128, 64, 4, pipeline_across_items=True,
                                                                      out_buffer_rows=64)}
    for name, config in configs.items():
        out = gmm(x_nan, w, gs, backend="mosaic_gpu", config=config)
        assert_close(out, gmm_reference(x, w, gs), jnp.bfloat16, f"forward, {name}")
        dx = gmm(g, w, gs, transpose_rhs=False, backend="mosaic_gpu", config=config)
        assert_close(dx, gmm_reference(g, w, gs, transpose_rhs=False), jnp.bfloat16, f"input gradient, {name}")
    # The weight gradient has no Mosaic kernel: `auto`'s choice runs it.
    dy = jax.random.normal(jax.random.PRNGKey(2), (m, n), jnp.bfloat16)
    _, vjp = jax.vjp(lambda x, w: grouped_linear(x, w, gs, backend="mosaic_gpu"), x, w)
    _, vjp_ref = jax.vjp(lambda x, w: grouped_linear(x, w, gs, backend="pallas_triton"), x, w)
    for got, want, name in zip(vjp(dy), vjp_ref(dy), ("dx", "dw")):
        assert_close(got, want, jnp.bfloat16, name)


H200_CONFIGS = {
    "rule": None,  # no config: `mosaic_config`'s, at this shape's 32 K steps `SHORT_K`
    "default": MosaicConfig(),
    "across-items-2": MosaicConfig(128, 128, 64, 2, pipeline_across_items=True),
    "across-items-128x64-4": MosaicConfig(128, 64, 64, 4, pipeline_across_items=True),
    # 4 stages of 128 x 256 x 64 fit beside 64-row output buffers, and divide every prefill K here
    "across-items-4-half-buffer": MosaicConfig(128, 128, 64, 4, pipeline_across_items=True, out_buffer_rows=64),
}


@pytest.mark.parametrize("config", H200_CONFIGS.values(), ids=H200_CONFIGS.keys())
@pytest.mark.parametrize("transpose_rhs", [True, False], ids=["nt", "nn"])
def test_mosaic_gmm_lowers_for_h200(transpose_rhs, config):
    """The default tiles and the tuning options at a Qwen3-30B-A3B-like shape go through Mosaic
    GPU's lowering, layout inference and shared-memory budget for an H200, from this host."""
    m, k, n, e = 4096, 2048, 1536, 128
    assert shape_support(m, n, k, jnp.bfloat16, config or SHORT_K) is None
    rhs = (e, n, k) if transpose_rhs else (e, k, n)
    text = lower_for_gpu(lambda x, w, gs: gmm(x, w, gs, transpose_rhs=transpose_rhs, backend="mosaic_gpu",
                                              config=config),
                         jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct(rhs, jnp.bfloat16),
                         jax.ShapeDtypeStruct((e,), jnp.int32))
    assert "mosaic_gpu" in text


def test_mosaic_config_rule():
    """Without a config the kernel runs `mosaic_config`'s choice: one pipeline across items with 4
    stages where K has at most 32 steps of 64 that the option applies to and the tiles fit, else
    the 3-stage default (the lowering test above runs it through `gmm`)."""
    for k in (128, 256, 768, 1536, 2048):  # 2 steps: the pipeline shrinks to 2 stages, which divide them
        assert mosaic_config(k, jnp.bfloat16) == SHORT_K
    for k in (640, 2048 + 256, 4096, 7168, 14336):  # 10 steps (4 does not divide), 36, 64, 112, 224
        assert mosaic_config(k, jnp.bfloat16) == MosaicConfig()
    assert mosaic_config(2048, jnp.bfloat16, jnp.float32) == MosaicConfig()  # fp32 buffers do not fit 4 stages


@pytest.mark.parametrize("fields,message", [
    (dict(tile_m=48), r"MosaicConfig.tile_m=48: must be a power of two >= 64"),
    (dict(max_concurrent_steps=9), r"max_concurrent_steps=9: must be in \[1, 8\]"),
    (dict(out_buffer_rows=32), r"MosaicConfig.out_buffer_rows=32: must be None .* or a power of two in \[64, tile_m"),
    (dict(tile_m=64, out_buffer_rows=128), r"MosaicConfig.out_buffer_rows=128: .* in \[64, tile_m=64\]"),
], ids=["tile-48", "steps-9", "buffer-32", "buffer-over-tile"])
def test_mosaic_config_rejects_bad_options(fields, message):
    with pytest.raises(ValueError, match=message):
        MosaicConfig(**fields)


def test_aligned_tiles_cover_every_row_once():
    from moe_jax.ops.gmm.mosaic_gpu.kernel import aligned_tiles, group_tiles

    rng = np.random.default_rng(3)
    for m, tile_m in ((200, 64), (1024, 128), (64, 64)):
        for _ in range(20):
            e = int(rng.integers(1, 9))
            sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(e) / e)
            group, lo, hi, read = np.asarray(aligned_tiles(jnp.asarray(sizes, jnp.int32), num_rows=m, tile_m=tile_m))
            covered = np.zeros(m, int)
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            for g, a, b, r in zip(group, lo, hi, read):
                if a == b:
                    continue
                assert r % ROW_ALIGN == 0 and 0 <= r <= m - tile_m and r <= a < b <= r + tile_m
                assert (offsets[g] <= a and b <= offsets[g + 1]) if g < e else a >= offsets[-1]
                covered[a:b] += 1
            assert (covered == 1).all()
            # The cooperative kernel finds a CTA's real-group items by counting: they come first,
            # then the zero-fill tiles, then the unused ones.
            real, fill = group < e, (group == e) & (lo < hi)
            n_real, n_fill = int(real.sum()), int(fill.sum())
            assert real[:n_real].all() and fill[n_real:n_real + n_fill].all()
            assert (lo[n_real + n_fill:] == hi[n_real + n_fill:]).all()
            tiles_G = np.asarray(group_tiles(jnp.asarray(sizes, jnp.int32), num_rows=m, tile_m=tile_m))
            np.testing.assert_array_equal(tiles_G[:-1], np.bincount(group[real], minlength=e))
            assert tiles_G[-1] == n_fill


def test_layer_telemetry_counts_the_mosaic_tiles():
    """On the mosaic_gpu backend the layer's gate/up telemetry is the rows of the kernel's own
    aligned tiles (`group_tiles`), not a Pallas candidate's: no `CANDIDATES` member is named."""
    from moe_jax.layers.routed import ExpertStage

    stage = ExpertStage(num_experts=4, d_in=256, d_ff=256, fused_gate_up=False, backend="mosaic_gpu", precision=None,
                        kernel="auto")
    sizes = np.array([0, 130, 3, 250])  # groups start at rows 0, 130 (aligned down to 128) and 133
    plans = stage.plans(512, jnp.bfloat16)
    assert plans.gate_up.fwd.backend == "mosaic_gpu" and plans.gate_up.wgrad.backend != "mosaic_gpu"
    gemm = stage.telemetry(plans, jnp.asarray(sizes, jnp.int32))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    bases = starts // ROW_ALIGN * ROW_ALIGN
    tiles = sum(-(-(s + n - b) // 128) for s, n, b in zip(starts, sizes, bases) if n)
    assert tiles == 1 + 1 + 2 + 1  # 130 rows from 0: 2 tiles; 3 rows; 250 rows from 128: 2 tiles (plus one)
    assert int(gemm.executed_rows) == int(gemm.executed_rows_max) == 128 * tiles
    assert int(gemm.useful_rows) == sizes.sum() and not np.any(gemm.kernel_counts_C)


def test_layer_with_a_backend_table_lowers_for_h200():
    """`MoE(gemm=GemmOptions(backend=BackendTable))`: lowered for an H200, forward and every
    gradient run the table's choice per kernel: the input gradients on Mosaic GPU, the forward on
    Pallas Triton and the weight gradients as `auto` runs them (`triton` where jax_triton imports,
    else Pallas Triton)."""
    import re

    from flax import nnx

    from moe_jax.layers import GemmOptions, MoE
    from moe_jax.ops import H200_BACKENDS
    from moe_jax.ops.gmm.triton import have_jax_triton

    def lowered(backend):
        layer = MoE(256, 256, 4, 2, gemm=GemmOptions(backend=backend), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                    rngs=nnx.Rngs(0))
        graph, state = nnx.split(layer)

        def grads(state, x):
            def loss(state, x):
                y, _ = nnx.merge(graph, state)(x)
                return jnp.sum(y.astype(jnp.float32) ** 2)
            return jax.grad(loss, argnums=(0, 1))(state, x)

        avals = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state),
                 jax.ShapeDtypeStruct((256, 256), jnp.bfloat16))
        text = lower_for_gpu(grads, *avals)
        names = re.findall(r'name = "(moe_jax_\w+)"', text)
        return text.count("custom_call @mosaic_gpu"), {n for n in names if n.startswith("moe_jax_gmm")}, names.count("moe_jax_tgmm")

    table = H200_BACKENDS.replace({("gmm_nn", "prefill"): ("mosaic_gpu", "triton", "pallas_triton")})
    mosaic_table, pallas_fwd_table, wgrads_table = lowered(table)
    mosaic_auto, pallas_fwd_auto, wgrads_auto = lowered("auto")
    assert mosaic_auto == 0 and mosaic_table == 3  # the input gradients of gate, up and down
    assert pallas_fwd_table and pallas_fwd_table == pallas_fwd_auto  # the forwards: the Pallas selector's kernels
    assert wgrads_table == wgrads_auto == (0 if have_jax_triton() else 3)  # `triton` runs them where it imports


def test_mosaic_shape_support_and_clear_errors():
    def planned(m, n, k, dtype, config=None):
        return plan(resolved_problem("gmm_nt", m, n, k, 16, dtype), "mosaic_gpu", config)

    assert planned(4096, 1536, 2048, jnp.bfloat16).backend == "mosaic_gpu"
    with pytest.raises(ValueError, match="mosaic_gpu multiplies bf16/fp16 only"):
        planned(4096, 1536, 2048, jnp.float32)
    with pytest.raises(ValueError, match=r"mosaic_gpu needs N % 256 == 0 and K % 64 == 0; got N=1000"):
        planned(4096, 1000, 2048, jnp.bfloat16)
    with pytest.raises(ValueError, match="mosaic_gpu needs N % 256 == 0"):
        gmm(jnp.ones((128, 64), jnp.bfloat16), jnp.ones((2, 100, 64), jnp.bfloat16), jnp.array([64, 64]),
            backend="mosaic_gpu")
    # Four stages of 128 x (2 x 128) x 64 leave too little for the two warpgroups' 128-row output tiles:
    # an explicit config that does not fit raises before anything is launched, naming the bytes.
    with pytest.raises(ValueError, match=r"needs 263232 B of shared memory .* over the 232448 B per block"):
        planned(4096, 1536, 2048, jnp.bfloat16, MosaicConfig(128, 128, 64, 4))
    # The weight gradient has no Mosaic kernel: `auto`'s choice runs it, and the plan says so.
    wgrad = plan(resolved_problem("tgmm", 4096, 1536, 2048, 16, jnp.bfloat16), "mosaic_gpu")
    assert wgrad.backend != "mosaic_gpu" and "mosaic_gpu has no tgmm kernel" in wgrad.why[0]
