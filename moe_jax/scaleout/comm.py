"""Exchange time from bytes: all-to-all and ring all-gather / reduce-scatter on a `Cluster`.

Legend: R ranks; a `group_R` labels each rank's collective group (ranks with the same label take
part in one collective; a group of one rank exchanges nothing).

The model, per collective call and rank:

    seconds = latency + max(nvlink_bytes / nvlink_GBps, network_bytes / internode_GBps)

- latency: `intra_latency_us` when the rank's group stays inside one node, else
  `inter_latency_us`; nothing for a group of one.
- The two link classes run at the same time (a rank drives its NVLink and its network port
  concurrently), and each direction is full duplex: a link class costs the larger of the bytes
  the rank sends and receives over it. Rows a rank keeps for itself cost nothing here (they are
  local copies, counted with the other HBM row moves in `moe_jax.scaleout.model`).
- All-to-all (`all_to_all`): every (source, destination) block goes directly, over NVLink when
  both ranks share a node, else over the network.
- All-gather and reduce-scatter (`ring`): NCCL's ring algorithm with one ring per GPU of a node,
  each carrying an equal share: a rank moves all pieces but its own over NVLink
  (`sum(pieces) - own`), and when the group spans nodes each network port carries that divided by
  the group's ranks per node (each ring crosses a node boundary once; NCCL's bus-bandwidth
  formula, nccl-tests doc/PERFORMANCE.md). A reduce-scatter moves the same bytes as the
  all-gather of its outputs.
- Not modelled: congestion and the network topology above the node (a full-bisection fabric is
  assumed), NCCL's protocol and channel choices, PXN routing through a peer's port (the port
  count per node is the same), and any overlap of one collective with compute or another
  collective: every call is a barrier and phases add up.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moe_jax.scaleout.cluster import Cluster

__all__ = ["Traffic", "all_to_all", "fit_link", "ring", "group_latency_s"]

_GB = 1e9


class Traffic(NamedTuple):
    """One collective, per rank (all `[R]` float64).

    send_bytes_R / recv_bytes_R: bytes leaving / entering the rank over any link (own rows
      excluded). nvlink_bytes_R / network_bytes_R: the larger direction on each link class (for
      the network, per port). seconds_R: the model's time for the call.
    """

    send_bytes_R: np.ndarray
    recv_bytes_R: np.ndarray
    nvlink_bytes_R: np.ndarray
    network_bytes_R: np.ndarray
    seconds_R: np.ndarray

    @staticmethod
    def none(ranks: int) -> "Traffic":
        z = np.zeros(ranks)
        return Traffic(z, z.copy(), z.copy(), z.copy(), z.copy())

    def __add__(self, other: "Traffic") -> "Traffic":  # two calls, one after the other
        return Traffic(*(a + b for a, b in zip(self, other)))


def _check_group(group_R, cluster: Cluster) -> np.ndarray:
    group = np.asarray(group_R)
    if group.shape != (cluster.ranks,):
        raise ValueError(f"group_R must have shape ({cluster.ranks},), one label per rank; got {group.shape}.")
    return group


def group_latency_s(group_R, cluster: Cluster) -> np.ndarray:
    """`[R]` seconds of fixed cost per call: intra- or inter-node latency by the rank's group, 0 alone."""
    group = _check_group(group_R, cluster)
    node = cluster.node_R()
    out = np.zeros(cluster.ranks)
    for g in np.unique(group):
        members = group == g
        if members.sum() < 2:
            continue
        spans = len(np.unique(node[members])) > 1
        out[members] = 1e-6 * (cluster.inter_latency_us if spans else cluster.intra_latency_us)
    return out


def all_to_all(send_bytes_RR, group_R, cluster: Cluster) -> Traffic:
    """One all-to-all: `send_bytes_RR[s, d]` bytes from rank s to rank d (the diagonal stays local;
    blocks between different groups must be zero)."""
    m = np.asarray(send_bytes_RR, dtype=np.float64)
    r = cluster.ranks
    if m.shape != (r, r):
        raise ValueError(f"send_bytes_RR must have shape ({r}, {r}); got {m.shape}.")
    if np.any(m < 0) or not np.all(np.isfinite(m)):
        raise ValueError("send_bytes_RR must be finite and non-negative.")
    group = _check_group(group_R, cluster)
    if np.any(m[group[:, None] != group[None, :]] > 0):
        raise ValueError("send_bytes_RR moves bytes between ranks of different groups (group_R).")
    m = m.copy()
    np.fill_diagonal(m, 0.0)
    near = cluster.same_node_RR()
    nv = np.maximum((m * near).sum(axis=1), (m * near).sum(axis=0))
    net = np.maximum((m * ~near).sum(axis=1), (m * ~near).sum(axis=0))
    seconds = group_latency_s(group, cluster) + np.maximum(nv / (cluster.nvlink_GBps * _GB),
                                                           net / (cluster.internode_GBps * _GB))
    return Traffic(m.sum(axis=1), m.sum(axis=0), nv, net, seconds)


def ring(piece_bytes_R, group_R, cluster: Cluster) -> Traffic:
    """One ring all-gather (or reduce-scatter) per group: rank r contributes (or ends with)
    `piece_bytes_R[r]` bytes; every rank of a group ends with (or starts from) all its pieces."""
    piece = np.asarray(piece_bytes_R, dtype=np.float64)
    r = cluster.ranks
    if piece.shape != (r,):
        raise ValueError(f"piece_bytes_R must have shape ({r},); got {piece.shape}.")
    if np.any(piece < 0) or not np.all(np.isfinite(piece)):
        raise ValueError("piece_bytes_R must be finite and non-negative.")
    group = _check_group(group_R, cluster)
    node = cluster.node_R()
    nv = np.zeros(r)
    net = np.zeros(r)
    for g in np.unique(group):
        members = group == g
        others = piece[members].sum() - piece[members]
        nv[members] = others
        nodes = np.unique(node[members])
        if len(nodes) > 1:
            per_node = members.sum() / len(nodes)
            net[members] = others / per_node
    seconds = group_latency_s(group, cluster) + np.maximum(nv / (cluster.nvlink_GBps * _GB),
                                                           net / (cluster.internode_GBps * _GB))
    return Traffic(nv.copy(), nv.copy(), nv, net, seconds)


def fit_link(bytes_per_call, seconds_per_call) -> tuple[float, float]:
    """`(GB/s, latency in us)` of `seconds = latency + bytes / bandwidth`, least squares over the
    given calls (at least two distinct byte counts). For reading a measurement, not for the
    defaults: `Cluster`'s figures are specifications."""
    b = np.asarray(bytes_per_call, dtype=np.float64)
    t = np.asarray(seconds_per_call, dtype=np.float64)
    if b.shape != t.shape or b.ndim != 1 or len(np.unique(b)) < 2:
        raise ValueError("bytes_per_call and seconds_per_call must be 1-D of equal length with at least two "
                         "distinct byte counts.")
    slope, intercept = np.polyfit(b, t, 1)
    if slope <= 0:
        raise ValueError("the fitted time does not grow with bytes; the measurements cannot give a bandwidth.")
    return float(1.0 / slope / _GB), float(intercept * 1e6)
