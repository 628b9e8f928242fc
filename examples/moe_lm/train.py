"""The training loop: build (or restore) model and optimizer, step, log, evaluate, checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from .checkpoints import Checkpoints
from .data import Split, train_batch, val_batches
from .metrics import format_log, history_record, load_metrics
from .model import ModelConfig, MoETransformer
from .placement import Rebalancer
from .runtime import to_device
from .steps import StepMetrics, eval_step, make_optimizer, make_train_step


def train(args, split: Split, mesh, ckpt: Checkpoints, resume_from: int | None, say, is_main: bool) -> dict:
    """Build (or restore) model and optimizer and run the steps; writes metrics at checkpoints."""
    out = args.out
    cfg = ModelConfig.from_args(args)
    # One compiled initialiser instead of a dispatch (and a compilation) per parameter.
    rebalancer = Rebalancer(args, mesh) if args.rebalance_every is not None else None
    placements = None if rebalancer is None else rebalancer.placements
    model = nnx.jit(lambda: MoETransformer(cfg, mesh=mesh, placements=placements, rngs=nnx.Rngs(args.seed)))()
    optimizer = make_optimizer(model, args)
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    say(f"model: {num_params:,} parameters, {args.layers} MoE layers of {args.experts} experts (top-{args.top_k})")

    start, history, val = 0, [], []
    if resume_from is not None:
        start = ckpt.restore(model, optimizer)
        history, val = load_metrics(out / "metrics.json", start)
        say(f"resumed from step {start}")
    if is_main:
        (out / "config.json").write_text(json.dumps({"args": _json_args(args)}, indent=2))

    train_step = make_train_step(args)
    val_data = [tuple(to_device(a, mesh) for a in b) for b in val_batches(split.val, args)]
    pending: list[tuple[int, StepMetrics]] = []  # device metrics not yet copied to the host
    t_start = t_log = time.perf_counter()
    last_log = start

    def metrics() -> dict:
        return {
            "args": _json_args(args), "history": history, "val": val, "start_step": start,
            "train_wall_s": time.perf_counter() - t_start,
        }

    def collect() -> None:
        # One host transfer per log interval keeps the device queue full in between.
        # Called before every rebalance, so the pending steps all ran the placements in use.
        placements = None if rebalancer is None else rebalancer.placements
        history.extend(history_record(done, m, args.ep or 1, placements) for done, m in jax.device_get(pending))
        pending.clear()

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train", disable=not is_main)
    for step in bar:
        inputs, targets = (to_device(a, mesh) for a in train_batch(split.train, args, step))
        done = step + 1  # updates applied after this step: the numbering of logs and checkpoints
        pending.append((done, train_step(model, optimizer, inputs, targets)))
        last = done == args.steps
        if done % args.log_every == 0 or last:
            collect()
            now = time.perf_counter()
            say(format_log(history[-1], (done - last_log) * args.batch * args.seq / max(now - t_log, 1e-9)))
            t_log, last_log = now, done
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
        if done % args.eval_every == 0 or last:
            loss = float(np.mean([float(eval_step(model, x, y)) for x, y in val_data]))
            val.append({"step": done, "loss": loss})
            say(f"step {done:>6} | val loss {loss:.4f}")
        if done % args.ckpt_every == 0 or last:
            collect()
            ckpt.save(done, model, optimizer)
            if is_main:  # metrics up to the checkpoint survive a crash; --resume truncates to it
                (out / "metrics.json").write_text(json.dumps(metrics()))
        if rebalancer is not None and rebalancer.due(done, last):
            collect()
            say(rebalancer.rebalance(model, optimizer, history, done))
    bar.close()
    return metrics()


def _json_args(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
