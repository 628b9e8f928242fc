"""Command line of the padding planner: `python -m moe_jax.padding COUNTS [--tiles ...]`."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Sequence

import numpy as np

from moe_jax.padding.planner import capacity_padding, per_rank_padding, tile_padding

__all__ = ["main"]

_INT32_MAX = 2**31 - 1



def _int_list(what: str, *, minimum: int):
    """An argparse `type` for a comma-separated list of ints >= minimum."""

    def parse(text: str) -> list[int]:
        values = []
        for piece in text.split(","):
            piece = piece.strip()
            try:
                value = int(piece)
            except ValueError:
                shown = piece if piece else "(empty)"
                raise argparse.ArgumentTypeError(
                    f"invalid {what} {text!r}: {shown!r} is not an integer"
                ) from None
            if value < minimum:
                raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: {value} is below {minimum}")
            if value > _INT32_MAX:
                raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: {value} does not fit in int32")
            values.append(value)
        return values

    return parse


def _positive_int(text: str) -> int:
    """An argparse `type` for one int >= 1."""
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moe_jax.padding",
        description=textwrap.fill(
            "Tile-tail padding of a grouped GEMM for one per-expert token histogram. For each tile "
            "height q, every expert with t rows executes q*ceil(t/q) rows: U = sum t (useful), "
            "P = sum q*ceil(t/q) (executed), padding % = (P-U)/P. Also prints active experts, "
            "effective experts U^2/sum t^2 (DA-MoE) and mean rows per expert U/E. Capacity padding "
            "(--capacity) is reported on its own line, never mixed into the tile figures.",
            width=88,
        ),
        epilog=(
            "examples:\n"
            "  python -m moe_jax.padding 17,17,17,17,16,16,16,16 --tiles 8,16,32\n"
            "  python -m moe_jax.padding 100,32,0,0,0,0,0,0 --tiles 8,32 --ranks 4\n"
            "  python -m moe_jax.padding 100,32,16,16 --expert-ranks 0,1,1,0 --capacity 64\n"
            "  python -m moe_jax.padding 100,32,0,0,0,0,0,0 --gemm 1536,2048"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "counts",
        nargs="+",
        type=_int_list("count list", minimum=0),
        metavar="COUNTS",
        help="rows (token assignments) per expert, non-negative ints, comma- and/or space-separated",
    )
    parser.add_argument(
        "--tiles",
        type=_int_list("tile list", minimum=1),
        default=[8, 16, 32, 64, 128],
        metavar="Q[,Q...]",
        help="row-tile heights q to evaluate (default: 8,16,32,64,128)",
    )
    parser.add_argument(
        "--ranks",
        type=_positive_int,
        default=None,
        metavar="R",
        help=(
            "expert-parallel ranks: add per-rank columns (max and sum of executed rows over ranks, "
            "imbalance = max / mean). Experts are placed in contiguous blocks of E/R unless "
            "--expert-ranks is given"
        ),
    )
    parser.add_argument(
        "--expert-ranks",
        type=_int_list("rank list", minimum=0),
        default=None,
        metavar="R0,R1,...",
        help=(
            "owning rank of each expert (one entry per expert); implies the per-rank columns. Without --ranks "
            "every rank from 0 to the largest named must own an expert"
        ),
    )
    parser.add_argument(
        "--capacity",
        type=_positive_int,
        default=None,
        metavar="C",
        help="also report capacity padding of fixed per-expert buffers of C rows (kept, dropped, padded)",
    )
    parser.add_argument(
        "--gemm",
        type=_int_list("gemm shape", minimum=1),
        default=None,
        metavar="N,K",
        help=(
            "also say which kernel GemmOptions(kernel='auto') runs for these counts in a forward grouped GEMM "
            "of N output and K input columns (M = sum of the counts): the histogram features, the tuned "
            "table and its cell"
        ),
    )
    return parser


def _selector_lines(counts: list[int], gemm: list[int]) -> list[str]:
    """What the on-device selector picks for `counts` at forward GEMM width/depth `gemm = [N, K]`."""
    import jax.numpy as jnp

    from moe_jax.ops import CANDIDATES, select, selector_table

    n, k = gemm
    num_rows = max(sum(counts), 1)
    table = selector_table(n, k, len(counts))
    pick = select(jnp.asarray(counts, jnp.int32), num_rows, table)
    f = pick.features
    name = list(CANDIDATES)[int(pick.candidate)]
    row, col = table.row(num_rows), int(table.column(f))
    return [
        f"selector (GemmOptions(kernel='auto')) for a GEMM of N={n}, K={k}, M={num_rows}: runs {name} "
        f"({CANDIDATES[name].name}), P = {int(pick.executed_rows)}",
        f"  features: U = {int(f.useful_rows)}, active = {int(f.active)}, max rows = {int(f.max_rows)}, "
        f"effective experts = {float(f.effective):.3f}",
        f"  table: tuned at (N, K, E) = {table.shape} on {table.device}; cell row {row} (M in "
        f"({2 ** (row - 1) if row else 0}, {2 ** row}]), column {col} (round(log2 effective experts)); "
        f"that row's candidates: {', '.join(table.candidates_for(num_rows))}",
    ]


def _format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints the padding table for one histogram. Returns 0."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    counts = [c for group in args.counts for c in group]
    counts_E = np.asarray(counts, dtype=np.int64)
    num_experts = len(counts)
    if args.gemm is not None and len(args.gemm) != 2:
        parser.error(f"--gemm takes N,K (two ints); got {args.gemm}")
    per_rank = args.ranks is not None or args.expert_ranks is not None
    rank_kwargs = {}
    if args.expert_ranks is not None:
        if len(args.expert_ranks) != num_experts:
            parser.error(
                f"--expert-ranks has {len(args.expert_ranks)} entries, expected one per expert ({num_experts})"
            )
        rank_kwargs["expert_rank_E"] = np.asarray(args.expert_ranks, dtype=np.int64)
        if args.ranks is not None and max(args.expert_ranks) >= args.ranks:
            parser.error(f"--expert-ranks names rank {max(args.expert_ranks)}, but --ranks is {args.ranks}")
        empty = sorted(set(range(max(args.expert_ranks) + 1)) - set(args.expert_ranks))
        if args.ranks is None and empty:
            # Without --ranks the rank count is read as max + 1; ranks that own no expert would count in the
            # imbalance mean unasked.
            top = max(args.expert_ranks)
            parser.error(
                f"--expert-ranks names ranks up to {top} but rank(s) {','.join(map(str, empty))} own no expert; "
                f"pass --ranks {top + 1} to count {top + 1} ranks (the empty ones included), or number the ranks "
                f"0..{len(set(args.expert_ranks)) - 1}"
            )
    elif args.ranks is not None and num_experts % args.ranks:
        parser.error(f"--ranks {args.ranks} must divide the number of experts ({num_experts}); or give --expert-ranks")
    if args.ranks is not None:
        rank_kwargs["num_ranks"] = args.ranks

    header = ["q", "U", "P", "P-U", "padding %", "active", "eff. experts", "rows/expert"]
    if per_rank:
        header += ["max P/rank", "sum P/rank", "imbalance", "slowest"]
    rows = []
    rank_stats = None
    try:
        for q in args.tiles:
            s = tile_padding(counts_E, q)
            row = [
                str(q),
                str(int(s.useful)),
                str(int(s.executed)),
                str(int(s.padded)),
                f"{100.0 * float(s.fraction):.2f}",
                str(int(s.active_experts)),
                f"{float(s.effective_experts):.3f}",
                f"{float(s.mean_rows_per_expert):.3f}",
            ]
            if per_rank:
                rank_stats = per_rank_padding(counts_E, q, **rank_kwargs)
                row += [
                    str(int(rank_stats.executed_max)),
                    str(int(rank_stats.executed_sum)),
                    f"{float(rank_stats.imbalance):.3f}",
                    str(int(rank_stats.slowest_rank)),
                ]
            rows.append(row)
        cap = capacity_padding(counts_E, args.capacity) if args.capacity is not None else None
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))

    print(f"experts E = {num_experts}; tile-tail padding of the grouped GEMM (executed rows P per tile q)")
    print(_format_table(header, rows))
    if rank_stats is not None:
        num_ranks = rank_stats.executed_R.shape[0]
        if args.expert_ranks is not None:
            placement = "given placement"
        else:
            placement = f"contiguous, {num_experts // num_ranks} experts each"
        useful_R = ",".join(str(int(u)) for u in rank_stats.useful_R)
        print(
            f"ranks R = {num_ranks} ({placement}); useful rows per rank: {useful_R} "
            f"(max {int(rank_stats.useful_max)}, sum {int(rank_stats.useful_sum)})"
        )
    if args.gemm is not None:
        print("\n".join(_selector_lines(counts, args.gemm)))
    if cap is not None:
        print(
            f"capacity padding (C = {cap.capacity} rows/expert, buffer {int(cap.buffer_rows)} rows): "
            f"kept {int(cap.kept)}, dropped {int(cap.dropped)}, padded {int(cap.padded)} "
            f"({100.0 * float(cap.fraction):.2f}% of buffer)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
