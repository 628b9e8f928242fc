"""The scale-out planner's results file: the plan for 8-256 ranks on the committed traces and
Zipf(1.2) (`moe_jax.scaleout`, a model), and its exchange model against the committed 2-GPU
exchange measurements (CPU, seconds).

    python -m benchmarks.scaleout [--out benchmarks/results/DATE-scaleout-plan.md]

The check (`exchange_check`): every `nccl` record of
`benchmarks/results/2026-11-30-h200x2-ep-breakdown-4{,-rerun}.json` (two
`torch.distributed.all_to_all_single` calls moving exactly the dropless splits, 2 H200s of one
node) is replayed through the model: the routing is regenerated with the benchmark's own
`benchmarks.ep.routing.make_routing` (same seed, so the same splits; the record's `recv_rows_P`
is checked against it), each source's routes per expert go into `moe_jax.scaleout.ep_work` at
ep = 2, and the model's dispatch + combine time is set beside the measured time. The same for
the layer's own exchange (`ours padded cf=1.25`: padded strategy, C = capacity_for(T, K, 2,
1.25) rows to the peer, plus the row moves in HBM around it) and for the part of it without the
collective (`no-a2a`, against the model's row moves alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.ep.routing import CAPACITY_FACTOR, GPU_SHAPES, make_routing
from moe_jax.scaleout import Cluster, KernelCosts, LayerShape, Load, QWEN3_30B_A3B, ep_work, fit_link, sweep
from moe_jax.scaleout.comm import all_to_all
from moe_jax.scaleout.report import markdown

RESULTS = Path(__file__).parent / "results"
EP_RECORDS = (RESULTS / "2026-11-30-h200x2-ep-breakdown-4.json", RESULTS / "2026-11-30-h200x2-ep-breakdown-4-rerun.json")
TRACES = Path(__file__).parent / "data" / "expert_counts.npz"
RANKS = (8, 16, 32, 64, 128, 256)


def _shape(record: dict):
    for shape in GPU_SHAPES:
        if shape.describe() == record["shape"]:
            return shape
    raise ValueError(f"no benchmarks.ep.routing.GPU_SHAPES entry is {record['shape']!r}")


def _counts_SE(shape, routing: str, ranks: int = 2) -> np.ndarray:
    idx, _ = make_routing(routing, ranks, shape.tokens, shape.experts, shape.top_k)
    return np.stack([np.bincount(rows.ravel(), minlength=shape.experts) for rows in idx.reshape(ranks, -1)])


def exchange_check(paths=EP_RECORDS, cluster: Cluster | None = None, costs: KernelCosts | None = None) -> list[dict]:
    """One dict per measured record (`nccl`, `ours padded cf=1.25`, `... no-a2a`): the shape, the
    routing, the run, the peer bytes per exchange (the larger of sent and received, busiest
    rank), the measured and modelled microseconds and measured / model."""
    cluster = cluster or Cluster(2)
    costs = costs or KernelCosts()
    out = []
    for run, path in enumerate(paths, 1):
        for rec in json.loads(Path(path).read_text())["records"]:
            if (rec["side"], rec["strategy"]) not in (("nccl", "nccl"), ("ours", f"padded cf={CAPACITY_FACTOR}"),
                                                      ("ours", f"padded cf={CAPACITY_FACTOR} no-a2a")):
                continue
            shape = _shape(rec)
            counts = _counts_SE(shape, rec["routing"])
            if "recv_rows_P" in rec and counts.reshape(2, 2, -1).sum(axis=2).sum(axis=0).tolist() != rec["recv_rows_P"]:
                raise ValueError(f"{path}: the regenerated routing does not give the record's recv_rows_P")
            layer = LayerShape(shape.d_model, 128, shape.experts, shape.top_k, shape.tokens)
            padded = rec["side"] == "ours"
            work = ep_work(layer, counts, 2, capacity_factor=CAPACITY_FACTOR if padded else None,
                           strategy="padded" if padded else "ragged")
            a2a = [all_to_all(c.data, c.group_R, cluster) for c in work.dispatch + work.combine]
            peer_bytes = float(np.maximum(a2a[0].send_bytes_R, a2a[0].recv_bytes_R).max())
            moves = work.moved_rows_R.max() * layer.row_bytes / (costs.copy_TBps * 1e12)
            exchange = sum(float(t.seconds_R.max()) for t in a2a)
            model = {"nccl": exchange, "ours": exchange + moves}[rec["side"]]
            kind = rec["strategy"]
            if kind.endswith("no-a2a"):
                model = moves
            out.append(dict(shape=rec["shape"], routing=rec["routing"], run=run, impl=kind, peer_bytes=peer_bytes,
                            measured_us=1e6 * rec["seconds"], model_us=1e6 * model,
                            ratio=rec["seconds"] / model))
    return out


def check_lines(rows: list[dict]) -> list[str]:
    rows = sorted(rows, key=lambda r: (r["impl"], r["shape"], r["routing"], r["run"]))
    lines = ["| shape | routing | run | measured | peer MB per exchange | measured us | model us | measured / model |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['routing']} | {r['run']} | {r['impl']} | {r['peer_bytes'] / 1e6:.1f} | "
                     f"{r['measured_us']:.1f} | {r['model_us']:.1f} | {r['ratio']:.2f} |")
    return lines


def summary(rows: list[dict]) -> list[str]:
    out = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ratios = np.array([r["ratio"] for r in rows if r["impl"] == impl])
        out.append(f"- `{impl}`: measured / model {ratios.min():.2f}-{ratios.max():.2f} "
                   f"(geomean {np.exp(np.log(ratios).mean()):.2f}) over {ratios.size} records.")
    nccl = [r for r in rows if r["impl"] == "nccl"]
    gbps, lat = fit_link([r["peer_bytes"] for r in nccl], [r["measured_us"] * 1e-6 / 2 for r in nccl])
    out.append(f"- A least-squares fit of the NCCL records (one call = half the pair, bytes = the busiest "
               f"rank's peer bytes) gives {gbps:.0f} GB/s and {lat:.0f} us per call, against the model's "
               f"{Cluster(2).nvlink_GBps:.0f} GB/s and {Cluster(2).intra_latency_us:.0f} us "
               "(`moe_jax.scaleout.fit_link`; the defaults are not fitted).")
    return out


def winners(plans) -> list[str]:
    """One line per load and R: the winner, its predicted time, EP's and the runner-up's."""
    lines = ["| load | R | winner | layer ms | runner-up | its ms | EP ms | EP slowest / mean rows | ETP ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for load, step_plans in plans:
        for plan in step_plans:
            ranked = sorted(plan.results.values(), key=lambda r: r.layer_s)
            ep, etp = plan.results.get("EP"), plan.results.get("ETP")
            lines.append(f"| {load.name} | {plan.ranks} | {ranked[0].name} | {1e3 * ranked[0].layer_s:.2f} | "
                         f"{ranked[1].name} | {1e3 * ranked[1].layer_s:.2f} | "
                         f"{'-' if ep is None else f'{1e3 * ep.layer_s:.2f}'} | "
                         f"{'-' if ep is None else f'{ep.rows_imbalance:.2f}'} | "
                         f"{'-' if etp is None else f'{1e3 * etp.layer_s:.2f}'} |")
    return lines


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write the markdown here as well")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    shape, cluster, costs = QWEN3_30B_A3B, Cluster(max(RANKS)), KernelCosts()
    loads = [Load.trace(TRACES, 0, shape.num_experts), Load.trace(TRACES, 1, shape.num_experts), Load.zipf(1.2)]
    plans = [(load, sweep(shape, load, cluster, costs, RANKS)) for load in loads]
    check = exchange_check()
    elapsed = time.perf_counter() - t0
    cmd = "python -m benchmarks.scaleout " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [
        "# Scale-out plan for 8-256 ranks: model, not measured",
        "",
        f"- Date: {datetime.date.today().isoformat()}. **Every time below is the model's prediction "
        "(`moe_jax.scaleout`), not a measurement**; only the last section compares the exchange model with "
        f"measurements. Computed on CPU ({cpu_name()}, {os.cpu_count()} cores), Python "
        f"{platform.python_version()}, NumPy {np.__version__}, in {elapsed:.0f} s.",
        f"- Command: `{cmd.strip()}` (the tables are `python -m moe_jax.scaleout` with its defaults).",
        f"- Layer: {shape.describe()} (Qwen3-30B-A3B-like), forward pass. Cluster: HGX H200 nodes of 8, "
        f"{cluster.describe().split(', ', 1)[1]}. Kernel rates: {costs.source} (gate/up {costs.gate_up_tflops:g}, "
        f"down {costs.down_tflops:g} TFLOP/s, copy {costs.copy_TBps:g} TB/s). The model and its assumptions: "
        "[docs/scaleout.md](../../docs/scaleout.md).",
        "- Loads: the committed traces (`benchmarks/data/expert_counts.npz`, 8 experts, top-2, recorded from "
        "the example model) summed over their last 25 training steps and rescaled onto 128 experts (each "
        "recorded expert in 16 equal parts, a fixed random order, as `benchmarks.placement` does), and "
        "Zipf(1.2) (`benchmarks.shapes.zipf_counts`' law), each scaled to the step's R x 4096 x 8 routes "
        "with no expert above the step's R x 4096 tokens, every source rank routing like the whole step.",
        "- R > E = 128: EP runs as EP groups of 128 ranks (one expert each) x data-parallel replicas; "
        "EP+replication has one slot per rank (R - E redundant); ETP and EPxETP split F (768 = 3 x 256 "
        "columns: F/256 = 3 at R = 256). EP+replication uses one redundant slot per rank while R <= E "
        "(S = E/R + 1), its placement planned and scored on the same load (in-window, optimistic; "
        "docs/placement.md has planned-from-the-past figures).",
        "- Columns: see `python -m moe_jax.scaleout --help`; `layer ms (slowest)` sums the slowest rank of "
        "each phase (every collective is a barrier), `mean rank ms` is the average rank's own total, and "
        "`weights MB/rank` is the memory price of each layout (replication holds more).",
        "",
    ]
    md += ["## Winners", "", *winners(plans), ""]
    for load, step_plans in plans:
        md += [f"## {load.name}", "", markdown(step_plans), ""]
    md += [
        "## The exchange model against the 2-GPU measurements",
        "",
        "`benchmarks/results/2026-11-30-h200x2-ep-breakdown-4.md` (2 H200 of one node, NVLink), both runs, every "
        "shape and routing, replayed through the model with the benchmark's own routings "
        "(`benchmarks.scaleout.exchange_check`). `nccl`: two `all_to_all_single` calls with the exact dropless "
        "splits (the model: two all-to-alls, latency + peer bytes / 450 GB/s). `ours padded cf=1.25`: the "
        "layer's exchange (the model: the padded strategy's C rows to the peer, plus the HBM row moves at "
        "4.28 TB/s). `no-a2a`: the same with the collective replaced by the identity (the model: the row moves "
        "alone).",
        "",
        *summary(check),
        "",
        *check_lines(check),
        "",
    ]
    text = "\n".join(md)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
