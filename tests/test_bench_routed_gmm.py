"""The routing-shaped benchmark's host side: histograms, the table fit, its agreement with the
device-side buckets, and the padding CLI's selector line (CPU)."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import routed_gmm as R
from benchmarks import shapes as S
from moe_jax.ops import CANDIDATES, SelectorTable
from moe_jax.ops.gmm.pallas_triton.selector import histogram_features
from moe_jax.padding.cli import main as padding_main


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_synthetic_histograms_are_routing_shaped(tokens):
    """Every family sums to U = T*k with no expert above T (top-k picks distinct experts), and
    the family spans broad to concentrated at that U."""
    hists = R.synthetic_histograms(tokens, 128, 8, seed=0)
    for name, counts in hists:
        assert counts.sum() == tokens * 8 and counts.max() <= tokens, name
    effective = [R.histogram_stats(c)["effective"] for _, c in hists]
    if tokens >= 64:
        assert max(effective) > 4 * min(effective)


def test_rescaled_trace_keeps_shape_and_caps():
    counts = R.rescale_trace(np.array([5, 3, 0, 8]), 128, 8, 16, seed=0)
    assert counts.sum() == 128 and counts.max() <= 16
    counts = R.rescale_trace(np.arange(16), 8, 2, 16, seed=0)
    assert counts.sum() == 32 and counts.max() <= 16


@pytest.mark.parametrize("m,counts", [(8, [1] * 8 + [0] * 8), (40, [20, 0, 19, 1] + [0] * 12), (1, [1] + [0] * 15),
                                      (300, [100, 100, 50, 50] + [0] * 12)])
def test_host_cell_equals_the_device_buckets(m, counts):
    """The fit buckets histograms exactly as the selector does on device."""
    table = SelectorTable(shape=(8, 8, 16), choice=(("gm16x32",) * 5,) * 16)
    f = histogram_features(jnp.asarray(counts, jnp.int32), m)
    host = R.host_cell(m, R.histogram_stats(np.asarray(counts))["effective"], R.table_dims(16))
    assert host == (table.row(m), int(table.column(f)))


def _row(m, effective, times):
    return dict(m=m, useful_rows=m, effective=effective, times=times)


def test_fit_pays_for_a_second_candidate_only_where_it_gains_more_than_the_chain():
    """Two cells of one row prefer different kernels. A small gain keeps one candidate, because the
    chain's cost outweighs it; a large gain splits the row. Unmeasured rows copy the nearest."""
    shape = S.GemmShape("t", m=64, e=8, k=8, n=8, top_k=2)
    names = ["gm16x64", "rt64x128"]
    small = [_row(64, 1.0, {"gm16x64": 100e-6, "rt64x128": 99e-6}), _row(64, 8.0, {"gm16x64": 99e-6, "rt64x128": 100e-6})]
    choice = R.fit_table(small, shape, names)
    assert len({c for row in choice for c in row}) == 1
    large = [_row(64, 1.0, {"gm16x64": 300e-6, "rt64x128": 100e-6}), _row(64, 8.0, {"gm16x64": 100e-6, "rt64x128": 300e-6})]
    choice = R.fit_table(large, shape, names)
    assert choice[6][0] == "rt64x128" and choice[6][3] == "gm16x64"
    assert choice[0] == choice[6] == choice[15]  # the only measured row fills the others


def test_fit_writes_a_loadable_tables_module(tmp_path):
    """`fit` on a sweep JSON writes a module whose tables validate."""
    rows = []
    for tokens in (1, 64):
        for split in ("train", "test"):
            for name, counts in R.synthetic_histograms(tokens, 128, 8, 0):
                times = {n: 1e-5 * (1 + i) for i, n in enumerate(CANDIDATES)}
                times.update(torch=1e-5, selector=1e-5)
                rows.append(dict(shape="qwen3-30b-a3b gate+up", n=1536, k=2048, e=128, m=tokens * 8, tokens=tokens,
                                 hist=name, split=split, counts=counts.tolist(), times=times, static=0,
                                 selected="gm16x32", **R.histogram_stats(counts)))
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(dict(meta=dict(command="sweep", device="NVIDIA H200", date="d", jax="j"), rows=rows,
                                    tables={})))
    out = tmp_path / "tables.py"
    R.main(["fit", str(path), "--write", str(out)])
    namespace = {}
    exec(compile(out.read_text(), str(out), "exec"), namespace)
    (table,) = namespace["TABLES"]
    assert table.shape == (1536, 2048, 128) and table.candidates_for(8) == ("gm16x32",)


def test_padding_cli_says_what_the_selector_runs(capsys):
    assert padding_main(["100,32,0,0,0,0,0,0", "--tiles", "16", "--gemm", "1536,2048"]) == 0
    out = capsys.readouterr().out
    assert "selector (GemmOptions(kernel='auto')) for a GEMM of N=1536, K=2048, M=132: runs " in out
    assert "effective experts = 1.581" in out and "tuned at (N, K, E) = (1536, 2048, 128)" in out
    with pytest.raises(SystemExit):
        padding_main(["1,2", "--gemm", "3"])
    assert "--gemm takes N,K" in capsys.readouterr().err


def test_train_traces_read_the_example_metrics(tmp_path):
    """`benchmarks.traces` turns the example's per-step, per-layer counts into named histograms, and
    says what to do with metrics written before counts were recorded."""
    from benchmarks.traces import train_traces

    record = dict(step=10, layers=[dict(counts=[3, 0, 5, 8]), dict(counts=[4, 4, 4, 4])])
    (tmp_path / "metrics.json").write_text(json.dumps(dict(history=[record])))
    traces = train_traces(tmp_path)
    assert sorted(traces) == ["train/step10/layer0", "train/step10/layer1"]
    np.testing.assert_array_equal(traces["train/step10/layer0"], [3, 0, 5, 8])
    (tmp_path / "metrics.json").write_text(json.dumps(dict(history=[dict(step=1, layers=[dict(load=[1.0])])])))
    with pytest.raises(ValueError, match="rerun the example"):
        train_traces(tmp_path)


def test_trace_picks_take_the_nearest_decode_step_and_the_ends_of_training():
    """The committed traces, as the sweep samples them at one token count."""
    traces = dict(np.load(Path(__file__).parents[1] / "benchmarks" / "data" / "expert_counts.npz"))
    picks = R.trace_picks(traces, 100)
    assert picks == ["decode/T128/layer0", "decode/T128/layer1", "train/step1/layer0", "train/step1/layer1",
                     "train/step300/layer0", "train/step300/layer1"]
    assert all(traces[k].shape == (8,) for k in picks)


def test_merged_sweeps_cite_each_tables_own_sweep():
    """Tables fitted from several sweep files name the sweep that measured each shape."""
    results = Path(__file__).parents[1] / "benchmarks" / "results"
    parts = [str(results / f"{n}.json") for n in ("2026-12-01-h200-routed-gmm-qwen3", "2026-12-02-h200-routed-gmm-deepseek")]
    text = R.render_tables(R.load_results(parts))
    sources = {}
    for line in text.splitlines():
        if "source=" in line:
            sources[line.split("shape=")[1].split(")")[0] + ")"] = line.split("source='")[1].split("'")[0]
    assert sources["(1536, 2048, 128)"].endswith("2026-12-01T11:41:36+00:00")
    assert sources["(4096, 7168, 256)"].endswith("2026-12-02T05:48:41+00:00")
    assert "2026-12-01T11:41:36+00:00, 2026-12-02T05:48:41+00:00" in text


def test_score_of_a_table_that_always_runs_the_best_static_candidate_is_one():
    """`score` looks each test histogram up in the table: a table naming the shape's best single
    static candidate in every cell scores exactly 1 against it, and at most 1 against the oracle."""
    results = R.load_results([str(Path(__file__).parents[1] / "benchmarks" / "results" /
                                  "2026-12-02-h200-routed-gmm-deepseek.json")])
    shape = next(s for s, _ in R.sweep_shapes(False) if s.name == "deepseek-v3 gate+up")
    rows, cols = R.table_dims(shape.e)
    table = SelectorTable(shape=(shape.n, shape.k, shape.e), device="test", source="test",
                          choice=tuple(("rt128x256",) * cols for _ in range(rows)))
    line = next(ln for ln in R.score_tables(results, [table]).splitlines() if ln.startswith("| deepseek"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "rt128x256" and cells[3] == "1.000"
    assert float(cells[5]) <= 1.0
