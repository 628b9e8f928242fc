"""Shapes and routings of the EP benchmark, identical in every process (JAX worker, torch ranks).

Legend: P ranks (ep size), T tokens per rank, D width, K top-k, E experts, R = T*K routes per rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from parity.problem import ZIPF_EXPONENT

__all__ = ["CAPACITY_FACTOR", "GPU_SHAPES", "ROUTINGS", "SMOKE_SHAPES", "Shape", "make_routing", "reps_for",
           "send_counts"]

CAPACITY_FACTOR = 1.25  # of the "cf=1.25" rows: C = capacity_for(T, K, P, CAPACITY_FACTOR)
ROUTINGS = ("balanced", "zipf")  # the benchmark's routings (make_routing also has "one_rank")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    tokens: int  # T per rank
    d_model: int
    top_k: int
    experts: int

    def describe(self) -> str:
        return f"{self.name} T={self.tokens} D={self.d_model} top-{self.top_k}/{self.experts}"

    @property
    def payload_bytes(self) -> int:
        """Bytes a dropless dispatch + combine delivers per rank: R rows of D bf16, both ways."""
        return 2 * self.tokens * self.top_k * self.d_model * 2


GPU_SHAPES = (
    Shape("prefill", 4096, 4096, 2, 64),
    Shape("prefill", 16384, 4096, 2, 64),
    Shape("decode", 128, 7168, 8, 256),
)
SMOKE_SHAPES = (Shape("prefill", 64, 32, 2, 8), Shape("decode", 8, 64, 4, 16))


def reps_for(shape: Shape, smoke: bool) -> int:
    """Calls per timed trial: about 4 GB of payload, 5 to 100 calls (3 in the CPU smoke)."""
    if smoke:
        return 3
    return int(max(5, min(100, 4e9 // max(shape.payload_bytes, 1))))


def make_routing(kind: str, ranks: int, tokens: int, experts: int, top_k: int, seed: int = 0):
    """`(expert_idx [ranks*T, K] int32, weights [ranks*T, K] f32)`, K distinct experts per token,
    weights summing to 1 per token. Identical in every process for the same arguments.

    balanced: each rank's T*K routes cover every expert exactly T*K/E times (when E divides T*K).
    zipf: expert popularity ~ (popularity rank)^-1.2 over a random expert order, K distinct
      experts per token drawn without replacement (Gumbel top-k).
    one_rank: every route to the experts of ep rank 0 (needs E/ranks >= K).
    """
    rng = np.random.default_rng(seed)
    n = ranks * tokens
    if kind == "balanced":
        perm = rng.permutation(experts)
        rows = []
        for _ in range(ranks):
            flat = perm[np.arange(tokens * top_k) % experts].reshape(tokens, top_k)
            rows.append(flat[rng.permutation(tokens)])
        idx = np.concatenate(rows)
    elif kind in ("zipf", "one_rank"):
        if kind == "zipf":
            logp = -ZIPF_EXPONENT * np.log1p(rng.permutation(experts).astype(np.float64))
        else:
            if experts // ranks < top_k:
                raise ValueError(f"one_rank routing needs E/ranks >= K distinct experts on rank 0; got "
                                 f"E={experts}, ranks={ranks}, K={top_k}.")
            logp = np.where(np.arange(experts) < experts // ranks, 0.0, -np.inf)
        keys = logp[None, :] + rng.gumbel(size=(n, experts))
        idx = np.argsort(-keys, axis=1)[:, :top_k]
    else:
        raise ValueError(f"unknown routing {kind!r}")
    weights = rng.uniform(0.1, 1.0, size=(n, top_k))
    weights /= weights.sum(axis=1, keepdims=True)
    return idx.astype(np.int32), weights.astype(np.float32)


def send_counts(idx_NK: np.ndarray, experts: int, ranks: int) -> np.ndarray:
    """`[src, dst]` routes ep rank src sends to ep rank dst (dropless), from `make_routing`'s
    rank-major `[ranks*T, K]` expert ids."""
    dest_PR = idx_NK.reshape(ranks, -1) // (experts // ranks)
    return np.stack([np.bincount(d, minlength=ranks) for d in dest_PR])
