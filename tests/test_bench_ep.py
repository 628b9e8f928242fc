"""`benchmarks.ep` runs its CPU smoke mode end to end (P host devices, P gloo processes, padded
strategy) at P = 2 and 4: every row the GPU table has, but the ragged ones (with `--chunks 1,2`,
the chunked-exchange rows too), so the benchmark cannot rot unnoticed in CI, and the P = 4 run
is what a 4-GPU machine will run. (The correctness
of the same path is tests/test_ep_moe.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Subprocesses (the benchmark's gloo workers): the slow lane, run on one pin only.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ranks", [2, 4])
def test_cpu_smoke(tmp_path, ranks):
    out = tmp_path / "ep.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the benchmark sets its own host-device count per worker
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.ep", "--cpu-smoke", "--ranks", str(ranks), "--json", str(out), "--chunks", "1,2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["cpu_smoke"] is True and payload["ranks"] == ranks and payload["mode"] == "bench"
    variants = {(r["side"], r["strategy"]) for r in payload["records"]}
    # gloo stands in for NCCL on CPU; the ragged strategies need a GPU; the ppermute row is the
    # two-rank exchange.
    assert variants == {("nccl", "nccl"), ("ours", "padded"), ("ours", "padded cf=1.25"),
                        ("ours", "padded cf=1.25 no-a2a"), ("ours", "padded cf=1.25 xla-ops"),
                        ("ours", "padded cf=1.25 fp8-dispatch"),
                        ("torch-ref", "torch-ref"), ("xla", "all_to_all"),
                        ("xla", "all_to_all cf=1.25"), ("ours", "padded gemm chunks=1"),
                        ("ours", "padded gemm chunks=2")} | ({("xla", "ppermute cf=1.25")} if ranks == 2 else set())
    assert all(r["seconds"] > 0 for r in payload["records"])
    assert all(len(r["recv_rows_P"]) == ranks for r in payload["records"] if r["side"] == "nccl")
    # Every torch process timed itself: the slowest rank is the reported time.
    torch_rows = [r for r in payload["records"] if r["side"] in ("nccl", "torch-ref")]
    assert torch_rows and all(len(r["rank_seconds"]) == ranks and r["seconds"] == max(r["rank_seconds"])
                              for r in torch_rows)
    assert "received rows per rank (dropless), max / mean:" in proc.stdout
    # The capacity rows drop routes under zipf routing (the table reports them), dropless ones never.
    assert any(r["dropped"] > 0 for r in payload["records"] if r["strategy"] == "padded cf=1.25")
    assert all(r["dropped"] == 0 for r in payload["records"] if r["strategy"] in ("padded", "padded gemm chunks=2"))
