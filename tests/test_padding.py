"""Tests for moe_jax.padding: the worked examples of docs/padding.md (DA-MoE's near-uniform and concentrated histograms), a property test against pure Python,
per-rank / capacity / communication figures, jit and vmap, validation, and the CLI."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_jax.padding import (
    CapacityPadding,
    CommPadding,
    PaddingStats,
    RankPadding,
    capacity_padding,
    communication_padding,
    main,
    per_rank_padding,
    tile_padding,
)

NEAR_UNIFORM = [17, 17, 17, 17, 16, 16, 16, 16]
CONCENTRATED = [100, 32, 0, 0, 0, 0, 0, 0]


def _py_tile(counts, q):
    """Pure-Python reference for tile_padding."""
    useful = sum(counts)
    executed = sum(q * math.ceil(t / q) for t in counts)
    sumsq = sum(t * t for t in counts)
    return dict(
        useful=useful,
        executed=executed,
        padded=executed - useful,
        fraction=(executed - useful) / executed if executed else 0.0,
        active=sum(1 for t in counts if t > 0),
        effective=useful * useful / sumsq if useful else 0.0,
        mean=useful / len(counts),
    )


# ------------------------------------------------------------------ worked examples (docs/padding.md)


@pytest.mark.parametrize(
    "q, executed, padded, fraction",
    [(8, 160, 28, 0.175), (16, 192, 60, 0.3125), (32, 256, 124, 0.484375)],
)
def test_near_uniform_worked_example(q, executed, padded, fraction):
    s = tile_padding(jnp.array(NEAR_UNIFORM, jnp.int32), q)
    assert isinstance(s, PaddingStats)
    assert s.tile == q
    assert int(s.useful) == 132
    assert int(s.executed) == executed
    assert int(s.padded) == padded
    assert float(s.fraction) == pytest.approx(fraction, rel=1e-6)
    assert int(s.active_experts) == 8
    assert float(s.effective_experts) == pytest.approx(132**2 / 2180, rel=1e-6)  # 7.9927
    assert 7.99 < float(s.effective_experts) < 8.0
    assert float(s.mean_rows_per_expert) == pytest.approx(16.5)


@pytest.mark.parametrize("q, executed, padded", [(8, 136, 4), (32, 160, 28)])
def test_concentrated_worked_example(q, executed, padded):
    s = tile_padding(CONCENTRATED, q)  # a plain list works too
    assert int(s.useful) == 132
    assert int(s.executed) == executed
    assert int(s.padded) == padded
    assert float(s.fraction) == pytest.approx(padded / executed, rel=1e-6)
    assert int(s.active_experts) == 2
    assert float(s.effective_experts) == pytest.approx(1.58, abs=5e-3)
    assert float(s.mean_rows_per_expert) == pytest.approx(16.5)


def test_worked_example_percentages():
    assert round(100 * float(tile_padding(CONCENTRATED, 8).fraction), 1) == 2.9
    assert round(100 * float(tile_padding(CONCENTRATED, 32).fraction), 1) == 17.5
    assert round(100 * float(tile_padding(NEAR_UNIFORM, 32).fraction), 1) == 48.4


def test_effective_experts_limits():
    for e in (1, 4, 64):
        s = tile_padding(np.full(e, 37), 16)
        assert float(s.effective_experts) == pytest.approx(e, rel=1e-6)
    hot = tile_padding(np.array([10**6] + [1] * 63), 16)
    assert 1.0 <= float(hot.effective_experts) < 1.001
    assert float(tile_padding([0, 0, 5, 0], 4).effective_experts) == pytest.approx(1.0)


def test_all_zero_counts_no_nan():
    s = tile_padding(jnp.zeros(8, jnp.int32), 32)
    assert int(s.executed) == int(s.useful) == int(s.padded) == int(s.active_experts) == 0
    for x in (s.fraction, s.effective_experts, s.mean_rows_per_expert):
        assert float(x) == 0.0


def test_dtypes():
    s = tile_padding(NEAR_UNIFORM, 8)
    for f in (s.useful, s.executed, s.padded, s.active_experts):
        assert f.dtype == jnp.int32 and f.shape == ()
    for f in (s.fraction, s.effective_experts, s.mean_rows_per_expert):
        assert f.dtype == jnp.float32 and f.shape == ()
    assert type(s.tile) is int


# ------------------------------------------------------------------ property test


_count = st.one_of(st.just(0), st.integers(1, 5), st.integers(0, 400))


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    counts=st.lists(_count, min_size=1, max_size=16),
    q=st.sampled_from([1, 2, 3, 7, 8, 16, 32, 64, 128]),
)
def test_tile_padding_matches_python(counts, q):
    ref = _py_tile(counts, q)
    s = tile_padding(np.asarray(counts, np.int64), q)
    assert int(s.useful) == ref["useful"]
    assert int(s.executed) == ref["executed"]
    assert int(s.padded) == ref["padded"]
    assert int(s.active_experts) == ref["active"]
    assert float(s.fraction) == pytest.approx(ref["fraction"], rel=1e-5, abs=1e-7)
    assert float(s.effective_experts) == pytest.approx(ref["effective"], rel=1e-5, abs=1e-7)
    assert float(s.mean_rows_per_expert) == pytest.approx(ref["mean"], rel=1e-6)
    assert not any(math.isnan(float(x)) for x in (s.fraction, s.effective_experts))
    # P is a multiple-of-q cover of each expert: U <= P < U + active * q
    assert ref["useful"] <= int(s.executed) < ref["useful"] + ref["active"] * q + (ref["active"] == 0)


# ------------------------------------------------------------------ per rank


def test_per_rank_hot_expert_sets_max():
    counts = [100, 0, 16, 16, 17, 3, 5, 0]
    r = per_rank_padding(counts, 8, num_ranks=4)  # contiguous: {0,1} {2,3} {4,5} {6,7}
    assert isinstance(r, RankPadding) and r.tile == 8
    np.testing.assert_array_equal(np.asarray(r.executed_R), [104, 32, 32, 8])
    np.testing.assert_array_equal(np.asarray(r.useful_R), [100, 32, 20, 5])
    np.testing.assert_array_equal(np.asarray(r.padded_R), [4, 0, 12, 3])
    np.testing.assert_allclose(np.asarray(r.fraction_R), [4 / 104, 0, 12 / 32, 3 / 8], rtol=1e-6)
    assert int(r.executed_max) == int(r.executed_R[0]) == 104
    assert int(r.slowest_rank) == 0
    assert int(r.executed_sum) == int(tile_padding(counts, 8).executed) == 176
    assert int(r.useful_sum) == 157 and int(r.useful_max) == 100
    assert float(r.imbalance) == pytest.approx(104 / (176 / 4), rel=1e-6)


def test_per_rank_custom_placement():
    counts = [100, 32, 16, 16, 0, 0, 0, 3]
    ranks = [2, 0, 1, 1, 0, 1, 2, 0]
    q = 16
    r = per_rank_padding(jnp.array(counts), q, expert_rank_E=jnp.array(ranks))
    assert r.executed_R.shape == (3,)  # num_ranks inferred as max + 1
    want = [sum(q * math.ceil(t / q) for t, k in zip(counts, ranks) if k == rank) for rank in range(3)]
    np.testing.assert_array_equal(np.asarray(r.executed_R), want)  # [48, 32, 112]
    assert int(r.executed_max) == 112 and int(r.slowest_rank) == 2
    assert int(r.executed_sum) == int(tile_padding(counts, q).executed)
    # an extra rank that owns nothing reports zeros and lowers the mean
    r4 = per_rank_padding(counts, q, expert_rank_E=ranks, num_ranks=4)
    np.testing.assert_array_equal(np.asarray(r4.executed_R), want + [0])
    assert float(r4.fraction_R[3]) == 0.0
    assert float(r4.imbalance) == pytest.approx(112 / (192 / 4), rel=1e-6)


def test_per_rank_all_zero():
    r = per_rank_padding(jnp.zeros(8, jnp.int32), 8, num_ranks=2)
    assert int(r.executed_max) == int(r.executed_sum) == 0
    assert float(r.imbalance) == 1.0
    assert not np.isnan(np.asarray(r.fraction_R)).any()


def test_per_rank_errors():
    with pytest.raises(ValueError, match="num_ranks"):
        per_rank_padding(NEAR_UNIFORM, 8)
    with pytest.raises(ValueError, match="num_ranks"):
        per_rank_padding(NEAR_UNIFORM, 8, num_ranks=3)
    with pytest.raises(ValueError, match="expert_rank_E"):
        per_rank_padding(NEAR_UNIFORM, 8, expert_rank_E=[0, 1])
    with pytest.raises(ValueError, match="expert_rank_E"):
        per_rank_padding(NEAR_UNIFORM, 8, expert_rank_E=[0] * 7 + [5], num_ranks=4)
    with pytest.raises(ValueError, match="expert_rank_E"):
        per_rank_padding(NEAR_UNIFORM, 8, expert_rank_E=[0] * 7 + [-1])
    with pytest.raises(ValueError, match="num_ranks"):
        jax.jit(lambda c, k: per_rank_padding(c, 8, expert_rank_E=k))(jnp.ones(4, jnp.int32), jnp.zeros(4, jnp.int32))


# ------------------------------------------------------------------ capacity / communication


def test_capacity_padding_counts_drops_exactly():
    c = capacity_padding(CONCENTRATED, 24)
    assert isinstance(c, CapacityPadding) and c.capacity == 24
    np.testing.assert_array_equal(np.asarray(c.kept_E), [24, 24, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(c.dropped_E), [76, 8, 0, 0, 0, 0, 0, 0])
    assert int(c.kept) == 48
    assert int(c.dropped) == 84
    assert int(c.buffer_rows) == 8 * 24
    assert int(c.padded) == 192 - 48
    assert float(c.fraction) == pytest.approx(144 / 192)
    assert float(c.drop_fraction) == pytest.approx(84 / 132)


def test_capacity_padding_no_drops():
    c = capacity_padding(NEAR_UNIFORM, 17)
    assert int(c.dropped) == 0 and int(c.kept) == 132
    assert int(c.padded) == 8 * 17 - 132
    z = capacity_padding(jnp.zeros(4, jnp.int32), 3)
    assert int(z.padded) == 12 and float(z.fraction) == 1.0 and float(z.drop_fraction) == 0.0


def test_communication_padding():
    m = communication_padding([5, 40, 0, 12], 16)
    assert isinstance(m, CommPadding) and m.buffer_rows_per_peer == 16
    assert int(m.payload) == 5 + 16 + 0 + 12
    assert int(m.overflow) == 24
    assert int(m.buffer_rows) == 64
    assert int(m.padded) == 64 - 33
    assert float(m.fraction) == pytest.approx(31 / 64)


def test_three_paddings_stay_separate():
    # The same histogram gives three different figures; none of them is folded into another.
    tail = tile_padding(NEAR_UNIFORM, 8)
    cap = capacity_padding(NEAR_UNIFORM, 32)
    comm = communication_padding([66, 66], 80)
    assert (int(tail.padded), int(cap.padded), int(comm.padded)) == (28, 124, 28)
    assert float(tail.fraction) == pytest.approx(28 / 160)
    assert float(cap.fraction) == pytest.approx(124 / 256)
    assert float(comm.fraction) == pytest.approx(28 / 160)


# ------------------------------------------------------------------ jit / vmap


def test_under_jit_with_traced_counts():
    @jax.jit
    def f(counts):
        return (
            tile_padding(counts, 16),
            per_rank_padding(counts, 16, num_ranks=4),
            capacity_padding(counts, 20),
            communication_padding(counts[:4], 40),
        )

    s, r, c, m = f(jnp.array(NEAR_UNIFORM, jnp.int32))
    assert s.tile == 16 and r.tile == 16 and c.capacity == 20 and m.buffer_rows_per_peer == 40  # static survive jit
    assert int(s.executed) == 192 and int(s.padded) == 60
    assert float(s.fraction) == pytest.approx(0.3125)
    assert float(s.effective_experts) == pytest.approx(132**2 / 2180, rel=1e-6)
    np.testing.assert_array_equal(np.asarray(r.executed_R), [64, 64, 32, 32])
    assert int(c.dropped) == 0 and int(c.padded) == 160 - 132
    assert int(m.payload) == 68 and int(m.padded) == 92


def test_jit_static_tile_and_traced_placement():
    f = jax.jit(tile_padding, static_argnums=1)
    assert int(f(jnp.array(CONCENTRATED), 32).executed) == 160
    g = jax.jit(lambda c, k: per_rank_padding(c, 8, expert_rank_E=k, num_ranks=2))
    r = g(jnp.array(CONCENTRATED), jnp.array([0, 1, 0, 0, 1, 1, 1, 1]))
    np.testing.assert_array_equal(np.asarray(r.executed_R), [104, 32])


def test_vmap_over_layers():
    counts_LE = jnp.array([NEAR_UNIFORM, CONCENTRATED], jnp.int32)
    s = jax.vmap(lambda c: tile_padding(c, 32))(counts_LE)
    assert s.tile == 32
    np.testing.assert_array_equal(np.asarray(s.executed), [256, 160])
    np.testing.assert_array_equal(np.asarray(s.useful), [132, 132])


def test_traced_negative_counts_count_as_zero():
    s = jax.jit(lambda c: tile_padding(c, 8))(jnp.array([-5, 9], jnp.int32))
    assert int(s.useful) == 9 and int(s.executed) == 16


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("fn", [tile_padding, capacity_padding])
def test_negative_counts_rejected(fn):
    with pytest.raises(ValueError, match="counts"):
        fn([3, -1, 2], 8)
    with pytest.raises(ValueError, match="counts"):
        fn(jnp.array([3, -1, 2]), 8)


def test_negative_send_counts_rejected():
    with pytest.raises(ValueError, match="send_counts"):
        communication_padding([3, -1], 8)


@pytest.mark.parametrize(
    "counts, exc",
    [
        ([[1, 2], [3, 4]], ValueError),  # 2-D
        (5, ValueError),  # 0-D
        ([], ValueError),  # no experts
        ([1.0, 2.0], TypeError),  # float
        (np.array([True, False]), TypeError),  # bool
        (["a", "b"], TypeError),
    ],
)
def test_bad_counts(counts, exc):
    with pytest.raises(exc, match="counts"):
        tile_padding(counts, 8)


@pytest.mark.parametrize(
    "tile, exc",
    [
        (0, ValueError),
        (-8, ValueError),
        (8.0, TypeError),
        (True, TypeError),
        (jnp.int32(8), TypeError),
        ("8", TypeError),
    ],
)
def test_bad_tile(tile, exc):
    with pytest.raises(exc, match="tile"):
        tile_padding(NEAR_UNIFORM, tile)


def test_numpy_int_tile_accepted():
    assert tile_padding(NEAR_UNIFORM, np.int64(16)).tile == 16


def test_bad_capacity_and_buffer():
    with pytest.raises(ValueError, match="capacity"):
        capacity_padding(NEAR_UNIFORM, 0)
    with pytest.raises(TypeError, match="capacity"):
        capacity_padding(NEAR_UNIFORM, 2.5)
    with pytest.raises(ValueError, match="buffer_rows_per_peer"):
        communication_padding([1, 2], 0)
    with pytest.raises(ValueError, match="capacity"):
        capacity_padding([1] * 4, 2**30)  # E * C overflows int32


def test_int32_overflow_rejected():
    with pytest.raises(ValueError, match="int32"):
        tile_padding([2**31 - 10, 2**31 - 10], 8)
    with pytest.raises(ValueError, match="int32"):
        tile_padding(np.array([2**40], np.int64), 8)


# ------------------------------------------------------------------ CLI


def _table_rows(out):
    """Map q -> list of cells for the table rows of the CLI output."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def test_cli_table(capsys):
    assert main(["17,17,17,17,16,16,16,16", "--tiles", "8,16,32"]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert sorted(rows) == [8, 16, 32]
    #          q     U      P      P-U    %        active eff      rows/expert
    assert rows[8] == ["8", "132", "160", "28", "17.50", "8", "7.993", "16.500"]
    assert rows[16] == ["16", "132", "192", "60", "31.25", "8", "7.993", "16.500"]
    assert rows[32] == ["32", "132", "256", "124", "48.44", "8", "7.993", "16.500"]
    assert "capacity" not in out  # no capacity figure unless asked


def test_cli_ranks_and_capacity(capsys):
    main(["100,32,0,0,0,0,0,0", "--tiles", "8,32", "--ranks", "4", "--capacity", "24"])
    out = capsys.readouterr().out
    rows = _table_rows(out)
    # rank 0 owns experts {0, 1}: executed 104 + 32 = 136 at q=8, 128 + 32 = 160 at q=32
    assert rows[8][:5] == ["8", "132", "136", "4", "2.94"]
    assert rows[8][5:7] == ["2", "1.581"]
    assert rows[8][8:] == ["136", "136", "4.000", "0"]
    assert rows[32][2] == "160" and rows[32][8:] == ["160", "160", "4.000", "0"]
    cap_lines = [line for line in out.splitlines() if line.startswith("capacity padding")]
    assert len(cap_lines) == 1
    assert "kept 48, dropped 84, padded 144" in cap_lines[0]
    assert "75.00%" in cap_lines[0]


def test_cli_empty_ranks_counted_when_asked_for(capsys):
    main(["100,32", "--tiles", "16", "--expert-ranks", "0,5", "--ranks", "6"])
    out = capsys.readouterr().out
    assert "ranks R = 6 (given placement); useful rows per rank: 100,0,0,0,0,32" in out


def test_cli_custom_placement_and_space_separated(capsys):
    main(["100", "32", "16,16", "--tiles", "16", "--expert-ranks", "0,1,1,0"])
    rows = _table_rows(capsys.readouterr().out)
    # rank 0: 112 + 16 = 128; rank 1: 32 + 16 = 48
    assert rows[16][2] == "176"
    assert rows[16][8:10] == ["128", "176"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["17,x"], "'x' is not an integer"),
        (["17,,3"], "is not an integer"),
        (["17,-3"], "below 0"),
        (["17,17", "--tiles", "8,0"], "tile list"),
        (["17,17", "--tiles", "8,a"], "tile list"),
        (["17,17,17", "--ranks", "2"], "--ranks 2 must divide"),
        (["17,17", "--expert-ranks", "0"], "--expert-ranks"),
        # Read as 6 ranks, four of them empty, it was accepted; the rank count must be asked for.
        (["17,17", "--expert-ranks", "0,5"], "rank(s) 1,2,3,4 own no expert; pass --ranks 6"),
        (["17,17", "--capacity", "0"], "--capacity"),
        (["99999999999999999999999"], "does not fit in int32"),  # was an OverflowError traceback
        ([], "COUNTS"),
    ],
)
def test_cli_bad_input(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and needle in err


def test_cli_as_a_module_prints_no_warning():
    """`python -m moe_jax.padding` runs the package's __main__: no runpy RuntimeWarning about a
    module imported before it was run (the planner was a module the package imported)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "moe_jax.padding", "17,16"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "q" in proc.stdout


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for word in ("--tiles", "--ranks", "--capacity", "effective experts", "q*ceil(t/q)"):
        assert word in out
