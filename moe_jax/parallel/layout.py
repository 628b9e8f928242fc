"""Where rows sit in expert-parallel dispatch: block offsets of the exchange and the regroup maps.

Runs inside `jax.shard_map` on per-device values; everything is integer work from the kept counts,
not differentiated. Legend: P ranks of the ep axis, El local experts, C capacity, S send-buffer
rows, M receive-buffer rows = packed rows, R routes of this rank.

Layouts of the send and receive buffers:
- `padded`: block p at rows `[p*C, (p+1)*C)` on both sides (S = M = P*C); rows past a block's
  kept rows are padding. A route's send row is also its receive row on the destination.
- `tight`: send blocks packed in destination order (S = R); the receiver packs incoming blocks
  in source order into M = P*C rows.

The count exchange (`[P, P, El]` kept counts, all-gathered) lets every rank compute the same
offsets on both sides of every exchange (`plan_exchange`), and the local-expert composition of
each incoming block (`plan_regroup`), so no offsets or expert ids travel.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax.permute import exclusive_cumsum

__all__ = ["LAYOUTS", "BlockExchange", "PairMaps", "Regroup", "buffer_rows", "invert_rows", "own_and_peer",
           "pair_maps", "plan_exchange", "plan_regroup"]

LAYOUTS = ("padded", "tight")


class BlockExchange(NamedTuple):
    """How one row exchange moves blocks between the P ranks of the ep axis (all `[P]` int32).

    Block p of this rank's send buffer (`send_sizes_P[p]` rows from `send_offsets_P[p]`) goes to
    rank p; the block from rank p lands at `recv_offsets_P[p]` of the receive buffer with
    `recv_sizes_P[p]` rows. `peer_recv_offsets_P[p]` is where this rank's block lands in rank p's
    receive buffer and `peer_send_offsets_P[p]` where rank p's block for this rank sits in rank
    p's send buffer (what `ragged_all_to_all` needs for the forward and reverse directions).
    """

    send_offsets_P: jax.Array
    send_sizes_P: jax.Array
    recv_offsets_P: jax.Array
    recv_sizes_P: jax.Array
    peer_recv_offsets_P: jax.Array
    peer_send_offsets_P: jax.Array

    def reversed(self) -> BlockExchange:
        """The exchange that sends every received block back to where it came from."""
        return BlockExchange(
            send_offsets_P=self.recv_offsets_P,
            send_sizes_P=self.recv_sizes_P,
            recv_offsets_P=self.send_offsets_P,
            recv_sizes_P=self.send_sizes_P,
            peer_recv_offsets_P=self.peer_send_offsets_P,
            peer_send_offsets_P=self.peer_recv_offsets_P,
        )


def buffer_rows(layout: str, routes: int, ep: int, capacity: int) -> tuple[int, int]:
    """(S, M): send-buffer rows and receive/packed rows. The padded exchange moves whole [C]-row
    blocks both ways; the ragged one sends the R routes tightly packed."""
    recv_rows = ep * capacity
    return (recv_rows if layout == "padded" else routes), recv_rows


def _block_of(rows, offsets_P):
    """Block p owning each row of a buffer whose blocks start at the nondecreasing `offsets_P`
    (the last block starting at or before the row, so empty blocks are skipped).

    A dense `[rows, P]` comparison, one fused elementwise kernel: `jnp.searchsorted` would be a
    while loop, a sequence of launches on GPU, for a handful of ranks."""
    return jnp.sum(offsets_P[None, :] <= rows[:, None], axis=1, dtype=jnp.int32) - 1


def plan_exchange(counts_PP, send_sizes, me, layout: str, capacity: int) -> BlockExchange:
    """Block offsets of the dispatch exchange from the kept-row matrix `counts_PP[src, dst]`, the
    same matrix on every rank, so sender and receiver agree without exchanging offsets.

    `send_sizes` is this rank's own row `counts_PP[me]`, computed locally: the send side (sizes
    and offsets) then does not wait for the count all_gather, so the send buffer can be built
    while it is in flight."""
    ep = counts_PP.shape[0]
    recv_sizes = counts_PP[:, me]
    if layout == "padded":
        # Fixed [C]-row slots: block p at p*C on both sides, and this rank's slot at every peer is
        # me*C.
        slots = jnp.arange(ep, dtype=jnp.int32) * capacity
        mine = jnp.full((ep,), me * capacity, jnp.int32)
        return BlockExchange(slots, send_sizes, slots, recv_sizes, mine, mine)
    # Tightly packed: send blocks in destination order, receive blocks in source order.
    recv_start_PP = exclusive_cumsum(counts_PP, axis=0)  # [src, dst]: src's block in dst's recv buffer
    send_start_PP = exclusive_cumsum(counts_PP, axis=1)  # [src, dst]: dst's block in src's send buffer
    return BlockExchange(
        send_offsets_P=exclusive_cumsum(send_sizes),
        send_sizes_P=send_sizes,
        recv_offsets_P=recv_start_PP[:, me],
        recv_sizes_P=recv_sizes,
        peer_recv_offsets_P=recv_start_PP[me, :],
        peer_send_offsets_P=send_start_PP[:, me],
    )


class Regroup(NamedTuple):
    """The receive buffer in the grouped-GEMM layout (int32): `recv_to_packed_M` (-1: the receive
    row holds no route), `packed_to_recv_M` (-1: packed row past the groups), `group_sizes_El`."""

    recv_to_packed_M: jax.Array
    packed_to_recv_M: jax.Array
    group_sizes_El: jax.Array


def invert_rows(rows_N: jax.Array, size: int) -> jax.Array:
    """int32 `[size]`: for each row s, the n with `rows_N[n] == s`, -1 where none; `rows_N` maps
    each n to a distinct row of `[0, size)` or to -1 (none). The map is injective, so the scatter
    is declared unique (the -1 entries get distinct out-of-range slots, dropped)."""
    n = rows_N.shape[0]
    i_N = jnp.arange(n, dtype=jnp.int32)
    slot_N = jnp.where(rows_N >= 0, rows_N, size + i_N)
    return jnp.full((size,), -1, jnp.int32).at[slot_N].set(i_N, mode="drop", unique_indices=True)


def plan_regroup(recv_PE, recv_offsets_P, rows: int, capacity: int | None) -> Regroup:
    """Map receive-buffer rows to the grouped-GEMM layout.

    `recv_PE[s, e]`: rows of local expert e in the block from source s. Each block is ordered by
    local expert (sender's send order), so a row's expert, and its packed position (expert
    offset + rows of that expert from earlier sources + rank within its run), follow from the
    counts alone: no expert ids travel and no sort is needed. `capacity`: the padded layout's
    fixed block size (blocks at s*C), None for blocks at `recv_offsets_P`.
    """
    recv_P = recv_PE.sum(axis=1)
    group_sizes_El = recv_PE.sum(axis=0)
    i_M = jnp.arange(rows, dtype=jnp.int32)
    src_M = _block_of(i_M, recv_offsets_P) if capacity is None else i_M // capacity
    j_M = i_M - recv_offsets_P[src_M]  # position within the source block
    valid_M = j_M < recv_P[src_M]
    run_end_PE = jnp.cumsum(recv_PE, axis=1)
    expert_M = jnp.minimum(jnp.sum(run_end_PE[src_M] <= j_M[:, None], axis=1), recv_PE.shape[1] - 1)
    run_start = (run_end_PE - recv_PE)[src_M, expert_M]
    before = exclusive_cumsum(recv_PE, axis=0)[src_M, expert_M]  # rows of this expert from earlier sources
    packed_M = exclusive_cumsum(group_sizes_El)[expert_M] + before + (j_M - run_start)
    recv_to_packed_M = jnp.where(valid_M, packed_M, -1)
    return Regroup(recv_to_packed_M, invert_rows(recv_to_packed_M, rows), group_sizes_El)


def own_and_peer(ids_S, me, capacity: int):
    """(own block, peer block) of a `[2C]` padded-layout vector (block p at rows p*C)."""
    return (lax.dynamic_slice(ids_S, (me * capacity,), (capacity,)),
            lax.dynamic_slice(ids_S, ((1 - me) * capacity,), (capacity,)))


class PairMaps(NamedTuple):
    """The two-rank path's view of the packed layout (blocks of C slots, block p at p*C; -1: none).
    A route this rank serves itself sits at receive row = send row, since slots are p*C on both
    sides."""

    own_slot_M: jax.Array  # slot in this rank's own block of each packed row
    peer_slot_M: jax.Array  # slot in the peer's block of each packed row
    peer_to_packed_C: jax.Array  # packed row filled by each slot of the peer's block
    own_packed_R: jax.Array  # packed row of each route this rank serves itself
    peer_slot_R: jax.Array  # slot in the peer's block of each route sent to the peer


def pair_maps(recv_to_packed_M, packed_to_recv_M, route_row_R, me, capacity: int) -> PairMaps:
    def split(row, real):
        """(own slot, peer slot) of padded-layout rows, -1 where not real or not that side."""
        own = row // capacity == me
        return jnp.where(real & own, row % capacity, -1), jnp.where(real & ~own, row % capacity, -1)

    own_slot_M, peer_slot_M = split(packed_to_recv_M, packed_to_recv_M >= 0)
    own_slot_R, peer_slot_R = split(route_row_R, route_row_R >= 0)
    return PairMaps(own_slot_M=own_slot_M, peer_slot_M=peer_slot_M,
                     peer_to_packed_C=own_and_peer(recv_to_packed_M, me, capacity)[1],
                     own_packed_R=jnp.where(own_slot_R >= 0, recv_to_packed_M[jnp.maximum(route_row_R, 0)], -1),
                     peer_slot_R=peer_slot_R)
