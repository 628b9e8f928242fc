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
    executed_rows: int32 scalar, rows the gate/up grouped GEMM executes, `sum_e ceil(t_e / bm) * bm`
      at the tile height bm of the kernel that ran (its plan's: on `pallas_triton` the selector's
      pick with `GemmOptions(kernel="auto")`, the shape table's with `"static"`; on `triton` and
      `mosaic_gpu` their own tiles), summed over devices; on the xla backend the useful rows
      (XLA's tiling is its own, so no tile padding is claimed). Under a mesh this is per-device
      grouping, so it can exceed the single-device figure.
    executed_rows_max: int32 scalar, the largest single device's executed rows (the slowest rank).
    useful_rows: int32 scalar, rows fed to the grouped GEMMs (U), summed over devices.
    useful_rows_max: int32 scalar, the largest single device's U.
    kernel_counts_C: int32 `[C]`, devices whose gate/up GEMM ran each `moe_jax.ops.CANDIDATES`
      member (in its order; all zero on the backends without those candidates: `triton`,
      `mosaic_gpu`, `xla`).
    padding_fraction: f32 scalar, (executed_rows - useful_rows) / executed_rows.
    dropped: int32 scalar, routes of real tokens that reached no expert: dropped by EP capacity (0 when
      dropless or without ep > 1), plus those of an injected routing whose expert id lies outside
      [0, E) (traced ids; concrete ones are refused), counted alike on one device and on every mesh.
    dropped_E: int32 `[E]`, the capacity drops per expert (`counts_E - dropped_E` is what the experts
      executed); ids outside [0, E) have no slot here nor in `counts_E`: `dropped - sum(dropped_E)`
      counts them.
    """

    aux_loss: jax.Array
    seq_aux_loss: jax.Array
    z_loss: jax.Array
    counts_E: jax.Array
    tokens: jax.Array
    executed_rows: jax.Array
    executed_rows_max: jax.Array
    useful_rows: jax.Array
    useful_rows_max: jax.Array
    kernel_counts_C: jax.Array
    padding_fraction: jax.Array
    dropped: jax.Array
    dropped_E: jax.Array


def moe_stats(routing: routing_lib.Routing, *, z_loss, mask_T, seq_BS: tuple[int, int], num_experts: int,
              gemm, dropped, kept_E) -> MoEStats:
    """`MoEStats` of one call from its routing of T = B*S tokens (`seq_BS = (B, S)`), the real-token
    mask (None: all real), the routed stage's GEMM telemetry `gemm` (executed and useful rows, sums
    and maxima, kernel counts) and drops (`kept_E`: delivered routes per expert, None where nothing
    can drop)."""
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
        executed_rows=gemm.executed_rows,
        executed_rows_max=gemm.executed_rows_max,
        useful_rows=gemm.useful_rows,
        useful_rows_max=gemm.useful_rows_max,
        kernel_counts_C=gemm.kernel_counts_C,
        padding_fraction=jnp.where(
            gemm.executed_rows > 0,
            (gemm.executed_rows - gemm.useful_rows) / jnp.maximum(gemm.executed_rows, 1), 0.0,
        ).astype(jnp.float32),
        dropped=dropped,
        dropped_E=jnp.zeros((num_experts,), jnp.int32) if kept_E is None else counts_E - kept_E,
    )
