"""The run's figure `train_moe.png`, drawn from the `metrics.json` records."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def require_matplotlib():
    """`matplotlib.pyplot` on the Agg backend; SystemExit naming the fix when matplotlib is missing.

    The run calls this before training, so a missing extra stops it at once, not after the last step.
    """
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "the run's figure (OUT/train_moe.png) needs matplotlib, which is not installed: install the examples "
            "extra (pip install -e '.[examples]') or pass --no-plot."
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_metrics(history: list[dict], val: list[dict], path: Path) -> None:
    """Loss curves, padding fraction and per-layer expert load (heatmap) over steps, as a PNG."""
    plt = require_matplotlib()

    steps = np.array([r["step"] for r in history])
    num_layers = len(history[0]["layers"])
    fig, axes = plt.subplots(
        2 + num_layers, 1, figsize=(9, 5 + 2.2 * num_layers), sharex=True, squeeze=False,
        gridspec_kw={"height_ratios": [2, 1] + [1.2] * num_layers},
    )
    axes = axes[:, 0]
    ax = axes[0]
    ce = np.array([r["ce"] for r in history])
    ax.plot(steps, ce, lw=0.6, alpha=0.35, color="C0")
    window = max(1, len(ce) // 30)
    smooth = np.convolve(ce, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1 :], smooth, lw=1.5, color="C0", label=f"train cross-entropy ({window}-step mean)")
    if val:
        ax.plot([v["step"] for v in val], [v["loss"] for v in val], "o-", color="C1", label="val cross-entropy")
    ax.set_ylabel("nats / byte")
    ax.set_title("Loss")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[1]
    for i in range(num_layers):
        ax.plot(steps, [r["layers"][i]["padding_fraction"] for r in history], lw=1, color=f"C{i}",
                label=f"layer {i} padding")
        load_NE = np.array([r["layers"][i]["load"] for r in history])
        cv = load_NE.std(axis=1) / np.maximum(load_NE.mean(axis=1), 1e-12)
        ax.plot(steps, cv, lw=1, ls="--", color=f"C{i}", label=f"layer {i} load CV")
    ax.set_ylabel("fraction / CV")
    ax.set_title("Grouped-GEMM padding fraction and expert-load coefficient of variation")
    ax.legend(fontsize="small", ncol=2)
    ax.grid(alpha=0.3)

    for i in range(num_layers):
        ax = axes[2 + i]
        load_EN = np.array([r["layers"][i]["load"] for r in history]).T
        num_experts = load_EN.shape[0]
        image = ax.imshow(
            load_EN * num_experts, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, num_experts - 0.5),
        )
        ax.set_ylabel("expert")
        ax.set_title(f"Layer {i}: expert load x E (1 = balanced)")
        # An inset colorbar keeps this axis as wide as the line plots above it.
        fig.colorbar(image, cax=ax.inset_axes((1.01, 0.0, 0.015, 1.0)))
    axes[-1].set_xlabel("step")
    fig.tight_layout(rect=(0, 0, 0.95, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
