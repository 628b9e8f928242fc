"""What one MoE call reports: the balancing losses and the load and padding figures."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax import routing as routing_lib

__all__ = ["MoEStats", "moe_stats"]


class MoEStats(NamedTuple):
    """What one MoE call reports for logging and auxiliary losses (global over all devices).

    aux_loss: f32 scalar, Switch/Megatron balance loss over real tokens (`routing.aux_loss`).
    seq_aux_loss: f32 scalar, DeepSeek-V3 sequence-wise loss; a `[T, D]` input is one sequence.
    z_loss: f32 scalar, router z-loss (0 with an injected routing: there are no logits).
    counts_E: int32 `[E]`, real routes per expert (masked tokens excluded).
    tokens: int32 scalar, real tokens.
    executed_rows: int32 scalar, rows the grouped GEMMs execute: on the Pallas backend at the
      tile height of the candidate that runs (`gmm_config(...).tiles.block_m` of the packed
      shape), summed over every device's GEMM of `sum_e ceil(t_e / bm) * bm`; on the xla backend
      the useful rows (XLA's tiling is its own, so no tile padding is claimed). Under a mesh this
      is per-device grouping, so it can exceed the single-device figure.
    padding_fraction: f32 scalar, (executed_rows - rows fed to the GEMMs) / executed_rows.
    dropped: int32 scalar, routes dropped by EP capacity (0 when dropless or without ep > 1).
    dropped_E: int32 `[E]`, those drops per expert (`counts_E - dropped_E` is what the experts
      executed).
    """

    aux_loss: jax.Array
    seq_aux_loss: jax.Array
    z_loss: jax.Array
    counts_E: jax.Array
    tokens: jax.Array
    executed_rows: jax.Array
    padding_fraction: jax.Array
    dropped: jax.Array
    dropped_E: jax.Array


def moe_stats(routing: routing_lib.Routing, *, z_loss, mask_T, seq_BS: tuple[int, int], num_experts: int,
              executed_rows, gemm_rows, dropped, kept_E) -> MoEStats:
    """`MoEStats` of one call from its routing of T = B*S tokens (`seq_BS = (B, S)`), the real-token
    mask (None: all real) and the routed stage's row counts (`kept_E`: delivered routes per expert,
    None where nothing can drop)."""
    idx_TK, probs_TE = routing.expert_idx_TK, routing.probs_TE
    num_tokens, top_k = idx_TK.shape
    counts_E = routing_lib.expert_counts(idx_TK, num_experts, mask_T=mask_T)
    return MoEStats(
        aux_loss=routing_lib.aux_loss(probs_TE, idx_TK, mask_T=mask_T),
        seq_aux_loss=routing_lib.seq_aux_loss(
            probs_TE.reshape(seq_BS + (num_experts,)), idx_TK.reshape(seq_BS + (top_k,)),
            mask_BS=None if mask_T is None else mask_T.reshape(seq_BS),
        ),
        z_loss=z_loss,
        counts_E=counts_E,
        tokens=jnp.asarray(num_tokens if mask_T is None else jnp.sum(mask_T, dtype=jnp.int32), jnp.int32),
        executed_rows=executed_rows,
        padding_fraction=jnp.where(
            executed_rows > 0, (executed_rows - gemm_rows) / jnp.maximum(executed_rows, 1), 0.0
        ).astype(jnp.float32),
        dropped=dropped,
        dropped_E=jnp.zeros((num_experts,), jnp.int32) if kept_E is None else counts_E - kept_E,
    )
