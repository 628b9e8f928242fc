"""Replicated experts on device: route to replicas, keep replicas' gradients summed, move slots.

A `moe_jax.parallel.placement.Placement` (host-side plan, docs/placement.md) says which logical
expert each physical slot holds. This module is what the layer needs to run one:

- `physical_weights` / `logical_weights`: expert weights `[E, ...]` <-> `[R*S, ...]` (each slot a
  copy of its logical expert; checkpoints and converters hold logical weights).
- `route_to_replicas`: inside the EP `shard_map` body, each route (token, logical expert e) of
  source rank `src` goes to replica `(j + src) % replicas_E[e]`, where j is the route's position
  among this rank's real routes to e (route order t*K + k), i.e. to physical slot
  `expert_slots_EM[e, replica]`. The existing dispatch then runs on R*S physical experts.
- `sum_replica_grads`: an identity on this rank's `[S, ...]` slot weights whose backward gives
  every replica the sum of its group's gradients (the logical expert's gradient), so that an
  elementwise optimizer keeps replicas bit-identical.
- `move_slots` (inside `shard_map`) and `rebalance` (a jitted call on a whole state, between
  training steps): after a re-plan, every slot's array (weights, optimizer moments) gathered from
  `placement_moves(old, new).source_RS`, with collective permutes of the moved slots only
  (`SlotTransfers`); no host round trip.
- `logical_counts`: per-slot row counts summed into per-expert counts.

Everything here treats a placement as static (compile-time constants): a new placement retraces.

Legend (shape suffixes): T tokens on this rank, K top-k, N = T*K routes, E logical experts, R
ranks of the expert-parallel axis, S slots per rank, F = R*S physical slots (flat id
`f = r*S + s`), M the most replicas of any expert, W slots one rank sends another in one round,
X the trailing weight dimensions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from moe_jax.parallel.mesh import EP_AXIS
from moe_jax.parallel.placement import Placement, placement_moves

__all__ = [
    "SlotTransfers",
    "TransferRound",
    "logical_counts",
    "logical_weights",
    "move_slots",
    "physical_weights",
    "rebalance",
    "replica_sum_transfers",
    "route_to_replicas",
    "slot_move_transfers",
    "sum_replica_grads",
]


def _check_placement(placement) -> Placement:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a moe_jax.parallel.placement.Placement (e.g. from plan_placement); "
                        f"got {type(placement).__name__}.")
    return placement


def _check_leading(w, size: int, name: str, what: str):
    if jnp.ndim(w) < 1 or jnp.shape(w)[0] != size:
        raise ValueError(f"{name} must have {what} = {size} rows on its leading axis; got shape {jnp.shape(w)}.")


# ---------------------------------------------------------------------------------------------
# logical <-> physical


def physical_weights(w_EX, placement: Placement):
    """`[R*S, ...]`: slot f holds a copy of logical expert `slot_expert_RS.ravel()[f]`'s weights.

    `w_EX` is a logical expert stack `[E, ...]` (a JAX or NumPy array, e.g. from a converted
    checkpoint); the result has its type. Its leading axis is the one to shard over the ep axis
    (S slots per rank)."""
    placement = _check_placement(placement)
    _check_leading(w_EX, placement.num_experts, "w_EX", "the placement's num_experts E")
    take = np.take if isinstance(w_EX, np.ndarray) else jnp.take
    return take(w_EX, placement.slot_expert_RS.ravel(), axis=0)


def logical_weights(w_FX, placement: Placement):
    """`[E, ...]`: each logical expert's weights, read from its first replica (lowest slot id).

    The inverse of `physical_weights` for replicas kept identical (the layer's gradient sum and an
    elementwise optimizer do); use it to save or convert a placed layer's weights."""
    placement = _check_placement(placement)
    _check_leading(w_FX, placement.num_slots, "w_FX", "the placement's slots R*S")
    take = np.take if isinstance(w_FX, np.ndarray) else jnp.take
    return take(w_FX, placement.expert_slots_EM[:, 0], axis=0)


def logical_counts(counts_F: jax.Array, placement: Placement) -> jax.Array:
    """int32 `[E]`: per-slot counts `[R*S]` summed over each expert's replicas."""
    placement = _check_placement(placement)
    _check_leading(counts_F, placement.num_slots, "counts_F", "the placement's slots R*S")
    return jax.ops.segment_sum(counts_F, jnp.asarray(placement.slot_expert_RS.ravel()),
                               num_segments=placement.num_experts).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# routing


def route_to_replicas(expert_idx_TK: jax.Array, placement: Placement, source_rank, mask_T: jax.Array | None = None
                      ) -> jax.Array:
    """int32 `[T, K]` physical slot of each route of source rank `source_rank`; -1 where the route
    is masked (`mask_T` False) or its logical id lies outside `[0, E)` (dispatch then delivers
    nothing and counts a real token's route as dropped).

    Route (t, k) to expert e is the j-th real route to e in route order t*K + k; it goes to
    replica `(j + source_rank) % replicas_E[e]` of e, slot `expert_slots_EM[e, replica]`. So each
    source rank deals its rows of e round-robin over e's replicas, starting at a replica that
    rotates with the source rank, which spreads the remainders: per source rank, the rows per slot
    are `split_counts(placement, counts_E, offset=source_rank)`. Deterministic (a stable sort, no
    atomics); `source_rank` may be traced (`lax.axis_index`)."""
    placement = _check_placement(placement)
    if expert_idx_TK.ndim != 2 or not jnp.issubdtype(expert_idx_TK.dtype, jnp.integer):
        raise ValueError(f"expert_idx_TK must be an integer [T, K] array of logical expert ids; got "
                         f"{expert_idx_TK.dtype} {tuple(expert_idx_TK.shape)}.")
    tokens, top_k = expert_idx_TK.shape
    e = placement.num_experts
    e_N = expert_idx_TK.reshape(tokens * top_k).astype(jnp.int32)
    valid_N = (e_N >= 0) & (e_N < e)
    if mask_T is not None:
        valid_N = valid_N & jnp.repeat(mask_T, top_k)
    key_N = jnp.where(valid_N, e_N, e)  # invalid and masked routes sort last, as expert E
    order_N = jnp.argsort(key_N, stable=True)
    counts = jnp.bincount(key_N, length=e + 1)  # [E + 1]: routes per expert, then the invalid ones
    starts = jnp.cumsum(counts) - counts
    sorted_key = key_N[order_N]
    pos_N = jnp.zeros_like(e_N).at[order_N].set(jnp.arange(e_N.size, dtype=jnp.int32) - starts[sorted_key])
    expert_N = jnp.minimum(key_N, e - 1)
    replicas_E = jnp.asarray(placement.replicas_E)
    replica_N = (pos_N + jnp.asarray(source_rank, jnp.int32)) % replicas_E[expert_N]
    slot_N = jnp.asarray(placement.expert_slots_EM)[expert_N, replica_N]
    return jnp.where(valid_N, slot_N, -1).reshape(tokens, top_k)


# ---------------------------------------------------------------------------------------------
# slot transfers: rounds of collective permutes


class TransferRound(NamedTuple):
    """One collective permute: `perm` (source rank, destination rank) pairs, each rank at most
    once as a source and once as a destination; rank r sends its local slots `send_RW[r]` and the
    destination writes them into its local slots `recv_RW[r']`. Unused entries are S (out of
    range: read clamped, written nowhere)."""

    perm: tuple[tuple[int, int], ...]
    send_RW: np.ndarray
    recv_RW: np.ndarray

    @property
    def rows_sent(self) -> int:
        """Slots on the wire in this round (a `[W, ...]` buffer per pair, padding included)."""
        return len(self.perm) * self.send_RW.shape[1]


class SlotTransfers(NamedTuple):
    """Static rounds moving slots between ranks (`replica_sum_transfers`, `slot_move_transfers`)."""

    rounds: tuple[TransferRound, ...]
    num_slots: int  # S

    @property
    def rows_sent(self) -> int:
        """Slots on the wire over all rounds, padding included; times a slot's bytes, the traffic."""
        return sum(r.rows_sent for r in self.rounds)


def _schedule(transfers: list[tuple[int, int, int, int]], num_ranks: int, slots: int) -> SlotTransfers:
    """Rounds for `transfers` (source rank, source slot, destination rank, destination slot):
    transfers between one rank pair share a buffer; each pair goes to the first round where neither
    its source sends nor its destination receives yet (pairs with most slots first, then by rank
    ids: deterministic). Greedy edge colouring: at most 2*degree - 1 rounds, where degree is the
    most pairs one rank sends or receives."""
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a, sa, b, sb in transfers:
        pairs.setdefault((a, b), []).append((sa, sb))
    rounds: list[tuple[set, set, list]] = []
    for (a, b), items in sorted(pairs.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        for senders, receivers, members in rounds:
            if a not in senders and b not in receivers:
                break
        else:
            senders, receivers, members = set(), set(), []
            rounds.append((senders, receivers, members))
        senders.add(a)
        receivers.add(b)
        members.append((a, b, items))
    out = []
    for _, _, members in rounds:
        width = max(len(items) for _, _, items in members)
        send_RW = np.full((num_ranks, width), slots, np.int32)
        recv_RW = np.full((num_ranks, width), slots, np.int32)
        for a, b, items in members:
            send_RW[a, :len(items)] = [sa for sa, _ in items]
            recv_RW[b, :len(items)] = [sb for _, sb in items]
        out.append(TransferRound(tuple((a, b) for a, b, _ in members), send_RW, recv_RW))
    return SlotTransfers(tuple(out), slots)


@functools.lru_cache(maxsize=64)
def replica_sum_transfers(placement: Placement) -> SlotTransfers:
    """The gather rounds of the replica gradient sum: every other replica of each replicated
    expert sends its slot to the expert's primary replica. `sum_replica_grads` runs them, then the
    same rounds reversed to send the sums back. Experts with one replica take no part, so a
    placement without replicas has no rounds; each round sends `[W, ...]` buffers of the
    replicated slots only. Cached per placement (placements are hashable).

    The primary of each expert (most replicas first, then by id) is its replica on the rank that
    receives the fewest slots so far (lowest slot id on ties): with every primary at the lowest
    slot id, rank 0 would receive from every replicated expert and the rounds would serialise
    on it."""
    placement = _check_placement(placement)
    s = placement.slots_per_rank
    incoming_R = np.zeros(placement.num_ranks, np.int64)
    transfers = []
    for e in np.argsort(-placement.replicas_E, kind="stable"):
        slots = placement.expert_slots_EM[e]
        real = [int(f) for f in slots[slots >= 0]]
        if len(real) < 2:
            continue
        primary = min(real, key=lambda f: (incoming_R[f // s], f))
        incoming_R[primary // s] += len(real) - 1
        transfers += [(f // s, f % s, primary // s, primary % s) for f in real if f != primary]
    return _schedule(transfers, placement.num_ranks, s)


@functools.lru_cache(maxsize=64)
def slot_move_transfers(old: Placement, new: Placement) -> SlotTransfers:
    """Rounds copying each slot that changes expert from its `placement_moves(old, new)` source
    (same-rank sources are copies within a rank, rounds with the pair (r, r)). Cached."""
    moves = placement_moves(old, new)
    s = old.slots_per_rank
    src_F = moves.source_RS.ravel()
    transfers = [(int(src_F[f]) // s, int(src_F[f]) % s, f // s, f % s)
                 for f in np.flatnonzero(moves.changed_RS.ravel())]
    return _schedule(transfers, old.num_ranks, s)


def _run_rounds(x_SX, rounds, axis_name, *, add: bool, reverse: bool = False):
    """Apply `rounds` to this rank's slots `x_SX` inside `shard_map` over `axis_name`: in each, read
    the send slots of `x_SX` as it was before the first round, permute, and add into (`add`) or
    overwrite the receive slots. `reverse` runs the rounds backwards with every pair reversed."""
    me = lax.axis_index(axis_name)
    source_SX = x_SX
    for rnd in (reversed(rounds) if reverse else rounds):
        send_RW, recv_RW = (rnd.recv_RW, rnd.send_RW) if reverse else (rnd.send_RW, rnd.recv_RW)
        perm = [(b, a) for a, b in rnd.perm] if reverse else list(rnd.perm)
        buf_WX = jnp.take(source_SX, jnp.asarray(send_RW)[me], axis=0, mode="clip")
        got_WX = lax.ppermute(buf_WX, axis_name, perm)
        rows = jnp.asarray(recv_RW)[me]
        x_SX = x_SX.at[rows].add(got_WX, mode="drop") if add else x_SX.at[rows].set(got_WX, mode="drop")
    return x_SX


# ---------------------------------------------------------------------------------------------
# the replica gradient sum


def sum_replica_grads(w_SX: jax.Array, placement: Placement, axis_name) -> jax.Array:
    """Identity on this rank's slot weights `[S, ...]` (inside `shard_map` over the ep axis
    `axis_name`, whose size is the placement's R) whose backward replaces each slot's gradient by
    the sum of the gradients of all replicas of its expert: the logical expert's gradient, the
    same bits on every replica.

    Backward: the replicated slots' gradients go to their expert's primary replica in the rounds of
    `replica_sum_transfers` (collective permutes of `[W, ...]` buffers), are summed there in
    float32 in a fixed order, rounded once to the gradient's dtype, and sent back by the same
    rounds reversed. Traffic per call: `2 * rows_sent` slot gradients (with no padding, 2 x the
    redundant slots), none for experts of one replica; no all-reduce of the other experts."""
    transfers = replica_sum_transfers(placement)
    if not transfers.rounds:
        return w_SX
    if w_SX.ndim < 1 or w_SX.shape[0] != placement.slots_per_rank:
        raise ValueError(f"w_SX must be this rank's [S, ...] slots with S = {placement.slots_per_rank}; got shape "
                         f"{w_SX.shape}.")

    @jax.custom_vjp
    def synced(w):
        return w

    def fwd(w):
        return w, None

    def bwd(_, g_SX):
        g32_SX = g_SX.astype(jnp.float32)
        total_SX = _run_rounds(g32_SX, transfers.rounds, axis_name, add=True).astype(g_SX.dtype)
        return (_run_rounds(total_SX, transfers.rounds, axis_name, add=False, reverse=True),)

    synced.defvjp(fwd, bwd)
    return synced(w_SX)


# ---------------------------------------------------------------------------------------------
# rebalance


def move_slots(x_SX: jax.Array, old: Placement, new: Placement, axis_name) -> jax.Array:
    """This rank's slots `[S, ...]` under `new`: each slot whose expert changes is copied from its
    `placement_moves(old, new)` source (inside `shard_map` over `axis_name`). Apply it to the
    expert weights and to every optimizer-state leaf with the same leading slot axis; unchanged
    slots are not touched, and only changed slots are sent (`slot_move_transfers`). Every copy
    reads the slots as they were before the move."""
    transfers = slot_move_transfers(old, new)
    return _run_rounds(x_SX, transfers.rounds, axis_name, add=False)


def _split_over(x, axis_name) -> bool:
    """Whether `x`'s leading axis is split over exactly the mesh axis `axis_name`."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    if not spec:
        return False
    lead = spec[0]
    return lead == axis_name or (isinstance(lead, tuple) and tuple(lead) == (axis_name,))


@functools.lru_cache(maxsize=64)
def _mover(old: Placement, new: Placement, mesh, axis_name):
    def body(xs):
        return tuple(move_slots(x, old, new, axis_name) for x in xs)

    spec = PartitionSpec(axis_name)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec))


def rebalance(tree, old: Placement, new: Placement, mesh, *, axis_name=EP_AXIS):
    """`tree` with its expert slot stacks moved from placement `old` to `new`, on device.

    tree: any pytree of arrays, e.g. `nnx.state((model, optimizer))` of one placed MoE layer and
      its optimizer. The slot stacks are the arrays whose leading axis is split over `axis_name`:
      the routed experts' weights and every optimizer leaf made like them (optax's moments keep
      their parameter's sharding); they must have R*S rows. Other leaves are returned as they are.
      Every slot stack in `tree` follows the same placement: call it once per layer.
    mesh: the layers' mesh (its `axis_name` axis has the placements' R ranks).

    One jitted program per (old, new) pair (cached): only the slots that change expert are
    written, each copied from its `placement_moves(old, new)` source by collective permutes
    (same-rank sources stay local). Replicas hold identical weights and moments, so any source is
    valid. Then give the layer its new placement (`EPOptions(placement=new)`), which recompiles the
    training step; the host only plans, the arrays never leave the devices."""
    old, new = _check_placement(old), _check_placement(new)
    placement_moves(old, new)  # same E, R, S, or a ValueError saying so
    if axis_name not in tuple(mesh.axis_names) or mesh.shape[axis_name] != old.num_ranks:
        raise ValueError(f"mesh must have an axis {axis_name!r} of the placements' {old.num_ranks} ranks; got axes "
                         f"{dict(mesh.shape)}.")
    leaves, treedef = jax.tree.flatten(tree)
    picked = [i for i, x in enumerate(leaves) if _split_over(x, axis_name)]
    for i in picked:
        _check_leading(leaves[i], old.num_slots, f"every array split over {axis_name!r} in tree",
                       "the placement's slots R*S")
    if picked and slot_move_transfers(old, new).rounds:
        moved = _mover(old, new, mesh, axis_name)(tuple(leaves[i] for i in picked))
        for i, x in zip(picked, moved):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
