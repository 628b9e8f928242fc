"""The `triton` backend's tile rules, from the shapes alone (it has no on-device selector).

Legend: M packed rows, K reduction width, N output width, E groups.
"""

from __future__ import annotations

from moe_jax.ops.gmm.tiles import TileConfig

__all__ = ["fp8_gmm_tiles", "gmm_tiles", "tgmm_tiles"]


def gmm_tiles(m: int, n: int, k: int, num_groups: int) -> TileConfig:
    """Forward and input-gradient tiles for `lhs[m, k] x rhs[num_groups, n, k]`: the Pallas
    backend's static row-tile tiles at the same mean rows per group (its sweeps on an H200,
    docs/decisions.md), and at decode sizes (<= 16 rows per group, where that table runs the
    group-major family, which has no Triton kernel) 16-row tiles with 64 columns and a 256-wide K
    step."""
    rows = m / max(num_groups, 1)
    if rows <= 16:
        return TileConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3, group_m=1)
    if rows <= 64:
        return TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, group_m=8)
    return TileConfig(block_m=128, block_n=256 if n >= 1024 else 128, block_k=64, num_warps=8, num_stages=4, group_m=8)


def tgmm_tiles(m: int, n: int, k: int, num_groups: int) -> TileConfig:
    """Weight-gradient tiles for `dB[num_groups, n, k] = dC[m, n]^T A[m, k]`.

    Tuned on the official Triton kernel separately from the Pallas kernel's rule: with few rows per
    group each program's row loop is short, and 4 warps with 32-row steps and a 4-deep pipeline
    beat 8 warps there; from 768 rows per group, 64-row steps over 128 x 256 blocks (H200 sweep,
    docs/decisions.md).
    """
    rows = m / max(num_groups, 1)
    if rows >= 768:
        return TileConfig(block_m=64, block_n=128, block_k=256, num_warps=8, num_stages=3, group_m=1)
    return TileConfig(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4, group_m=1)


def fp8_gmm_tiles(m: int, n: int, k: int, num_groups: int) -> TileConfig:
    """Tiles of the FP8 kernel (`fp8_gmm_kernel`) for `lhs[m, k] x rhs[num_groups, n, k]`: K steps
    of one 128-wide scale block. Beyond decode sizes, 64 x 128 output tiles on one warpgroup with a
    4-deep pipeline: each step waits for its tensor-core sum before promoting it, so the SM's
    overlap comes from two such programs resident at once (their registers and shared memory fit
    twice); 128 x 128 on two warpgroups fits once and measured equal or slower, 128 x 256 spills
    the promotion's second fp32 tile (H200 sweep: docs/fp8.md)."""
    rows = m / max(num_groups, 1)
    if rows <= 16:
        return TileConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, group_m=1)
    return TileConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4, group_m=8)
