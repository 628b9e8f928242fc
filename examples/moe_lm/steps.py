"""One training step and one validation step, each a single `nnx.jit`-compiled function.

The train step runs forward, cross-entropy plus the `--balance` terms, backward, the AdamW update
and, for `loss_free`, the selection-bias update from the step's expert counts (after the
gradient, so the bias is feedback and never differentiated).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax
from flax import nnx

from moe_jax.layers import MoEStats

from .model import MoETransformer

# The choices of --balance (how `make_train_step` adds the balancing term).
BALANCE_METHODS = ("aux", "seq_aux", "loss_free", "none")


class StepMetrics(NamedTuple):
    """What one training step reports (device arrays; L layers, E experts)."""

    loss: jax.Array  # total objective
    ce: jax.Array  # next-byte cross-entropy (nats)
    grad_norm: jax.Array
    lr: jax.Array
    stats: MoEStats  # per layer, stacked: counts_E [L, E], scalars [L] (all logged whatever --balance is)


def make_schedule(args) -> optax.Schedule:
    warmup = min(args.warmup, args.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=args.lr, warmup_steps=warmup,
        decay_steps=max(args.steps, warmup + 1), end_value=args.lr * 0.1,
    )


def make_optimizer(model: MoETransformer, args) -> nnx.Optimizer:
    """AdamW (decay on matrices only) after global-norm clipping, on the model's `nnx.Param`s.

    The selection biases are `SelectionBias` variables, not `Param`s, so the optimizer never
    touches them.
    """
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(make_schedule(args), b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask),
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS).mean()


def make_train_step(args):
    """The jitted step `(model, optimizer, inputs_BS, targets_BS) -> StepMetrics` (updates in place)."""
    schedule = make_schedule(args)
    balance, aux_coef, z_coef, bias_rate = args.balance, args.aux_coef, args.z_coef, args.bias_rate

    def loss_fn(model, inputs_BS, targets_BS):
        logits_BSV, stats = model(inputs_BS)
        ce = cross_entropy(logits_BSV, targets_BS)
        loss = ce + z_coef * stats.z_loss.sum()
        if balance == "aux":
            loss = loss + aux_coef * stats.aux_loss.sum()
        elif balance == "seq_aux":
            loss = loss + aux_coef * stats.seq_aux_loss.sum()
        return loss, (ce, stats)

    @nnx.jit
    def train_step(model, optimizer, inputs_BS, targets_BS):
        step = optimizer.step[...]
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)  # w.r.t. nnx.Param only
        (loss, (ce, stats)), grads = grad_fn(model, inputs_BS, targets_BS)
        optimizer.update(model, grads)
        if balance == "loss_free":
            for block, counts_E in zip(model.blocks, stats.counts_E):
                block.moe.update_selection_bias(counts_E, bias_rate)
        return StepMetrics(loss=loss, ce=ce, grad_norm=optax.tree.norm(grads), lr=schedule(step), stats=stats)

    return train_step


@nnx.jit
def eval_step(model, inputs_BS, targets_BS):
    logits_BSV, _ = model(inputs_BS)
    return cross_entropy(logits_BSV, targets_BS)
