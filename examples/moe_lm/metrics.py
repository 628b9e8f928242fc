"""Per-step metrics records: the JSON record of `metrics.json`, its log line, and its reload on resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moe_jax.parallel.placement import rank_loads

from .steps import StepMetrics


def history_record(step: int, m: StepMetrics, ep: int, placements=None) -> dict:
    """One JSON-able record of a step's (host) metrics; `placements` (one per layer, or None for
    the contiguous layout) are the expert placements the step ran."""
    layers = []
    for i, counts_E in enumerate(np.asarray(m.stats.counts_E)):
        layer = {
            "aux": float(m.stats.aux_loss[i]),
            "seq_aux": float(m.stats.seq_aux_loss[i]),
            "z": float(m.stats.z_loss[i]),
            # fraction of routes per expert; 1/E each when balanced
            "load": [round(float(c), 6) for c in counts_E / max(counts_E.sum(), 1)],
            "counts": [int(c) for c in counts_E],  # routes per expert (the routing trace)
            "padding_fraction": float(m.stats.padding_fraction[i]),
            "dropped": int(m.stats.dropped[i]),
        }
        if ep > 1:
            # The slowest EP rank sets the layer's latency: its routed rows over the mean rank's
            # (before tile padding; host numpy). Contiguous layout: E/ep experts per rank; with a
            # placement, each expert's rows split evenly over its replicas (within a row per slot).
            if placements is None:
                rows = counts_E.reshape(ep, -1).sum(axis=1)
            else:
                rows = np.rint(rank_loads(placements[i], counts_E)).astype(np.int64)
            layer["rank_rows"] = [int(r) for r in rows]
            layer["rank_imbalance"] = float(rows.max() / rows.mean()) if rows.sum() else 1.0
        layers.append(layer)
    return {
        "step": step, "loss": float(m.loss), "ce": float(m.ce), "lr": float(m.lr),
        "grad_norm": float(m.grad_norm), "layers": layers,
    }


def format_log(record: dict, tokens_per_s: float) -> str:
    lines = [
        f"step {record['step']:>6} | loss {record['loss']:.4f} ce {record['ce']:.4f} | "
        f"lr {record['lr']:.2e} | grad {record['grad_norm']:.3f} | {tokens_per_s:,.0f} tok/s"
    ]
    for i, layer in enumerate(record["layers"]):
        load = np.asarray(layer["load"])
        cv = load.std() / max(load.mean(), 1e-12)
        lines.append(
            f"    layer {i}: aux {layer['aux']:.3f} seq_aux {layer['seq_aux']:.3f} z {layer['z']:.3f} | "
            f"load min {load.min():.3f} max {load.max():.3f} cv {cv:.3f} | "
            f"padding {layer['padding_fraction']:.3f} | dropped {layer['dropped']}"
            + (f" | rank rows max/mean {layer['rank_imbalance']:.2f}" if "rank_imbalance" in layer else "")
        )
    return "\n".join(lines)


def load_metrics(path: Path, upto_step: int) -> tuple[list[dict], list[dict]]:
    """History and validation records of a previous run, up to its checkpointed step."""
    if not path.is_file():
        return [], []
    saved = json.loads(path.read_text())
    history = [r for r in saved.get("history", []) if r["step"] <= upto_step]
    val = [v for v in saved.get("val", []) if v["step"] <= upto_step]
    return history, val
