"""Formatting of the EP benchmark: one progress line per record, and the table of all records.

A record is a dict with `side` ("ours", "xla", "nccl", "torch-ref"), `strategy` (the row label),
`shape`, `d_model`, `routing`, and either `error` or `seconds`, `rows_per_rank`, `dropped`; torch
records add `rank_seconds` (every rank's median), NCCL records `recv_rows_P` (the dropless load of
each receiving rank).
"""

from __future__ import annotations

import statistics

__all__ = ["progress", "table"]

_SIDE_ORDER = {"nccl": 0, "torch-ref": 1, "xla": 2, "ours": 3}


def progress(record: dict) -> None:
    """Print one record as it is measured."""
    result = record["error"] if "error" in record else f"{record['seconds'] * 1e6:.1f} us"
    print(f"  {record['side']:<9} {record['strategy']:<16} {record['shape']} {record['routing']}: {result}",
          flush=True)


def table(records: list[dict]) -> str:
    """Every record as a row (time, GB/s per GPU, time / NCCL time, dropped routes, slowest torch
    rank / mean), then each routing's received rows per rank, max / mean."""
    nccl = {(r["shape"], r["routing"]): r["seconds"] for r in records if r["side"] == "nccl" and "seconds" in r}
    lines = [f"{'shape':<36} {'routing':<9} {'impl':<32} {'time us':>10} {'GB/s/GPU':>9} {'x NCCL':>7} "
             f"{'dropped':>8} {'slow/mean':>9}"]
    for r in sorted(records, key=lambda r: (r["shape"], r["routing"], _SIDE_ORDER[r["side"]], r["strategy"])):
        name = f"{r['side']} {r['strategy']}" if r["side"] in ("ours", "xla") else r["strategy"]
        if "error" in r:
            lines.append(f"{r['shape']:<36} {r['routing']:<9} {name:<32} failed: {r['error'][:60]}")
            continue
        gbps = 2 * r["rows_per_rank"] * r["d_model"] * 2 / r["seconds"] / 1e9  # bf16: 2 bytes
        base = nccl.get((r["shape"], r["routing"]))
        ratio = f"{r['seconds'] / base:7.2f}" if base else f"{'-':>7}"
        ranks = r.get("rank_seconds")
        tail = f"{max(ranks) / statistics.mean(ranks):9.2f}" if ranks else f"{'-':>9}"
        lines.append(f"{r['shape']:<36} {r['routing']:<9} {name:<32} {r['seconds'] * 1e6:10.1f} {gbps:9.1f} "
                     f"{ratio} {int(r['dropped']):8d} {tail}")
    loads = {(r["shape"], r["routing"]): r["recv_rows_P"] for r in records if "recv_rows_P" in r}
    if loads:
        lines.append("received rows per rank (dropless), max / mean:")
        lines += [f"  {shape:<36} {routing:<9} {max(rows) / statistics.mean(rows):.2f}  ({rows})"
                  for (shape, routing), rows in sorted(loads.items())]
    return "\n".join(lines)
