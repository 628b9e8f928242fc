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

Backends (purely local integer work, no collectives, not differentiated), registered with
`moe_jax.ops.platform`:

- `pallas_triton`: `kernel.send_plan_pallas`, one launch. Each program compares its routes with
  every route (`R*R` compares in all), so it runs only up to `PALLAS_MAX_ROUTES` routes (and
  `PALLAS_MAX_RANKS` ranks); beyond, this backend plans with XLA too. At decode it replaces a
  chain of about a dozen small XLA kernels (docs/decisions.md has the measurements).
- `xla`: dense counts (`permute.stable_rank` by destination, `permute.pack` by expert): a handful
  of fused reductions, about `R*(512 + P + E)` compares, for prefill sizes.

`reference.plan_sends_reference` computes the same plan with stable sorts, for tests.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.ops.pallas_triton import next_pow2
from moe_jax.ops.platform import BackendName, implementation, interpret, register
from moe_jax.parallel.send_plan.kernel import send_plan_pallas
from moe_jax.permute import exclusive_cumsum, pack, stable_rank
from moe_jax.validation import check_int

__all__ = ["PALLAS_MAX_RANKS", "PALLAS_MAX_ROUTES", "SendPlan", "SendPlanTiles", "plan_sends"]

# Largest R the Pallas backend runs its kernel for: its compares grow as R*R, and above this the
# XLA plan was faster on an H200 (docs/decisions.md); XLA plans above.
PALLAS_MAX_ROUTES = 4096
# Largest ep the Pallas backend runs its kernel for: its [routes, ranks] and [send rows, ranks]
# tiles grow with P (Triton caps a tile at 2**20 elements, dropless padded plans reach that at
# P = 256), and it was measured at P = 2 only; XLA plans for larger P.
PALLAS_MAX_RANKS = 8


@dataclasses.dataclass(frozen=True)
class SendPlanTiles:
    """Launch shape of the send-plan kernel: `block` routes per program, `chunk` routes compared per
    loop step (both powers of two, capped at R's), `num_warps`. The default was the fastest or
    within 1% of five shapes tried at R = 1024-4096 (docs/decisions.md)."""

    block: int = 16
    chunk: int = 1024
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block", "chunk"):
            v = check_int(f"SendPlanTiles.{name}", getattr(self, name))
            if v & (v - 1):
                raise ValueError(f"SendPlanTiles.{name}={v}: must be a power of two (a Triton block).")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"SendPlanTiles.num_warps={self.num_warps!r}: must be one of 1, 2, 4, 8, 16.")


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


def valid_and_dest(expert_R, real_R, num_experts: int, ep: int):
    valid_R = (expert_R >= 0) & (expert_R < num_experts)
    if real_R is not None:
        valid_R &= real_R
    # Invalid ids and masked tokens go to a bin past the ranks: never sent, never counted.
    return valid_R, jnp.where(valid_R, expert_R // (num_experts // ep), ep)


def block_starts(send_sizes_P, capacity: int, padded: bool):
    ep = send_sizes_P.shape[0]
    return jnp.arange(ep, dtype=jnp.int32) * capacity if padded else exclusive_cumsum(send_sizes_P)


def send_ids(route_row_R, top_k: int, send_rows: int):
    token_R = jnp.arange(route_row_R.shape[0], dtype=jnp.int32) // top_k
    target_R = jnp.where(route_row_R >= 0, route_row_R, send_rows)
    return jnp.full((send_rows,), -1, jnp.int32).at[target_R].set(token_R, mode="drop")


@register("plan_sends", "xla")
def xla_plan(expert_R, real_R, *, num_experts, ep, capacity, top_k, padded, send_rows, tiles) -> SendPlan:
    """Dense counts instead of sorts (XLA's stable argsorts are a chain of kernels on GPU,
    docs/decisions.md); `tiles` is unused."""
    del tiles
    valid_R, dest_R = valid_and_dest(expert_R, real_R, num_experts, ep)
    dest_rank_R, send_counts_P = stable_rank(dest_R, ep)
    keep_R = valid_R & (dest_rank_R < capacity)
    # expert = dest * El + local, so packing the kept routes by expert id orders them by
    # (destination, local expert), and within an expert by route.
    kept = pack(expert_R[:, None], num_experts, mask_T=keep_R)
    kept_PE = kept.group_sizes_E.reshape(ep, num_experts // ep)
    send_sizes_P = kept_PE.sum(axis=1)
    safe_dest_R = jnp.minimum(dest_R, ep - 1)  # not-kept routes are masked below
    slot_R = kept.inverse_R - exclusive_cumsum(send_sizes_P)[safe_dest_R]
    starts_P = block_starts(send_sizes_P, capacity, padded)
    route_row_R = jnp.where(keep_R, starts_P[safe_dest_R] + slot_R, -1)
    return SendPlan(route_row_R, send_ids(route_row_R, top_k, send_rows), kept_PE, send_counts_P, send_sizes_P)


@register("plan_sends", "pallas_triton")
def pallas_plan(expert_R, real_R, *, num_experts, ep, capacity, top_k, padded, send_rows, tiles) -> SendPlan:
    routes = expert_R.shape[0]
    if routes > PALLAS_MAX_ROUTES or ep > PALLAS_MAX_RANKS:  # see the two limits
        return xla_plan(expert_R, real_R, num_experts=num_experts, ep=ep, capacity=capacity, top_k=top_k,
                        padded=padded, send_rows=send_rows, tiles=tiles)
    rows, ids, kept_E, counts, sizes = send_plan_pallas(
        expert_R, None if real_R is None else real_R.astype(jnp.int32), num_experts=num_experts, ep=ep,
        capacity=capacity, top_k=top_k, padded=padded, send_rows=send_rows,
        block=min(tiles.block, next_pow2(routes)), chunk=min(tiles.chunk, next_pow2(routes)),
        num_warps=tiles.num_warps, interpret=interpret(),
    )
    return SendPlan(rows, ids, kept_E.reshape(ep, num_experts // ep), counts, sizes)


def check_plan_args(expert_R, real_R, num_experts, ep, capacity, top_k, padded, send_rows) -> None:
    """ValueError naming the argument for any input `plan_sends` cannot plan."""
    if expert_R.ndim != 1 or not jnp.issubdtype(expert_R.dtype, jnp.integer):
        raise ValueError(f"expert_R must be a 1-D int array [R]; got {expert_R.dtype} {tuple(expert_R.shape)}.")
    routes = expert_R.shape[0]
    if real_R is not None and (real_R.shape != (routes,) or real_R.dtype != jnp.bool_):
        raise ValueError(f"real_R must be bool [R] = ({routes},) or None; got {real_R.dtype} {tuple(real_R.shape)}.")
    for name, value in (("num_experts", num_experts), ("ep", ep), ("capacity", capacity), ("top_k", top_k)):
        check_int(name, value)
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
    top_k: int, padded: bool, send_rows: int, backend: BackendName = "auto", tiles: SendPlanTiles = SendPlanTiles(),
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
      tiles: launch shape of the Pallas kernel (`SendPlanTiles`).

    Returns a `SendPlan`.
    """
    check_plan_args(expert_R, real_R, num_experts, ep, capacity, top_k, padded, send_rows)
    if not isinstance(tiles, SendPlanTiles):
        raise TypeError(f"tiles must be a SendPlanTiles; got {type(tiles).__name__}.")
    impl = implementation("plan_sends", backend)
    if expert_R.shape[0] == 0:
        none_P = jnp.zeros((ep,), jnp.int32)
        return SendPlan(jnp.zeros((0,), jnp.int32), jnp.full((send_rows,), -1, jnp.int32),
                        jnp.zeros((ep, num_experts // ep), jnp.int32), none_P, none_P)
    return impl(expert_R.astype(jnp.int32), real_R, num_experts=num_experts, ep=ep, capacity=capacity, top_k=top_k,
                padded=padded, send_rows=send_rows, tiles=tiles)
