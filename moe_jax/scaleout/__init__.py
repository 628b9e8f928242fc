"""Scale-out planner for MoE layers on 8-256 ranks (a model, not a measurement).

Given a layer shape, routing loads (committed traces or Zipf(s)), a cluster (ranks per node,
NVLink and network bandwidth) and per-kernel costs (from the benchmark results), it predicts per
rank the rows, the padding at the tile height of the kernel that runs, the exchange bytes and the
layer time (slowest rank beside the mean) for EP, ETP, EP x ETP and EP with replication (placed by
`moe_jax.parallel.placement`), and says which layout wins and why. `python -m moe_jax.scaleout
--help`; the model and what it was checked against: docs/scaleout.md.

Modules, one job each: `shape` (LayerShape), `cluster` (Cluster), `comm` (collective time from
bytes), `tiles` (the tile height `moe_jax.ops.plan` would run), `costs` (KernelCosts: GEMM time),
`loads` (traces, Zipf, counts per source rank), `layouts` (what each layout makes each rank do),
`model` (times, the sweep, the winner), `report` (markdown, JSON), `cli`.
"""

from moe_jax.scaleout.cluster import Cluster
from moe_jax.scaleout.comm import Traffic, all_to_all, fit_link, ring
from moe_jax.scaleout.costs import KernelCosts
from moe_jax.scaleout.layouts import KINDS, Layout, Work, ep_work, epxetp_work, etp_work, replication_work, work_for
from moe_jax.scaleout.loads import Load, read_trace, rescale_experts, scale_to_routes, split_sources, zipf_counts
from moe_jax.scaleout.model import (LayoutResult, StepPlan, candidate_layouts, evaluate, plan_step, replica_slots,
                                    step_counts, sweep)
from moe_jax.scaleout.shape import QWEN3_30B_A3B, LayerShape
from moe_jax.scaleout.tiles import Tiles, kernel_plan, kernel_tiles

__all__ = [
    "KINDS", "QWEN3_30B_A3B", "Cluster", "KernelCosts", "LayerShape", "Layout", "LayoutResult", "Load", "StepPlan",
    "Tiles", "Traffic", "Work", "all_to_all", "candidate_layouts", "ep_work", "epxetp_work", "etp_work", "evaluate",
    "fit_link", "kernel_plan", "kernel_tiles", "plan_step", "read_trace", "replica_slots", "replication_work", "rescale_experts",
    "ring", "scale_to_routes", "split_sources", "step_counts", "sweep", "work_for", "zipf_counts",
]
