"""`plan_sends` by stable sorts, with its signature: the definition the two backends are tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.platform import BackendName
from moe_jax.parallel.send_plan.api import (
    SendPlan,
    SendPlanTiles,
    block_starts,
    check_plan_args,
    send_ids,
    valid_and_dest,
)
from moe_jax.permute import exclusive_cumsum

__all__ = ["plan_sends_reference"]


def plan_sends_reference(
    expert_R: jax.Array, real_R: jax.Array | None = None, *, num_experts: int, ep: int, capacity: int,
    top_k: int, padded: bool, send_rows: int, backend: BackendName = "auto", tiles: SendPlanTiles = SendPlanTiles(),
) -> SendPlan:
    """`plan_sends` by stable sorts (`backend` and `tiles` are accepted for the signature and ignored)."""
    del backend, tiles
    check_plan_args(expert_R, real_R, num_experts, ep, capacity, top_k, padded, send_rows)
    routes = expert_R.shape[0]
    expert_R = expert_R.astype(jnp.int32)
    valid_R, dest_R = valid_and_dest(expert_R, real_R, num_experts, ep)
    r_R = jnp.arange(routes, dtype=jnp.int32)
    # Rank among the valid routes to the same destination, in route order.
    by_dest = jnp.argsort(dest_R, stable=True)
    send_counts_P = jnp.sum(dest_R[:, None] == jnp.arange(ep)[None, :], axis=0, dtype=jnp.int32)
    dest_rank_R = jnp.zeros((routes,), jnp.int32).at[by_dest].set(
        r_R - exclusive_cumsum(jnp.append(send_counts_P, routes))[dest_R[by_dest]])
    keep_R = valid_R & (dest_rank_R < capacity)
    # Kept routes sorted by (expert, route): blocks by destination, then local expert.
    by_expert = jnp.argsort(jnp.where(keep_R, expert_R, num_experts), stable=True)
    kept_E = jnp.sum((expert_R[:, None] == jnp.arange(num_experts)[None, :]) & keep_R[:, None], axis=0, dtype=jnp.int32)
    kept_PE = kept_E.reshape(ep, num_experts // ep)
    send_sizes_P = kept_PE.sum(axis=1)
    position_R = jnp.zeros((routes,), jnp.int32).at[by_expert].set(r_R)
    safe_dest_R = jnp.minimum(dest_R, ep - 1)
    slot_R = position_R - exclusive_cumsum(send_sizes_P)[safe_dest_R]
    route_row_R = jnp.where(keep_R, block_starts(send_sizes_P, capacity, padded)[safe_dest_R] + slot_R, -1)
    return SendPlan(route_row_R, send_ids(route_row_R, top_k, send_rows), kept_PE, send_counts_P, send_sizes_P)
