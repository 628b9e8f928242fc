"""Benchmark shapes and expert-count generators (balanced, Zipf-skewed, decode routing).

Legend: M packed rows (tokens x top-k), K input width, N output width, E experts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_jax.scaleout.loads import zipf_counts as zipf


@dataclasses.dataclass(frozen=True)
class GemmShape:
    name: str
    m: int
    e: int
    k: int
    n: int
    top_k: int

    @property
    def tokens(self) -> int:
        return self.m // self.top_k


PREFILL = (
    GemmShape("qwen3-30b-a3b gate+up", m=32768, e=128, k=2048, n=1536, top_k=8),
    GemmShape("qwen3-30b-a3b down", m=32768, e=128, k=768, n=2048, top_k=8),
    GemmShape("mixtral-8x7b up", m=8192, e=8, k=4096, n=14336, top_k=2),
    GemmShape("deepseek-v3 gate+up", m=32768, e=256, k=7168, n=4096, top_k=8),
)

DECODE_TOKENS = (1, 8, 32, 128)


def decode_shape(tokens: int) -> GemmShape:
    """Qwen3-30B-A3B gate+up projection at decode: top-8 of 128 experts, one row per token-expert pair."""
    return GemmShape(f"decode T={tokens}", m=8 * tokens, e=128, k=2048, n=1536, top_k=8)


def balanced_counts(m: int, e: int) -> np.ndarray:
    counts = np.full(e, m // e, np.int64)
    counts[: m % e] += 1
    return counts


def zipf_counts(m: int, e: int, *, cap: int, s: float = 1.2, seed: int = 0) -> np.ndarray:
    """Counts proportional to rank^-s (experts in random order), summing to `m`, each <= `cap`
    (`moe_jax.scaleout.loads.zipf_counts`: `cap` is the token count, under top-k routing an expert
    sees each token at most once; overflow above it is poured into the next experts by the same law)."""
    return zipf(m, e, cap=cap, s=s, seed=seed)


def decode_counts(tokens: int, e: int = 128, top_k: int = 8, seed: int = 0) -> np.ndarray:
    """Counts from `tokens` tokens each routed to `top_k` distinct uniformly random experts."""
    rng = np.random.default_rng(seed)
    picks = np.stack([rng.choice(e, top_k, replace=False) for _ in range(tokens)])
    return np.bincount(picks.ravel(), minlength=e)
