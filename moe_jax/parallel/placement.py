"""Expert placement and replication: which logical expert each physical expert slot holds.

Host-side NumPy planning from a load history; nothing here runs on device or under jit. Legend:
E logical experts, R ranks of the expert-parallel axis (P elsewhere in `moe_jax.parallel`), S
slots per rank (physical experts; S*R >= E, the S*R - E redundant slots hold replicas of hot
experts), L layers, M the most replicas of any expert, N nodes (R / ranks_per_node), G expert
groups. A physical slot has the flat id `f = r*S + s` (rank r, local slot s).

The load model: an expert's load (its rows, summed over a window of steps) is split evenly among
its replicas, so a rank's load is the sum over its slots of `load_E[e] / replicas_E[e]`. The
on-device router (`moe_jax.parallel.replicas.route_to_replicas`) deals each source rank's rows of
an expert round-robin over its replicas in slot-id order, starting at a replica rotated by the
source rank, which realises that split to within one row per slot and source rank (`split_counts`
with `offset=` the source rank is that integer split).

The planner (`plan_placement`) starts from the expert-parallel load balancer of DeepSeek-V3
(DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, redundant experts in its
inference and deployment section; the open EPLB description spells out the steps), written afresh
here:

1. replication: each redundant slot goes, one at a time, to the expert with the largest load per
   replica (at most one replica per rank);
2. packing: the replicas, heaviest first, each go to the least-loaded rank that has a free slot
   and no replica of that expert yet;
3. hierarchical variant (`ranks_per_node`): first the expert groups are packed onto nodes (equal
   group counts, heaviest group to the least-loaded node), then steps 1-2 run inside each node,
   so every replica of an expert stays on the node of its group.

`refine=True` (the default) adds, at a few to a hundred milliseconds per layer:
- replica-count candidates: besides step 1's counts, for each target capacity C on a grid around
  the mean rank load, `ceil(load / C)` replicas per expert with the slots left over as light
  fillers; each candidate is packed and the best kept (with 2-3 slots per rank, replicas near the
  rank capacity pack far tighter than the lightest-possible replicas of step 1);
- a local search of pairwise slot swaps between the most-loaded rank and any other rank of its
  node, while one lowers the maximum;
- when S*R == E, today's contiguous layout (refined the same way) as one more start, so the plan
  is never worse than what it replaces.
It is never worse than step 1-3 alone. Everything is deterministic: ties go to the lowest index.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "Placement",
    "PlacementMoves",
    "align_placement",
    "imbalance",
    "imbalance_bound",
    "placement_moves",
    "plan_placement",
    "rank_loads",
    "slots_per_rank_for",
    "split_counts",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Which logical expert each physical slot holds.

    `slot_expert_RS[r, s]` is the logical expert (in `[0, num_experts)`) held in slot s of rank r.
    Contract: every expert is held by at least one slot and every slot holds exactly one expert.
    (The planner never puts two replicas of one expert on one rank; a hand-made placement may,
    the load model still holds.) The array is stored as a read-only int32 copy. Placements compare
    equal when `num_experts` and the array are equal.
    """

    slot_expert_RS: np.ndarray
    num_experts: int

    def __post_init__(self):
        raw = np.asarray(self.slot_expert_RS)
        if raw.ndim != 2 or raw.shape[0] < 1 or raw.shape[1] < 1:
            raise ValueError(f"slot_expert_RS must be a non-empty [R, S] array, got shape {raw.shape}")
        if raw.dtype.kind not in "iu":
            raise ValueError(f"slot_expert_RS must hold integers, got dtype {raw.dtype}")
        e = _positive_int(self.num_experts, "num_experts")
        if raw.min() < 0 or raw.max() >= e:
            raise ValueError(f"slot_expert_RS must hold experts in [0, {e}), got values in [{raw.min()}, {raw.max()}]")
        missing = np.flatnonzero(np.bincount(raw.ravel(), minlength=e) == 0)
        if missing.size:
            raise ValueError(f"slot_expert_RS leaves experts {missing[:8].tolist()}{'...' if missing.size > 8 else ''} "
                             "without a slot: every expert needs at least one")
        arr = raw.astype(np.int32, copy=True)
        arr.setflags(write=False)
        object.__setattr__(self, "slot_expert_RS", arr)
        object.__setattr__(self, "num_experts", e)

    @classmethod
    def uniform(cls, num_experts: int, num_ranks: int) -> Placement:
        """Today's contiguous layout: expert e in slot e % (E/R) of rank e // (E/R), no replicas."""
        e = _positive_int(num_experts, "num_experts")
        r = _positive_int(num_ranks, "num_ranks")
        if e % r:
            raise ValueError(f"num_experts = {e} must be a multiple of num_ranks = {r} for the contiguous layout")
        return cls(np.arange(e).reshape(r, e // r), e)

    @property
    def num_ranks(self) -> int:
        return self.slot_expert_RS.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.slot_expert_RS.shape[1]

    @property
    def num_slots(self) -> int:
        return self.slot_expert_RS.size

    @property
    def num_redundant(self) -> int:
        """Slots beyond one per expert (S*R - E)."""
        return self.num_slots - self.num_experts

    @functools.cached_property
    def replicas_E(self) -> np.ndarray:
        """`[E]` int32: how many slots hold each expert (>= 1)."""
        out = np.bincount(self.slot_expert_RS.ravel(), minlength=self.num_experts).astype(np.int32)
        out.setflags(write=False)
        return out

    @functools.cached_property
    def expert_slots_EM(self) -> np.ndarray:
        """`[E, M]` int32: the flat slot ids (`r*S + s`) of each expert's replicas in ascending
        order, padded with -1; M = `replicas_E.max()`. Replica i of expert e lives on rank
        `expert_slots_EM[e, i] // S`; a router that deals the rows of expert e round-robin sends
        its j-th row to `expert_slots_EM[e, j % replicas_E[e]]`."""
        flat = self.slot_expert_RS.ravel()
        order = np.argsort(flat, kind="stable")  # slots grouped by expert, ascending slot id within
        starts = np.concatenate([[0], np.cumsum(self.replicas_E)[:-1]])
        out = np.full((self.num_experts, int(self.replicas_E.max())), -1, np.int32)
        out[flat[order], np.arange(flat.size) - starts[flat[order]]] = order
        out.setflags(write=False)
        return out

    def __eq__(self, other):
        if not isinstance(other, Placement):
            return NotImplemented
        return self.num_experts == other.num_experts and np.array_equal(self.slot_expert_RS, other.slot_expert_RS)

    def __hash__(self):
        return hash((self.num_experts, self.slot_expert_RS.shape, self.slot_expert_RS.tobytes()))


class PlacementMoves(NamedTuple):
    """What changes between two placements of the same shape (see `placement_moves`).

    `changed_RS` `[R, S]` bool: the slot holds another expert in the new placement.
    `source_RS` `[R, S]` int32: a flat slot id of the old placement holding the expert the slot
    holds in the new one (the slot itself where unchanged; a slot on the same rank when the old
    placement had one, so the copy is local; else the old replica with the fewest copies taken
    from it so far, to spread the sends).
    `num_changed`: slots whose weights (and optimizer state) must be written.
    `num_remote`: of those, the ones that copy from another rank.
    """

    changed_RS: np.ndarray
    source_RS: np.ndarray
    num_changed: int
    num_remote: int


# ---------------------------------------------------------------------------------------------
# validation helpers


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_load(load, name: str, ndims: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(load)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    if arr.ndim not in ndims or arr.shape[-1] < 1:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name} must be a non-empty {want} array, got shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    if np.any(arr < 0):
        raise ValueError(f"{name} must be non-negative, got a minimum of {arr.min()}")
    return arr


def _check_placement_load(placement: Placement, load_E) -> np.ndarray:
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a Placement, got {type(placement).__name__}")
    load = _check_load(load_E, "load_E", (1,))
    if load.shape != (placement.num_experts,):
        raise ValueError(f"load_E must have shape ({placement.num_experts},) to match the placement, got {load.shape}")
    return load


def _check_slots(num_experts: int, num_ranks, slots_per_rank) -> tuple[int, int]:
    r = _positive_int(num_ranks, "num_ranks")
    s = _positive_int(slots_per_rank, "slots_per_rank")
    if s * r < num_experts:
        raise ValueError(f"slots_per_rank * num_ranks = {s} * {r} = {s * r} < num_experts = {num_experts}: "
                         "every expert needs a slot")
    if s > num_experts:
        raise ValueError(f"slots_per_rank = {s} > num_experts = {num_experts}: a rank would hold two replicas "
                         "of one expert")
    return r, s


def slots_per_rank_for(num_experts: int, num_ranks: int, redundant: int = 0) -> int:
    """The S that gives at least `redundant` redundant slots: `ceil((E + redundant) / R)`.

    With the same S on every rank, S*R - E moves in steps of R, so the redundant count you get is
    `redundant` rounded up to E's remainder class mod R (e.g. E = 128, R = 64: 0 or 64, not 16)."""
    e = _positive_int(num_experts, "num_experts")
    r = _positive_int(num_ranks, "num_ranks")
    if isinstance(redundant, bool) or not isinstance(redundant, (int, np.integer)) or redundant < 0:
        raise ValueError(f"redundant must be a non-negative integer, got {redundant!r}")
    return -(-(e + int(redundant)) // r)


# ---------------------------------------------------------------------------------------------
# loads


def rank_loads(placement: Placement, load_E) -> np.ndarray:
    """`[R]` float64: each rank's load when each expert's load is split evenly over its replicas."""
    load = _check_placement_load(placement, load_E)
    per_slot_RS = (load / placement.replicas_E)[placement.slot_expert_RS]
    return per_slot_RS.sum(axis=1)


def imbalance(placement: Placement, load_E) -> float:
    """max / mean of `rank_loads` (1.0 for an all-zero load: nothing is imbalanced)."""
    loads = rank_loads(placement, load_E)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def split_counts(placement: Placement, counts_E, offset: int = 0) -> np.ndarray:
    """`[R, S]` int64: rows per slot when each expert's `counts_E[e]` rows are dealt round-robin
    over its replicas in ascending slot-id order (the first `counts_E[e] % replicas_E[e]`
    replicas get one row more). This is the integer form of the even split `rank_loads` assumes:
    it conserves every expert's count and differs from `counts_E[e] / replicas_E[e]` by < 1.

    `offset`: the deal starts at replica `offset % replicas_E[e]` instead of 0 (so the replicas
    from there on get the extra rows). The layer's router deals source rank r's rows with
    `offset = r` (`moe_jax.parallel.replicas.route_to_replicas`); this is its host reference."""
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
    counts = _check_placement_load(placement, counts_E)
    if not np.array_equal(counts, np.round(counts)):
        raise ValueError("counts_E must hold whole row counts")
    counts = counts.astype(np.int64)
    k = placement.replicas_E.astype(np.int64)
    base, extra = counts // k, counts % k
    e_F = placement.slot_expert_RS.ravel()
    # The replica index of each flat slot among its expert's replicas (ascending slot id).
    replica_F = np.empty(e_F.size, np.int64)
    slots = placement.expert_slots_EM
    valid = slots >= 0
    replica_F[slots[valid]] = np.nonzero(valid)[1]
    rows_F = base[e_F] + ((replica_F - int(offset)) % k[e_F] < extra[e_F])
    return rows_F.reshape(placement.slot_expert_RS.shape)


def _greedy_replicas(load: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """Replica counts (sum `num_slots`, each in [1, cap]) minimising the largest load per replica:
    every extra slot goes to the expert with the largest `load / count` (lowest index on ties).
    Giving each slot to the current maximum is optimal for that objective (the maximum after j
    extra slots cannot be lowered by any other choice of j), which is why it is also the bound."""
    e = load.size
    counts = np.ones(e, np.int64)
    extra = num_slots - e
    if extra <= 0:
        return counts
    heap = [(-float(load[i]), i) for i in range(e) if cap > 1]
    heapq.heapify(heap)
    for _ in range(extra):
        _, i = heapq.heappop(heap)  # extra <= e*(cap-1), so the heap never runs dry
        counts[i] += 1
        if counts[i] < cap:
            heapq.heappush(heap, (-float(load[i] / counts[i]), i))
    return counts


def imbalance_bound(load_E, num_ranks: int, slots_per_rank: int) -> float:
    """A lower bound on `imbalance` of any placement of `load_E` on R ranks x S slots with no
    expert twice on a rank (every placement `plan_placement` makes).

    The rank holding the heaviest replica carries at least m* (the smallest achievable heaviest
    replica, `_greedy_replicas`) plus S-1 replicas of other experts; those weigh at least the S-1
    smallest loads, with the largest min(X, S-1) of them split min(R, X+1) ways (X = S*R - E
    redundant slots: at most X experts have a second replica, none more than X+1 or R). The
    bound is max(1, that / mean rank load).
    """
    load = _check_load(load_E, "load_E", (1,))
    r, s = _check_slots(load.size, num_ranks, slots_per_rank)
    total = load.sum()
    if total == 0:
        return 1.0
    x = r * s - load.size
    top = (load / _greedy_replicas(load, r * s, cap=r)).max()
    rest = np.sort(load)[: s - 1]
    split = min(x, s - 1)
    rest_lb = rest[: s - 1 - split].sum() + rest[s - 1 - split:].sum() / min(r, x + 1)
    return float(max(1.0, (top + rest_lb) * r / total))


# ---------------------------------------------------------------------------------------------
# the planner


def _pack(weight_I: np.ndarray, expert_I: np.ndarray, num_ranks: int, slots: int, num_experts: int) -> np.ndarray:
    """Balanced packing with a slot count per rank: items heaviest first (then by expert, then by
    index), each to the least-loaded rank with a free slot and no replica of its expert (lowest
    rank on ties). Returns `[I]` the rank of each item. If only ranks holding the expert have free
    slots left (possible for the last, lightest items) it goes to the least-loaded of those and
    `_repair` moves the duplicate away."""
    order = np.lexsort((np.arange(weight_I.size), expert_I, -weight_I))
    load = np.zeros(num_ranks)
    free = np.full(num_ranks, slots)
    holds = np.zeros((num_ranks, num_experts), bool)
    rank_I = np.empty(weight_I.size, np.int64)
    for i in order:
        e = expert_I[i]
        ok = (free > 0) & ~holds[:, e]
        if not ok.any():
            ok = free > 0
        r = int(np.argmin(np.where(ok, load, np.inf)))
        rank_I[i] = r
        load[r] += weight_I[i]
        free[r] -= 1
        holds[r, e] = True
    return rank_I


def _layout(weight_I, expert_I, rank_I, num_ranks, slots):
    """`[R, S]` experts and per-slot loads from the packing, each rank's slots by ascending expert."""
    order = np.lexsort((expert_I, rank_I))
    return expert_I[order].reshape(num_ranks, slots).copy(), weight_I[order].reshape(num_ranks, slots).copy()


def _swap_values(se, w, load, holds, node, r):
    """For every swap of a slot i of rank r with slot j of rank q (same node, q != r, neither rank
    ending up with two replicas of one expert): max of the two ranks' new loads, `[S, R, S]`, inf
    where not allowed."""
    a, wa = se[r], w[r]
    R = se.shape[0]
    ok = se[None, :, :] != a[:, None, None]
    ok &= ~holds[:, a].T[:, :, None]  # rank q does not hold a yet
    ok &= ~holds[r][se][None, :, :]  # rank r does not hold b yet
    ok &= ((node == node[r]) & (np.arange(R) != r))[None, :, None]
    delta = wa[:, None, None] - w[None, :, :]
    value = np.maximum(load[r] - delta, load[None, :, None] + delta)
    return np.where(ok, value, np.inf)


def _apply_swap(se, w, load, holds, r, i, q, j):
    a, b = se[r, i], se[q, j]
    delta = w[r, i] - w[q, j]
    se[r, i], se[q, j] = b, a
    w[r, i], w[q, j] = w[q, j], w[r, i]
    load[r] -= delta
    load[q] += delta
    holds[r, a] = np.any(se[r] == a)
    holds[q, b] = np.any(se[q] == b)
    holds[r, b] = holds[q, a] = True


def _repair(se, w, node, num_experts):
    """Remove the duplicate replicas `_pack` may leave (two replicas of one expert on a rank),
    each by the swap with another rank of the node that keeps the pair's larger load smallest.

    Each swap moves a duplicated expert a off rank r to a rank q lacking it, in exchange for an
    expert b that r lacks, so the count of duplicates drops by at least one. Taking r as the rank
    with the fewest distinct experts guarantees such a swap: a has at most as many replicas as the
    node has ranks and two of them share r, so some rank q of the node lacks a; and if every
    expert of q were on r, q (lacking a) would have fewer distinct experts than r."""
    R, S = se.shape
    load = w.sum(axis=1)
    holds = _holds(se, num_experts)
    while True:
        distinct = holds.sum(axis=1)
        r = int(np.argmin(distinct))
        if distinct[r] == S:
            return
        vals, cnt = np.unique(se[r], return_counts=True)
        a = vals[np.argmax(cnt > 1)]
        i = int(np.flatnonzero(se[r] == a)[-1])
        best, arg = np.inf, None
        for q in np.flatnonzero((node == node[r]) & ~holds[:, a]):
            for j in range(S):
                if holds[r, se[q, j]]:
                    continue
                delta = w[r, i] - w[q, j]
                v = max(load[r] - delta, load[q] + delta)
                if v < best:
                    best, arg = v, (int(q), j)
        _apply_swap(se, w, load, holds, r, i, *arg)


def _holds(se, num_experts):
    holds = np.zeros((se.shape[0], num_experts), bool)
    holds[np.arange(se.shape[0])[:, None], se] = True
    return holds


def _refine(se, w, node, num_experts, max_iters: int | None = None):
    """Local search: while a swap between the most-loaded rank and another rank of its node
    leaves both below the current maximum, do the one with the smallest larger load (first in
    (slot, rank, slot) order on ties). Each swap removes one rank from the top load or lowers it,
    so the search ends; it stops at the first maximum no single swap can lower."""
    load = w.sum(axis=1)
    holds = _holds(se, num_experts)
    R, S = se.shape
    for _ in range(max_iters if max_iters is not None else 4 * R * S + 16):
        r = int(np.argmax(load))
        top = load[r]
        if top <= 0:
            return
        value = _swap_values(se, w, load, holds, node, r)
        k = int(np.argmin(value))
        i, q, j = np.unravel_index(k, value.shape)
        if not value.flat[k] < top * (1 - 1e-12):
            return
        _apply_swap(se, w, load, holds, r, int(i), int(q), int(j))


# Targets of the capacity-targeted replica counts, as fractions of the mean rank load (see
# `_candidate_counts`). A grid, not a search: each point is one cheap pack + refine, and the best
# point depends on the load in no smooth way.
_CAPACITY_FACTORS = tuple(np.round(np.linspace(0.5, 1.5, 41), 3))


def _candidate_counts(load, num_ranks, slots, refine):
    """Replica-count vectors to try, EPLB's first. With `refine`, also for each target capacity C
    (a fraction of the mean rank load): `ceil(load / C)` replicas per expert, so no replica is
    heavier than C, and the slots left over, one at a time, to the expert lightest per replica
    (tiny fillers; piling them on few experts packed as well as or better than spreading them in
    the measurements). EPLB's counts make the heaviest replica as light as possible, which is
    what matters when slots are plentiful; when they are few (S of 2-3), replicas near the rank
    capacity plus light fillers pack much tighter (Zipf 1.2, E = 128, R = 64, S = 3: 1.12 ->
    1.01)."""
    num_slots, cap = num_ranks * slots, num_ranks  # at most one replica per rank
    out = [_greedy_replicas(load, num_slots, cap)]
    if not refine:
        return out
    seen = {out[0].tobytes()}
    mean = load.sum() / num_ranks
    if mean <= 0:
        return out
    for f in _CAPACITY_FACTORS:
        if not mean * f > 0:  # subnormal loads underflow
            continue
        counts = np.clip(np.ceil(load / (mean * f)), 1, cap).astype(np.int64)
        left = num_slots - counts.sum()
        if left < 0:
            continue
        for _ in range(left):  # fillers: the lightest expert per replica (lowest on ties)
            i = int(np.argmin(np.where(counts < cap, load / counts, np.inf)))
            counts[i] += 1
        if counts.tobytes() not in seen:
            seen.add(counts.tobytes())
            out.append(counts)
    return out


def _plan_ranks(load_sub, experts_sub, num_ranks, slots, num_experts, refine):
    """Steps 1-2 (replicate, pack, and with `refine` the count candidates and swaps) for
    `experts_sub` (global ids, loads `load_sub`) on `num_ranks` interchangeable ranks of `slots`
    slots. Returns the best `[R', S]` experts and per-slot loads (first candidate on ties)."""
    node = np.zeros(num_ranks, np.int64)
    best = None
    for counts in _candidate_counts(load_sub, num_ranks, slots, refine):
        expert_I = np.repeat(experts_sub, counts)
        weight_I = np.repeat(load_sub / counts, counts)
        rank_I = _pack(weight_I, expert_I, num_ranks, slots, num_experts)
        se, w = _layout(weight_I, expert_I, rank_I, num_ranks, slots)
        _repair(se, w, node, num_experts)
        if refine:
            _refine(se, w, node, num_experts)
        top = w.sum(axis=1).max()
        if best is None or top < best[0]:
            best = (top, se, w)
    return best[1], best[2]


def _group_nodes(load, num_groups, num_nodes):
    """Hierarchical step 0: the experts of each node, packing G contiguous expert groups onto N
    nodes, G/N groups each, heaviest group to the least-loaded node with room (lowest on ties)."""
    e = load.size
    group_load = load.reshape(num_groups, e // num_groups).sum(axis=1)
    node_G = _pack(group_load, np.arange(num_groups), num_nodes, num_groups // num_nodes, num_groups)
    experts = np.arange(e).reshape(num_groups, e // num_groups)
    return [experts[np.flatnonzero(node_G == n)].ravel() for n in range(num_nodes)]


def _plan_one(load, r, s, ranks_per_node, num_groups, refine):
    e = load.size
    if ranks_per_node is None:
        node = np.zeros(r, np.int64)
        se, w = _plan_ranks(load, np.arange(e), r, s, e, refine)
    else:
        num_nodes = r // ranks_per_node
        node = np.repeat(np.arange(num_nodes), ranks_per_node)
        parts = [_plan_ranks(load[ex], ex, ranks_per_node, s, e, refine)
                 for ex in _group_nodes(load, num_groups, num_nodes)]
        se = np.concatenate([p[0] for p in parts])
        w = np.concatenate([p[1] for p in parts])
    if refine and s * r == e:
        # Today's layout as another start: the plan must never be worse than what it replaces.
        # Contiguous expert ranges keep whole groups on a node (E/N a multiple of E/G), so it is
        # a valid hierarchical start too.
        su = np.arange(e).reshape(r, s)
        wu = load[su].copy()
        _refine(su, wu, node, e)
        if wu.sum(axis=1).max() < w.sum(axis=1).max():
            se = su
    return np.sort(se, axis=1)


def plan_placement(
    load,
    num_ranks: int,
    slots_per_rank: int,
    *,
    ranks_per_node: int | None = None,
    num_groups: int | None = None,
    refine: bool = True,
    previous: Placement | Sequence[Placement] | None = None,
) -> Placement | tuple[Placement, ...]:
    """Place E logical experts (with replicas) on R ranks x S slots to minimise the largest rank load.

    Args:
      load: `load_E` (one layer) or `load_LE` (one placement per layer): non-negative loads, e.g.
        each expert's routed rows summed over a window of steps. A replicated expert's load is
        split evenly among its replicas (module docstring).
      num_ranks: R, the ranks of the expert-parallel axis.
      slots_per_rank: S, physical expert slots per rank; `E <= S*R` and `S <= E` (or `S <= E/N`
        with nodes). `slots_per_rank_for` turns a redundant-slot budget into S.
      ranks_per_node: with it, the hierarchical variant: N = R / ranks_per_node nodes, each holding
        whole expert groups and every replica of its experts.
      num_groups: G contiguous expert groups (hierarchical only; default E, one expert per group),
        e.g. the groups of group-limited routing. G must divide E and be a multiple of N.
      refine: False runs the published method alone; True (default) adds the swap search and,
        when S*R == E, the contiguous layout as a second start (module docstring).
      previous: the placement(s) in use; the result is relabelled (`align_placement`) so that as
        many slots as possible keep their expert. Loads are unchanged by the relabelling.

    Returns:
      A `Placement` for `load_E`, a tuple of L placements for `load_LE`. Slots within a rank are in
      ascending expert order unless `previous` is given.
    """
    load_arr = _check_load(load, "load", (1, 2))
    e = load_arr.shape[-1]
    r, s = _check_slots(e, num_ranks, slots_per_rank)
    if ranks_per_node is not None:
        rpn = _positive_int(ranks_per_node, "ranks_per_node")
        if r % rpn:
            raise ValueError(f"ranks_per_node = {rpn} must divide num_ranks = {r}")
        nodes = r // rpn
        g = e if num_groups is None else _positive_int(num_groups, "num_groups")
        if e % g:
            raise ValueError(f"num_groups = {g} must divide the number of experts E = {e}")
        if g % nodes:
            raise ValueError(f"num_groups = {g} must be a multiple of the number of nodes "
                             f"num_ranks / ranks_per_node = {nodes}")
        if s > e // nodes:
            raise ValueError(f"slots_per_rank = {s} > experts per node E / nodes = {e // nodes}: a rank would "
                             "hold two replicas of one expert")
        rpn_arg, g_arg = rpn, g
    else:
        if num_groups is not None:
            raise ValueError("num_groups is used by the hierarchical variant only: pass ranks_per_node too")
        rpn_arg = g_arg = None

    def one(load_E, prev):
        p = Placement(_plan_one(load_E, r, s, rpn_arg, g_arg, refine), e)
        return p if prev is None else align_placement(p, prev, ranks_per_node=rpn_arg)

    if load_arr.ndim == 1:
        if previous is not None and not isinstance(previous, Placement):
            raise ValueError("previous must be one Placement for a 1-D load")
        return one(load_arr, previous)
    if previous is None:
        previous = [None] * load_arr.shape[0]
    elif isinstance(previous, Placement) or len(previous) != load_arr.shape[0]:
        raise ValueError(f"previous must be a sequence of {load_arr.shape[0]} placements (one per layer of load_LE)")
    return tuple(one(load_E, prev) for load_E, prev in zip(load_arr, previous))


# ---------------------------------------------------------------------------------------------
# changing placements


def _overlap(a_RS: np.ndarray, b_RS: np.ndarray, num_experts: int) -> np.ndarray:
    """`[R_a, R_b]`: experts rank i of a and rank j of b have in common (as multisets)."""
    ha = np.stack([np.bincount(row, minlength=num_experts) for row in a_RS])
    hb = np.stack([np.bincount(row, minlength=num_experts) for row in b_RS])
    return np.minimum(ha[:, None, :], hb[None, :, :]).sum(axis=2)


def _match(score: np.ndarray) -> np.ndarray:
    """`[n]` a permutation, new i -> old match[i], with a large total score: the greedy matching
    (largest remaining score first, lowest (i, j) on ties) or the identity, whichever scores more
    (the identity on ties). Not optimal (no assignment solver), but never worse than leaving the
    numbering alone, and deterministic."""
    n = score.shape[0]
    match = np.full(n, -1)
    used_i, used_j = np.zeros(n, bool), np.zeros(n, bool)
    order = np.lexsort((np.tile(np.arange(n), n), np.repeat(np.arange(n), n), -score.ravel()))
    for k in order:
        i, j = divmod(int(k), n)
        if not used_i[i] and not used_j[j]:
            match[i], used_i[i], used_j[j] = j, True, True
    identity = np.arange(n)
    return match if score[identity, match].sum() > np.trace(score) else identity


def align_placement(new: Placement, old: Placement, *, ranks_per_node: int | None = None) -> Placement:
    """`new` with its ranks renumbered and each rank's slots reordered so that as many slots as
    possible hold the same expert as in `old`; rank loads are the same multiset (ranks are
    interchangeable). With `ranks_per_node`, nodes are matched first and ranks only within a
    node, so each node keeps its experts. Placements of different shapes are returned unchanged."""
    if not isinstance(new, Placement) or not isinstance(old, Placement):
        raise ValueError("new and old must be Placements")
    if new.slot_expert_RS.shape != old.slot_expert_RS.shape or new.num_experts != old.num_experts:
        return new
    e = new.num_experts
    a, b = new.slot_expert_RS, old.slot_expert_RS
    R, S = a.shape
    if ranks_per_node is None:
        rank_map = _match(_overlap(a, b, e))
    else:
        rpn = _positive_int(ranks_per_node, "ranks_per_node")
        if R % rpn:
            raise ValueError(f"ranks_per_node = {rpn} must divide num_ranks = {R}")
        n = R // rpn
        node_map = _match(_overlap(a.reshape(n, rpn * S), b.reshape(n, rpn * S), e))
        rank_map = np.empty(R, np.int64)
        for i in range(n):
            j = node_map[i]
            inner = _match(_overlap(a[i * rpn:(i + 1) * rpn], b[j * rpn:(j + 1) * rpn], e))
            rank_map[i * rpn:(i + 1) * rpn] = j * rpn + inner
        full = _overlap(a, b, e)
        if full[np.arange(R), rank_map].sum() < np.trace(full):
            rank_map = np.arange(R)  # node-first matching lost to the numbering as it was
    out = np.empty_like(a)
    for i in range(R):
        j = rank_map[i]
        pending = list(np.sort(a[i]))
        row = np.full(S, -1)
        for s in range(S):  # keep an expert in the slot it had
            if b[j, s] in pending:
                pending.remove(b[j, s])
                row[s] = b[j, s]
        row[row < 0] = pending
        out[j] = row
    return Placement(out, e)


def placement_moves(old: Placement, new: Placement) -> PlacementMoves:
    """Which slots change expert from `old` to `new` (same E, R, S) and where each new slot's
    weights can be copied from (`PlacementMoves`)."""
    if not isinstance(old, Placement) or not isinstance(new, Placement):
        raise ValueError("old and new must be Placements")
    if old.slot_expert_RS.shape != new.slot_expert_RS.shape or old.num_experts != new.num_experts:
        raise ValueError(f"old and new must have the same experts and [R, S]: got E = {old.num_experts}, "
                         f"{old.slot_expert_RS.shape} and E = {new.num_experts}, {new.slot_expert_RS.shape}")
    a, b = old.slot_expert_RS, new.slot_expert_RS
    R, S = a.shape
    changed = a != b
    source = np.arange(R * S, dtype=np.int32).reshape(R, S)
    taken = np.zeros(R * S, np.int64)
    remote = 0
    for r, s in zip(*np.nonzero(changed)):
        e = b[r, s]
        local = np.flatnonzero(a[r] == e)
        if local.size:
            source[r, s] = r * S + local[0]
            continue
        cands = old.expert_slots_EM[e][old.expert_slots_EM[e] >= 0]
        src = int(cands[np.argmin(taken[cands])])
        taken[src] += 1
        source[r, s] = src
        remote += 1
    return PlacementMoves(changed, source, int(changed.sum()), remote)
