"""On-device choice of the forward grouped-GEMM candidate from the routing histogram.

Legend: E groups (experts), M packed rows (static), U useful rows (traced, U <= M), C candidates
(`config.CANDIDATES`).

Which kernel is fastest moves with the histogram, not only with M: at one M, rows spread over all
experts favour narrow group-major launches at decode and tall row tiles at prefill, while the same
rows on a few hot experts favour row tiles that split each hot expert over many programs
(docs/kernel-selection.md has the measurements). The choice is made inside the program, from
`group_sizes`, with no host round trip, so it works under `jit`, `scan` and `shard_map`:

1. `histogram_features`: the useful rows U (clamped sizes, as the kernels see them), active
   experts, max rows per expert, effective experts `U^2 / sum t^2` (1 for one hot expert, E for a
   balanced histogram), and the executed rows P of every candidate (rows rounded up to its tile
   height per expert).
2. `SelectorTable.row` / `.column`: the row bucket `r = ceil(log2 M)` of the static packed rows (M in
   `(2^(r-1), 2^r]`; the dropless layer has U = M, and M sizes the row-tile grids) and the traced
   effective-expert bucket `x = round(log2 E_eff)`. Every histogram of one cell runs the same
   kernel, so layers whose histograms differ by a few rows do not flip kernels: E_eff has to move
   by ~1.4x to change cell (the guardrail).
3. The table maps the cell to a candidate name; `select` returns its position among the row's
   distinct candidates (`candidates_for(M)`; only those are compiled), and the backend runs one
   gated launch per candidate, chained through one output buffer, of which only the chosen one
   does any work. No XLA conditional is used: XLA's GPU runtime copies a conditional's branch
   index to the host and waits for it, a host round trip per call (docs/kernel-selection.md).

Tables are tuned offline per device and shape (`python -m benchmarks.routed_gmm fit`, from a sweep
of routing-shaped histograms) and live in `tables`; `selector_table(n, k, E)` returns the
nearest tuned shape's table for the local device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.ops.gmm.pallas_triton.candidates import CANDIDATES
from moe_jax.ops.gmm.schedule import clamp_group_sizes

__all__ = ["Features", "Selection", "SelectorTable", "histogram_features", "select", "selector_table"]


class Features(NamedTuple):
    """Histogram features, computed on device (all scalars except `executed_C`)."""

    useful_rows: jax.Array  # int32 U: rows in groups after the clamp
    active: jax.Array  # int32 experts with rows
    max_rows: jax.Array  # int32 rows of the largest group
    effective: jax.Array  # f32 U^2 / sum t^2 (0 when U = 0)
    executed_C: jax.Array  # int32 [C] rows executed at each CANDIDATES tile height


def histogram_features(group_sizes: jax.Array, num_rows: int) -> Features:
    """`Features` of `group_sizes` `[E]` over `num_rows` packed rows (sizes clamped as the kernels
    clamp them: negative as zero, rows past `num_rows` dropped from the last groups)."""
    offsets = clamp_group_sizes(group_sizes, num_rows)
    t = offsets[1:] - offsets[:-1]
    useful = offsets[-1]
    tf = t.astype(jnp.float32)
    sum_sq = jnp.sum(tf * tf)
    uf = useful.astype(jnp.float32)
    effective = jnp.where(sum_sq > 0, uf * uf / jnp.maximum(sum_sq, 1.0), 0.0)
    # Rows rounded up to each tile height (as `moe_jax.padding.executed_rows`), once per height.
    heights = sorted({c.tiles.block_m for c in CANDIDATES.values()})
    executed = {h: jnp.sum(-(-t // h) * h, dtype=jnp.int32) for h in heights}
    return Features(
        useful_rows=useful,
        active=jnp.sum(t > 0, dtype=jnp.int32),
        max_rows=jnp.max(t),
        effective=effective,
        executed_C=jnp.stack([executed[c.tiles.block_m] for c in CANDIDATES.values()]),
    )


@dataclasses.dataclass(frozen=True)
class SelectorTable:
    """Candidate per histogram cell, tuned for one device at one GEMM shape.

    shape: `(n, k, num_groups)` of the forward GEMM it was tuned at (`lhs[M, k] x rhs[E, n, k]`).
    choice: `choice[r][x]`, a `CANDIDATES` name for row bucket r (packed rows M in
      `(2^(r-1), 2^r]`; row 0 holds M <= 1) and effective-expert bucket x (`round(log2 E_eff)`);
      features past the last row or column use it. Split-K candidates are not allowed (their
      partial planes are summed after the launch, so they cannot join a gated chain).
    device: the `device_kind` it was measured on. source: how it was made.
    """

    shape: tuple[int, int, int]
    choice: tuple[tuple[str, ...], ...]
    device: str = "NVIDIA H200"
    source: str = ""

    def __post_init__(self):
        shape = tuple(self.shape)
        if len(shape) != 3 or not all(isinstance(v, int) and v > 0 for v in shape):
            raise ValueError(f"SelectorTable.shape={self.shape!r}: must be (n, k, num_groups), positive ints.")
        choice = tuple(tuple(row) for row in self.choice)
        if not choice or not choice[0] or len({len(row) for row in choice}) != 1:
            raise ValueError("SelectorTable.choice must be a non-empty rectangle of candidate names.")
        unknown = sorted({name for row in choice for name in row} - set(CANDIDATES))
        if unknown:
            raise ValueError(f"SelectorTable.choice names {unknown}, not in CANDIDATES ({list(CANDIDATES)}).")
        split = sorted({name for row in choice for name in row if CANDIDATES[name].family == "split_k"})
        if split:
            raise ValueError(f"SelectorTable.choice names split-K candidates {split}; the selector chains "
                             "gated launches into one output, which split-K's partial planes cannot join.")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "choice", choice)

    def row(self, num_rows: int) -> int:
        """Row bucket of `num_rows` packed rows: `ceil(log2 M)`, clipped to the table."""
        r = 0 if num_rows <= 1 else (int(num_rows) - 1).bit_length()
        return min(r, len(self.choice) - 1)

    def candidates_for(self, num_rows: int) -> tuple[str, ...]:
        """The distinct candidates of `num_rows`'s row, in `CANDIDATES` order (the gated launches)."""
        used = set(self.choice[self.row(num_rows)])
        return tuple(name for name in CANDIDATES if name in used)

    def column(self, features: Features) -> jax.Array:
        """Effective-expert bucket `round(log2 E_eff)` of `features`, clipped to the table (traced)."""
        x = jnp.round(jnp.log2(jnp.maximum(features.effective, 1.0))).astype(jnp.int32)
        return jnp.clip(x, 0, len(self.choice[0]) - 1)


class Selection(NamedTuple):
    """What `select` chose."""

    branch: jax.Array  # int32 position in `table.candidates_for(M)` (the gated launch that runs)
    candidate: jax.Array  # int32 index into CANDIDATES (telemetry)
    executed_rows: jax.Array  # int32 P of the chosen candidate
    features: Features


def select(group_sizes: jax.Array, num_rows: int, table: SelectorTable) -> Selection:
    """The candidate `table` picks for `group_sizes` `[E]` over `num_rows` packed rows; traced
    values only (no host callback), so it runs inside `jit`, `scan` and `shard_map`."""
    features = histogram_features(group_sizes, num_rows)
    names = table.candidates_for(num_rows)
    line = table.choice[table.row(num_rows)]
    branch = jnp.asarray([names.index(name) for name in line], jnp.int32)[table.column(features)]
    order = list(CANDIDATES)
    candidate = jnp.asarray([order.index(name) for name in names], jnp.int32)[branch]
    return Selection(branch, candidate, features.executed_C[candidate], features)


def shape_distance(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    """Log-space distance of two `(n, k, num_groups)` shapes (which tuned table is nearest)."""
    return sum(abs(math.log2(x) - math.log2(y)) for x, y in zip(a, b))


def selector_table(n: int, k: int, num_groups: int, *, device: str | None = None) -> SelectorTable:
    """The tuned table nearest to the forward shape `(n, k, num_groups)` (`shape_distance`) among
    those measured on `device` (default: the first local device's kind). A device without tables
    of its own uses all of them (today: the H200's); docs/kernel-selection.md says how to tune one."""
    from moe_jax.ops.gmm.pallas_triton.tables import TABLES

    if device is None:
        device = jax.devices()[0].device_kind
    own = [t for t in TABLES if t.device == device] or list(TABLES)
    return min(own, key=lambda t: (shape_distance(t.shape, (n, k, num_groups)), t.shape))
