"""What each layout makes every rank do: rows per local group, the collectives and their bytes.

Legend: R ranks, T tokens per rank, D model width, F expert hidden width, E experts, K top-k,
El = E/ep local experts, S slots per rank, G groups of a rank's grouped GEMM (El, S or E),
C capacity (rows one source may send one destination), s source rank, q destination.

Layouts (`Layout.kind`), all holding one copy of the experts spread over the R ranks (plus the
redundant slots of replication):

- `EP`: expert parallelism as `moe_jax.parallel` runs it. Rank r = d*ep + q (ep minor) holds
  experts [q*El, (q+1)*El) and T tokens; every route goes to the rank of its expert (all-to-all
  over the EP group), the SwiGLU runs there, and the rows come back (the reverse all-to-all).
  With R > E an EP group holds one expert per rank and the R / E groups are data-parallel
  replicas (`make_mesh(ep=E, data=R/E)`), each exchanging its own tokens.
- `ETP`: expert tensor parallelism over all R ranks: every rank holds every expert's F/R hidden
  columns, all-gathers the tokens of the group (T rows from each rank, the routing beside them
  is negligible), runs every route of the step with F/R columns, and the down projection's
  partial sums are reduce-scattered back to the tokens' ranks (after the weighted combine, so T
  rows per rank). Rows are the same on every rank, whatever the skew.
- `EPxETP`: ep x tp = R, rank r = g*tp + j (tp minor, so a tp group shares a node when tp <=
  ranks per node): all-to-all over the ep ranks of the same j to the expert group's rank,
  all-gather of the received rows over the tp group, SwiGLU with F/tp columns on all of the
  group's rows, reduce-scatter over tp, all-to-all back (Megatron's order; the MoE layer's
  EP x ETP dispatches the tp group's replicated tokens from every tp rank and all-reduces the
  `[T, D]` outputs instead, docs/expert-tensor-parallelism.md).
- `EP+replication`: EP with S slots per rank (S*R >= E) placed by
  `moe_jax.parallel.placement.plan_placement` on the step's load; an expert's rows are split
  over its replicas, each source dealing its rows round-robin from a replica offset by its rank
  (`dealt_rows`, the router docs/placement.md designs; within a row per source of the even split
  the placement's load model assumes), and the placement is planned and scored on the same load (the
  in-window figure of docs/placement.md: a placement planned from past steps does worse).

Dispatch is dropless (C = T*K) except for `EP` with a capacity factor, where each source keeps at
most C rows per destination (`moe_jax.parallel.capacity_for`, as the layer computes it); which
routes drop inside a destination's experts is modelled as proportional to their rows (the layer
keeps the first C in token order), exact when nothing drops. The ragged strategy moves the kept
rows; the padded strategy moves C rows per destination. The grouped GEMMs are planned for the
static buffer the layer sizes (M = ep * C rows for EP, as `moe_jax.layers.routed` does).

Row moves in HBM around the collectives (gathers into send buffers, regroups, the combine), in
rows of D: EP kinds `3*T*K + 4*gemm_rows + T` (send gather written and read back by the
combine, received rows regrouped and un-regrouped, T outputs), ETP `3*gemm_rows + tp*T` (the
routes packed from the gathered tokens, read by the combine, tp*T partial outputs).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moe_jax.parallel.capacity import capacity_for
from moe_jax.parallel.placement import Placement
from moe_jax.scaleout.shape import LayerShape
from moe_jax.validation import check_int

__all__ = ["Collective", "Layout", "Work", "dealt_rows", "ep_work", "epxetp_work", "etp_work", "replication_work", "work_for"]

KINDS = ("EP", "ETP", "EPxETP", "EP+replication")
STRATEGIES = ("ragged", "padded")


class Layout(NamedTuple):
    """kind (one of `KINDS`), ep, tp, data (ep*tp*data = R) and the groups per rank's GEMM
    (El for EP, S for replication, E for ETP, E/ep for EPxETP)."""

    kind: str
    ep: int
    tp: int
    data: int
    groups: int

    @property
    def ranks(self) -> int:
        return self.ep * self.tp * self.data

    def describe(self) -> str:
        if self.kind == "EP":
            return f"EP ep={self.ep}" + (f" x data {self.data}" if self.data > 1 else "")
        if self.kind == "ETP":
            return f"ETP tp={self.tp}"
        if self.kind == "EPxETP":
            return f"EPxETP ep={self.ep} x tp={self.tp}"
        return f"EP+replication S={self.groups}"


class Collective(NamedTuple):
    """One collective call: `kind` "all_to_all" (`data` = `[R, R]` bytes, source x destination)
    or "ring" (all-gather / reduce-scatter; `data` = `[R]` bytes of each rank's piece), over the
    groups `group_R` (ranks with one label form one call)."""

    name: str
    kind: str
    data: np.ndarray
    group_R: np.ndarray


class Work(NamedTuple):
    """One layout on one step, per rank.

    group_sizes_RG: `[R, G]` int64 rows of each local group (useful rows). gemm_rows: M, the
    static rows the kernels are planned for. gate_up_nk / down_nk: (N, K) of the gate (= up) and
    down GEMMs on a rank. dispatch / combine: the collectives before and after the experts.
    moved_rows_R: `[R]` rows of D moved in HBM around them. weight_bytes_R: `[R]` expert weights
    held. dropped: routes dropped by capacity. placement: the replication's `Placement`.
    """

    layout: Layout
    group_sizes_RG: np.ndarray
    gemm_rows: int
    gate_up_nk: tuple[int, int]
    down_nk: tuple[int, int]
    dispatch: tuple[Collective, ...]
    combine: tuple[Collective, ...]
    moved_rows_R: np.ndarray
    weight_bytes_R: np.ndarray
    dropped: int = 0
    placement: Placement | None = None


def _check_counts(shape: LayerShape, counts_SE, ranks: int) -> np.ndarray:
    counts = np.asarray(counts_SE)
    if counts.shape != (ranks, shape.num_experts):
        raise ValueError(f"counts_SE must have shape (ranks, E) = ({ranks}, {shape.num_experts}); got {counts.shape}.")
    if counts.dtype.kind not in "iu" or np.any(counts < 0):
        raise ValueError("counts_SE must hold non-negative integers (routes of each source rank to each expert).")
    if np.any(counts > shape.tokens_per_rank):
        raise ValueError(f"counts_SE has a source sending more than tokens_per_rank = {shape.tokens_per_rank} "
                         "routes to one expert; a token picks an expert at most once.")
    return counts.astype(np.int64)


def _cap(rows_XL: np.ndarray, capacity: int) -> np.ndarray:
    """Rows kept per (pair, local expert) when each pair keeps at most `capacity` rows: unchanged
    below it, else in proportion to the experts' rows (largest remainder, lower index on ties)."""
    out = rows_XL.copy()
    total = rows_XL.sum(axis=-1)
    for i in np.flatnonzero(total > capacity):
        raw = rows_XL[i] * (capacity / total[i])
        keep = np.floor(raw).astype(np.int64)
        order = np.lexsort((np.arange(raw.size), -(raw - keep)))
        keep[order[: capacity - keep.sum()]] += 1
        out[i] = keep
    return out


def _moves_ep(shape: LayerShape, send_rows_R, gemm_rows_R) -> np.ndarray:
    return 3.0 * np.asarray(send_rows_R, float) + 4.0 * np.asarray(gemm_rows_R, float) + shape.tokens_per_rank


def ep_work(shape: LayerShape, counts_SE, ep: int, data: int = 1, *, capacity_factor: float | None = None,
            strategy: str = "ragged") -> Work:
    """`EP` on R = ep * data ranks (module docstring)."""
    ep = check_int("ep", ep)
    data = check_int("data", data)
    e, r = shape.num_experts, ep * data
    if e % ep:
        raise ValueError(f"ep = {ep} must divide num_experts = {e}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}.")
    counts = _check_counts(shape, counts_SE, r)
    el, routes = e // ep, shape.routes_per_rank
    cap = routes if capacity_factor is None else capacity_for(shape.tokens_per_rank, shape.top_k, ep,
                                                              capacity_factor, local_experts=el)
    kept_SQL = _cap(counts.reshape(r, ep, el).reshape(r * ep, el), cap).reshape(r, ep, el)
    dropped = int(counts.sum() - kept_SQL.sum())
    group_R = np.arange(r) // ep
    sizes_RL = np.zeros((r, el), np.int64)
    send_rows = np.zeros((r, r))
    for d in range(data):
        src = slice(d * ep, (d + 1) * ep)
        sizes_RL[src] = kept_SQL[src].sum(axis=0)
        send_rows[src, src] = kept_SQL[src].sum(axis=2)
    same = group_R[:, None] == group_R[None, :]
    wire_rows = send_rows if strategy == "ragged" else np.where(same, float(cap), 0.0)
    bytes_RR = wire_rows * shape.row_bytes
    if strategy == "ragged":
        send_buf, recv_buf = kept_SQL.sum(axis=(1, 2)), sizes_RL.sum(axis=1)
    else:
        send_buf = recv_buf = np.full(r, ep * cap)
    layout = Layout("EP", ep, 1, data, el)
    return Work(layout, sizes_RL, ep * cap, (shape.d_ff, shape.d_model), (shape.d_model, shape.d_ff),
                (Collective("dispatch all-to-all", "all_to_all", bytes_RR, group_R),),
                (Collective("combine all-to-all", "all_to_all", bytes_RR.T.copy(), group_R),),
                _moves_ep(shape, send_buf, recv_buf), np.full(r, float(el * shape.expert_bytes)), dropped)


def dealt_rows(placement: Placement, counts_SE) -> np.ndarray:
    """`[R_src, R, S]` int64: rows source s sends to each slot when every source deals its routes
    to expert e round-robin over e's replicas (ascending slot id), source s starting at replica
    `s % replicas_E[e]` (the router docs/placement.md describes: the offset spreads the
    remainders). Summed over sources it conserves every expert's count; each slot is within one
    row per source of the even split."""
    counts = np.asarray(counts_SE, dtype=np.int64)
    r, s = placement.slot_expert_RS.shape
    out = np.zeros((counts.shape[0], r * s), np.int64)
    src = np.arange(counts.shape[0])
    for e in range(placement.num_experts):
        slots = placement.expert_slots_EM[e]
        slots = slots[slots >= 0]
        n = slots.size
        base, rem = counts[:, e] // n, counts[:, e] % n
        for i, f in enumerate(slots):
            out[:, f] = base + (((i - src) % n) < rem)
    return out.reshape(counts.shape[0], r, s)


def replication_work(shape: LayerShape, counts_SE, placement: Placement) -> Work:
    """`EP+replication` with `placement` (R ranks x S slots), dropless, ragged exchange; rows per
    slot as `dealt_rows` deals them."""
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a moe_jax.parallel.placement.Placement; got {type(placement).__name__}.")
    if placement.num_experts != shape.num_experts:
        raise ValueError(f"placement has {placement.num_experts} experts; the layer has {shape.num_experts}.")
    r, s = placement.slot_expert_RS.shape
    counts = _check_counts(shape, counts_SE, r)
    dealt = dealt_rows(placement, counts)  # [source, rank, slot]
    sizes_RS = dealt.sum(axis=0)
    send_rows = dealt.sum(axis=2).astype(np.float64)  # [s, q]
    group_R = np.zeros(r, np.int64)
    bytes_RR = send_rows * shape.row_bytes
    layout = Layout("EP+replication", r, 1, 1, s)
    return Work(layout, sizes_RS, r * shape.routes_per_rank, (shape.d_ff, shape.d_model), (shape.d_model, shape.d_ff),
                (Collective("dispatch all-to-all", "all_to_all", bytes_RR, group_R),),
                (Collective("combine all-to-all", "all_to_all", bytes_RR.T.copy(), group_R),),
                _moves_ep(shape, counts.sum(axis=1), sizes_RS.sum(axis=1)),
                np.full(r, float(s * shape.expert_bytes)), 0, placement)


def etp_work(shape: LayerShape, counts_SE, tp: int, data: int = 1) -> Work:
    """`ETP` over tp ranks (x `data` replicas, each group its own tokens), dropless."""
    tp = check_int("tp", tp)
    data = check_int("data", data)
    if shape.d_ff % tp:
        raise ValueError(f"tp = {tp} must divide d_ff = {shape.d_ff} (each rank holds F/tp columns).")
    r = tp * data
    counts = _check_counts(shape, counts_SE, r)
    group_R = np.arange(r) // tp
    sizes_RE = counts.reshape(data, tp, -1).sum(axis=1)[group_R]
    gemm_rows_R = sizes_RE.sum(axis=1)
    pieces = np.full(r, float(shape.tokens_per_rank * shape.row_bytes))
    f = shape.d_ff // tp
    layout = Layout("ETP", 1, tp, data, shape.num_experts)
    return Work(layout, sizes_RE, tp * shape.routes_per_rank, (f, shape.d_model), (shape.d_model, f),
                (Collective("dispatch all-gather", "ring", pieces, group_R),),
                (Collective("combine reduce-scatter", "ring", pieces.copy(), group_R),),
                3.0 * gemm_rows_R + tp * shape.tokens_per_rank,
                np.full(r, shape.num_experts * shape.expert_bytes / tp), 0)


def epxetp_work(shape: LayerShape, counts_SE, ep: int, tp: int) -> Work:
    """`EPxETP` on R = ep * tp ranks (rank g*tp + j), dropless, ragged exchange."""
    ep = check_int("ep", ep)
    tp = check_int("tp", tp)
    e, r = shape.num_experts, ep * tp
    if e % ep:
        raise ValueError(f"ep = {ep} must divide num_experts = {e}.")
    if shape.d_ff % tp:
        raise ValueError(f"tp = {tp} must divide d_ff = {shape.d_ff}.")
    counts = _check_counts(shape, counts_SE, r)
    el = e // ep
    to_SQL = counts.reshape(r, ep, el)
    j_R, g_R = np.arange(r) % tp, np.arange(r) // tp
    send_rows = np.zeros((r, r))
    piece_RL = np.zeros((r, el), np.int64)
    for s in range(r):
        dest = np.arange(ep) * tp + j_R[s]  # the rank of expert group q with this source's tp index
        send_rows[s, dest] = to_SQL[s].sum(axis=1)
        piece_RL[dest] += to_SQL[s]
    sizes_RL = piece_RL.reshape(ep, tp, el).sum(axis=1)[g_R]  # after the all-gather over tp
    a2a = send_rows * shape.row_bytes
    pieces = piece_RL.sum(axis=1) * float(shape.row_bytes)
    f = shape.d_ff // tp
    layout = Layout("EPxETP", ep, tp, 1, el)
    return Work(layout, sizes_RL, tp * ep * shape.routes_per_rank, (f, shape.d_model), (shape.d_model, f),
                (Collective("dispatch all-to-all (ep)", "all_to_all", a2a, j_R),
                 Collective("dispatch all-gather (tp)", "ring", pieces, g_R)),
                (Collective("combine reduce-scatter (tp)", "ring", pieces.copy(), g_R),
                 Collective("combine all-to-all (ep)", "all_to_all", a2a.T.copy(), j_R)),
                _moves_ep(shape, counts.sum(axis=1), sizes_RL.sum(axis=1)),
                np.full(r, el * shape.expert_bytes / tp), 0)


def work_for(layout: Layout, shape: LayerShape, counts_SE, *, placement: Placement | None = None,
             capacity_factor: float | None = None, strategy: str = "ragged") -> Work:
    """The `Work` of `layout` (its kind's function with its sizes)."""
    if layout.kind == "EP":
        return ep_work(shape, counts_SE, layout.ep, layout.data, capacity_factor=capacity_factor, strategy=strategy)
    if layout.kind == "ETP":
        return etp_work(shape, counts_SE, layout.tp, layout.data)
    if layout.kind == "EPxETP":
        return epxetp_work(shape, counts_SE, layout.ep, layout.tp)
    if layout.kind == "EP+replication":
        if placement is None:
            raise ValueError("EP+replication needs a placement (moe_jax.parallel.placement.plan_placement).")
        return replication_work(shape, counts_SE, placement)
    raise ValueError(f"layout.kind must be one of {KINDS}; got {layout.kind!r}.")
