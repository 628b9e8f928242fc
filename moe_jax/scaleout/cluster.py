"""The machines a plan runs on: ranks, ranks per node, link bandwidths and latencies.

Legend: R ranks (GPUs), N nodes (R / ranks_per_node). Rank r sits on node r // ranks_per_node
(consecutive ranks share a node, as `moe_jax.parallel.make_mesh` lays out the minor axis).

The defaults describe HGX/DGX H200 nodes. They are assumptions taken from vendor specifications,
not measurements of ours:

- `nvlink_GBps = 450`: per GPU and direction inside a node. NVIDIA's H200 SXM specification gives
  900 GB/s of NVLink (4th generation, 18 links) per GPU, counting both directions; through the
  NVSwitch every pair of GPUs of a node can use it.
- `internode_GBps = 50`: per GPU and direction between nodes. The DGX H200 has eight 400 Gb/s
  ConnectX-7 (InfiniBand NDR) ports for eight GPUs, one 50 GB/s port per GPU.
- `intra_latency_us = 10`, `inter_latency_us = 25`: a fixed cost per collective call (launch,
  synchronisation, the first bytes), order-of-magnitude figures for NCCL collectives of small
  messages inside a node and across nodes; assumptions, not fitted.

What the committed 2-GPU measurement says about the NVLink figure is in docs/scaleout.md
(`moe_jax.scaleout.comm.fit_link` fits bandwidth and latency to measured exchanges).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_jax.validation import check_int, check_number

__all__ = ["Cluster"]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """R ranks, `ranks_per_node` per node, the two link classes and their per-call latencies.

    ranks: R >= 1. ranks_per_node: GPUs sharing one NVLink domain; R must be a multiple of it
      when R exceeds it (R below it is one partly filled node).
    nvlink_GBps / internode_GBps: GB/s (1e9 bytes) per GPU and direction on the NVLink domain and
      on the network between nodes (the GPU's own network port).
    intra_latency_us / inter_latency_us: fixed microseconds per collective whose group stays
      inside one node / spans nodes.
    """

    ranks: int
    ranks_per_node: int = 8
    nvlink_GBps: float = 450.0
    internode_GBps: float = 50.0
    intra_latency_us: float = 10.0
    inter_latency_us: float = 25.0

    def __post_init__(self):
        object.__setattr__(self, "ranks", check_int("ranks", self.ranks))
        object.__setattr__(self, "ranks_per_node", check_int("ranks_per_node", self.ranks_per_node))
        if self.ranks > self.ranks_per_node and self.ranks % self.ranks_per_node:
            raise ValueError(f"ranks = {self.ranks} must be a multiple of ranks_per_node = {self.ranks_per_node} "
                             "(whole nodes), or at most one node.")
        for name in ("nvlink_GBps", "internode_GBps"):
            object.__setattr__(self, name, check_number(name, getattr(self, name)))
        for name in ("intra_latency_us", "inter_latency_us"):
            object.__setattr__(self, name, check_number(name, getattr(self, name), positive=False))
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}.")

    @property
    def nodes(self) -> int:
        return max(1, self.ranks // self.ranks_per_node)

    def node_R(self) -> np.ndarray:
        """`[R]` int: the node of each rank."""
        return np.arange(self.ranks) // self.ranks_per_node

    def same_node_RR(self) -> np.ndarray:
        """`[R, R]` bool: both ranks on one node (the pair talks over NVLink)."""
        node = self.node_R()
        return node[:, None] == node[None, :]

    def with_ranks(self, ranks: int) -> "Cluster":
        """The same machines with `ranks` ranks."""
        return dataclasses.replace(self, ranks=ranks)

    def describe(self) -> str:
        return (f"R={self.ranks} ({self.nodes} node{'s' if self.nodes > 1 else ''} x {min(self.ranks, self.ranks_per_node)}), "
                f"NVLink {self.nvlink_GBps:g} GB/s, inter-node {self.internode_GBps:g} GB/s per GPU and direction, "
                f"latency {self.intra_latency_us:g}/{self.inter_latency_us:g} us per collective")
