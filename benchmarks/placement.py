"""Expert placement and replication (`moe_jax.parallel.placement`) on recorded and synthetic
loads: max/mean rows per rank before (today's contiguous layout) and after placement (CPU, seconds).

    python -m benchmarks.placement [--traces benchmarks/data/expert_counts.npz] [--window 25] \\
        [--out benchmarks/results/DATE-placement.md]

At E = 128 experts on R = 8, 16, 64 ranks with redundant-slot budgets 0, E/16 and E/8. Every rank
has the same S slots, so the redundant count S*R - E moves in steps of R: a budget is rounded up
to the next multiple of R (`slots_per_rank_for`), which at R = 64 means 64 (E/2), over budget.
Columns: `uniform` the contiguous layout (no replicas, what runs today); `EPLB` the published
method alone (`refine=False`); `EPLB + swaps` with the swap search but EPLB's replica counts
only; `planned` the default (also the replica-count candidates); `hier.` the hierarchical variant
at 8 ranks per node (one group per expert, so the node step only balances nodes and keeps each
expert's replicas on one node); `bound` a lower bound no placement can beat (`imbalance_bound`).
A replicated expert's rows are split evenly among its replicas.

Loads:
- Zipf(1.2): `shapes.zipf_counts` at 4096 tokens x top-8 (32768 rows, each expert <= 4096 rows, a
  fixed order, seed 0).
- traces: the training steps of `benchmarks/data/expert_counts.npz` (2 layers, 8 experts, top-2,
  300 steps of 2048 tokens). Rescaled onto 128 experts the way `routed_gmm.rescale_trace` does:
  each recorded expert's rows go in equal shares to 128/8 experts in a fixed random order (seed 0,
  the same order at every step, so windows are comparable). Each layer's history is cut into
  windows of `--window` steps; a placement is planned from a window's summed counts and scored on
  the same window (`in window`) and on the next one (`next window`: what a placement planned from
  the past meets). Cells give the median and the worst over the windows. Also each layer's decode
  histogram at T = 256 of the trained checkpoint, scored with the placement planned from the last
  training window.
- the same traces at their own 8 experts, on 2 and 4 ranks (no redundancy, or one more slot per
  rank): the skew as recorded, without the 16 equal copies the rescale makes of each expert.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

from benchmarks import shapes as S
from moe_jax.parallel import placement as placement_module
from moe_jax.parallel.placement import (
    Placement,
    imbalance,
    imbalance_bound,
    plan_placement,
    slots_per_rank_for,
)

E = 128
RANKS = (8, 16, 64)
BUDGETS = (0, E // 16, E // 8)
RANKS_PER_NODE = 8
NATIVE_RANKS = (2, 4)  # for the traces at their own expert count (8)
TARGET = 1.10
DEFAULT_TRACES = Path(__file__).parent / "data" / "expert_counts.npz"


def configs(e: int = E, ranks=RANKS, budgets=BUDGETS) -> list[tuple[int, int, int]]:
    """(R, S, redundant) per rank count, budgets rounded up to whole slots per rank, deduplicated."""
    out = []
    for r in ranks:
        for s in sorted({slots_per_rank_for(e, r, b) for b in budgets}):
            out.append((r, s, s * r - e))
    return out


def zipf_load(seed: int = 0) -> np.ndarray:
    return S.zipf_counts(4096 * 8, E, cap=4096, s=1.2, seed=seed).astype(np.float64)


def rescale(counts: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """A recorded `[E_trace]` histogram as `[E]` loads: equal shares per recorded expert, in `perm`'s order."""
    return np.repeat(counts.astype(np.float64) / (E // counts.size), E // counts.size)[perm]


def trace_loads(path: Path, window: int, rescaled: bool = True, seed: int = 0):
    """Per layer: `[W, E']` window sums of the training steps, and the decode T=256 histogram;
    rescaled to E experts, or (`rescaled=False`) over the recorded experts as they are."""
    traces = dict(np.load(path))
    layers = sorted({int(k.rsplit("layer", 1)[1]) for k in traces if k.startswith("train/")})
    steps = sorted({int(k.split("/")[1][4:]) for k in traces if k.startswith("train/")})
    perm = np.random.default_rng(seed).permutation(E)

    def load(counts):
        return rescale(counts, perm) if rescaled else counts.astype(np.float64)

    out = {}
    for layer in layers:
        per_step = np.stack([load(traces[f"train/step{s}/layer{layer}"]) for s in steps])
        w = len(steps) // window
        windows = per_step[: w * window].reshape(w, window, -1).sum(axis=1)
        decode = traces.get(f"decode/T256/layer{layer}")
        out[layer] = (windows, None if decode is None else load(decode))
    return out, (steps[0], steps[-1])


def one(load: np.ndarray, r: int, s: int) -> dict:
    e = load.size
    t0 = time.perf_counter()
    planned = plan_placement(load, r, s)
    ms = 1e3 * (time.perf_counter() - t0)
    with mock.patch.object(placement_module, "_CAPACITY_FACTORS", ()):  # EPLB's counts only
        swaps = plan_placement(load, r, s)
    row = {
        "uniform": imbalance(Placement.uniform(e, r), load),
        "eplb": imbalance(plan_placement(load, r, s, refine=False), load),
        "swaps": imbalance(swaps, load),
        "planned": imbalance(planned, load),
        "bound": imbalance_bound(load, r, s),
        "max_replicas": int(planned.replicas_E.max()),
        "ms": ms,
        "placement": planned,
    }
    if r > RANKS_PER_NODE:
        row["hier"] = imbalance(plan_placement(load, r, s, ranks_per_node=RANKS_PER_NODE), load)
    return row


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fmt(x: float) -> str:
    return f"{x:.3f}"


def med_worst(xs) -> str:
    xs = np.asarray(xs)
    return f"{np.median(xs):.3f} / {xs.max():.3f}"


def budget_note(red: int, e: int = E) -> str:
    return f"{red} ({'<=' if red <= e // 8 else '>'} E/8)"


def zipf_table() -> list[str]:
    load = zipf_load()
    lines = [
        "| R | S | redundant | uniform | EPLB | EPLB + swaps | planned | hier. | bound | target 1.10 | max replicas | "
        "plan ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, s, red in configs():
        row = one(load, r, s)
        hier = fmt(row["hier"]) if "hier" in row else "(1 node)"
        met = "met" if row["planned"] <= TARGET else "missed"
        lines.append(f"| {r} | {s} | {budget_note(red)} | {fmt(row['uniform'])} | {fmt(row['eplb'])} | "
                     f"{fmt(row['swaps'])} | **{fmt(row['planned'])}** | {hier} | {fmt(row['bound'])} | {met} | "
                     f"{row['max_replicas']} | {row['ms']:.0f} |")
    return lines


def trace_tables(path: Path, window: int, rescaled: bool = True, cfgs=None) -> tuple[list[str], list[str]]:
    loads, (first, last) = trace_loads(path, window, rescaled)
    lines = [
        "| layer | R | S | redundant | uniform | EPLB | EPLB + swaps | planned, in window | planned, next window | "
        "hier., in window | bound | windows <= 1.10 (in / next) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    decode_lines = [
        "| layer | R | S | redundant | uniform | planned from the last training window | bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for layer, (windows, decode) in loads.items():
        e = windows.shape[1]
        for r, s, red in cfgs or configs():
            rows = [one(w, r, s) for w in windows]
            nxt = [imbalance(a["placement"], b) for a, b in zip(rows[:-1], windows[1:])]
            col = {k: [x[k] for x in rows] for k in ("uniform", "eplb", "swaps", "planned", "bound")}
            hier = med_worst([x["hier"] for x in rows]) if r > RANKS_PER_NODE else "(1 node)"
            ok_in = sum(x <= TARGET for x in col["planned"])
            ok_next = sum(x <= TARGET for x in nxt)
            lines.append(f"| {layer} | {r} | {s} | {budget_note(red, e)} | {med_worst(col['uniform'])} | "
                         f"{med_worst(col['eplb'])} | {med_worst(col['swaps'])} | **{med_worst(col['planned'])}** | "
                         f"{med_worst(nxt)} | {hier} | {med_worst(col['bound'])} | "
                         f"{ok_in}/{len(rows)} / {ok_next}/{len(nxt)} |")
            if decode is not None:
                decode_lines.append(f"| {layer} | {r} | {s} | {budget_note(red, e)} | "
                                    f"{fmt(imbalance(Placement.uniform(e, r), decode))} | "
                                    f"{fmt(imbalance(rows[-1]['placement'], decode))} | "
                                    f"{fmt(imbalance_bound(decode, r, s))} |")
    head = [f"Training steps {first}-{last}, windows of {window} steps ({len(next(iter(loads.values()))[0])} per "
            "layer); each cell: median / worst over the windows."]
    return head + [""] + lines, decode_lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="an .npz written by benchmarks.traces")
    p.add_argument("--window", type=int, default=25, help="training steps per planning window")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here as well")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    zipf = zipf_table()
    trace, decode = trace_tables(args.traces, args.window)
    # The recorded experts as they are: no replica, or one more slot a rank.
    native_e = next(v.size for k, v in np.load(args.traces).items() if k.startswith("train/"))
    native, _ = trace_tables(args.traces, args.window, rescaled=False,
                             cfgs=configs(native_e, NATIVE_RANKS, (0, 1)))
    elapsed = time.perf_counter() - t0
    cmd = "python -m benchmarks.placement " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        "# Expert placement and replication: max/mean rows per rank before and after",
        "",
        f"- Date: {datetime.date.today().isoformat()}. Machine: CPU ({cpu_name()}, {platform.machine()}, "
        f"{os.cpu_count()} cores), Python {platform.python_version()}, NumPy {np.__version__}; "
        f"the whole run took {elapsed:.0f} s.",
        f"- Command: `{cmd.strip()}`.",
        f"- E = {E} experts; R ranks x S slots; redundant = S*R - E (budgets 0, E/16, E/8 rounded up to a "
        "multiple of R). Cells are max/mean rows per rank; target <= 1.10. A replicated expert's rows are "
        "split evenly among its replicas. `uniform`: today's contiguous layout. `EPLB`: the published method "
        "alone. `EPLB + swaps`: EPLB's replica counts with the swap search. `planned`: `plan_placement` "
        "defaults (EPLB + replica-count candidates + swap search). "
        f"`hier.`: hierarchical, {RANKS_PER_NODE} ranks per node. `bound`: no placement does better "
        "(`imbalance_bound`). Method and data: the `benchmarks/placement.py` docstring and `docs/placement.md`.",
        "",
        "## Zipf(1.2), 4096 tokens x top-8",
        "",
        *zipf,
        "",
        f"## Recorded traces ({args.traces.name}), rescaled to {E} experts",
        "",
        *trace,
        "",
        "### Decode, T = 256 tokens of the trained checkpoint",
        "",
        *decode,
        "",
        f"## Recorded traces at their own {native_e} experts (0 or R redundant slots)",
        "",
        *native,
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
