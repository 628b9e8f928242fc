"""`--rebalance-every N`: each MoE layer runs an expert placement with replicas of hot experts
(`moe_jax.parallel.placement`), re-planned every N steps from the window's expert counts.

Between two training steps the host sums each layer's `counts_E` over the last N steps, plans a
new placement with the one in use as `previous` (as many slots as possible keep their expert),
and `moe_jax.parallel.replicas.rebalance` moves that layer's expert weights and AdamW moments to
it on device; the layer then gets the new placement, which recompiles the train and eval steps
(docs/placement.md). The first placement is planned from a uniform load: the spare slots hold
replicas spread over the ranks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from moe_jax.parallel.placement import imbalance, placement_moves, plan_placement, slots_per_rank_for
from moe_jax.parallel.replicas import rebalance


def _in_layer(path: tuple, layer: int) -> bool:
    """Whether a state path (model or optimizer state) lies under `blocks[layer].moe`."""
    return any(path[k:k + 3] == ("blocks", layer, "moe") for k in range(len(path) - 2))


class Rebalancer:
    """The placements in use (one per layer) and the between-steps rebalance."""

    def __init__(self, args, mesh):
        self.every, self.mesh, self.ep = args.rebalance_every, mesh, args.ep
        redundant = args.ep if args.redundant_slots is None else args.redundant_slots
        self.slots = slots_per_rank_for(args.experts, args.ep, redundant)
        if self.slots > args.experts:
            raise SystemExit(f"--redundant-slots {redundant}: {self.slots} slots per rank exceed the "
                             f"{args.experts} experts (a rank would hold an expert twice); use fewer")
        first = plan_placement(np.ones(args.experts), args.ep, self.slots)
        self.placements = (first,) * args.layers

    def due(self, done: int, last: bool) -> bool:
        return done % self.every == 0 and not last

    def rebalance(self, model, optimizer, history: list[dict], done: int) -> str:
        """Re-plan from the records of steps (done - N, done] and move every layer's expert slots
        and optimizer moments to its new placement; returns the log line."""
        window = [r for r in history if done - self.every < r["step"] <= done]
        counts_LE = np.sum([[layer["counts"] for layer in r["layers"]] for r in window], axis=0)
        old = self.placements
        new = plan_placement(counts_LE, self.ep, self.slots, previous=old)
        state = nnx.state((model, optimizer))
        variables = dict(nnx.to_flat_state(state))
        changed = remote = 0
        for i, (a, b) in enumerate(zip(old, new)):
            if a == b:
                continue
            moves = placement_moves(a, b)
            changed, remote = changed + moves.num_changed, remote + moves.num_remote
            mine = {path: v.get_value() for path, v in variables.items() if _in_layer(path, i)}
            for path, value in rebalance(mine, a, b, self.mesh).items():
                variables[path].set_value(value)
            moe = model.blocks[i].moe
            moe.expert_parallel = dataclasses.replace(moe.expert_parallel, placement=b)
        nnx.update((model, optimizer), state)
        self.placements = new
        before = max(imbalance(p, c) for p, c in zip(old, counts_LE))
        after = max(imbalance(p, c) for p, c in zip(new, counts_LE))
        return (f"step {done:>6} | rebalance: rank max/mean over the last {len(window)} steps {before:.3f} -> "
                f"{after:.3f} (worst layer, even split), {changed} slots moved ({remote} across ranks)")
