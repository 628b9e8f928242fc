"""Command line of the scale-out planner: `python -m moe_jax.scaleout [options]`.

Prints, per routing load, a markdown table (one row per layout family and rank count) and per R
the winner with its reason; `--json PATH` writes every rank's figures and the placements too
(`--json -` prints the JSON instead of the markdown).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Sequence

from moe_jax.scaleout.cluster import Cluster
from moe_jax.scaleout.costs import KernelCosts
from moe_jax.scaleout.layouts import KINDS, STRATEGIES
from moe_jax.scaleout.loads import Load
from moe_jax.scaleout.model import sweep
from moe_jax.scaleout.report import markdown, per_rank_markdown, to_json
from moe_jax.scaleout.shape import LayerShape

__all__ = ["main"]

DEFAULT_TRACES = Path("benchmarks/data/expert_counts.npz")
DEFAULT_RANKS = (8, 16, 32, 64, 128, 256)


def _ints(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_jax.scaleout",
        description="Scale-out planner for MoE layers (a model, not a measurement): per rank rows, padding at "
                    "the tile that runs, exchange bytes and predicted layer time (slowest rank beside the mean) "
                    "for EP, ETP, EP x ETP and EP with replication, over a sweep of rank counts; which layout "
                    "wins and why. Model and assumptions: docs/scaleout.md.",
        epilog="examples:\n"
               "  python -m moe_jax.scaleout                          # Qwen3-30B-A3B-like layer, traces + Zipf(1.2)\n"
               "  python -m moe_jax.scaleout --zipf 1.2 --ranks 64 --per-rank\n"
               "  python -m moe_jax.scaleout --trace-layer 0 --ranks-per-node 72 --json plan.json\n"
               "  python -m moe_jax.scaleout --costs benchmarks/results/2026-12-01-h200-gmm.json --train",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("layer")
    g.add_argument("--d-model", type=int, default=2048, help="D (default 2048)")
    g.add_argument("--d-ff", type=int, default=768, help="F, expert hidden width (default 768)")
    g.add_argument("--experts", type=int, default=128, help="E (default 128)")
    g.add_argument("--top-k", type=int, default=8, help="K (default 8)")
    g.add_argument("--tokens", type=int, default=4096, help="T, tokens per rank (default 4096)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--fp8", action="store_true",
                   help="the routed experts in blockwise FP8 (Fp8Blockwise): FP8 GEMM rates, FP8 rows in the forward's "
                        "dispatch all-to-all")
    g = p.add_argument_group("routing loads (default: --trace-layer 0 --trace-layer 1 --zipf 1.2)")
    g.add_argument("--zipf", type=float, action="append", default=None, metavar="S", help="a Zipf(S) load (repeatable)")
    g.add_argument("--trace-layer", type=int, action="append", default=None, metavar="L",
                   help="layer L of --traces (repeatable)")
    g.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help=f"trace file (default {DEFAULT_TRACES})")
    g.add_argument("--window", type=int, default=25, help="trace steps summed, the last ones (default 25)")
    g.add_argument("--counts", type=_ints, action="append", default=None, metavar="C0,C1,...",
                   help="a load from a per-expert histogram (E entries; rescaled to the step's routes)")
    g = p.add_argument_group("cluster (defaults: HGX H200, docs/scaleout.md)")
    g.add_argument("--ranks", type=_ints, default=list(DEFAULT_RANKS), metavar="R,...",
                   help="rank counts to sweep (default 8,16,32,64,128,256)")
    g.add_argument("--ranks-per-node", type=int, default=8)
    g.add_argument("--nvlink-GBps", type=float, default=Cluster.nvlink_GBps, help="per GPU and direction (450)")
    g.add_argument("--internode-GBps", type=float, default=Cluster.internode_GBps, help="per GPU and direction (50)")
    g.add_argument("--intra-latency-us", type=float, default=Cluster.intra_latency_us)
    g.add_argument("--inter-latency-us", type=float, default=Cluster.inter_latency_us)
    g = p.add_argument_group("costs and options")
    g.add_argument("--costs", type=Path, default=None,
                   help="a `python -m benchmarks.gmm run --json` file for the kernel rates (default: the H200 "
                        "figures of benchmarks/results/2026-12-01-h200-gmm.md)")
    g.add_argument("--train", action="store_true", help="forward + backward (default: forward)")
    g.add_argument("--extra-slots", type=int, default=None,
                   help="redundant slots per rank for EP+replication beyond ceil(E/R) (default 1 while R <= E, else 0)")
    g.add_argument("--ep-capacity-factor", type=float, default=None, help="EP only: capacity factor (default dropless)")
    g.add_argument("--ep-strategy", choices=STRATEGIES, default="ragged",
                   help="EP only: ragged (kept rows move) or padded (C rows per peer move)")
    g.add_argument("--layouts", default=",".join(KINDS), help=f"families to compare (default {','.join(KINDS)})")
    g.add_argument("--per-rank", action="store_true", help="also print every rank of every layout")
    g.add_argument("--json", default=None, metavar="PATH", help="write the JSON here ('-': print it instead)")
    return p


def _loads(args, shape: LayerShape, parser) -> list[Load]:
    loads = []
    layers = args.trace_layer
    if args.zipf is None and args.trace_layer is None and args.counts is None:
        layers = [0, 1] if args.traces.exists() else []
        args.zipf = [1.2]
    for layer in layers or []:
        loads.append(Load.trace(args.traces, layer, shape.num_experts, window=args.window))
    for s in args.zipf or []:
        loads.append(Load.zipf(s))
    for counts in args.counts or []:
        if len(counts) != shape.num_experts:
            parser.error(f"--counts has {len(counts)} entries; --experts is {shape.num_experts}")
        loads.append(Load(f"histogram ({len(counts)} experts)", share_E=counts))
    return loads


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.layouts.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        parser.error(f"--layouts: unknown {bad}; choose from {','.join(KINDS)}")
    try:
        shape = LayerShape(args.d_model, args.d_ff, args.experts, args.top_k, args.tokens,
                           2 if args.dtype == "bfloat16" else 4, fp8=args.fp8)
        cluster = Cluster(max(args.ranks), args.ranks_per_node, args.nvlink_GBps, args.internode_GBps,
                          args.intra_latency_us, args.inter_latency_us)
        for r in args.ranks:
            cluster.with_ranks(r)  # each R must be whole nodes
        costs = KernelCosts() if args.costs is None else KernelCosts.from_gmm_json(args.costs)
        loads = _loads(args, shape, parser)
        options = dict(train=args.train, extra_slots=args.extra_slots, capacity_factor=args.ep_capacity_factor,
                       strategy=args.ep_strategy, kinds=kinds)
        results = [(load, sweep(shape, load, cluster, costs, args.ranks, **options)) for load in loads]
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    command = "python -m moe_jax.scaleout " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command.strip(), "date": datetime.date.today().isoformat(), "model_not_measured": True,
            "layer": shape.describe(), "cluster": cluster.describe(), "costs": costs.source,
            "pass": "forward + backward" if args.train else "forward"}
    if args.json is not None:
        payload = to_json([p for _, plans in results for p in plans], meta)
        if args.json == "-":
            print(json.dumps(payload, indent=1))
            return 0
        Path(args.json).write_text(json.dumps(payload))
    print(f"# Scale-out plan: model, not measured ({meta['date']})\n")
    print(f"- Command: `{meta['command']}`")
    print(f"- Layer: {meta['layer']}, {meta['pass']} pass. Cluster: {cluster.describe().split(', ', 1)[1]}; "
          f"{args.ranks_per_node} ranks per node. Kernel rates: {costs.source}.")
    print("- Columns: rows into the gate/up grouped GEMM per rank; its tile height (the static plan of "
          "`moe_jax.ops.plan` for an H200) and the padding it adds on the worst rank; MB per rank (the larger of sent and "
          "received) and MB per network port over the pass's collectives; experts (gate, up, down GEMMs) on the slowest rank "
          "and on average; layer ms = sum over phases of the slowest rank (every collective is a barrier), "
          "mean rank ms = the average rank's own total. docs/scaleout.md has the model.\n")
    for load, plans in results:
        print(f"## {load.name}\n")
        print(markdown(plans))
        print()
        if args.per_rank:
            for plan in plans:
                print(per_rank_markdown(plan))
    return 0
