"""Padding planner for grouped GEMMs under routing skew.

Legend: E experts, R ranks (or peers), q the row-tile height of the grouped GEMM, t_e the rows
(token assignments) routed to expert e.

The grouped GEMM (`moe_jax.ops`) schedules, for each expert, ``ceil(t_e / q)`` row tiles of ``q``
rows counted from the expert's first row, so it executes ``P = sum_e q * ceil(t_e / q)`` rows for
``U = sum_e t_e`` useful ones; an empty expert costs nothing. ``P`` depends on the whole
histogram, not on ``U`` alone: ``[17,17,17,17,16,16,16,16]`` and ``[100,32,0,0,0,0,0,0]`` both have
``U = 132`` but ``P = 256`` vs ``160`` at ``q = 32``.

Three kinds of padding are kept apart on purpose (one "padding percent" that mixes them points
tuning at the wrong component):

* tile-tail padding inside the MMA tile: `tile_padding`, and per rank `per_rank_padding`;
* capacity padding of fixed per-expert buffers before the grouped op: `capacity_padding`;
* communication padding of fixed all-to-all buffers: `communication_padding`.

Everything is `jnp` and `jit`/`vmap`-safe: counts may be traced int32 arrays and no function
copies them to the host. Arguments that fix shapes or tile sizes (``tile``, ``capacity``,
``num_ranks``, ...) are static Python ints and stay static fields of the result pytrees, so a
result that comes out of `jax.jit` still has ``stats.tile == 8``. Values are checked only when
they are concrete: negative concrete counts raise `ValueError`; inside `jit` a negative count is
treated as 0 (like `moe_jax.ops.metadata`), and totals are assumed to fit in int32.

Run ``python -m moe_jax.padding --help`` for the command-line planner (`moe_jax.padding.cli`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.validation import check_int

__all__ = [
    "PaddingStats",
    "RankPadding",
    "CapacityPadding",
    "CommPadding",
    "executed_rows",
    "tile_padding",
    "per_rank_padding",
    "capacity_padding",
    "communication_padding",
]

_INT32_MAX = int(np.iinfo(np.int32).max)


# --------------------------------------------------------------------------------------------
# Result types. Each is a NamedTuple registered as a pytree whose first field (a Python int) is
# static aux data, so it survives jit/vmap unchanged; every other field is a jnp array.
# --------------------------------------------------------------------------------------------


class PaddingStats(NamedTuple):
    """Tile-tail padding of one grouped GEMM (all arrays are scalars).

    tile: q, the row-tile height (static Python int).
    useful: U = sum t_e (int32).
    executed: P = sum q * ceil(t_e / q) (int32).
    padded: P - U (int32).
    fraction: (P - U) / P (float32); 0 when P == 0.
    active_experts: experts with t_e > 0 (int32).
    effective_experts: U^2 / sum t_e^2 (float32, DA-MoE); E under uniform routing, -> 1 when one
      expert takes everything; 0 when U == 0.
    mean_rows_per_expert: U / E over all E experts (float32), the expected matrix height.
    """

    tile: int
    useful: jax.Array
    executed: jax.Array
    padded: jax.Array
    fraction: jax.Array
    active_experts: jax.Array
    effective_experts: jax.Array
    mean_rows_per_expert: jax.Array


class RankPadding(NamedTuple):
    """Tile-tail padding per expert-parallel rank.

    tile: q (static Python int).
    useful_R, executed_R, padded_R: int32 [R], per-rank U, P and P - U.
    fraction_R: float32 [R], padded_R / executed_R (0 where a rank executes nothing).
    executed_max, executed_sum: int32 scalars; executed_sum equals the global P.
    useful_max, useful_sum: int32 scalars; useful_sum equals the global U.
    imbalance: float32, executed_max / mean(executed_R); 1.0 when every rank executes nothing.
    slowest_rank: int32, the rank with the most executed rows (lowest index on ties).

    The maximum, not the sum, sets layer latency: report it beside the sum.
    """

    tile: int
    useful_R: jax.Array
    executed_R: jax.Array
    padded_R: jax.Array
    fraction_R: jax.Array
    executed_max: jax.Array
    executed_sum: jax.Array
    useful_max: jax.Array
    useful_sum: jax.Array
    imbalance: jax.Array
    slowest_rank: jax.Array


class CapacityPadding(NamedTuple):
    """Padding and drops of fixed per-expert buffers of `capacity` rows.

    capacity: C rows per expert (static Python int).
    kept_E, dropped_E: int32 [E], min(t_e, C) and t_e - min(t_e, C).
    kept, dropped: int32 totals of those.
    buffer_rows: int32, E * C.
    padded: int32, buffer_rows - kept.
    fraction: float32, padded / buffer_rows.
    drop_fraction: float32, dropped / U (0 when U == 0).
    """

    capacity: int
    kept_E: jax.Array
    dropped_E: jax.Array
    kept: jax.Array
    dropped: jax.Array
    buffer_rows: jax.Array
    padded: jax.Array
    fraction: jax.Array
    drop_fraction: jax.Array


class CommPadding(NamedTuple):
    """Padding of an all-to-all that sends a fixed buffer of `buffer_rows_per_peer` rows to each peer.

    buffer_rows_per_peer: cap (static Python int).
    payload: int32, sum min(c_r, cap), the rows actually carried.
    overflow: int32, sum max(c_r - cap, 0), rows that do not fit (dropped or sent again).
    buffer_rows: int32, R * cap.
    padded: int32, buffer_rows - payload.
    fraction: float32, padded / buffer_rows.
    """

    buffer_rows_per_peer: int
    payload: jax.Array
    overflow: jax.Array
    buffer_rows: jax.Array
    padded: jax.Array
    fraction: jax.Array


def _register_with_static_head(cls: type) -> None:
    def flatten(obj):
        return tuple(obj[1:]), obj[0]

    def unflatten(head, children):
        return cls(head, *children)

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)


for _cls in (PaddingStats, RankPadding, CapacityPadding, CommPadding):
    _register_with_static_head(_cls)
del _cls


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _static_int(value, name: str, *, minimum: int = 1) -> int:
    """A static Python int >= minimum that fits in int32, or TypeError/ValueError naming `name`."""
    value = check_int(name, value, minimum=minimum)
    if value > _INT32_MAX:
        raise ValueError(f"{name} must fit in int32, got {value}")
    return value


def _int_vector(x, name: str):
    """Check that `x` is a 1-D integer vector with at least one entry.

    Returns `(array_int32, host_values)`: host_values is an int64 numpy copy when `x` is concrete
    (then it has been checked for negatives and int32 range), else None (a tracer under jit/vmap,
    whose negative entries are clamped to 0).
    """
    if isinstance(x, jax.core.Tracer):
        host = None
        dtype, shape = x.dtype, x.shape
    else:
        try:
            host = np.asarray(x)
        except Exception as exc:  # ragged lists and similar
            raise TypeError(f"{name} must be a 1-D integer array, got {type(x).__name__}: {exc}") from exc
        dtype, shape = host.dtype, host.shape
    if len(shape) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(shape)}")
    if shape[0] == 0:
        raise ValueError(f"{name} must have at least one entry")
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {dtype}")
    if host is None:
        return jnp.maximum(x.astype(jnp.int32), 0), None
    if np.issubdtype(dtype, np.signedinteger) and (host < 0).any():
        bad = int(np.flatnonzero(host < 0)[0])
        raise ValueError(f"{name} must be non-negative, got {name}[{bad}] = {int(host[bad])}")
    if int(host.max()) > _INT32_MAX:
        raise ValueError(f"{name} entries must fit in int32, got max {int(host.max())}")
    host = host.astype(np.int64)
    return jnp.asarray(host, dtype=jnp.int32), host


def _check_total(total: int, what: str, name: str) -> None:
    if total > _INT32_MAX:
        raise ValueError(f"{what} = {total} does not fit in int32; check {name}")


def _safe_div(num, den):
    """num / den in float32, 0 where den == 0 (no NaN, no division by zero in the graph)."""
    num = jnp.asarray(num, jnp.float32)
    den = jnp.asarray(den, jnp.float32)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def executed_rows(t, tile: int):
    """Rows a grouped GEMM with `tile`-row tiles runs per expert: q * ceil(t / q) per entry of
    the counts `t` (numpy or jax, traced too; no checks, no host copy). Written without
    `t + q - 1`, so it cannot overflow early."""
    return -(-t // tile) * tile


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def tile_padding(counts_E, tile: int) -> PaddingStats:
    """Tile-tail padding of a grouped GEMM with row tiles of `tile` rows.

    Args:
      counts_E: int [E], rows routed to each expert (may be traced).
      tile: q, a static Python int >= 1.
    """
    tile = _static_int(tile, "tile")
    t, host = _int_vector(counts_E, "counts_E")
    num_experts = t.shape[0]
    if host is not None:
        _check_total(int(executed_rows(host, tile).sum()), "executed rows P", "counts_E and tile")

    executed_E = executed_rows(t, tile)
    useful = jnp.sum(t, dtype=jnp.int32)
    executed = jnp.sum(executed_E, dtype=jnp.int32)
    padded = executed - useful
    t_f = t.astype(jnp.float32)
    useful_f = useful.astype(jnp.float32)
    return PaddingStats(
        tile=tile,
        useful=useful,
        executed=executed,
        padded=padded,
        fraction=_safe_div(padded, executed),
        active_experts=jnp.sum(t > 0, dtype=jnp.int32),
        effective_experts=_safe_div(useful_f * useful_f, jnp.sum(t_f * t_f)),
        mean_rows_per_expert=useful_f / num_experts,
    )


def per_rank_padding(counts_E, tile: int, *, expert_rank_E=None, num_ranks: int | None = None) -> RankPadding:
    """Tile-tail padding per expert-parallel rank.

    Args:
      counts_E: int [E], rows routed to each expert (may be traced).
      tile: q, a static Python int >= 1.
      expert_rank_E: optional int [E], the rank that owns each expert (may be traced, then
        `num_ranks` is required and out-of-range entries are ignored). Default: contiguous blocks
        of E / num_ranks experts.
      num_ranks: R, a static Python int >= 1. Required without `expert_rank_E` (then E % R must be
        0); with it, defaults to max(expert_rank_E) + 1. Ranks that own no expert report zeros and
        still count in the mean behind `imbalance`.
    """
    tile = _static_int(tile, "tile")
    t, host = _int_vector(counts_E, "counts_E")
    num_experts = t.shape[0]
    if host is not None:
        _check_total(int(executed_rows(host, tile).sum()), "executed rows P", "counts_E and tile")

    if expert_rank_E is None:
        if num_ranks is None:
            raise ValueError("per_rank_padding needs expert_rank_E or num_ranks")
        num_ranks = _static_int(num_ranks, "num_ranks")
        if num_experts % num_ranks:
            raise ValueError(
                f"num_ranks = {num_ranks} must divide the number of experts E = {num_experts} "
                "for the default contiguous placement; pass expert_rank_E otherwise"
            )
        rank_E = jnp.arange(num_experts, dtype=jnp.int32) // (num_experts // num_ranks)
    else:
        if isinstance(expert_rank_E, jax.core.Tracer):
            if expert_rank_E.ndim != 1 or expert_rank_E.shape[0] != num_experts:
                raise ValueError(f"expert_rank_E must have shape ({num_experts},), got {tuple(expert_rank_E.shape)}")
            if not jnp.issubdtype(expert_rank_E.dtype, jnp.integer):
                raise TypeError(f"expert_rank_E must have an integer dtype, got {expert_rank_E.dtype}")
            if num_ranks is None:
                raise ValueError("num_ranks is required when expert_rank_E is traced")
            num_ranks = _static_int(num_ranks, "num_ranks")
            rank_E = expert_rank_E.astype(jnp.int32)
        else:
            rank_E, rank_host = _int_vector(expert_rank_E, "expert_rank_E")
            if rank_host.shape[0] != num_experts:
                raise ValueError(
                    f"expert_rank_E must have one entry per expert ({num_experts}), got {rank_host.shape[0]}"
                )
            top = int(rank_host.max())
            if num_ranks is None:
                num_ranks = top + 1
            else:
                num_ranks = _static_int(num_ranks, "num_ranks")
                if top >= num_ranks:
                    raise ValueError(f"expert_rank_E has rank {top}, outside [0, num_ranks = {num_ranks})")

    executed_E = executed_rows(t, tile)
    useful_R = jax.ops.segment_sum(t, rank_E, num_segments=num_ranks).astype(jnp.int32)
    executed_R = jax.ops.segment_sum(executed_E, rank_E, num_segments=num_ranks).astype(jnp.int32)
    padded_R = executed_R - useful_R
    executed_max = jnp.max(executed_R)
    executed_sum = jnp.sum(executed_R, dtype=jnp.int32)
    imbalance = jnp.where(executed_sum > 0, _safe_div(executed_max * jnp.float32(num_ranks), executed_sum), 1.0)
    return RankPadding(
        tile=tile,
        useful_R=useful_R,
        executed_R=executed_R,
        padded_R=padded_R,
        fraction_R=_safe_div(padded_R, executed_R),
        executed_max=executed_max,
        executed_sum=executed_sum,
        useful_max=jnp.max(useful_R),
        useful_sum=jnp.sum(useful_R, dtype=jnp.int32),
        imbalance=imbalance.astype(jnp.float32),
        slowest_rank=jnp.argmax(executed_R).astype(jnp.int32),
    )


def capacity_padding(counts_E, capacity: int) -> CapacityPadding:
    """Padding and drops of fixed buffers of `capacity` rows per expert before the grouped op.

    Args:
      counts_E: int [E], rows routed to each expert (may be traced).
      capacity: C, a static Python int >= 1.
    """
    capacity = _static_int(capacity, "capacity")
    t, host = _int_vector(counts_E, "counts_E")
    num_experts = t.shape[0]
    _check_total(num_experts * capacity, "buffer rows E * capacity", "capacity")
    if host is not None:
        _check_total(int(host.sum()), "useful rows U", "counts_E")

    kept_E = jnp.minimum(t, capacity)
    dropped_E = t - kept_E
    kept = jnp.sum(kept_E, dtype=jnp.int32)
    dropped = jnp.sum(dropped_E, dtype=jnp.int32)
    buffer_rows = jnp.int32(num_experts * capacity)
    padded = buffer_rows - kept
    return CapacityPadding(
        capacity=capacity,
        kept_E=kept_E,
        dropped_E=dropped_E,
        kept=kept,
        dropped=dropped,
        buffer_rows=buffer_rows,
        padded=padded,
        fraction=_safe_div(padded, buffer_rows),
        drop_fraction=_safe_div(dropped, kept + dropped),
    )


def communication_padding(send_counts_R, buffer_rows_per_peer: int) -> CommPadding:
    """Padding of an all-to-all that sends `buffer_rows_per_peer` rows to each of R peers.

    Args:
      send_counts_R: int [R], rows this rank has for each peer (may be traced).
      buffer_rows_per_peer: cap, a static Python int >= 1.
    """
    cap = _static_int(buffer_rows_per_peer, "buffer_rows_per_peer")
    c, host = _int_vector(send_counts_R, "send_counts_R")
    num_peers = c.shape[0]
    _check_total(num_peers * cap, "buffer rows R * buffer_rows_per_peer", "buffer_rows_per_peer")
    if host is not None:
        _check_total(int(host.sum()), "rows to send", "send_counts_R")

    carried = jnp.minimum(c, cap)
    payload = jnp.sum(carried, dtype=jnp.int32)
    overflow = jnp.sum(c - carried, dtype=jnp.int32)
    buffer_rows = jnp.int32(num_peers * cap)
    padded = buffer_rows - payload
    return CommPadding(
        buffer_rows_per_peer=cap,
        payload=payload,
        overflow=overflow,
        buffer_rows=buffer_rows,
        padded=padded,
        fraction=_safe_div(padded, buffer_rows),
    )
