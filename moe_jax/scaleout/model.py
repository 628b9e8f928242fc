"""Predicted per-rank rows, padding, exchange bytes and time of each layout, and which one wins.

Legend: R ranks, T tokens per rank, D model width, F expert hidden width, E experts, K top-k,
S slots per rank, G groups of a rank's grouped GEMM.

A layer pass is four phases, each a barrier (the exchanges synchronise the ranks; nothing
overlaps, which is what the layer does today):

    dispatch (collectives) -> experts (gate, up, down grouped GEMMs) -> combine (collectives),
    plus the row moves in HBM around the collectives (gathers, regroups, the weighted combine).

- Rows: each rank's groups (`layouts.Work.group_sizes_RG`); the executed rows round each group up
  to the tile height of the kernel that runs (`tiles.kernel_tiles`: the library's static plan for
  the rank's GEMM on an H200); padding = (executed - useful) / executed.
- GEMM time: `costs.KernelCosts.gemm_seconds` (executed FLOPs at a measured rate, or the bytes at
  the copy bandwidth), gate + up + down.
- Exchange time: `comm` (bytes / bandwidth + latency per call, NVLink and network concurrent).
- Row moves: `Work.moved_rows_R` rows of D, read or written once each, at the copy bandwidth.
- Layer time = the sum over phases of the slowest rank's time in that phase; beside it the mean
  over ranks of each rank's own total. With `train`, the backward pass repeats every collective
  (reverse direction, same bytes) and the row moves, and the GEMMs count 3x the FLOPs.
- FP8 experts (`LayerShape.fp8`): the GEMMs at the FP8 rates on one-byte operands, and the
  forward's dispatch all-to-all at `dispatch_row_bytes` a row; the backward's reverse dispatch,
  the combine and the all-gathers move the dtype's rows, as the layer does.

`plan_step` evaluates every layout family at one R (EPxETP at every tp that fits, keeping the
fastest) and names the winner with the reason: the phase where it gains most over the runner-up,
with the figure behind it (rows of the slowest rank against the mean, bytes over the network).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moe_jax.parallel.placement import plan_placement
from moe_jax.scaleout import comm
from moe_jax.scaleout.cluster import Cluster
from moe_jax.scaleout.costs import KernelCosts
from moe_jax.scaleout.layouts import Layout, Work, work_for
from moe_jax.scaleout.loads import Load, split_sources
from moe_jax.scaleout.shape import LayerShape
from moe_jax.scaleout.tiles import Tiles, kernel_tiles, padded
from moe_jax.validation import check_int

__all__ = ["LayoutResult", "StepPlan", "candidate_layouts", "evaluate", "plan_step", "replica_slots",
           "step_counts", "sweep"]

PHASES = ("dispatch", "experts", "combine", "row moves")


@dataclasses.dataclass(frozen=True)
class LayoutResult:
    """One layout's prediction, per rank (`[R]` arrays) and in summary.

    rows_R: useful rows into the gate/up GEMM; executed_R: rows it runs at `tiles_gate_up`'s
    height; padding_R: (executed - useful) / executed (0 where nothing runs). send_bytes_R /
    recv_bytes_R / network_bytes_R: summed over the pass's collectives (network: per port).
    phase_seconds: phase name -> `[R]` seconds. layer_s: sum over phases of the slowest rank;
    mean_s: mean of the ranks' totals; slowest_rank: the rank with the largest total.
    useful_flop_fraction: useful / executed FLOPs of the expert GEMMs (tile padding of rows,
    columns and the reduction). weight_bytes_R: expert weights per rank.
    """

    layout: Layout
    rows_R: np.ndarray
    executed_R: np.ndarray
    padding_R: np.ndarray
    tiles_gate_up: Tiles
    tiles_down: Tiles
    send_bytes_R: np.ndarray
    recv_bytes_R: np.ndarray
    network_bytes_R: np.ndarray
    phase_seconds: dict
    layer_s: float
    mean_s: float
    slowest_rank: int
    useful_flop_fraction: float
    weight_bytes_R: np.ndarray
    dropped: int
    work: Work

    @property
    def name(self) -> str:
        return self.layout.describe()

    @property
    def rows_imbalance(self) -> float:
        """max / mean useful rows (1.0 when no rows)."""
        mean = self.rows_R.mean()
        return float(self.rows_R.max() / mean) if mean > 0 else 1.0

    def phase_max(self, phase: str) -> float:
        return float(self.phase_seconds[phase].max())

    @property
    def exchange_max_s(self) -> float:
        return self.phase_max("dispatch") + self.phase_max("combine")


def _traffic(collectives, cluster: Cluster, all_to_all_scale: float = 1.0) -> comm.Traffic:
    """The collectives' traffic, the all-to-alls' bytes times `all_to_all_scale` (FP8 rows)."""
    total = comm.Traffic.none(cluster.ranks)
    for c in collectives:
        if c.kind == "all_to_all":
            total = total + comm.all_to_all(np.asarray(c.data) * all_to_all_scale, c.group_R, cluster)
        elif c.kind == "ring":
            total = total + comm.ring(c.data, c.group_R, cluster)
        else:
            raise ValueError(f"unknown collective kind {c.kind!r}")
    return total


def evaluate(work: Work, shape: LayerShape, cluster: Cluster, costs: KernelCosts, *, train: bool = False,
             device_kind: str = "NVIDIA H200") -> LayoutResult:
    """The `LayoutResult` of `work` (one layout on one step) on `cluster` with `costs`."""
    r = cluster.ranks
    if work.layout.ranks != r or work.group_sizes_RG.shape[0] != r:
        raise ValueError(f"work is for {work.layout.ranks} ranks; cluster has ranks = {r}.")
    sizes = work.group_sizes_RG
    groups = sizes.shape[1]
    (n_gu, k_gu), (n_dn, k_dn) = work.gate_up_nk, work.down_nk
    tiles_gu = kernel_tiles(int(work.gemm_rows), n_gu, k_gu, groups, shape.dtype_name, device_kind)
    tiles_dn = kernel_tiles(int(work.gemm_rows), n_dn, k_dn, groups, shape.dtype_name, device_kind)
    rows_R = sizes.sum(axis=1)
    executed_R = padded(sizes, tiles_gu.block_m).sum(axis=1)
    padding_R = np.where(executed_R > 0, (executed_R - rows_R) / np.maximum(executed_R, 1), 0.0)
    b, suffix = (1, "_fp8") if shape.fp8 else (shape.dtype_bytes, "")
    experts_s = (2 * costs.gemm_seconds("gate_up" + suffix, sizes, n_gu, k_gu, tiles_gu, b, train)
                 + costs.gemm_seconds("down" + suffix, sizes, n_dn, k_dn, tiles_dn, b, train))
    useful = float(rows_R.sum()) * (2 * n_gu * k_gu + n_dn * k_dn)
    executed = (float(executed_R.sum()) * 2 * padded(n_gu, tiles_gu.block_n) * padded(k_gu, tiles_gu.block_k)
                + float(padded(sizes, tiles_dn.block_m).sum()) * padded(n_dn, tiles_dn.block_n)
                * padded(k_dn, tiles_dn.block_k))
    passes = 2.0 if train else 1.0
    # The forward's dispatch all-to-all moves FP8 rows with FP8 experts; its backward (the reverse
    # exchange, straight-through) and every other collective move the dtype's rows, in which the
    # layouts' collectives are counted.
    full = _traffic(work.dispatch, cluster)
    dispatch = _traffic(work.dispatch, cluster, shape.dispatch_row_bytes / shape.row_bytes) if shape.fp8 else full
    combine = _traffic(work.combine, cluster)
    if train:
        dispatch, combine = dispatch + full, combine + combine
    moves_s = passes * work.moved_rows_R * shape.row_bytes / (costs.copy_TBps * 1e12)
    phases = {"dispatch": dispatch.seconds_R, "experts": experts_s, "combine": combine.seconds_R, "row moves": moves_s}
    total_R = sum(phases.values())
    traffic = dispatch + combine
    return LayoutResult(
        layout=work.layout, rows_R=rows_R, executed_R=executed_R, padding_R=padding_R, tiles_gate_up=tiles_gu,
        tiles_down=tiles_dn, send_bytes_R=traffic.send_bytes_R, recv_bytes_R=traffic.recv_bytes_R,
        network_bytes_R=traffic.network_bytes_R, phase_seconds=phases,
        layer_s=float(sum(v.max() for v in phases.values())), mean_s=float(total_R.mean()),
        slowest_rank=int(np.argmax(total_R)), useful_flop_fraction=useful / executed if executed else 1.0,
        weight_bytes_R=work.weight_bytes_R, dropped=work.dropped, work=work)


def replica_slots(num_experts: int, ranks: int, extra_slots: int | None = None) -> int:
    """S for EP+replication: ceil(E/R) + `extra_slots`; the default adds one slot per rank (R
    redundant slots, DeepSeek-V3's prefill ratio of one per GPU) while R <= E, and none above
    (one slot per rank already leaves R - E redundant)."""
    e = check_int("num_experts", num_experts)
    r = check_int("ranks", ranks)
    if extra_slots is None:
        extra_slots = 1 if r <= e else 0
    extra_slots = check_int("extra_slots", extra_slots, minimum=0)
    return min(e, math.ceil(e / r) + extra_slots)


def candidate_layouts(shape: LayerShape, ranks: int, *, extra_slots: int | None = None) -> dict[str, list[Layout]]:
    """Per family, the layouts that fit R ranks (an empty list: the family cannot, and why is in
    `why_not`). EP: ep = R when R <= E and E % R == 0, else ep = E x data R/E when E divides R.
    ETP: tp = R when R divides F. EPxETP: every power-of-two tp in [2, R/2] dividing F with
    ep = R/tp dividing E. EP+replication: `replica_slots`."""
    e, f, r = shape.num_experts, shape.d_ff, check_int("ranks", ranks)
    out = {"EP": [], "ETP": [], "EPxETP": [], "EP+replication": []}
    if r <= e and e % r == 0:
        out["EP"].append(Layout("EP", r, 1, 1, e // r))
    elif r > e and r % e == 0:
        out["EP"].append(Layout("EP", e, 1, r // e, 1))
    if f % r == 0:
        out["ETP"].append(Layout("ETP", 1, r, 1, e))
    tp = 2
    while tp <= r // 2:
        if r % tp == 0 and f % tp == 0 and e % (r // tp) == 0:
            out["EPxETP"].append(Layout("EPxETP", r // tp, tp, 1, e // (r // tp)))
        tp *= 2
    s = replica_slots(e, r, extra_slots)
    if s * r >= e:
        out["EP+replication"].append(Layout("EP+replication", r, 1, 1, s))
    return out


def why_not(kind: str, shape: LayerShape, ranks: int) -> str:
    e, f = shape.num_experts, shape.d_ff
    return {"EP": f"needs E % R == 0 or R % E == 0 (E={e}, R={ranks})",
            "ETP": f"needs R | F (F={f}, R={ranks})",
            "EPxETP": f"no tp in [2, R/2] with tp | F and R/tp | E (F={f}, E={e}, R={ranks})",
            "EP+replication": "no slot count fits"}[kind]


def step_counts(shape: LayerShape, load: Load, ranks: int) -> np.ndarray:
    """`[R, E]` routes of each source rank to each expert for one step of `load` on R ranks."""
    r = check_int("ranks", ranks)
    counts_E = load.counts(shape.num_experts, r * shape.routes_per_rank, r * shape.tokens_per_rank)
    return split_sources(counts_E, r)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Every family's best layout at one R (None where it cannot run), the winner and why."""

    ranks: int
    load_name: str
    results: dict
    skipped: dict
    winner: str
    reason: str
    counts_SE: np.ndarray


def _exchanged_mb(res: LayoutResult) -> float:
    """The busiest rank's bytes in MB, the larger of sent and received."""
    return float(np.maximum(res.send_bytes_R, res.recv_bytes_R).max()) / 1e6


def _reason(ranked: list[LayoutResult], by_kind: dict) -> str:
    win = ranked[0]
    if len(ranked) == 1:
        return f"{win.name} is the only layout that fits"
    other = ranked[1]
    gains = {p: other.phase_max(p) - win.phase_max(p) for p in PHASES}
    gains["exchange"] = gains.pop("dispatch") + gains.pop("combine")
    gap = other.layer_s - win.layer_s
    # The phases that make up the gap, largest first (those above a tenth of it; at least one).
    decisive = [p for p in sorted(gains, key=gains.get, reverse=True) if gains[p] > 0.1 * gap] or [max(gains, key=gains.get)]
    parts = []
    for phase in decisive:
        if phase == "experts":
            parts.append(f"experts {1e3 * win.phase_max('experts'):.2f} vs {1e3 * other.phase_max('experts'):.2f} ms "
                         f"(slowest rank {win.rows_imbalance:.2f}x mean rows vs {other.rows_imbalance:.2f}x; useful "
                         f"FLOPs {100 * win.useful_flop_fraction:.0f}% vs {100 * other.useful_flop_fraction:.0f}%)")
        elif phase == "exchange":
            parts.append(f"exchange {1e3 * win.exchange_max_s:.2f} vs {1e3 * other.exchange_max_s:.2f} ms "
                         f"({_exchanged_mb(win):.0f} vs {_exchanged_mb(other):.0f} MB/rank, "
                         f"{win.network_bytes_R.max() / 1e6:.0f} vs {other.network_bytes_R.max() / 1e6:.0f} MB over "
                         "the network)")
        else:
            parts.append(f"row moves {1e3 * win.phase_max(phase):.2f} vs {1e3 * other.phase_max(phase):.2f} ms")
    text = (f"{win.layout.kind} {1e3 * win.layer_s:.2f} ms vs {other.layout.kind} {1e3 * other.layer_s:.2f} ms: "
            + "; ".join(parts))
    if gap < 0.05 * other.layer_s:
        text += f" (a {100 * gap / other.layer_s:.1f}% margin: too close for this model to call)"
    ep = by_kind.get("EP")
    if ep is not None and ep.layout.kind not in (win.layout.kind, other.layout.kind):
        text += f"; EP {1e3 * ep.layer_s:.2f} ms ({ep.rows_imbalance:.2f}x mean rows)"
    return text


def plan_step(shape: LayerShape, load: Load, cluster: Cluster, costs: KernelCosts, *, train: bool = False,
              extra_slots: int | None = None, capacity_factor: float | None = None, strategy: str = "ragged",
              counts_SE=None, kinds=None) -> StepPlan:
    """Every layout family on `cluster.ranks` ranks for one step of `load` (or the given
    per-source `counts_SE`), each family's fastest configuration, the winner and the reason.
    `capacity_factor` / `strategy` apply to EP only (the others are dropless, ragged)."""
    r = cluster.ranks
    counts = step_counts(shape, load, r) if counts_SE is None else np.asarray(counts_SE)
    results, skipped = {}, {}
    for kind, layouts in candidate_layouts(shape, r, extra_slots=extra_slots).items():
        if kinds is not None and kind not in kinds:
            continue
        if not layouts:
            skipped[kind] = why_not(kind, shape, r)
            continue
        best = None
        for layout in layouts:
            placement = None
            if kind == "EP+replication":
                placement = plan_placement(counts.sum(axis=0).astype(np.float64), r, layout.groups)
            work = work_for(layout, shape, counts, placement=placement, capacity_factor=capacity_factor,
                            strategy=strategy)
            res = evaluate(work, shape, cluster, costs, train=train)
            if best is None or res.layer_s < best.layer_s:
                best = res
        results[kind] = best
    if not results:
        raise ValueError(f"no layout fits R = {r} ranks for {shape.describe()}: {skipped}")
    ranked = sorted(results.values(), key=lambda x: x.layer_s)
    return StepPlan(r, load.name, results, skipped, ranked[0].layout.kind, _reason(ranked, results), counts)


def sweep(shape: LayerShape, load: Load, cluster: Cluster, costs: KernelCosts, ranks=(8, 16, 32, 64, 128, 256),
          **options) -> list[StepPlan]:
    """`plan_step` at each R of `ranks` (the cluster's other figures kept)."""
    return [plan_step(shape, load, cluster.with_ranks(check_int("ranks", r)), costs, **options) for r in ranks]
