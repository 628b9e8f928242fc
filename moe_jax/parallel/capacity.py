"""Capacity of expert-parallel dispatch: how many rows one rank may send to one other.

Legend: T tokens per rank, K top-k, R = T*K routes, P ep size, El = E/P local experts, C capacity.

A capacity factor scales the balanced load `T*K/P` (GShard, Lepikhin et al. 2021; Switch
Transformer, Fedus et al. 2022, where the factor scales `T*K/E` per expert: C spread over a
destination's El experts is that per-expert capacity). Routes past a destination's C rows are
dropped and counted; `capacity=None` is dropless (C = R).
"""

from __future__ import annotations

import math

from moe_jax.validation import check_int, check_number

__all__ = ["capacity_for", "check_capacity_factor", "resolve_capacity"]


def check_capacity_factor(capacity_factor) -> float:
    """`capacity_factor` as a float; ValueError unless it is a finite number > 0 (1.0 = the balanced load)."""
    return check_number("capacity_factor", capacity_factor, hint=" (1.0 = the balanced load)")


def capacity_for(tokens_per_rank: int, top_k: int, ep_size: int, capacity_factor: float, *,
                 local_experts: int = 1) -> int:
    """Capacity C for `capacity_factor` times the balanced load: `ceil(cf * T*K / P)`.

    The result is clamped to `[min(local_experts, T*K), T*K]`: at least one row per local expert
    of the destination (below one row per expert a factor means nothing, and small batches such as
    decode hit this floor), and at most T*K, the dropless worst case (a larger buffer would only
    hold padding). Pass `local_experts=E // P`; the default 1 keeps one row per (source,
    destination) pair. Raises for non-positive sizes or a non-positive/non-finite factor.
    """
    tokens_per_rank = check_int("tokens_per_rank", tokens_per_rank)
    top_k = check_int("top_k", top_k)
    ep_size = check_int("ep_size", ep_size)
    local_experts = check_int("local_experts", local_experts)
    capacity_factor = check_capacity_factor(capacity_factor)
    routes = tokens_per_rank * top_k
    # Round away float noise first (1.1 * 100 / 10 is 11.000000000000002, not 12 rows' worth).
    cap = math.ceil(round(capacity_factor * routes / ep_size, 9))
    return max(min(local_experts, routes), min(cap, routes))


def resolve_capacity(capacity, routes: int, local_experts: int) -> int:
    """C for `ep_dispatch`: R when dropless (`None`), else `min(capacity, R)` (more than R rows can
    never fill). Below one row per local expert (C < min(El, R)) a capacity is an error, unless it
    covers all R routes anyway (few tokens, e.g. decode: every route fits and nothing can drop)."""
    if capacity is None:
        return routes
    capacity = check_int("capacity", capacity, minimum=None)
    floor = min(local_experts, routes)
    if capacity < floor:
        raise ValueError(
            f"capacity={capacity} is below one row per local expert: each destination owns "
            f"{local_experts} experts and this rank has {routes} routes, so capacity must be >= "
            f"{floor}. Use capacity=None for dropless dispatch or a larger capacity_factor."
        )
    return min(capacity, routes)
