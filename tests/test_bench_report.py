"""The markdown report of a benchmark JSON (the GPU run itself cannot execute on CPU)."""

import json
from pathlib import Path

from benchmarks.report import render


def _result():
    meta = dict(device="NVIDIA H200", date="2026-11-30T05:00:00+00:00", jax="0.11.2", torch="2.11.0",
                triton="3.6.0", python="3.12.3", command="python -m benchmarks.gmm run", copy_tbps=4.0)
    base = dict(shape="qwen3_gate_up", skew="balanced", max_count=256, flops=1e12)
    rows = [
        {**base, "impl": "ours", "seconds": 2e-3, "tflops": 500.0},
        {**base, "impl": "torch", "seconds": 1e-3, "tflops": 1000.0},
        {**base, "impl": "ours_fb", "seconds": 6e-3, "tflops": 500.0},
        {**base, "impl": "torch_fb", "seconds": 4.5e-3, "tflops": 666.0},
        {**base, "impl": "mgpu", "seconds": None, "tflops": None},
        dict(shape="decode_T8", skew="decode", tokens=8, active=40, weight_bytes=2e8, impl="ours",
             seconds=1e-4, tbps=2.0),
    ]
    summary = dict(fwd_geomean_ours_over_torch=0.5, target_fwd=0.8, fwdbwd_geomean_ours_over_torch=0.75,
                   target_fwdbwd=0.7, fwd_geomean_speedup_over_ragged_dot=None,
                   decode_fraction_of_copy_bw={"decode_T8": 0.5}, target_decode=0.7)
    return dict(meta=meta, summary=summary, rows=rows)


def test_render_ratios_and_missing_peers():
    md = render(_result())
    assert "# Grouped GEMM on NVIDIA H200 — 2026-11-30" in md
    # torch 1 ms vs ours 2 ms -> 0.50; a peer that did not run shows a dash.
    assert "| qwen3_gate_up | balanced | 256 | 500 | 1000 | – | – | – | – | 0.50 |" in md
    assert "| qwen3_gate_up | balanced | 500 | 666 | 0.75 |" in md
    assert "| 8 | 40 | 200.0 | 100.0 | – | – | – | 2.00 | 0.50 |" in md
    assert "decode_T8: 0.50" in md


def test_render_committed_result():
    """The kept H200 result (written before the decode summary key was renamed) still renders."""
    path = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-30-h200-gmm.json"
    md = render(json.loads(path.read_text()))
    assert "# Grouped GEMM on NVIDIA H200 — 2026-11-30" in md
    assert "- decode, fraction of copy bandwidth (target ≥ 0.7): " in md
