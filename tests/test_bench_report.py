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
    path = Path(__file__).resolve().parents[1] / "benchmarks/results/archive/2026-11-30-h200-gmm.json"
    md = render(json.loads(path.read_text()))
    assert "# Grouped GEMM on NVIDIA H200 — 2026-11-30" in md
    assert "- decode, fraction of copy bandwidth (target ≥ 0.7): " in md


def test_wgrad_profile_table_reads_ncu_csv(tmp_path):
    """`benchmarks.wgrad_profile table`: one line per profiled kernel run from ncu's CSV log, with
    every metric; ncu's own note lines and CUTLASS's setup kernel left out."""
    from benchmarks.wgrad_profile import table

    head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    row = '"{i}","1","python3","h","{name}","1","7","(128, 1, 1)","(12288, 1, 1)","0","9.0","Command line profiler metrics","{m}","{u}","{v}"\n'
    path = tmp_path / "ncu.csv"
    path.write_text("==PROF== Connected to process 1\n" + head
                    + row.format(i=0, name="tgmm_kernel", m="gpu__time_duration.sum", u="ns", v="295,040")
                    + row.format(i=0, name="tgmm_kernel", m="dram__bytes_read.sum", u="byte", v="184,565,248")
                    + row.format(i=1, name="void at::prepare_grouped_gemm_data<x>", m="gpu__time_duration.sum", u="ns", v="2,496")
                    + row.format(i=2, name="void cutlass::device_kernel<y>", m="gpu__time_duration.sum", u="ns", v="258,656"))
    assert table(str(path)) == ["0 tgmm_kernel: gpu__time_duration=295,040 | dram__bytes_read=184,565,248",
                                "2 void cutlass::device_kernel<y>: gpu__time_duration=258,656"]
