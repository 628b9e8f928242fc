"""Expert-parallel dispatch and combine: move token rows to the ranks that own their experts and
bring the expert outputs back. `ep_moe` is the whole routed stage: dispatch, experts, combine.

Everything here runs INSIDE `jax.shard_map` on per-device arrays, collectives over the ep axis
(`axis_name`, default `"ep"`). Shapes are static and nothing syncs with the host: buffers have a
worst-case size, and which rows are real is carried by on-device counts and masks.

Legend (shape suffixes): T tokens on this rank, D model width, K experts per token (top-k),
R = T*K routes, E experts, El = E/P local experts, P ep size, C capacity (rows one source rank
may send to one destination rank), S send-buffer rows, M receive-buffer rows = packed rows,
N token chunks of `ep_moe(chunks=...)`.

Dispatch (`ep_dispatch`); docs/expert-parallelism.md walks through it:

1. Expand T tokens into R routes (route r = t*K + k). Destination rank = expert // El, local
   expert = expert % El. Routes of masked tokens (`mask_T`) are not sent at all.
2. Capacity (`capacity.py`): within each destination, routes keep token order and the first C
   are kept; the rest are dropped and counted. Ranking by token rather than by local expert keeps
   the overflow spread over all experts of the destination.
3. Send layout: the kept routes to each destination form one block, ordered by (local expert,
   token, slot). Steps 1-3 are `send_plan.plan_sends`.
4. Count exchange: one `all_gather` of every rank's kept counts per (destination, local expert),
   `[P, El]` int32 each; every rank derives the same block offsets and regroup maps from it
   (`layout.py`), so no offsets or expert ids travel.
5. Exchange the rows through the transport (`transports.py`).
6. Regroup by local expert: packed rows are expert 0's rows, expert 1's rows, ...; within an
   expert, rows are ordered by (source rank, token, slot). Rows past `sum(group_sizes)` are zero.

The row moves around the collectives (send buffer, regroup, and un-regroup in combine) are
`moe_jax.ops.gather_rows` with materialised row ids and readers inverses, so every backward is a
gather summed in float32: no atomics, the same bits on every run.

Combine (`ep_combine`) is the reverse: un-regroup, reverse exchange, read each route's returned
row, weighted sum over K in float32. Both strategies keep the same routes and produce the same
packed layout, so their results agree exactly. Dropless (`capacity=None`) means C = R.

Chunks (`ep_moe(chunks=n)`, `chunks.py`): the rank's tokens are cut into N contiguous chunks and
each runs dispatch, experts and combine on its own, unrolled at trace time. Chunk i+1's dispatch
reads only its own slice of the inputs, never chunk i's expert outputs, and nothing is carried
from chunk to chunk (no loop, no accumulator): the only joins are the final concatenation of the
outputs and the sums of the statistics. That leaves XLA free to run chunk i+1's exchange while
chunk i's grouped GEMMs run (docs/expert-parallelism.md, "Chunked exchange").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax.ops import RowGather, gather_rows
from moe_jax.ops.fp8 import Fp8Rows, quantize_rows, row_bytes
from moe_jax.ops.platform import BackendName
from moe_jax.parallel.capacity import resolve_capacity
from moe_jax.parallel.chunks import check_chunks, token_chunks
from moe_jax.parallel.layout import (
    BlockExchange,
    buffer_rows,
    invert_rows,
    own_and_peer,
    pair_maps,
    plan_exchange,
    plan_regroup,
)
from moe_jax.parallel.mesh import EP_AXIS
from moe_jax.parallel.send_plan import plan_sends
from moe_jax.parallel.transports import Transport, check_strategy, check_transport, select_transport
from moe_jax.permute import check_mask
from moe_jax.validation import check_bool, check_int

__all__ = ["EPPlan", "EPStats", "ep_combine", "ep_dispatch", "ep_moe"]


class EPStats(NamedTuple):
    """Per-rank dispatch figures for logging. Under `ep_moe(chunks=n)` every count is the sum
    over the N chunks run (the same rank's rows added up before any maximum over ranks is taken),
    so dropless it equals the unchunked figure exactly.

    dropped: int32 scalar, routes of real tokens dropped by capacity (plus any such route with
        an expert id outside `[0, E)`), summed over the ep axis: every rank of an EP group reports
        the group total (each `"data"` replica's EP group has its own total).
    send_counts_P: `[P]` int32, real routes this rank addressed to each ep rank, before dropping.
    recv_rows: int32 scalar, rows this rank received and kept (= `sum(group_sizes_El)`).
    group_sizes_El: `[El]` int32, packed rows of each local expert on this rank.
    kept_E: `[E]` int32, this rank's routes that were delivered, per global expert (its routes to
        expert e minus those dropped by capacity; summed over the ranks, the experts' loads).
    capacity: static Python int C, rows one source may send to one destination in one chunk (R
        when dropless; with uneven chunks, the largest chunk's C).
    chunk_group_sizes_NEl: `[N, El]` int32, `group_sizes_El` of each chunk (N = 1 unchunked):
        chunk i's grouped GEMMs ran on row i (sum over N: `group_sizes_El`).
    """

    dropped: jax.Array
    send_counts_P: jax.Array
    recv_rows: jax.Array
    group_sizes_El: jax.Array
    kept_E: jax.Array
    capacity: int
    chunk_group_sizes_NEl: jax.Array


class EPPlan(NamedTuple):
    """What `ep_dispatch` decided and `ep_combine` needs to bring outputs back.

    A trace-local object: use it in the same traced function (e.g. the same `shard_map` body) as
    the dispatch that built it; `strategy`, `transport` and `capacity` are static Python values.

    strategy: `"padded"` or `"ragged"`. transport: the requested transport (`"auto"`, a name or a
        `Transport`); combine resolves it for its own rows. capacity: C.
    route_row_TK: int32, row of each delivered route in the send buffer; -1 where route (t, k)
        was not delivered (masked token, dropped by capacity or invalid expert id).
    recv_to_packed_M: int32, packed row of each receive-buffer row, -1 where it holds no route.
    packed_to_recv_M: int32, receive-buffer row of each packed row, -1 past `sum(group_sizes_El)`.
    group_sizes_El: int32, packed rows of each local expert.
    exchange: `BlockExchange` of the dispatch direction (combine uses `exchange.reversed()`).
    send_counts_P: int32, routes addressed to each rank before dropping.
    kept_PE: int32 `[P, El]`, this rank's delivered routes per (destination, local expert).
    dropped: int32 scalar, ep-group total of undelivered routes of real tokens.
    """

    strategy: str
    transport: str | Transport
    capacity: int
    route_row_TK: jax.Array
    recv_to_packed_M: jax.Array
    packed_to_recv_M: jax.Array
    group_sizes_El: jax.Array
    exchange: BlockExchange
    send_counts_P: jax.Array
    kept_PE: jax.Array
    dropped: jax.Array

    @property
    def keep_TK(self) -> jax.Array:
        """bool `[T, K]`: route (t, k) was delivered."""
        return self.route_row_TK >= 0

    def stats(self) -> EPStats:
        """The loggable summary of this dispatch."""
        return EPStats(dropped=self.dropped, send_counts_P=self.send_counts_P,
                       recv_rows=jnp.sum(self.group_sizes_El), group_sizes_El=self.group_sizes_El,
                       kept_E=self.kept_PE.reshape(-1), capacity=self.capacity,
                       chunk_group_sizes_NEl=self.group_sizes_El[None])

    def transport_for(self, rows_ND: jax.Array) -> Transport:
        """The transport an exchange of `rows_ND`'s width runs (its block is `[C, D]`)."""
        block_bytes = self.capacity * rows_ND.shape[1] * rows_ND.dtype.itemsize
        return select_transport(self.strategy, self.transport, ep=self.send_counts_P.shape[0], block_bytes=block_bytes)


# ----------------------------------------------------------------------------- checks


def _axis_size(axis_name) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis {axis_name!r} is not bound: call EP dispatch/combine inside jax.shard_map over a "
            f"mesh with that axis (e.g. make_mesh(ep=...), axis '{EP_AXIS}')."
        ) from err


def _local_experts(num_experts, ep: int) -> int:
    num_experts = check_int("num_experts", num_experts)
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the ep axis size {ep}; every rank "
            f"must own the same number of experts (choose ep from the divisors of {num_experts})."
        )
    return num_experts // ep


def _check_routes(x_TD, expert_idx_TK) -> tuple[int, int]:
    if x_TD.ndim != 2:
        raise ValueError(f"x_TD must be [T, D] (flatten batch dims first); got shape {tuple(x_TD.shape)}.")
    if expert_idx_TK.ndim != 2 or expert_idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"expert_idx_TK must be [T, K] with T = x_TD.shape[0] = {x_TD.shape[0]}; got shape "
            f"{tuple(expert_idx_TK.shape)}. Pass the router's top-k indices for the same tokens."
        )
    if not jnp.issubdtype(expert_idx_TK.dtype, jnp.integer):
        raise ValueError(f"expert_idx_TK must hold integer expert ids; got dtype {expert_idx_TK.dtype}.")
    return expert_idx_TK.shape


# ----------------------------------------------------------------------------- public API


def ep_dispatch(
    x_TD: jax.Array,
    expert_idx_TK: jax.Array,
    *,
    num_experts: int,
    axis_name=EP_AXIS,
    strategy: str = "padded",
    capacity: int | None = None,
    mask_T: jax.Array | None = None,
    backend: BackendName = "auto",
    transport: str | Transport = "auto",
    fp8_dispatch: bool = False,
) -> tuple[jax.Array, jax.Array, EPPlan]:
    """Send each token's rows to the owners of its K experts; return them grouped by local expert.

    Args:
      x_TD: this rank's tokens, `[T, D]`.
      expert_idx_TK: int `[T, K]` global expert ids in `[0, num_experts)`; routes with other ids
        are never delivered (they count as dropped).
      num_experts: E, a multiple of the ep axis size P; rank p owns experts `[p*El, (p+1)*El)`.
      axis_name: the ep mesh axis (inside `jax.shard_map`).
      strategy: `"padded"` or `"ragged"` (GPU only), see `moe_jax.parallel.transports`.
      capacity: C rows per (source, destination) pair, or None for dropless (C = T*K). Values
        above T*K are clamped to T*K; values below one row per local expert (C < min(E/P, T*K))
        raise ValueError.
      mask_T: optional bool `[T]`, True for real tokens. Routes of masked tokens are neither sent
        nor counted (not in `send_counts_P`, not dropped); their combined output is zero.
      backend: backend of the row gathers and the send plan (`"auto"`: our Pallas kernels on GPU,
        XLA elsewhere).
      transport: `"auto"` (the strategy's default), a name in `transports.TRANSPORTS` or a
        `Transport` fitting the strategy's layout.
      fp8_dispatch: the rows cross the exchange as e4m3 values with fp32 scales per 1 x 128 tile
        (`Transport.exchange(fp8=True)`: about half of bf16's bytes) and arrive dequantized, for
        experts that quantize them the same way (`Fp8Blockwise`); the gradient returns in x's
        dtype. Rows this rank keeps (a pairwise transport's own block) are not quantized here.

    Returns:
      packed_x_MD: `[M, D]`, M = P*C, rows of local expert 0, then 1, ... (within an expert by
        source rank, token, slot); rows past `sum(group_sizes_El)` are zero.
      group_sizes_El: int32 `[El]` rows per local expert (padding rows not counted).
      plan: `EPPlan` for `ep_combine`.
    """
    got = _receive(x_TD, expert_idx_TK, num_experts=num_experts, axis_name=axis_name, strategy=strategy,
                   capacity=capacity, mask_T=mask_T, backend=backend, transport=transport, fp8_dispatch=fp8_dispatch,
                   fp8_rows=False)
    return _regroup(got, backend), got.plan.group_sizes_El, got.plan


def _regroup(got: Received, backend) -> jax.Array:
    """The packed rows `[M, D]`; padding rows are written as zeros, whatever the receive buffer
    holds there."""
    if got.inverse is None:  # nothing was sent: `src` is already the (empty) packed buffer
        return got.src
    return gather_rows(got.src, got.ids_M, inverse_N=got.inverse, backend=backend)


def _regroup_fp8(got: Received, backend) -> Fp8Rows:
    """`got.fp8` in the packed layout, row for row with `_regroup(got)` (padding rows: zero values
    and scales). Not differentiated: the gradient reaches the senders through the rows' own regroup."""
    if got.inverse is None:
        return got.fp8
    # A pairwise transport's two sources: the values of both, then the scales of both.
    sources = tuple(zip(*got.fp8)) if isinstance(got.src, tuple) else tuple(got.fp8)
    return Fp8Rows(*(gather_rows(src, got.ids_M, backend=backend) for src in sources))


class Received(NamedTuple):
    """What arrived at this rank, before the regroup by local expert: packed row i is row
    `ids_M[i]` of `src` (-1: a padding row, zero), where `src` is the receive buffer, or the pair
    `(x_TD, peer block)` on a pairwise transport, whose rows are numbered on from T. `inverse`
    lists the packed rows that read each source row (`gather_rows`' `inverse_N`). `fp8`: when
    asked for, `src` as e4m3 rows (`Fp8Rows`, or a pair of them): the rows as the FP8 exchange
    delivered them, and on a pairwise transport `x_TD` quantized here; else None."""

    src: jax.Array | tuple[jax.Array, jax.Array]
    ids_M: jax.Array
    inverse: jax.Array | tuple[jax.Array, jax.Array] | None
    plan: EPPlan
    fp8: Fp8Rows | tuple[Fp8Rows, Fp8Rows] | None = None


def _receive(x_TD, expert_idx_TK, *, num_experts, axis_name, strategy, capacity, mask_T, backend,
             transport, fp8_dispatch, fp8_rows) -> Received:
    """`ep_dispatch` up to the regroup: the plan, the exchange, and where each packed row is
    (with `fp8_rows`, also in the e4m3 form the experts read)."""
    check_strategy(strategy)
    check_transport(transport)
    fp8_dispatch = check_bool("fp8_dispatch", fp8_dispatch)
    if check_bool("fp8_rows", fp8_rows) and not fp8_dispatch:
        raise ValueError("fp8_rows=True hands expert_fn the e4m3 rows the exchange delivers, but fp8_dispatch=False "
                         "moves them in x's dtype: pass fp8_dispatch=True as well, or fp8_rows=False.")
    tokens, top_k = _check_routes(x_TD, expert_idx_TK)
    mask_T = check_mask(mask_T, tokens, "ep_dispatch")
    ep = _axis_size(axis_name)
    local = _local_experts(num_experts, ep)
    routes = tokens * top_k
    cap = resolve_capacity(capacity, routes, local)
    if routes == 0:
        empty_MD, plan = _empty_dispatch(x_TD, tokens, top_k, strategy, transport, ep, local)
        empty_fp8 = quantize_rows(jnp.zeros_like(empty_MD)) if fp8_rows else None
        return Received(empty_MD, jnp.zeros((0,), jnp.int32), None, plan, empty_fp8)
    width = x_TD.shape[1]
    moved_row_bytes = row_bytes(width) if fp8_dispatch else width * x_TD.dtype.itemsize
    moved = select_transport(strategy, transport, ep=ep, block_bytes=cap * moved_row_bytes)
    layout = moved.layout
    send_rows, recv_rows = buffer_rows(layout, routes, ep, cap)

    real_R = None if mask_T is None else jnp.repeat(mask_T, top_k)
    sends = plan_sends(expert_idx_TK.reshape(routes), real_R, num_experts=num_experts, ep=ep, capacity=cap,
                       top_k=top_k, padded=layout == "padded", send_rows=send_rows, backend=backend)
    # The count exchange: every rank's [P, El] kept counts, integers, not differentiated.
    counts_PPE = lax.all_gather(sends.kept_PE, axis_name)
    me = lax.axis_index(axis_name)
    ex = plan_exchange(counts_PPE.sum(axis=2), sends.send_sizes_P, me, layout, cap)
    regroup = plan_regroup(counts_PPE[:, me, :], ex.recv_offsets_P, recv_rows, cap if layout == "padded" else None)
    # x_TD's backward through each gather sums, per token, the rows its K routes were read into
    # (`gather_rows`' [T, K] inverse: float32, no atomics); -1 where a route is not read there.
    route_row_R, send_ids_S = sends.route_row_R, sends.send_ids_S
    route_row_TK = route_row_R.reshape(tokens, top_k)
    fp8 = None
    if moved.pairwise:
        # Only the peer block is built and moved; packed rows of this rank's own routes read their
        # tokens straight from x_TD, so the regroup gathers from the pair (x_TD, peer block).
        pair = pair_maps(regroup.recv_to_packed_M, regroup.packed_to_recv_M, route_row_R, me, cap)
        own_ids, peer_ids = own_and_peer(send_ids_S, me, cap)
        peer_send = gather_rows(x_TD, peer_ids, inverse_N=pair.peer_slot_R.reshape(tokens, top_k), backend=backend)
        if fp8_rows:
            peer, peer_fp8 = moved.exchange_fp8(peer_send, ex, out_rows=cap, axis_name=axis_name)
            # The own rows never cross: quantized here as the exchange quantizes the peer's.
            fp8 = (quantize_rows(lax.stop_gradient(x_TD)), peer_fp8)
        else:
            peer = moved.exchange(peer_send, ex, out_rows=cap, axis_name=axis_name, fp8=fp8_dispatch)
        regroup_src = (x_TD, peer)
        regroup_ids = jnp.where(pair.own_slot_M >= 0, own_ids[jnp.maximum(pair.own_slot_M, 0)],
                                jnp.where(pair.peer_slot_M >= 0, tokens + pair.peer_slot_M, -1))
        regroup_inverse = (pair.own_packed_R.reshape(tokens, top_k), pair.peer_to_packed_C)  # peer rows: read once
    else:
        send_x_SD = gather_rows(x_TD, send_ids_S, inverse_N=route_row_TK, backend=backend)
        if fp8_rows:
            regroup_src, fp8 = moved.exchange_fp8(send_x_SD, ex, out_rows=recv_rows, axis_name=axis_name)
        else:
            regroup_src = moved.exchange(send_x_SD, ex, out_rows=recv_rows, axis_name=axis_name, fp8=fp8_dispatch)
        regroup_ids, regroup_inverse = regroup.packed_to_recv_M, regroup.recv_to_packed_M

    # Every route of a real token that is not sent counts: over capacity or an invalid expert id.
    real_routes = routes if real_R is None else jnp.sum(real_R, dtype=jnp.int32)
    dropped = lax.psum(real_routes - jnp.sum(sends.send_sizes_P), axis_name)
    plan = EPPlan(
        strategy=strategy,
        transport=transport,
        capacity=cap,
        route_row_TK=route_row_TK,
        recv_to_packed_M=regroup.recv_to_packed_M,
        packed_to_recv_M=regroup.packed_to_recv_M,
        group_sizes_El=regroup.group_sizes_El,
        exchange=ex,
        send_counts_P=sends.send_counts_P,
        kept_PE=sends.kept_PE,
        dropped=dropped,
    )
    return Received(regroup_src, regroup_ids, regroup_inverse, plan, fp8)


def _empty_dispatch(x_TD, tokens: int, top_k: int, strategy: str, transport, ep: int, local: int):
    """`ep_dispatch` of no routes (T = 0 or K = 0 on every rank, as shapes are static): an empty
    packed buffer and a plan whose combine returns `[T, D_out]` zeros; nothing is exchanged."""
    none_P = jnp.zeros((ep,), jnp.int32)
    plan = EPPlan(
        strategy=strategy,
        transport=transport,
        capacity=0,
        route_row_TK=jnp.full((tokens, top_k), -1, jnp.int32),
        recv_to_packed_M=jnp.zeros((0,), jnp.int32),
        packed_to_recv_M=jnp.zeros((0,), jnp.int32),
        group_sizes_El=jnp.zeros((local,), jnp.int32),
        exchange=BlockExchange(none_P, none_P, none_P, none_P, none_P, none_P),
        send_counts_P=none_P,
        kept_PE=jnp.zeros((ep, local), jnp.int32),
        dropped=jnp.zeros((), jnp.int32),
    )
    return jnp.zeros((0, x_TD.shape[1]), x_TD.dtype), plan


def ep_combine(packed_y_MD: jax.Array, weights_TK: jax.Array, plan: EPPlan, *, axis_name=EP_AXIS,
               backend: BackendName = "auto") -> jax.Array:
    """Return expert outputs to their tokens' ranks and form `y_t = sum_k w_tk * y_tk`.

    Args:
      packed_y_MD: expert outputs in the packed layout `ep_dispatch` produced, `[M, D]`. Rows past
        `sum(group_sizes)` are never read (they may hold anything, NaN included).
      weights_TK: routing weights `[T, K]` of this rank's tokens.
      plan: the `EPPlan` from the matching `ep_dispatch` (its transport moves the rows back).
      backend: row-gather backend, as for `ep_dispatch`.

    Returns `y_TD` in `packed_y_MD.dtype`, summed over K in float32. Dropped routes contribute
    zero. Differentiable in `packed_y_MD` and `weights_TK`.
    """
    tokens, top_k = plan.route_row_TK.shape
    if weights_TK.shape != (tokens, top_k):
        raise ValueError(
            f"weights_TK must be [T, K] = {(tokens, top_k)} like the dispatched expert_idx_TK; got "
            f"shape {tuple(weights_TK.shape)}."
        )
    recv_rows = plan.recv_to_packed_M.shape[0]
    if packed_y_MD.ndim != 2 or packed_y_MD.shape[0] != recv_rows:
        raise ValueError(
            f"packed_y_MD must be [M, D] with M = {recv_rows} packed rows from ep_dispatch; got shape "
            f"{tuple(packed_y_MD.shape)}."
        )
    routes = tokens * top_k
    if routes == 0:
        return jnp.zeros((tokens, packed_y_MD.shape[1]), packed_y_MD.dtype)
    moved = plan.transport_for(packed_y_MD)
    send_rows, _ = buffer_rows(moved.layout, routes, plan.send_counts_P.shape[0], plan.capacity)

    row_R = plan.route_row_TK.reshape(routes)
    if moved.pairwise:
        # Only the peer block goes back; routes this rank served itself read their packed rows
        # directly (slots are p*C on both sides, so a route's send row is also its receive row).
        pair = pair_maps(plan.recv_to_packed_M, plan.packed_to_recv_M, row_R, lax.axis_index(axis_name),
                         plan.capacity)
        peer_back = gather_rows(packed_y_MD, pair.peer_to_packed_C, inverse_N=pair.peer_slot_M, backend=backend)
        peer_y = moved.exchange(peer_back, plan.exchange.reversed(), out_rows=plan.capacity, axis_name=axis_name)
        row_R = jnp.where(pair.own_packed_R >= 0, pair.own_packed_R,
                          jnp.where(pair.peer_slot_R >= 0, packed_y_MD.shape[0] + pair.peer_slot_R, -1))
        returned = (packed_y_MD, peer_y)  # read as their concatenation, never built
    else:
        back_MD = gather_rows(packed_y_MD, plan.recv_to_packed_M, inverse_N=plan.packed_to_recv_M, backend=backend)
        returned = (moved.exchange(back_MD, plan.exchange.reversed(), out_rows=send_rows, axis_name=axis_name),)
    # Materialised once: fused into the weighted sum below, XLA recomputed the index arithmetic
    # behind it for every element (docs/decisions.md, "index arithmetic behind a barrier").
    row_R = lax.optimization_barrier(row_R)
    # Every returned row is read by at most one route, so the gather's backward is a gather through
    # the inverse (no scatter-add). Routes without a row (-1) read nothing (a zero row) and add
    # nothing: the rows they would have read may be padding, NaN included.
    inverse_S = invert_rows(row_R, sum(r.shape[0] for r in returned))
    y_RD = gather_rows(returned, row_R, inverse_N=inverse_S, backend=backend)
    y_TKD = y_RD.reshape(tokens, top_k, -1).astype(jnp.float32)
    y_TD = jnp.sum(y_TKD * weights_TK.astype(jnp.float32)[:, :, None], axis=1)
    return y_TD.astype(packed_y_MD.dtype)


def ep_moe(
    x_TD: jax.Array,
    expert_idx_TK: jax.Array,
    weights_TK: jax.Array,
    expert_fn: Callable[..., jax.Array],
    *,
    num_experts: int,
    axis_name=EP_AXIS,
    strategy: str = "padded",
    capacity: int | None = None,
    mask_T: jax.Array | None = None,
    backend: BackendName = "auto",
    transport: str | Transport = "auto",
    fuse_regroup: bool = False,
    chunks: int = 1,
    fp8_dispatch: bool = False,
    fp8_rows: bool = False,
) -> tuple[jax.Array, EPStats]:
    """Dispatch, `packed_y_MD = expert_fn(packed_x_MD, group_sizes_El)`, combine.

    `expert_fn` closes over this rank's LOCAL expert weights (the `[El, ...]` shard) and must map
    the packed rows group by group (grouped-GEMM layout, e.g. `moe_jax.ops.grouped_linear`),
    returning `[M, D_out]`; its rows past `sum(group_sizes_El)` are ignored.
    `mask_T` (bool `[T]`) excludes padding tokens: they are not sent and their output is zero.
    `backend` picks the row-gather and send-plan backend, `transport` the row exchange and
    `fp8_dispatch` its payload (see `ep_dispatch`; the combine always moves `expert_fn`'s dtype).
    Returns `(y_TD, EPStats)`.

    `fp8_rows=True` (with `fp8_dispatch=True`): `expert_fn` also gets the rows as the exchange
    delivered them, e4m3 values with their tile scales, as the keyword `fp8_rows` (a
    `moe_jax.ops.fp8.Fp8Rows` row for row with the rows it gets: `expert_fn(x, group_sizes_El,
    fp8_rows=...)`, or `expert_fn(recv, group_sizes_El, rows, fp8_rows=...)` with `fuse_regroup`).
    FP8 experts compute on them (`swiglu_experts_fp8(quantized=...)`) instead of quantizing the
    dequantized rows again (the receiver's dequantize, 16-bit regroup and quantize passes drop
    out of the forward); the gradient still flows through the dequantized rows. On a pairwise
    transport the rows this rank keeps are quantized here, as the exchange quantizes the peer's.

    `fuse_regroup=True`: no packed copy of the received rows is made where the transport delivers
    one buffer (all_to_all, ragged_all_to_all); `expert_fn(recv_RD, group_sizes_El, rows)` gets
    the receive buffer and a `moe_jax.ops.RowGather` saying which of its rows each packed row is,
    to read them inside its first grouped GEMM (`grouped_linear(rows=...)`). The pairwise
    transport delivers two sources (this rank's tokens and the peer block), which are regrouped
    first as without the option; so is an exchange of no routes.

    `chunks=n` (n >= 1): this rank's T tokens are cut into N = min(n, T) contiguous chunks
    (`moe_jax.parallel.chunks.token_chunks`, sizes differing by at most one) and each runs its own
    dispatch, `expert_fn` call (once per chunk, on that chunk's packed rows: `expert_fn` must take
    any M) and combine; no chunk reads another's results, so XLA may overlap them. `capacity` is
    then each chunk's C (clamped to a chunk's routes; None: dropless per chunk, equal results to
    n = 1). `y_TD` is the chunks' outputs in token order; the `EPStats` figures are sums over the
    chunks (`chunk_group_sizes_NEl` keeps each chunk's group sizes).
    """
    tokens, top_k = _check_routes(x_TD, expert_idx_TK)
    if weights_TK.shape != (tokens, top_k):
        raise ValueError(
            f"weights_TK must be [T, K] = {(tokens, top_k)} like expert_idx_TK; got shape {tuple(weights_TK.shape)}."
        )
    mask_T = check_mask(mask_T, tokens, "ep_moe")
    bounds = token_chunks(tokens, check_chunks(chunks))
    options = dict(num_experts=num_experts, axis_name=axis_name, strategy=strategy, capacity=capacity,
                   backend=backend, transport=transport, fuse_regroup=fuse_regroup, fp8_dispatch=fp8_dispatch,
                   fp8_rows=fp8_rows)
    if len(bounds) == 1:
        return _moe_chunk(x_TD, expert_idx_TK, weights_TK, mask_T, expert_fn, **options)
    parts = [
        _moe_chunk(x_TD[a:b], expert_idx_TK[a:b], weights_TK[a:b], None if mask_T is None else mask_T[a:b], expert_fn,
                   **options)
        for a, b in bounds
    ]
    return jnp.concatenate([y_TD for y_TD, _ in parts]), _sum_stats([stats for _, stats in parts])


def _moe_chunk(x_TD, expert_idx_TK, weights_TK, mask_T, expert_fn, *, num_experts, axis_name, strategy, capacity,
               backend, transport, fuse_regroup, fp8_dispatch, fp8_rows) -> tuple[jax.Array, EPStats]:
    """`ep_moe` of one chunk of tokens: dispatch, experts, combine."""
    got = _receive(x_TD, expert_idx_TK, num_experts=num_experts, axis_name=axis_name, strategy=strategy,
                   capacity=capacity, mask_T=mask_T, backend=backend, transport=transport, fp8_dispatch=fp8_dispatch,
                   fp8_rows=fp8_rows)
    sizes_El = got.plan.group_sizes_El
    fused = fuse_regroup and got.inverse is not None and not isinstance(got.src, tuple)
    extra = {}
    if fp8_rows:
        extra["fp8_rows"] = got.fp8 if fused else _regroup_fp8(got, backend)
    if fused:
        # Each received row is read by exactly one packed row (or none): a one-column inverse.
        packed_y_MD = expert_fn(got.src, sizes_El, RowGather(got.ids_M, got.inverse[:, None]), **extra)
    else:
        packed_y_MD = expert_fn(_regroup(got, backend), sizes_El, **extra)
    return ep_combine(packed_y_MD, weights_TK, got.plan, axis_name=axis_name, backend=backend), got.plan.stats()


def _sum_stats(stats: list[EPStats]) -> EPStats:
    """One rank's `EPStats` over its chunks: every count summed on this rank (a maximum over ranks,
    taken later, then sees the rank's whole load, as unchunked), the chunks' group sizes stacked."""
    total = lambda field: functools.reduce(jnp.add, (getattr(s, field) for s in stats))  # noqa: E731
    return EPStats(dropped=total("dropped"), send_counts_P=total("send_counts_P"), recv_rows=total("recv_rows"),
                   group_sizes_El=total("group_sizes_El"), kept_E=total("kept_E"),
                   capacity=max(s.capacity for s in stats),
                   chunk_group_sizes_NEl=jnp.concatenate([s.chunk_group_sizes_NEl for s in stats]))
