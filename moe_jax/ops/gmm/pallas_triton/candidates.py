"""The `pallas_triton` backend's kernel choices: kernel families, the named candidates and the
static per-shape tables.

A `GmmConfig` is a named candidate for the forward and input-gradient GEMM: a kernel *family* (how
programs map to work) and its tiles (`moe_jax.ops.gmm.tiles.TileConfig`). Candidates are chosen
per shape class from small static tables (`gmm_config`, `tgmm_config`) or on the device by the
selector (`selector`), never by autotuning at call time; the tables were filled by
`python -m benchmarks.gmm tune` on an H200 (docs/decisions.md lists the sweeps and their results).

Families (`FAMILIES`):
- `row_tile`: one program per (row tile, column block) of an on-device schedule
  (`schedule.make_group_metadata`); every program has about the same work whatever the skew.
- `group_major`: one program per (active-group slot, column block) walks that group's row tiles;
  no schedule is built before the kernel, which is what decode needs; a hot group is serialised.
- `split_k`: the group-major walk with each program's K loop split over `splits` programs,
  fp32 partial sums reduced in a fixed order (no atomics): for launches whose active groups x
  column blocks leave SMs idle.
"""

from __future__ import annotations

import dataclasses
import types

from moe_jax.ops.gmm.tiles import TileConfig, tile_name
from moe_jax.validation import check_int

__all__ = ["CANDIDATES", "FAMILIES", "GmmConfig", "candidate_index", "gmm_config", "tgmm_config"]

FAMILIES = ("row_tile", "group_major", "split_k")


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """A forward/input-gradient candidate: kernel `family` (one of `FAMILIES`) with `tiles`, and
    for `split_k` the number of K splits (>= 2; 1 for the other families)."""

    family: str = "row_tile"
    tiles: TileConfig = TileConfig()
    splits: int = 1

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"GmmConfig.family={self.family!r}: use one of {FAMILIES}.")
        if not isinstance(self.tiles, TileConfig):
            raise TypeError(f"GmmConfig.tiles must be a TileConfig; got {type(self.tiles).__name__}.")
        splits = check_int("GmmConfig.splits", self.splits)
        if (self.family == "split_k") != (splits > 1):
            raise ValueError(f"GmmConfig(family={self.family!r}, splits={splits}): the split_k family takes "
                             "splits >= 2, the others splits=1.")
        object.__setattr__(self, "splits", splits)

    @property
    def name(self) -> str:
        """E.g. `row_tile 128x256x64 w8 s4` (block_m x block_n x block_k, warps, stages), `split_k4 ...`."""
        family = self.family + (str(self.splits) if self.family == "split_k" else "")
        return f"{family} {tile_name(self.tiles)}"


def _tiles(bm, bn, bk, warps, stages, group_m):
    return TileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, group_m=group_m)


# The named candidate family, decode to prefill. Every candidate is valid for every input (empty
# groups, ragged edges, zero rows); the static table and the on-device selector
# (`selector`) both choose among these, and `MoEStats.kernel_counts_C` counts them
# in this order.
CANDIDATES: types.MappingProxyType[str, GmmConfig] = types.MappingProxyType({
    "gm16x32": GmmConfig("group_major", _tiles(16, 32, 256, 4, 3, 1)),
    "gm16x64": GmmConfig("group_major", _tiles(16, 64, 256, 4, 3, 1)),
    "sk4_16x64": GmmConfig("split_k", _tiles(16, 64, 256, 4, 3, 1), splits=4),
    "rt16x64": GmmConfig("row_tile", _tiles(16, 64, 256, 4, 3, 1)),
    "rt32x128": GmmConfig("row_tile", _tiles(32, 128, 128, 4, 3, 8)),
    "rt64x128": GmmConfig("row_tile", _tiles(64, 128, 64, 4, 4, 8)),
    "rt64x256": GmmConfig("row_tile", _tiles(64, 256, 64, 8, 4, 8)),
    "rt128x128": GmmConfig("row_tile", _tiles(128, 128, 64, 8, 4, 8)),
    "rt128x256": GmmConfig("row_tile", _tiles(128, 256, 64, 8, 4, 8)),
})


def candidate_index(config: GmmConfig) -> int:
    """Position of `config` in `CANDIDATES`, or -1 for a configuration outside the family."""
    return next((i for i, c in enumerate(CANDIDATES.values()) if c == config), -1)


def gmm_config(m: int, n: int, k: int, num_groups: int) -> GmmConfig:
    """The static choice: a `CANDIDATES` member for `lhs[m,k] x rhs[num_groups, n, k]` from the
    shapes alone (the on-device selector also looks at the histogram).

    Shape classes by mean rows per group `m / num_groups` (H200 sweeps, docs/decisions.md):
    - decode (<= 16): the group-major family (bytes are weights; no schedule kernels before it)
      with narrow column blocks so every SM gets weight blocks to stream: 32 columns while fewer
      than two rows per group (8 of 128 experts active at one token), 64 from there.
    - small prefill (<= 64): 64-row tiles, so fewer rows are tile padding.
    - prefill: 128x256x64 tiles, 8 warps, 4 stages (128 columns for n < 1024).
    """
    rows = m / max(num_groups, 1)
    if rows <= 16:
        return CANDIDATES["gm16x32" if rows < 2 else "gm16x64"]
    if rows <= 64:
        return CANDIDATES["rt64x128"]
    return CANDIDATES["rt128x256" if n >= 1024 else "rt128x128"]


def tgmm_config(m: int, n: int, k: int, num_groups: int) -> TileConfig:
    """The Pallas kernel's weight-gradient tiles for `dB[num_groups, n, k] = dC[m, n]^T A[m, k]`
    per group (the `triton` backend has its own rule, `moe_jax.ops.gmm.triton.rules`).

    Each program owns a `block_n x block_k` tile of one group's gradient and walks that group's
    rows. Prefill (> 64 rows per group): 128x128 tiles with 32-row steps, 64-row steps from 768
    rows per group; smaller groups get 64x64 tiles (docs/decisions.md).
    """
    rows = m / max(num_groups, 1)
    if rows <= 64:
        return TileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3, group_m=1)
    bm = 64 if rows >= 768 else 32
    return TileConfig(block_m=bm, block_n=128, block_k=128, num_warps=8, num_stages=3, group_m=1)
