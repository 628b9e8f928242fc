"""`benchmarks.combine` at a small shape: the library's combine and its two autodiff peers give the
same forward and rows' gradient (checked before timing), weight gradients within rounding, and each
gets a time."""

from benchmarks.combine import OURS, PLAIN, UNIQUE, rows
from benchmarks.layer import LayerShape


def test_peers_agree_and_are_timed():
    rec = rows(LayerShape("tiny", 64, 32, 16, 8, 2))
    assert rec["equal"] and rec["dw_max_rel_diff"] < 1e-5
    assert set(rec["ms"]) == {OURS, UNIQUE, PLAIN} and all(ms > 0 for ms in rec["ms"].values())
    assert rec[f"{PLAIN} / combine"] > 0 and rec[f"{UNIQUE} / combine"] > 0
