"""Markdown and JSON of `StepPlan`s: one row per layout family and R, the winner and why, the
placement replication would use, and (optionally) every rank.

Legend: R ranks, S slots per rank, E experts.
"""

from __future__ import annotations

import numpy as np

from moe_jax.parallel.placement import Placement
from moe_jax.scaleout.model import PHASES, LayoutResult, StepPlan

__all__ = ["markdown", "per_rank_markdown", "placement_summary", "to_json"]

HEADER = ("| R | layout | rows/rank max | mean | max/mean | tile (gate/up) | padding % (max rank) | useful FLOPs % | "
          "exchanged MB/rank max | network MB/port max | experts ms max / mean | exchange ms | layer ms (slowest) | "
          "mean rank ms | weights MB/rank |")
RULE = "|" + "---|" * (HEADER.count("|") - 1)


def placement_summary(placement: Placement | None, top: int = 6) -> str:
    """'S=3, 64 redundant slots, 23 experts replicated; most replicas: e57 x23, ...'."""
    if placement is None:
        return ""
    reps = placement.replicas_E
    order = np.lexsort((np.arange(reps.size), -reps))
    most = ", ".join(f"e{int(e)} x{int(reps[e])}" for e in order[:top] if reps[e] > 1)
    return (f"S={placement.slots_per_rank}, {placement.num_redundant} redundant slots, "
            f"{int((reps > 1).sum())} experts replicated" + (f"; most replicas: {most}" if most else ""))


def _row(res: LayoutResult) -> str:
    ms = 1e3
    exp = res.phase_seconds["experts"]
    return (f"| {res.layout.ranks} | {res.name} | {int(res.rows_R.max())} | {res.rows_R.mean():.0f} | "
            f"{res.rows_imbalance:.2f} | {res.tiles_gate_up.block_m} ({res.tiles_gate_up.kernel}, {res.tiles_gate_up.how}) | "
            f"{100 * res.padding_R.max():.1f} | {100 * res.useful_flop_fraction:.0f} | "
            f"{np.maximum(res.send_bytes_R, res.recv_bytes_R).max() / 1e6:.0f} | {res.network_bytes_R.max() / 1e6:.0f} | "
            f"{ms * exp.max():.2f} / {ms * exp.mean():.2f} | {ms * res.exchange_max_s:.2f} | "
            f"**{ms * res.layer_s:.2f}** | {ms * res.mean_s:.2f} | {res.weight_bytes_R.max() / 1e6:.0f} |")


def markdown(plans: list[StepPlan]) -> str:
    """The table of every plan (rows grouped by R), then per R the winner, the reason, the
    placement of EP+replication and the layouts that do not fit."""
    lines = [HEADER, RULE]
    for plan in plans:
        for res in sorted(plan.results.values(), key=lambda r: r.layer_s):
            lines.append(_row(res))
    lines.append("")
    for plan in plans:
        lines.append(f"- R = {plan.ranks}: **{plan.winner}** wins. {plan.reason}.")
        rep = plan.results.get("EP+replication")
        if rep is not None:
            lines.append(f"  Placement: {placement_summary(rep.work.placement)}.")
        if plan.results.get("EP") is not None and plan.results["EP"].dropped:
            lines.append(f"  EP drops {plan.results['EP'].dropped} routes at its capacity.")
        for kind, why in plan.skipped.items():
            lines.append(f"  {kind}: does not fit ({why}).")
    return "\n".join(lines)


def per_rank_markdown(plan: StepPlan) -> str:
    """Every rank of every layout of one plan."""
    out = []
    for res in sorted(plan.results.values(), key=lambda r: r.layer_s):
        out += [f"#### {res.name} (R = {plan.ranks}, {plan.load_name})", "",
                "| rank | rows | executed | padding % | sent MB | received MB | network MB | "
                + " | ".join(f"{p} ms" for p in PHASES) + " | total ms |",
                "|" + "---|" * (8 + len(PHASES))]
        total = sum(res.phase_seconds.values())
        for r in range(plan.ranks):
            out.append(f"| {r} | {int(res.rows_R[r])} | {int(res.executed_R[r])} | {100 * res.padding_R[r]:.1f} | "
                       f"{res.send_bytes_R[r] / 1e6:.1f} | {res.recv_bytes_R[r] / 1e6:.1f} | "
                       f"{res.network_bytes_R[r] / 1e6:.1f} | "
                       + " | ".join(f"{1e3 * res.phase_seconds[p][r]:.3f}" for p in PHASES)
                       + f" | {1e3 * total[r]:.3f} |")
        out.append("")
    return "\n".join(out)


def _result_json(res: LayoutResult) -> dict:
    placement = res.work.placement
    return {
        "layout": res.name, "kind": res.layout.kind, "ep": res.layout.ep, "tp": res.layout.tp,
        "data": res.layout.data, "groups_per_rank": res.layout.groups,
        "tiles_gate_up": res.tiles_gate_up._asdict(), "tiles_down": res.tiles_down._asdict(),
        "gemm_rows_planned": int(res.work.gemm_rows),
        "layer_ms": 1e3 * res.layer_s, "mean_rank_ms": 1e3 * res.mean_s, "slowest_rank": res.slowest_rank,
        "rows_imbalance": res.rows_imbalance, "useful_flop_fraction": res.useful_flop_fraction,
        "dropped": res.dropped,
        "per_rank": {
            "rows": res.rows_R.astype(int).tolist(), "executed_rows": res.executed_R.astype(int).tolist(),
            "padding": np.round(res.padding_R, 6).tolist(), "sent_bytes": res.send_bytes_R.tolist(),
            "received_bytes": res.recv_bytes_R.tolist(), "network_bytes": res.network_bytes_R.tolist(),
            "weight_bytes": res.weight_bytes_R.tolist(),
            **{f"{p.replace(' ', '_')}_ms": (1e3 * res.phase_seconds[p]).tolist() for p in PHASES},
        },
        "placement": None if placement is None else {
            "slot_expert_RS": placement.slot_expert_RS.tolist(), "replicas_E": placement.replicas_E.tolist(),
            "summary": placement_summary(placement)},
    }


def to_json(plans: list[StepPlan], meta: dict) -> dict:
    """A JSON-ready dict: `meta` and per plan the winner, the reason and every layout per rank."""
    return {"meta": meta, "plans": [
        {"ranks": p.ranks, "load": p.load_name, "winner": p.winner, "reason": p.reason, "skipped": p.skipped,
         "counts_E": p.counts_SE.sum(axis=0).astype(int).tolist(),
         "layouts": {k: _result_json(v) for k, v in p.results.items()}} for p in plans]}
