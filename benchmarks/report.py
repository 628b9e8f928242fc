"""Print the markdown tables of a `benchmarks.gmm run --json` result.

    python -m benchmarks.report out.json > benchmarks/results/DATE-DEVICE-gmm.md  # a new file

The output is a starting point, not the kept file: the markdown in `benchmarks/results/` was
saved from it once and then annotated by hand (Device and Command lines, Notes and Gaps
sections), so do not regenerate a committed one over itself. Runs anywhere (no GPU, no torch):
it only reads the JSON, and reads no summary key beyond the forward/backward geomeans, the
targets and `decode_fraction_of_copy_bw`, so older result files render too.
"""

from __future__ import annotations

import argparse
import json
import sys

PREFILL_IMPLS = ("ours", "torch", "ragged_dot", "mgpu", "seed_triton", "dense")
FB_IMPLS = ("ours_fb", "torch_fb")
DECODE_IMPLS = ("ours", "ours_tiles_kernel", "torch", "ragged_dot")


def _index(rows):
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        out.setdefault((r["shape"], r["skew"]), {})[r["impl"]] = r
    return out


def _fmt(x, spec):
    return "–" if x is None else format(x, spec)


def _ratio(a, b):
    """time(b) / time(a): > 1 means `a` is faster."""
    if not a or not b or a.get("seconds") is None or b.get("seconds") is None:
        return None
    return b["seconds"] / a["seconds"]


def _tflops_cells(impls: dict, names, ours: str, peer: str) -> str:
    """TFLOP/s of each of `names`, then time(peer) / time(ours), as table cells."""
    tf = [_fmt(impls.get(i, {}).get("tflops"), ".0f") for i in names]
    return " | ".join(tf + [_fmt(_ratio(impls.get(ours), impls.get(peer)), ".2f")])


def render(result: dict) -> str:
    meta, summary, rows = result["meta"], result["summary"], result["rows"]
    cases = _index(rows)
    lines = [
        f"# Grouped GEMM on {meta['device']} — {meta['date'][:10]}",
        "",
        f"jax {meta['jax']}, torch {meta['torch']}, triton {meta.get('triton', '?')}, python {meta['python']}; "
        f"configs from {meta.get('configs_from', 'table')}; measured copy bandwidth {meta['copy_tbps']:.2f} TB/s.",
        "",
        f"Command: `{meta['command']}` (device machine, `PYTHONPATH=.`).",
        "",
        "## Prefill, forward (TFLOP/s; ratio = torch time / our time)",
        "",
        "| shape | skew | max rows/expert | " + " | ".join(PREFILL_IMPLS) + " | ours/torch |",
        "|---|---|---|" + "---|" * len(PREFILL_IMPLS) + "---|",
    ]
    prefill = [(k, v) for k, v in cases.items() if k[1] != "decode"]
    for (shape, skew), impls in prefill:
        max_count = next(iter(impls.values()))["max_count"]
        lines.append(f"| {shape} | {skew} | {max_count} | {_tflops_cells(impls, PREFILL_IMPLS, 'ours', 'torch')} |")
    lines += [
        "",
        "## Prefill, forward + backward (TFLOP/s counting 3× the forward FLOPs)",
        "",
        "| shape | skew | " + " | ".join(FB_IMPLS) + " | ours/torch |",
        "|---|---|" + "---|" * len(FB_IMPLS) + "---|",
    ]
    for (shape, skew), impls in prefill:
        lines.append(f"| {shape} | {skew} | {_tflops_cells(impls, FB_IMPLS, 'ours_fb', 'torch_fb')} |")
    lines += [
        "",
        "## Decode (µs; TB/s on the active experts' weight bytes, and its fraction of the copy bandwidth)",
        "",
        "| tokens | active experts | weight MB | " + " | ".join(f"{i} µs" for i in DECODE_IMPLS)
        + " | ours TB/s | ours / copy |",
        "|---|---|---|" + "---|" * len(DECODE_IMPLS) + "---|---|",
    ]
    for (shape, skew), impls in cases.items():
        if skew != "decode":
            continue
        any_row = next(iter(impls.values()))
        us = [_fmt(None if impls.get(i, {}).get("seconds") is None else impls[i]["seconds"] * 1e6, ".1f")
              for i in DECODE_IMPLS]
        tb = impls.get("ours", {}).get("tbps")
        lines.append(f"| {any_row['tokens']} | {any_row['active']} | {any_row['weight_bytes'] / 1e6:.1f} | "
                     + " | ".join(us) + f" | {_fmt(tb, '.2f')} | {_fmt(None if tb is None else tb / meta['copy_tbps'], '.2f')} |")
    lines += [
        "",
        "## Summary against the targets",
        "",
        f"- forward geomean ours/torch: {_fmt(summary.get('fwd_geomean_ours_over_torch'), '.2f')} (target ≥ {summary['target_fwd']})",
        f"- forward+backward geomean ours/torch: {_fmt(summary.get('fwdbwd_geomean_ours_over_torch'), '.2f')} "
        f"(target ≥ {summary['target_fwdbwd']})",
        f"- forward geomean speed-up over `jax.lax.ragged_dot`: {_fmt(summary.get('fwd_geomean_speedup_over_ragged_dot'), '.1f')}×",
        f"- decode, fraction of copy bandwidth (target ≥ {summary['target_decode']}): "
        + ", ".join(f"{k}: {v:.2f}" for k, v in summary.get("decode_fraction_of_copy_bw", {}).items()),
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json_path", help="a file written by `python -m benchmarks.gmm run --json`")
    args = p.parse_args(argv)
    with open(args.json_path) as f:
        sys.stdout.write(render(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
