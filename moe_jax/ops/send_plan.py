"""Expert-parallel dispatch's sender-side plan: which routes are kept and where each one goes.

Legend: R = T*K routes (route r = t*K + k, token t's k-th choice), E experts, P ranks of the ep
axis, El = E/P experts per rank, C capacity (rows one rank may send to one destination), S rows of
the send buffer.

Route r with expert e goes to rank p = e // El. It is valid if e is in `[0, E)` and its token is
real (`real_R`). Capacity keeps the first C valid routes to each destination in route order (token
order: overflow spreads over all of a destination's experts instead of always hitting its last).
The kept routes to p form one block of the send buffer, ordered by (local expert, route), which is
the order the receiver regroups by. Layout of the blocks:

- `padded=True`: block p starts at row p*C (S = P*C); rows past a block's kept routes are padding.
- `padded=False`: blocks packed tightly in destination order (S >= R); rows past them are padding.

Backends (purely local integer work, no collectives, not differentiated):

- `pallas_triton`: `kernels.send_plan_pallas`, one launch. Each program compares its routes with
  every route (`R*R` compares in all), so it runs only up to `PALLAS_MAX_ROUTES` routes (and
  `PALLAS_MAX_RANKS` ranks); beyond, this backend plans with XLA too.
  At decode (R = 1024) it replaces a chain of about a dozen small XLA kernels (about 29 us
  between the previous combine and the send gather on an H200), and dispatch+combine drops from
  186 to 168 us.
- `xla`: dense counts (`permute.stable_rank` by destination, `permute.pack` by expert): a handful
  of fused reductions, about `R*(512 + P + E)` compares, for prefill sizes.

`plan_sends_reference` computes the same plan with stable sorts, for tests.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.ops import kernels as _kernels
from moe_jax.ops.backends import BackendName, _on_gpu, resolve_backend
from moe_jax.permute import exclusive_cumsum, pack, stable_rank

__all__ = ["PALLAS_MAX_RANKS", "PALLAS_MAX_ROUTES", "SendPlan", "plan_sends", "plan_sends_reference"]

# Largest R the Pallas backend runs its kernel for (its compares grow as R*R; XLA plans above).
# In the EP loop on 2 H200s (padded cf=1.25, D=7168, top-8 of 256), dispatch+combine with the
# kernel vs XLA's plan: R=1024 168 vs 186 us, R=2048 260 vs 284, R=4096 448 vs 462; at R=8192
# (D=4096, top-2 of 64) an earlier config lost, 583 vs 515 us.
PALLAS_MAX_ROUTES = 4096
# Largest ep the Pallas backend runs its kernel for: its [routes, ranks] and [send rows, ranks]
# tiles grow with P (Triton caps a tile at 2**20 elements, dropless padded plans reach that at
# P = 256), and it was measured at P = 2 only; XLA plans for larger P.
PALLAS_MAX_RANKS = 8
# Of 32/256/4, 16/512/4, 16/1024/4, 8/1024/4, 32/1024/8 (routes per program, per loop step,
# warps), 16/1024/4 was the fastest or within 1% at R = 1024-4096.
_BLOCK = 16
_CHUNK = 1024
_NUM_WARPS = 4


class SendPlan(NamedTuple):
    """The sender's plan (all int32).

    route_row_R: `[R]` send-buffer row of each kept route, -1 for a route not sent (invalid,
      masked or dropped by capacity).
    send_ids_S: `[S]` token (`r // K`) each send row carries, -1 for padding rows.
    kept_PE: `[P, El]` kept routes per (destination, local expert).
    send_counts_P: `[P]` valid routes per destination before capacity.
    send_sizes_P: `[P]` kept routes per destination (`kept_PE.sum(1)`).
    """

    route_row_R: jax.Array
    send_ids_S: jax.Array
    kept_PE: jax.Array
    send_counts_P: jax.Array
    send_sizes_P: jax.Array

    @property
    def keep_R(self) -> jax.Array:
        """bool `[R]`: the route is sent."""
        return self.route_row_R >= 0


def _valid_and_dest(expert_R, real_R, num_experts: int, ep: int):
    valid_R = (expert_R >= 0) & (expert_R < num_experts)
    if real_R is not None:
        valid_R &= real_R
    # Invalid ids and masked tokens go to a bin past the ranks: never sent, never counted.
    return valid_R, jnp.where(valid_R, expert_R // (num_experts // ep), ep)


def _block_starts(send_sizes_P, capacity: int, padded: bool):
    ep = send_sizes_P.shape[0]
    return jnp.arange(ep, dtype=jnp.int32) * capacity if padded else exclusive_cumsum(send_sizes_P)


def _send_ids(route_row_R, top_k: int, send_rows: int):
    token_R = jnp.arange(route_row_R.shape[0], dtype=jnp.int32) // top_k
    target_R = jnp.where(route_row_R >= 0, route_row_R, send_rows)
    return jnp.full((send_rows,), -1, jnp.int32).at[target_R].set(token_R, mode="drop")


def _xla_plan(expert_R, real_R, *, num_experts, ep, capacity, top_k, padded, send_rows) -> SendPlan:
    """Dense counts instead of sorts: XLA's two stable argsorts took 39 us at R = 8192 on an H200
    (benchmarks/results/2026-11-30-h200x2-ep-breakdown-2.md)."""
    valid_R, dest_R = _valid_and_dest(expert_R, real_R, num_experts, ep)
    dest_rank_R, send_counts_P = stable_rank(dest_R, ep)
    keep_R = valid_R & (dest_rank_R < capacity)
    # expert = dest * El + local, so packing the kept routes by expert id orders them by
    # (destination, local expert), and within an expert by route.
    kept = pack(expert_R[:, None], num_experts, mask_T=keep_R)
    kept_PE = kept.group_sizes_E.reshape(ep, num_experts // ep)
    send_sizes_P = kept_PE.sum(axis=1)
    safe_dest_R = jnp.minimum(dest_R, ep - 1)  # not-kept routes are masked below
    slot_R = kept.inverse_R - exclusive_cumsum(send_sizes_P)[safe_dest_R]
    starts_P = _block_starts(send_sizes_P, capacity, padded)
    route_row_R = jnp.where(keep_R, starts_P[safe_dest_R] + slot_R, -1)
    return SendPlan(route_row_R, _send_ids(route_row_R, top_k, send_rows), kept_PE, send_counts_P, send_sizes_P)


def _pallas_plan(expert_R, real_R, *, num_experts, ep, capacity, top_k, padded, send_rows) -> SendPlan:
    routes = expert_R.shape[0]
    if routes > PALLAS_MAX_ROUTES or ep > PALLAS_MAX_RANKS:  # see the two limits
        return _xla_plan(expert_R, real_R, num_experts=num_experts, ep=ep, capacity=capacity, top_k=top_k,
                         padded=padded, send_rows=send_rows)
    block = min(_BLOCK, _kernels._pow2_at_least(routes))
    rows, ids, kept_E, counts, sizes = _kernels.send_plan_pallas(
        expert_R, None if real_R is None else real_R.astype(jnp.int32), num_experts=num_experts, ep=ep,
        capacity=capacity, top_k=top_k, padded=padded, send_rows=send_rows, block=block,
        chunk=min(_CHUNK, _kernels._pow2_at_least(routes)), num_warps=_NUM_WARPS,
        interpret=not _on_gpu(),
    )
    return SendPlan(rows, ids, kept_E.reshape(ep, num_experts // ep), counts, sizes)


_IMPLS = {"pallas_triton": _pallas_plan, "xla": _xla_plan}


def _check(expert_R, real_R, num_experts, ep, capacity, top_k, padded, send_rows) -> None:
    if expert_R.ndim != 1 or not jnp.issubdtype(expert_R.dtype, jnp.integer):
        raise ValueError(f"expert_R must be a 1-D int array [R]; got {expert_R.dtype} {tuple(expert_R.shape)}.")
    routes = expert_R.shape[0]
    if real_R is not None and (real_R.shape != (routes,) or real_R.dtype != jnp.bool_):
        raise ValueError(f"real_R must be bool [R] = ({routes},) or None; got {real_R.dtype} {tuple(real_R.shape)}.")
    for name, value in (("num_experts", num_experts), ("ep", ep), ("capacity", capacity), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} must be a multiple of ep={ep}.")
    if routes % top_k:
        raise ValueError(f"expert_R has {routes} routes, not a multiple of top_k={top_k} (R = T*K).")
    need = ep * capacity if padded else routes
    if send_rows < need:
        raise ValueError(
            f"send_rows={send_rows} cannot hold the send buffer: the {'padded' if padded else 'tight'} "
            f"layout needs {need} rows ({'ep * capacity' if padded else 'R'})."
        )


def plan_sends(
    expert_R: jax.Array, real_R: jax.Array | None = None, *, num_experts: int, ep: int, capacity: int,
    top_k: int, padded: bool, send_rows: int, backend: BackendName = "auto",
) -> SendPlan:
    """Plan this rank's sends of expert-parallel dispatch (see the module docstring).

    Args:
      expert_R: int `[R]` expert of each route, `R = T*K` in token-major order.
      real_R: optional bool `[R]`, False for routes of padding tokens (never sent nor counted).
      num_experts: E, a multiple of `ep`; ep: P.
      capacity: C >= 1, rows one destination may take from this rank.
      top_k: K (send rows carry tokens `r // K`).
      padded: block p at row p*C (`True`) or blocks packed tightly (`False`).
      send_rows: S, rows of the send buffer (>= P*C padded, >= R tight).
      backend: `"auto"` (`"pallas_triton"` on GPU, else `"xla"`), `"pallas_triton"` (the kernel up
        to `PALLAS_MAX_ROUTES` routes and `PALLAS_MAX_RANKS` ranks, XLA's dense counts beyond) or
        `"xla"`.

    Returns a `SendPlan`.
    """
    _check(expert_R, real_R, num_experts, ep, capacity, top_k, padded, send_rows)
    name = resolve_backend(backend)
    if expert_R.shape[0] == 0:
        none_P = jnp.zeros((ep,), jnp.int32)
        return SendPlan(jnp.zeros((0,), jnp.int32), jnp.full((send_rows,), -1, jnp.int32),
                        jnp.zeros((ep, num_experts // ep), jnp.int32), none_P, none_P)
    return _IMPLS[name](expert_R.astype(jnp.int32), real_R, num_experts=num_experts, ep=ep, capacity=capacity,
                        top_k=top_k, padded=padded, send_rows=send_rows)


def plan_sends_reference(
    expert_R: jax.Array, real_R: jax.Array | None = None, *, num_experts: int, ep: int, capacity: int,
    top_k: int, padded: bool, send_rows: int, backend: BackendName = "auto",
) -> SendPlan:
    """`plan_sends` by stable sorts (`backend` is accepted for the signature and ignored)."""
    del backend
    _check(expert_R, real_R, num_experts, ep, capacity, top_k, padded, send_rows)
    routes = expert_R.shape[0]
    expert_R = expert_R.astype(jnp.int32)
    valid_R, dest_R = _valid_and_dest(expert_R, real_R, num_experts, ep)
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
    route_row_R = jnp.where(keep_R, _block_starts(send_sizes_P, capacity, padded)[safe_dest_R] + slot_R, -1)
    return SendPlan(route_row_R, _send_ids(route_row_R, top_k, send_rows), kept_PE, send_counts_P, send_sizes_P)
