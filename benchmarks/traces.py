"""Routing traces from a trained example run: per-layer expert counts at training (prefill-sized)
steps and in a decode loop of the trained model, written as one small `.npz`.

    python examples/train_moe.py --out runs/trace          # or any example run directory
    python -m benchmarks.traces runs/trace --out benchmarks/data/expert_counts.npz

Keys: `train/step{S}/layer{L}`: the counts of one logged training step (batch x seq tokens, top-k),
from the run's `metrics.json`; `decode/T{T}/layer{L}`: the routes of the newest token of T
sequences (prefixes of held-out text, one token per sequence, as one decode step of a batch of T
sequences routes them), from the run's last checkpoint. Every array is int64 `[E]`. The sweep
(`python -m benchmarks.routed_gmm sweep --traces PATH`) rescales each onto a benchmark shape's
experts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def train_traces(run: Path) -> dict[str, np.ndarray]:
    """Counts per logged step and layer from `run/metrics.json` (records written with `counts`)."""
    history = json.loads((run / "metrics.json").read_text())["history"]
    out = {}
    for record in history:
        for layer, stats in enumerate(record["layers"]):
            if "counts" not in stats:
                raise ValueError(f"{run / 'metrics.json'} has no per-expert counts (written by an older example); "
                                 "rerun the example to record them.")
            out[f"train/step{record['step']}/layer{layer}"] = np.asarray(stats["counts"], np.int64)
    return out


def decode_traces(run: Path, tokens: tuple[int, ...] = DECODE_TOKENS, seed: int = 0) -> dict[str, np.ndarray]:
    """The newest token's routes per layer for T held-out prefixes, from `run`'s last checkpoint."""
    import jax
    from flax import nnx

    from examples.moe_lm.checkpoints import Checkpoints
    from examples.moe_lm.data import load_corpus, split_corpus
    from examples.moe_lm.model import ModelConfig, MoETransformer
    from examples.moe_lm.steps import make_optimizer

    args = argparse.Namespace(**json.loads((run / "config.json").read_text())["args"])
    args.data = Path(args.data) if args.data else None
    args.out = run
    cfg = ModelConfig.from_args(args)
    model = MoETransformer(cfg, rngs=nnx.Rngs(args.seed))
    with Checkpoints(run / "checkpoints") as ckpt:
        ckpt.restore(model, make_optimizer(model, args))
    val = split_corpus(load_corpus(args.data), args.val_fraction, args.seq).val
    route = nnx.jit(lambda m, t: m(t, return_routing=True)[2])
    rng = np.random.default_rng(seed)
    out = {}
    for t in tokens:
        # Prefixes of random lengths: the newest token sits at a random position, as in a batch of
        # sequences at different points of their generation.
        lengths = rng.integers(1, args.seq + 1, size=t)
        starts = rng.integers(0, len(val) - args.seq, size=t)
        windows = val[starts[:, None] + np.arange(args.seq)].astype(np.int32)
        for layer, routing in enumerate(route(model, jax.numpy.asarray(windows))):
            idx_BSK = np.asarray(routing.expert_idx_TK).reshape(t, args.seq, -1)
            newest = idx_BSK[np.arange(t), lengths - 1]  # causal: later positions do not change it
            out[f"decode/T{t}/layer{layer}"] = np.bincount(newest.ravel(), minlength=args.experts).astype(np.int64)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="an example run directory (metrics.json, config.json, checkpoints/)")
    p.add_argument("--out", type=Path, required=True, help="the .npz to write")
    args = p.parse_args(argv)
    traces = {**train_traces(args.run), **decode_traces(args.run)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **traces)
    print(f"wrote {args.out}: {len(traces)} histograms")


if __name__ == "__main__":
    main()
