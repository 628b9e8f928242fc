"""Expert-parallel dispatch and combine: move token rows to the ranks that own their experts and
bring the expert outputs back.

Everything here runs INSIDE `jax.shard_map` on per-device arrays, collectives over the ep axis
(`axis_name`, default `"ep"`). Shapes are static and nothing syncs with the host: buffers have a
worst-case size, and which rows are real is carried by on-device counts and masks.

Legend (shape suffixes): T tokens on this rank, D model width, K experts per token (top-k),
R = T*K routes, E experts, El = E/P local experts, P ep size, C capacity (rows one source rank
may send to one destination rank), S send-buffer rows, M receive-buffer rows = packed rows.

Dispatch (`ep_dispatch`), after the seed's section 4.3:

1. Expand T tokens into R routes (route r = t*K + k). Destination rank = expert // El, local
   expert = expert % El. Routes of masked tokens (`mask_T`) are not sent at all.
2. Capacity: within each destination, routes keep token order (lower token index first, then
   lower top-k slot) and the first C are kept; the rest are dropped and counted. Ranking by token
   rather than by local expert keeps the overflow spread over all experts of the destination
   instead of always hitting its highest-numbered one.
3. Send layout: the kept routes to each destination form one block, ordered by (local expert,
   token, slot). Block p starts at `send_offsets_P[p]`. Steps 1-3 are `moe_jax.ops.plan_sends`:
   one Pallas launch on GPU for up to 4096 routes (decode), XLA dense counts above.
4. Count exchange: one `all_gather` of every rank's kept counts per (destination, local expert),
   `[P, El]` int32 each. From the resulting `[P, P, El]` matrix every rank computes the same
   block offsets on both sides of every exchange, so no offsets travel separately, and the
   receiver knows the local-expert composition of each incoming block without receiving expert
   ids.
5. Exchange the rows (strategy below).
6. Regroup by local expert: packed row layout is expert 0's rows, expert 1's rows, ...; within an
   expert, rows are ordered by (source rank, token, slot). Rows past `sum(group_sizes)` are zero.

The row moves around the collectives (send buffer, regroup, and un-regroup in combine) are
`moe_jax.ops.gather_rows` with materialised row ids: a Pallas kernel on GPU (`backend`), about 1.4x
faster than the XLA gather it replaced, which also recomputed the index arithmetic per element.

Combine (`ep_combine`) is the reverse: un-regroup, reverse exchange (sizes swapped), gather each
route's returned row, weighted sum over K in float32.

Strategies (one seam, `_move_rows`; planning and regrouping are shared):

* `"padded"` -- `jax.lax.all_to_all` of `[P, C, D]` buffers: block p of the send buffer is rows
  `[p*C, (p+1)*C)`, zero past the kept rows. S = M = P*C. Runs on every backend. At P = 2 (for
  blocks of `_PAIR_MIN_BLOCK_BYTES` and more) the own block is never built: only the peer block
  is gathered and swapped by one `ppermute`; the regroup reads this rank's own routes straight
  from `x_TD` (the Pallas gather writes those rows while the peer block is in flight) and the
  combine reads them straight from the expert output.
* `"ragged"` -- `jax.lax.ragged_all_to_all`: the send buffer packs the kept routes tightly
  (S = R, blocks at exclusive cumsums of the kept counts), and each receiver packs the incoming
  blocks tightly in source order into M = P*C rows. GPU only (XLA:CPU does not implement it).
  Measured on 2 H200s with jax 0.11.2 (benchmarks/results/2026-11-30-h200x2-ep.md): about 5 GB/s
  by default, about 100-115 GB/s with XLA_FLAGS=--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true
  at prefill, against 250-310 GB/s for `"padded"` there at capacity factor 1.25 (about 165-170 GB/s at decode;
  benchmarks/results/2026-11-30-h200x2-ep-breakdown-4.md); hence
  `"padded"` is the default.

Both strategies keep the same routes and produce the same packed layout, so results agree
exactly. Dropless (`capacity=None`) means C = R: a destination may receive every route of every
source, M = P*T*K.

Each row exchange has its own `jax.custom_vjp` whose backward is the reverse exchange (like the
seed's AllToAllRows); JAX's built-in transpose of `ragged_all_to_all` is not used. The two-rank
`ppermute` of the padded strategy uses JAX's transpose of `ppermute`, the same swap. Integer
metadata (the count all_gather) is not differentiated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax.ops.backends import BackendName
from moe_jax.ops.rows import gather_rows
from moe_jax.ops.send_plan import plan_sends
from moe_jax.parallel.mesh import EP_AXIS
from moe_jax.permute import check_mask, exclusive_cumsum

__all__ = [
    "STRATEGIES",
    "BlockExchange",
    "EPPlan",
    "EPStats",
    "capacity_for",
    "check_capacity_factor",
    "ep_dispatch",
    "ep_combine",
    "ep_moe",
]

STRATEGIES = ("padded", "ragged")


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


class EPStats(NamedTuple):
    """Per-rank dispatch figures for logging.

    dropped: int32 scalar, routes of real tokens dropped by capacity (plus any such route with
        an expert id outside `[0, E)`), summed over the ep axis: every rank of an EP group reports the group total
        (each `"data"` replica's EP group has its own total).
    send_counts_P: `[P]` int32, real routes this rank addressed to each ep rank, before dropping.
    recv_rows: int32 scalar, rows this rank received and kept (= `sum(group_sizes)`).
    capacity: static Python int C, rows one source may send to one destination (R when dropless).
    """

    dropped: jax.Array
    send_counts_P: jax.Array
    recv_rows: jax.Array
    capacity: int


class EPPlan(NamedTuple):
    """What `ep_dispatch` decided and `ep_combine` needs to bring outputs back.

    A trace-local object: use it in the same traced function (e.g. the same `shard_map` body) as
    the dispatch that built it; `strategy` and `capacity` are static Python values.

    strategy, capacity: static; the exchange strategy and C.
    route_row_TK: int32, row of each delivered route in the send buffer; -1 where route (t, k)
        was not delivered (masked token, dropped by capacity or invalid expert id).
    recv_to_packed_M: int32, packed row of each receive-buffer row, -1 where it holds no route.
    packed_to_recv_M: int32, receive-buffer row of each packed row, -1 past `sum(group_sizes_El)`.
    group_sizes_El: int32, packed rows of each local expert.
    exchange: `BlockExchange` of the dispatch direction (combine uses `exchange.reversed()`).
    send_counts_P: int32, routes addressed to each rank before dropping.
    dropped: int32 scalar, ep-group total of undelivered routes of real tokens.
    """

    strategy: str
    capacity: int
    route_row_TK: jax.Array
    recv_to_packed_M: jax.Array
    packed_to_recv_M: jax.Array
    group_sizes_El: jax.Array
    exchange: BlockExchange
    send_counts_P: jax.Array
    dropped: jax.Array

    @property
    def keep_TK(self) -> jax.Array:
        """bool `[T, K]`: route (t, k) was delivered."""
        return self.route_row_TK >= 0

    def stats(self) -> EPStats:
        """The loggable summary of this dispatch."""
        return EPStats(
            dropped=self.dropped,
            send_counts_P=self.send_counts_P,
            recv_rows=jnp.sum(self.group_sizes_El),
            capacity=self.capacity,
        )


# ----------------------------------------------------------------------------- checks / sizes


def check_capacity_factor(capacity_factor) -> None:
    """ValueError unless `capacity_factor` is a finite number > 0 (1.0 = the balanced load)."""
    if not (isinstance(capacity_factor, (int, float)) and not isinstance(capacity_factor, bool)
            and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(
            f"capacity_factor must be a finite number > 0 (1.0 = the balanced load); got {capacity_factor!r}."
        )


def capacity_for(tokens_per_rank: int, top_k: int, ep_size: int, capacity_factor: float, *,
                 local_experts: int = 1) -> int:
    """Capacity C for `capacity_factor` times the balanced load: `ceil(cf * T*K / P)`.

    Rule: the result is clamped to `[min(local_experts, T*K), T*K]`: at least one row per local
    expert of the destination (`ep_dispatch` rejects less: below GShard/Switch's expert capacity of
    one, `cf * T*K / E < 1`, a factor means nothing; small batches such as decode hit this floor),
    and at most T*K, the dropless worst case (a larger buffer would only hold padding). Pass
    `local_experts=E // P`; the default 1 keeps one row per (source, destination) pair.
    Raises ValueError for non-positive sizes or a non-positive/non-finite factor.
    """
    for name, value in (("tokens_per_rank", tokens_per_rank), ("top_k", top_k), ("ep_size", ep_size),
                        ("local_experts", local_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")
    check_capacity_factor(capacity_factor)
    routes = tokens_per_rank * top_k
    # Round away float noise first (1.1 * 100 / 10 is 11.000000000000002, not 12 rows' worth).
    cap = math.ceil(round(capacity_factor * routes / ep_size, 9))
    return max(min(local_experts, routes), min(cap, routes))


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {strategy!r}; use 'padded' (all_to_all on fixed-capacity buffers, "
            "any backend) or 'ragged' (ragged_all_to_all, GPU only)."
        )


def _resolve_capacity(capacity, routes: int, local_experts: int) -> int:
    """C: R when dropless (`None`), else `min(capacity, R)` (more than R rows can never fill).

    C spread over a destination's El experts is the per-expert capacity C/El (GShard/Switch's
    `cf * T*K / E` when C = capacity_for(...)); below one row per expert (C < El) the factor is
    too small to mean anything, so it is an error, unless C covers all R routes anyway (few
    tokens, e.g. decode: then every route fits and nothing can drop).
    """
    if capacity is None:
        return routes
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise ValueError(f"capacity must be an int or None (dropless); got {capacity!r}.")
    floor = min(local_experts, routes)
    if capacity < floor:
        raise ValueError(
            f"capacity={capacity} is below one row per local expert: each destination owns "
            f"{local_experts} experts and this rank has {routes} routes, so capacity must be >= "
            f"{floor}. Use capacity=None for dropless dispatch or a larger capacity_factor."
        )
    return min(capacity, routes)


def _axis_size(axis_name) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis {axis_name!r} is not bound: call EP dispatch/combine inside jax.shard_map over a "
            f"mesh with that axis (e.g. make_mesh(ep=...), axis '{EP_AXIS}')."
        ) from err


def _local_experts(num_experts: int, ep: int) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int; got {num_experts!r}.")
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


def _buffer_rows(strategy: str, routes: int, ep: int, capacity: int) -> tuple[int, int]:
    """(S, M): send-buffer rows and receive/packed rows. The padded exchange moves whole [C]-row
    blocks both ways; the ragged one sends the R routes tightly packed."""
    recv_rows = ep * capacity
    return (recv_rows if strategy == "padded" else routes), recv_rows


# ----------------------------------------------------------------------------- index helpers


def _block_of(rows, offsets_P):
    """Block p owning each row of a buffer whose blocks start at the nondecreasing `offsets_P`
    (the last block starting at or before the row, so empty blocks are skipped).

    A dense `[rows, P]` comparison, one fused elementwise kernel: `jnp.searchsorted` would be a
    while loop, a sequence of launches on GPU, for a handful of ranks."""
    return jnp.sum(offsets_P[None, :] <= rows[:, None], axis=1, dtype=jnp.int32) - 1


# ----------------------------------------------------------------------------- planning


def _plan_exchange(counts_PP, send_sizes, me, strategy: str, capacity: int) -> BlockExchange:
    """Block offsets of the dispatch exchange from the kept-row matrix `counts_PP[src, dst]`, the
    same matrix on every rank, so sender and receiver agree without exchanging offsets.

    `send_sizes` is this rank's own row `counts_PP[me]`, computed locally: the send side (sizes
    and offsets) then does not wait for the count all_gather, so the send buffer can be built
    while it is in flight."""
    ep = counts_PP.shape[0]
    recv_sizes = counts_PP[:, me]
    if strategy == "padded":
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


class _Regroup(NamedTuple):
    recv_to_packed_M: jax.Array  # -1: receive row holds no route
    packed_to_recv_M: jax.Array  # -1: packed row past the groups
    group_sizes_El: jax.Array


def _plan_regroup(recv_PE, recv_offsets_P, rows: int, capacity: int | None) -> _Regroup:
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
    packed_to_recv_M = jnp.full((rows,), -1, jnp.int32).at[jnp.where(valid_M, packed_M, rows)].set(i_M, mode="drop")
    return _Regroup(recv_to_packed_M, packed_to_recv_M, group_sizes_El)


# ----------------------------------------------------------------------------- row exchanges


def _move_rows(rows_ND, ex: BlockExchange, out_rows: int, axis_name, strategy: str):
    """One exchange, no autodiff: rows of block p go to rank p (the strategy seam)."""
    if strategy == "padded":
        # Slots are p*C on both sides, so a tiled all_to_all over [P*C] rows is the exchange; the
        # rows past each block's size are zero on the sender and arrive as zeros.
        return lax.all_to_all(rows_ND, axis_name, 0, 0, tiled=True)
    # The collective's result takes the type of its output buffer, so under shard_map's check_vma
    # the buffer must vary over the same mesh axes as the rows (zeros_like keeps them); custom_vjp
    # rejects a backward whose result does not.
    out = jnp.zeros_like(rows_ND, shape=(out_rows,) + rows_ND.shape[1:])
    return lax.ragged_all_to_all(
        rows_ND,
        out,
        ex.send_offsets_P,
        ex.send_sizes_P,
        ex.peer_recv_offsets_P,
        ex.recv_sizes_P,
        axis_name=axis_name,
    )


# Smallest [C, D] block for which the two-rank padded exchange keeps its own routes local and
# swaps the peer block with a `ppermute`. On 2 H200s (benchmarks/results/2026-11-30-h200x2-ep-breakdown-3.md)
# it saved 8-9% of dispatch+combine against the all_to_all at 168 MB blocks (T = 16384), 7% at
# 42 MB (T = 4096), and cost 5% at decode's 9 MB blocks (191 vs 181 us).
_PAIR_MIN_BLOCK_BYTES = 16 << 20


def _pairwise(strategy: str, ep: int, capacity: int, rows_ND) -> bool:
    """Whether this padded exchange runs between two ranks with the own routes kept local and a
    `ppermute` of the peer block (see the module docstring) rather than an `all_to_all`."""
    block_bytes = capacity * rows_ND.shape[1] * rows_ND.dtype.itemsize
    return strategy == "padded" and ep == 2 and block_bytes >= _PAIR_MIN_BLOCK_BYTES


def _own_and_peer(ids_S, me, capacity: int):
    """(own block, peer block) of a `[2C]` padded-layout vector (block p at rows p*C)."""
    return (lax.dynamic_slice(ids_S, (me * capacity,), (capacity,)),
            lax.dynamic_slice(ids_S, ((1 - me) * capacity,), (capacity,)))


class _PairMaps(NamedTuple):
    """The two-rank path's view of the packed layout (blocks of C slots, block p at p*C; -1: none).
    A route this rank serves itself sits at receive row = send row, since slots are p*C on both
    sides."""

    own_slot_M: jax.Array  # slot in this rank's own block of each packed row
    peer_slot_M: jax.Array  # slot in the peer's block of each packed row
    peer_to_packed_C: jax.Array  # packed row filled by each slot of the peer's block
    own_packed_R: jax.Array  # packed row of each route this rank serves itself
    peer_slot_R: jax.Array  # slot in the peer's block of each route sent to the peer


def _pair_maps(recv_to_packed_M, packed_to_recv_M, route_row_R, me, capacity: int) -> _PairMaps:
    def split(row, real):
        """(own slot, peer slot) of padded-layout rows, -1 where not real or not that side."""
        own = row // capacity == me
        return jnp.where(real & own, row % capacity, -1), jnp.where(real & ~own, row % capacity, -1)

    own_slot_M, peer_slot_M = split(packed_to_recv_M, packed_to_recv_M >= 0)
    own_slot_R, peer_slot_R = split(route_row_R, route_row_R >= 0)
    return _PairMaps(own_slot_M=own_slot_M, peer_slot_M=peer_slot_M,
                     peer_to_packed_C=_own_and_peer(recv_to_packed_M, me, capacity)[1],
                     own_packed_R=jnp.where(own_slot_R >= 0, recv_to_packed_M[jnp.maximum(route_row_R, 0)], -1),
                     peer_slot_R=peer_slot_R)


def _swap_pair(rows_ND, axis_name):
    """The two ranks of the ep axis swap `rows_ND` (its transpose is the same swap)."""
    return lax.ppermute(rows_ND, axis_name, [(0, 1), (1, 0)])


def _exchange_rows(rows_ND, ex: BlockExchange, *, out_rows: int, axis_name, strategy: str):
    """Differentiable `_move_rows`: the cotangent of a received block goes back to its sender
    through the reverse exchange (send/recv swapped), as in the seed's AllToAllRows."""
    in_rows = rows_ND.shape[0]

    @jax.custom_vjp
    def exchange(rows, ex):
        return _move_rows(rows, ex, out_rows, axis_name, strategy)

    def forward(rows, ex):
        return exchange(rows, ex), ex

    def backward(ex, grad_rows):
        return _move_rows(grad_rows, ex.reversed(), in_rows, axis_name, strategy), None

    exchange.defvjp(forward, backward)
    return exchange(rows_ND, ex)


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
) -> tuple[jax.Array, jax.Array, EPPlan]:
    """Send each token's rows to the owners of its K experts; return them grouped by local expert.

    Args:
      x_TD: this rank's tokens, `[T, D]`.
      expert_idx_TK: int `[T, K]` global expert ids in `[0, num_experts)`; routes with other ids
        are never delivered (they count as dropped).
      num_experts: E, a multiple of the ep axis size P; rank p owns experts `[p*El, (p+1)*El)`.
      axis_name: the ep mesh axis (inside `jax.shard_map`).
      strategy: `"padded"` or `"ragged"` (GPU only), see the module docstring.
      capacity: C rows per (source, destination) pair, or None for dropless (C = T*K). Values
        above T*K are clamped to T*K; values below one row per local expert (C < min(E/P, T*K))
        raise ValueError.
      mask_T: optional bool `[T]`, True for real tokens. Routes of masked tokens are neither sent
        nor counted (not in `send_counts_P`, not dropped); their combined output is zero.
      backend: backend of the row gathers and the send plan (`"auto"`: our Pallas kernels on GPU,
        XLA elsewhere; see `moe_jax.ops.gather_rows` and `moe_jax.ops.plan_sends`).

    Returns:
      packed_x_MD: `[M, D]`, M = P*C, rows of local expert 0, then 1, ... (within an expert by
        source rank, token, slot); rows past `sum(group_sizes_El)` are zero.
      group_sizes_El: int32 `[El]` rows per local expert (padding rows not counted).
      plan: `EPPlan` for `ep_combine`.
    """
    _check_strategy(strategy)
    tokens, top_k = _check_routes(x_TD, expert_idx_TK)
    mask_T = check_mask(mask_T, tokens, "ep_dispatch")
    ep = _axis_size(axis_name)
    local = _local_experts(num_experts, ep)
    routes = tokens * top_k
    cap = _resolve_capacity(capacity, routes, local)
    send_rows, recv_rows = _buffer_rows(strategy, routes, ep, cap)
    if routes == 0:
        return _empty_dispatch(x_TD, tokens, top_k, strategy, ep, local)

    real_R = None if mask_T is None else jnp.repeat(mask_T, top_k)
    # Send-buffer row of each kept route and the token each send row reads (-1: padding).
    sends = plan_sends(expert_idx_TK.reshape(routes), real_R, num_experts=num_experts, ep=ep, capacity=cap,
                       top_k=top_k, padded=strategy == "padded", send_rows=send_rows, backend=backend)
    # The count exchange: every rank's [P, El] kept counts, integers, not differentiated.
    counts_PPE = lax.all_gather(sends.kept_PE, axis_name)
    me = lax.axis_index(axis_name)
    ex = _plan_exchange(counts_PPE.sum(axis=2), sends.send_sizes_P, me, strategy, cap)
    route_row_R, send_ids_S = sends.route_row_R, sends.send_ids_S
    regroup = _plan_regroup(counts_PPE[:, me, :], ex.recv_offsets_P, recv_rows,
                            cap if strategy == "padded" else None)
    # x_TD's backward through each gather sums, per token, the rows its K routes were read into
    # (`gather_rows`' [T, K] inverse: float32, no atomics); -1 where a route is not read there.
    route_row_TK = route_row_R.reshape(tokens, top_k)
    if _pairwise(strategy, ep, cap, x_TD):
        # Only the peer block is built and swapped; packed rows of this rank's own routes read
        # their tokens straight from x_TD (the own block is never materialised), so the regroup
        # gathers from the pair (x_TD, received peer block).
        pair = _pair_maps(regroup.recv_to_packed_M, regroup.packed_to_recv_M, route_row_R, me, cap)
        own_ids, peer_ids = _own_and_peer(send_ids_S, me, cap)
        peer_x = _swap_pair(gather_rows(x_TD, peer_ids, inverse_N=pair.peer_slot_R.reshape(tokens, top_k),
                                        backend=backend), axis_name)
        regroup_src = (x_TD, peer_x)
        regroup_ids = jnp.where(pair.own_slot_M >= 0, own_ids[jnp.maximum(pair.own_slot_M, 0)],
                                jnp.where(pair.peer_slot_M >= 0, tokens + pair.peer_slot_M, -1))
        regroup_inverse = (pair.own_packed_R.reshape(tokens, top_k), pair.peer_to_packed_C)  # peer rows: read once
    else:
        send_x_SD = gather_rows(x_TD, send_ids_S, inverse_N=route_row_TK, backend=backend)
        regroup_src = _exchange_rows(send_x_SD, ex, out_rows=recv_rows, axis_name=axis_name, strategy=strategy)
        regroup_ids, regroup_inverse = regroup.packed_to_recv_M, regroup.recv_to_packed_M
    # Padding rows are written as zeros here, whatever the receive buffer holds there.
    packed_x_MD = gather_rows(regroup_src, regroup_ids, inverse_N=regroup_inverse, backend=backend)

    # Every route of a real token that is not sent counts: over capacity or an invalid expert id.
    real_routes = routes if real_R is None else jnp.sum(real_R, dtype=jnp.int32)
    dropped = lax.psum(real_routes - jnp.sum(sends.send_sizes_P), axis_name)
    plan = EPPlan(
        strategy=strategy,
        capacity=cap,
        route_row_TK=route_row_TK,
        recv_to_packed_M=regroup.recv_to_packed_M,
        packed_to_recv_M=regroup.packed_to_recv_M,
        group_sizes_El=regroup.group_sizes_El,
        exchange=ex,
        send_counts_P=sends.send_counts_P,
        dropped=dropped,
    )
    return packed_x_MD, regroup.group_sizes_El, plan


def _empty_dispatch(x_TD, tokens: int, top_k: int, strategy: str, ep: int, local: int):
    """`ep_dispatch` of no routes (T = 0 or K = 0 on every rank, as shapes are static): empty
    buffers and a plan whose combine returns `[T, D_out]` zeros; nothing is exchanged."""
    none_P = jnp.zeros((ep,), jnp.int32)
    plan = EPPlan(
        strategy=strategy,
        capacity=0,
        route_row_TK=jnp.full((tokens, top_k), -1, jnp.int32),
        recv_to_packed_M=jnp.zeros((0,), jnp.int32),
        packed_to_recv_M=jnp.zeros((0,), jnp.int32),
        group_sizes_El=jnp.zeros((local,), jnp.int32),
        exchange=BlockExchange(none_P, none_P, none_P, none_P, none_P, none_P),
        send_counts_P=none_P,
        dropped=jnp.zeros((), jnp.int32),
    )
    return jnp.zeros((0, x_TD.shape[1]), x_TD.dtype), plan.group_sizes_El, plan


def ep_combine(packed_y_MD: jax.Array, weights_TK: jax.Array, plan: EPPlan, *, axis_name=EP_AXIS,
               backend: BackendName = "auto") -> jax.Array:
    """Return expert outputs to their tokens' ranks and form `y_t = sum_k w_tk * y_tk`.

    Args:
      packed_y_MD: expert outputs in the packed layout `ep_dispatch` produced, `[M, D]`. Rows past
        `sum(group_sizes)` are never read (they may hold anything, NaN included).
      weights_TK: routing weights `[T, K]` of this rank's tokens.
      plan: the `EPPlan` from the matching `ep_dispatch`.
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
    ep = plan.send_counts_P.shape[0]
    routes = tokens * top_k
    send_rows, _ = _buffer_rows(plan.strategy, routes, ep, plan.capacity)
    zero = jnp.zeros((), packed_y_MD.dtype)
    if routes == 0:
        return jnp.zeros((tokens, packed_y_MD.shape[1]), packed_y_MD.dtype)

    # Routes without a row (-1) read row 0 below and are zeroed by a select, never a multiply by a
    # mask: that row may be padding (NaN included), and the select's gradient there is exactly 0.
    row_R = plan.route_row_TK.reshape(routes)
    if _pairwise(plan.strategy, ep, plan.capacity, packed_y_MD):
        # Only the peer block goes back; routes this rank served itself read their packed rows
        # directly (slots are p*C on both sides, so a route's send row is also its receive row).
        pair = _pair_maps(plan.recv_to_packed_M, plan.packed_to_recv_M, row_R, lax.axis_index(axis_name),
                          plan.capacity)
        peer_y = _swap_pair(gather_rows(packed_y_MD, pair.peer_to_packed_C, inverse_N=pair.peer_slot_M,
                                        backend=backend), axis_name)
        row_R = jnp.where(pair.own_packed_R >= 0, pair.own_packed_R,
                          jnp.where(pair.peer_slot_R >= 0, packed_y_MD.shape[0] + pair.peer_slot_R, -1))
        returned_SD = jnp.concatenate([packed_y_MD, peer_y])
    else:
        back_MD = gather_rows(packed_y_MD, plan.recv_to_packed_M, inverse_N=plan.packed_to_recv_M, backend=backend)
        returned_SD = _exchange_rows(
            back_MD, plan.exchange.reversed(), out_rows=send_rows, axis_name=axis_name, strategy=plan.strategy
        )
    # Materialised once: fused into the weighted sum below, XLA recomputed the index arithmetic
    # behind it for every element (a 6 us decode combine took 258 us on an H200).
    row_R = lax.optimization_barrier(row_R)
    y_RD = jnp.where((row_R >= 0)[:, None], returned_SD[jnp.maximum(row_R, 0)], zero)
    y_TKD = y_RD.reshape(tokens, top_k, -1).astype(jnp.float32)
    y_TD = jnp.sum(y_TKD * weights_TK.astype(jnp.float32)[:, :, None], axis=1)
    return y_TD.astype(packed_y_MD.dtype)


def ep_moe(
    x_TD: jax.Array,
    expert_idx_TK: jax.Array,
    weights_TK: jax.Array,
    expert_fn: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    num_experts: int,
    axis_name=EP_AXIS,
    strategy: str = "padded",
    capacity: int | None = None,
    mask_T: jax.Array | None = None,
    backend: BackendName = "auto",
) -> tuple[jax.Array, EPStats]:
    """Dispatch, `packed_y_MD = expert_fn(packed_x_MD, group_sizes_El)`, combine.

    `expert_fn` closes over this rank's LOCAL expert weights (the `[El, ...]` shard) and must map
    the packed rows group by group (grouped-GEMM layout, e.g. `moe_jax.ops.grouped_linear`),
    returning `[M, D_out]`; its rows past `sum(group_sizes_El)` are ignored.
    `mask_T` (bool `[T]`) excludes padding tokens: they are not sent and their output is zero.
    `backend` picks the row-gather and send-plan backend (see `ep_dispatch`).
    Returns `(y_TD, EPStats)`.
    """
    packed_x_MD, group_sizes_El, plan = ep_dispatch(
        x_TD,
        expert_idx_TK,
        num_experts=num_experts,
        axis_name=axis_name,
        strategy=strategy,
        capacity=capacity,
        mask_T=mask_T,
        backend=backend,
    )
    packed_y_MD = expert_fn(packed_x_MD, group_sizes_El)
    return ep_combine(packed_y_MD, weights_TK, plan, axis_name=axis_name, backend=backend), plan.stats()
