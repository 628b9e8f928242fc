"""`benchmarks.combine` at a small shape: the library's combine and the plain-indexing peer give the
same forward and gradients (checked before timing), and each gets a time."""

from benchmarks.combine import rows
from benchmarks.layer import LayerShape


def test_peers_agree_and_are_timed():
    rec = rows(LayerShape("tiny", 64, 32, 16, 8, 2))
    assert rec["equal"] and all(ms > 0 for ms in rec["ms"].values()) and rec["plain / combine"] > 0
