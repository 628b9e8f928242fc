"""The on-device kernel selector (`moe_jax.ops.gmm.pallas_triton.selector`): features, table, the gated chain.

The same bodies run compiled on a GPU and interpreted on CPU; the lowering test checks the
gated chain for an H200 from any host.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import CANDIDATES, SelectorTable, gmm, gmm_reference, grouped_linear, select, selector_table
from moe_jax.ops.gmm.pallas_triton.selector import histogram_features
from moe_jax.ops.gmm.pallas_triton.tables import TABLES
from moe_jax.ops.gmm.pallas_triton.tile import Gate
from moe_jax.testing import assert_close
from tests.helpers import ON_GPU, lower_for_gpu

NAMES = list(CANDIDATES)
# A row of packed rows M in (32, 64] with three candidates: concentrated histograms (E_eff < 2)
# run 64-row tiles, middling ones 16-row tiles, broad ones (E_eff >= 5.7) the group-major kernel.
TABLE = SelectorTable(shape=(24, 40, 8), choice=(("gm16x32",) * 4,) * 6 + (("rt64x128", "rt16x64", "rt16x64", "gm16x64"),))


def _inputs(seed, m, k, n, e, dtype=jnp.float32):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (m, k), dtype), jax.random.normal(kw, (e, n, k), dtype)


def _top_level_primitives(jaxpr) -> set[str]:
    """Primitive names of `jaxpr` and its nested XLA-level jaxprs (not inside Pallas kernels)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _top_level_primitives(inner)
    return names


def test_features_of_broad_and_concentrated_histograms():
    """U, active, max, effective experts U^2 / sum t^2 and each candidate's executed rows."""
    f = jax.jit(histogram_features, static_argnums=1)(jnp.asarray([8, 8, 8, 8, 0, 0, 0, 0], jnp.int32), 40)
    assert (int(f.useful_rows), int(f.active), int(f.max_rows)) == (32, 4, 8)
    assert float(f.effective) == 4.0
    heights = [c.tiles.block_m for c in CANDIDATES.values()]
    np.testing.assert_array_equal(f.executed_C, [4 * h for h in heights])  # every expert rounds up to one tile
    f = histogram_features(jnp.asarray([-3, 50, 9, 0], jnp.int32), 40)  # clamped as the kernels clamp
    assert int(f.useful_rows) == 40 and int(f.max_rows) == 40 and float(f.effective) == 1.0
    f = histogram_features(jnp.zeros((4,), jnp.int32), 40)
    assert int(f.useful_rows) == 0 and float(f.effective) == 0.0 and not np.any(f.executed_C)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes,pick", [
    ((40, 0, 0, 0, 0, 0, 0, 0), "rt64x128"),  # one hot expert
    ((20, 0, 19, 0, 0, 0, 0, 0), "rt16x64"),  # two; rows not a multiple of any tile, one row past the groups
    ((5, 5, 5, 5, 5, 5, 5, 5), "gm16x64"),  # balanced: the same U = 40 as the first
    ((0, 0, 0, 0, 0, 0, 0, 0), "rt64x128"),  # nothing routed: every row is a zero row
], ids=["hot", "two", "broad", "empty"])
def test_selector_equals_the_static_path(dtype, sizes, pick):
    """Under `jit` with traced sizes, the selector runs the candidate its table names for the
    histogram, bit for bit, and matches the fp32 reference; broad and concentrated histograms of
    equal U run different kernels where the table says so."""
    m, k, n = 40, 40, 24
    x, w = _inputs(3, m, k, n, len(sizes), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    chosen = jax.jit(lambda gs: select(gs, m, TABLE).candidate)(gs)
    assert NAMES[int(chosen)] == pick
    y = jax.jit(lambda x, w, gs: gmm(x, w, gs, config=TABLE, backend="pallas_triton"))(x, w, gs)
    y_static = jax.jit(lambda x, w, gs: gmm(x, w, gs, config=CANDIDATES[pick], backend="pallas_triton"))(x, w, gs)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_static, np.float32))
    assert_close(y, gmm_reference(x, w, gs), dtype, f"selector ({pick})")
    assert not np.any(np.asarray(y[sum(sizes):], np.float32))


def test_selector_has_no_host_round_trip_or_xla_conditional():
    """The traced program has no callback and no XLA conditional or loop: the choice is a device
    scalar read by gated kernels (an XLA conditional on GPU copies its predicate to the host)."""
    x, w = _inputs(4, 40, 40, 24, 8)
    jaxpr = jax.make_jaxpr(lambda x, w, gs: gmm(x, w, gs, config=TABLE, backend="pallas_triton"))(
        x, w, jnp.ones((8,), jnp.int32))
    prims = _top_level_primitives(jaxpr.jaxpr)
    assert "pallas_call" in prims
    assert not prims & {"cond", "switch", "while", "pure_callback", "io_callback", "debug_callback"}, prims


def test_selector_inside_scan_picks_per_layer():
    """Under `lax.scan` over layers with different histograms, each layer gets its own pick."""
    sizes = jnp.asarray([[40, 0, 0, 0, 0, 0, 0, 0], [5] * 8, [20, 0, 19, 0, 0, 0, 0, 0]], jnp.int32)
    picks = jax.jit(lambda s: jax.lax.scan(lambda c, gs: (c, select(gs, 40, TABLE).candidate), 0, s)[1])(sizes)
    assert [NAMES[int(i)] for i in picks] == ["rt64x128", "gm16x64", "rt16x64"]


def test_gradients_through_the_selected_path():
    """`grouped_linear` with the selector on forward and input gradient: gradients equal the
    static path's (the candidate the table picks for each GEMM's shape) and the reference's."""
    m, k, n = 40, 40, 24
    x, w = _inputs(5, m, k, n, 8)
    gs = jnp.asarray([20, 0, 19, 0, 0, 0, 0, 0], jnp.int32)
    dy = jax.random.normal(jax.random.PRNGKey(6), (m, n))

    def grads(fwd, dgrad):
        f = lambda x, w: jnp.sum(grouped_linear(x, w, gs, backend="pallas_triton", fwd_config=fwd,
                                                dgrad_config=dgrad) * dy)
        return jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)

    dx, dw = grads(TABLE, TABLE)
    dx_s, dw_s = grads(CANDIDATES["rt16x64"], CANDIDATES["rt16x64"])  # both GEMMs have M = 40, E_eff ~ 2
    np.testing.assert_array_equal(dx, dx_s)
    np.testing.assert_array_equal(dw, dw_s)
    ref = jax.grad(lambda x, w: jnp.sum(gmm_reference(x, w, gs) * dy), argnums=(0, 1))(x, w)
    assert_close(dx, ref[0], jnp.float32, "dx")
    assert_close(dw, ref[1], jnp.float32, "dw")


def test_gated_launch_leaves_the_output_alone_unless_chosen():
    """A gated launch whose index is not the choice writes nothing (the NaN buffer survives); the
    chosen one writes every element."""
    from moe_jax.ops.gmm.pallas_triton.group_major import gmm_group_major_pallas
    from moe_jax.ops.gmm.pallas_triton.row_tile import gmm_row_tile_pallas

    m, k, n = 30, 40, 24
    x, w = _inputs(7, m, k, n, 4)
    gs = jnp.asarray([9, 0, 17, 0], jnp.int32)
    nan = jnp.full((m, n), jnp.nan, jnp.float32)
    choice = jnp.asarray([1], jnp.int32)
    common = dict(transpose_rhs=True, out_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST, interpret=not ON_GPU)
    for launch, tiles in ((gmm_row_tile_pallas, CANDIDATES["rt16x64"].tiles),
                          (gmm_group_major_pallas, CANDIDATES["gm16x32"].tiles)):
        skipped = launch(x, w, gs, tiles=tiles, out_init=nan, gate=Gate(choice, 0), **common)
        assert np.isnan(np.asarray(skipped)).all()
        ran = launch(x, w, gs, tiles=tiles, out_init=nan, gate=Gate(choice, 1), **common)
        assert_close(ran, gmm_reference(x, w, gs), jnp.float32, launch.__name__)


def test_tuned_tables_and_validation():
    """The shipped tables are valid for their shapes; a shape picks the nearest tuned table; bad
    tables and the split-K family (it cannot join a gated chain) are refused by name."""
    assert TABLES and all(t.device == "NVIDIA H200" for t in TABLES)
    for t in TABLES:
        assert len(t.choice) == 16 and len(t.choice[0]) >= int(np.ceil(np.log2(t.shape[2]))) + 1
    assert selector_table(1536, 2048, 128, device="NVIDIA H200").shape == (1536, 2048, 128)
    assert selector_table(768, 2048, 128, device="some other GPU").shape == (1536, 2048, 128)  # nearest
    with pytest.raises(ValueError, match="split-K"):
        SelectorTable(shape=(8, 8, 2), choice=(("sk4_16x64",),))
    with pytest.raises(ValueError, match="not in CANDIDATES"):
        SelectorTable(shape=(8, 8, 2), choice=(("rt1x1",),))
    with pytest.raises(ValueError, match="rectangle"):
        SelectorTable(shape=(8, 8, 2), choice=(("gm16x32",), ("gm16x32", "gm16x64")))
    with pytest.raises(ValueError, match="shape"):
        SelectorTable(shape=(8, 0, 2), choice=(("gm16x32",),))
    with pytest.raises(ValueError, match="config='fastest': use None .*'auto'"):
        gmm(jnp.ones((4, 8)), jnp.ones((2, 4, 8)), jnp.asarray([2, 2], jnp.int32), config="fastest")
    assert TABLE.candidates_for(40) == ("gm16x64", "rt16x64", "rt64x128")
    assert TABLE.candidates_for(8) == ("gm16x32",)


def test_auto_matches_reference_on_the_tuned_table():
    """`config="auto"` resolves the shape's tuned table and computes the same product."""
    x, w = _inputs(8, 24, 32, 16, 4)
    gs = jnp.asarray([7, 0, 12, 3], jnp.int32)
    y = jax.jit(lambda x, w, gs: gmm(x, w, gs, config="auto", backend="pallas_triton"))(x, w, gs)
    assert_close(y, gmm_reference(x, w, gs), jnp.float32, "auto")


def test_gated_chain_lowers_for_h200():
    """The three-candidate chain at a Qwen3-30B-A3B-like width lowers through Pallas to Triton
    IR for an H200: one gated launch per candidate of the row, no XLA conditional."""
    text = lower_for_gpu(lambda x, w, gs: gmm(x, w, gs, config=TABLE, backend="pallas_triton"),
                         jax.ShapeDtypeStruct((40, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((8, 1536, 2048), jnp.bfloat16),
                         jax.ShapeDtypeStruct((8,), jnp.int32))
    assert re.findall(r'name = "(moe_jax_\w+)"', text) == ["moe_jax_gmm_group_major", "moe_jax_gmm", "moe_jax_gmm"]
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
