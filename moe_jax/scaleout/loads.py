"""Routing loads: which share of the routes each expert gets, from committed traces or Zipf(s),
turned into whole row counts for a step of R ranks x T tokens x top-K.

Legend: E experts, R ranks (sources of routes), T tokens per rank, K top-k, L layers, W steps of
a trace window.

- `zipf_counts`: the Zipf law the benchmarks use (counts proportional to rank^-s over
  a seeded random expert order, water-filled under a per-expert cap), the same numbers for the
  same arguments (`benchmarks.shapes` calls it).
- Traces: `benchmarks/data/expert_counts.npz` (written by `benchmarks/traces.py`; keys
  `train/step{S}/layer{L}`, int64 `[E_trace]` each). A trace load is one layer's counts summed over
  the last `window` training steps. Recorded at 8 experts; `rescale_experts` spreads them over E
  experts the way `benchmarks/placement.py` does: each recorded expert's share goes in equal
  parts to E / E_trace experts in a fixed random order (seed 0), which leaves the recorded skew
  between groups and none inside one.
- `scale_to_routes` turns shares into integer counts of `routes` rows (largest remainder), no
  expert above `cap` (= the step's tokens: a token picks an expert at most once), the overflow
  poured onto the others in proportion.
- `split_sources` deals each expert's count over the R source ranks as evenly as possible
  (remainders rotate over the ranks): the model assumes every rank's tokens route like the whole
  step's. A measured per-rank routing can be passed to the model instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from moe_jax.validation import check_int, check_number

__all__ = ["Load", "read_trace", "rescale_experts", "scale_to_routes", "split_sources", "zipf_counts"]


def zipf_counts(routes: int, num_experts: int, *, cap: int, s: float = 1.2, seed: int = 0) -> np.ndarray:
    """`[E]` int64 counts proportional to rank^-s (experts in a seeded random order), summing to
    `routes`, each <= `cap`; the overflow above the cap is poured into the next experts by the same
    law (water filling). The benchmarks' Zipf histograms (`benchmarks.shapes`) are these."""
    routes = check_int("routes", routes, minimum=0)
    e = check_int("num_experts", num_experts)
    cap = check_int("cap", cap)
    s = check_number("s", s, positive=False)
    if routes > e * cap:
        raise ValueError(f"routes = {routes} cannot fit {e} experts of at most cap = {cap} rows each.")
    w = np.arange(1, e + 1, dtype=np.float64) ** -s
    counts = np.zeros(e, np.int64)
    remaining = routes
    free = np.ones(e, bool)
    while remaining > 0:
        share = np.where(free, w, 0.0)
        raw = remaining * share / share.sum()
        add = np.floor(raw).astype(np.int64)
        rem = remaining - add.sum()
        order = np.argsort(-(raw - add))
        add[order[:rem]] += 1
        counts += add
        over = np.maximum(counts - cap, 0)
        counts -= over
        remaining = int(over.sum())
        free &= counts < cap
    rng = np.random.default_rng(seed)
    return counts[rng.permutation(e)]


def read_trace(path, layer: int, window: int | None = None) -> np.ndarray:
    """`[E_trace]` float64: layer `layer`'s training-step counts summed over the last `window` steps
    (all steps when None) of a `benchmarks/traces.py` file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace file {path} does not exist.")
    layer = check_int("layer", layer, minimum=0)
    with np.load(path) as data:
        keys = [k for k in data.files if k.startswith("train/") and k.endswith(f"/layer{layer}")]
        if not keys:
            layers = sorted({k.rsplit("layer", 1)[1] for k in data.files if k.startswith("train/")})
            raise ValueError(f"{path} has no training counts for layer {layer}; layers: {layers}.")
        steps = sorted(int(k.split("/")[1][len("step"):]) for k in keys)
        if window is not None:
            window = check_int("window", window)
            steps = steps[-window:]
        return np.sum([data[f"train/step{s}/layer{layer}"] for s in steps], axis=0).astype(np.float64)


def rescale_experts(load, num_experts: int, seed: int = 0) -> np.ndarray:
    """`[E]` float64: each of the `[E_trace]` loads split into E / E_trace equal parts, in a fixed
    random order (seed), as `benchmarks/placement.py` rescales the traces."""
    load = np.asarray(load, dtype=np.float64)
    e = check_int("num_experts", num_experts)
    if load.ndim != 1 or load.size == 0 or np.any(load < 0):
        raise ValueError(f"load must be a non-empty, non-negative 1-D array; got shape {load.shape}.")
    if e % load.size:
        raise ValueError(f"num_experts = {e} must be a multiple of the trace's {load.size} experts to rescale it.")
    perm = np.random.default_rng(seed).permutation(e)
    return np.repeat(load / (e // load.size), e // load.size)[perm]


def scale_to_routes(share_E, routes: int, cap: int) -> np.ndarray:
    """`[E]` int64 counts summing to `routes` in proportion to `share_E` (largest remainder, ties
    to the lower index), none above `cap`: the overflow goes to the experts below the cap in
    proportion to their shares."""
    share = np.asarray(share_E, dtype=np.float64)
    routes = check_int("routes", routes, minimum=0)
    cap = check_int("cap", cap)
    if share.ndim != 1 or share.size == 0 or np.any(share < 0) or not np.all(np.isfinite(share)):
        raise ValueError("share_E must be a non-empty, finite, non-negative 1-D array.")
    if share.sum() <= 0:
        raise ValueError("share_E must have a positive sum.")
    if routes > share.size * cap:
        raise ValueError(f"routes = {routes} cannot fit {share.size} experts of at most cap = {cap} rows each.")
    counts = np.zeros(share.size, np.int64)
    free = np.ones(share.size, bool)
    remaining = routes
    while remaining > 0:
        w = np.where(free, share, 0.0)
        if w.sum() <= 0:  # only zero-share experts are left below the cap: spread evenly over them
            w = free.astype(np.float64)
        raw = remaining * w / w.sum()
        add = np.floor(raw).astype(np.int64)
        order = np.lexsort((np.arange(share.size), -(raw - add)))
        add[order[: remaining - add.sum()]] += 1
        counts += add
        over = np.maximum(counts - cap, 0)
        counts -= over
        remaining = int(over.sum())
        free &= counts < cap
    return counts


def split_sources(counts_E, num_sources: int) -> np.ndarray:
    """`[R, E]` int64: each expert's count dealt over R sources, `c // R` each and the `c % R`
    remainders to consecutive sources continuing where the previous expert's stopped (so source
    totals differ by at most one). Column sums are `counts_E`."""
    counts = np.asarray(counts_E)
    r = check_int("num_sources", num_sources)
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or np.any(counts < 0):
        raise ValueError("counts_E must be a 1-D array of non-negative integers.")
    base, rem = counts // r, counts % r
    out = np.repeat(base[None, :].astype(np.int64), r, axis=0)
    start = 0
    for e in np.flatnonzero(rem):
        rows = (start + np.arange(rem[e])) % r
        out[rows, e] += 1
        start = (start + rem[e]) % r
    return out


@dataclasses.dataclass(frozen=True)
class Load:
    """A routing load to plan for: a name and `share_E` (any non-negative weights over E
    experts), or Zipf(s) (`zipf`), whose counts come from `zipf_counts` at each step size."""

    name: str
    share_E: np.ndarray | None = None
    zipf_s: float | None = None
    seed: int = 0

    def __post_init__(self):
        if (self.share_E is None) == (self.zipf_s is None):
            raise ValueError("Load takes exactly one of share_E and zipf_s.")
        if self.share_E is not None:
            share = np.asarray(self.share_E, dtype=np.float64)
            if share.ndim != 1 or share.size == 0 or np.any(share < 0) or share.sum() <= 0:
                raise ValueError(f"Load {self.name!r}: share_E must be non-negative, 1-D, with a positive sum.")
            share = share.copy()
            share.setflags(write=False)
            object.__setattr__(self, "share_E", share)

    @classmethod
    def zipf(cls, s: float, seed: int = 0) -> "Load":
        return cls(f"Zipf({s:g})", zipf_s=check_number("s", s, positive=False), seed=seed)

    @classmethod
    def trace(cls, path, layer: int, num_experts: int, window: int | None = 25, seed: int = 0) -> "Load":
        """One layer of a committed trace, summed over the last `window` steps, rescaled to E experts."""
        raw = read_trace(path, layer, window)
        what = f"last {window} steps" if window else "all steps"
        return cls(f"trace layer {layer} ({what})", share_E=rescale_experts(raw, num_experts, seed))

    def counts(self, num_experts: int, routes: int, cap: int) -> np.ndarray:
        """`[E]` int64 counts of a step of `routes` rows, each <= `cap`."""
        if self.zipf_s is not None:
            return zipf_counts(routes, num_experts, cap=cap, s=self.zipf_s, seed=self.seed)
        if self.share_E.size != num_experts:
            raise ValueError(f"Load {self.name!r} has {self.share_E.size} experts; the layer has {num_experts}.")
        return scale_to_routes(self.share_E, routes, cap)
