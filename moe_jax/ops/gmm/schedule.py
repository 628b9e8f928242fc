"""The row-tile schedule of a grouped GEMM, built on the device from `group_sizes`.

Legend: M rows of the packed operand, E groups (experts), W static worst-case tile count.

Rows of the packed operand are grouped contiguously: group e owns rows
`[offsets[e], offsets[e+1])`. A *tile* is up to `block_m` consecutive rows of one group, counted
from the group's first row (a contiguous schedule, as in MegaBlocks' block-sparse grouped GEMM,
Gale et al. 2023), so padding per group is `block_m * ceil(M_e / block_m) - M_e`, the figure
`moe_jax.padding` reports. Rows past the last
group, `[offsets[E], M)`, form a pseudo-group E whose tiles only write zeros, so the output needs
no separate memset.

Everything here is `jnp` on traced values: no host round trip, no data-dependent shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.ops.pallas_triton import next_pow2

__all__ = ["GroupMetadata", "clamp_group_sizes", "executed_at", "lane_sizes", "make_group_metadata", "max_tiles"]


class GroupMetadata(NamedTuple):
    """Tile schedule for `M` rows in `E` groups with tiles of `block_m` rows.

    Fields (all int32, on device):
      group_offsets_E1: `[E+1]`, exclusive prefix sum of the group sizes after clamping each to
        >= 0 and the running total to <= M. `group_offsets_E1[E]` is the number of grouped rows.
      tile_group_W: `[W]`, the group of each tile, in `[0, E]`; E marks a zero-fill tile.
      tile_start_W: `[W]`, first row of each tile.
      tile_end_W: `[W]`, one past its last row.
      num_tiles: `[]`, tiles in use.

    Invariants: tiles `[0, num_tiles)` are ordered by group then row and partition `[0, M)`;
    `start <= end <= min(start + block_m, M)`; a group's tiles all start at
    `offsets[g] + j * block_m`; tiles `>= num_tiles` have `start == end == M` and group E.
    """

    group_offsets_E1: jax.Array
    tile_group_W: jax.Array
    tile_start_W: jax.Array
    tile_end_W: jax.Array
    num_tiles: jax.Array


def max_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound W on the tiles for any `group_sizes` with `sum <= num_rows`.

    With the zero-fill pseudo-group there are `E + 1` groups; if `k` of them are non-empty the
    tile count is at most `k + (M - k) // block_m` (each non-empty group costs one tile for its
    first row plus `floor` of the rest, and floors are superadditive). That grows with `k`, and
    `k <= min(E + 1, M)`.
    """
    if num_rows <= 0:
        return 0
    k = min(num_groups + 1, num_rows)
    return k + (num_rows - k) // block_m


def clamp_group_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Exclusive offsets `[E+1]` of `group_sizes` clamped to `>= 0` each and `<= num_rows` in total.

    No intermediate overflows int32, whatever the sizes (a plain cumsum of sizes near 2**31 wraps
    negative): each size is clipped to `[0, num_rows]` before the cast, and the running total
    saturates at `num_rows` through the associative step `(a, b) -> b + min(a, num_rows - b)`,
    which equals `min(a + b, num_rows)` for `a, b` in `[0, num_rows]` and never exceeds it.
    """
    sizes = jnp.clip(group_sizes, 0, num_rows).astype(jnp.int32)
    ends = jax.lax.associative_scan(lambda a, b: b + jnp.minimum(a, num_rows - b), sizes)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends.astype(jnp.int32)])


def lane_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """`group_sizes` `[E]` as the int32 vector the in-kernel schedules load whole: each size clipped
    to `[0, num_rows]` in its own dtype before the cast (so an unsigned size past 2**31 stays a
    large size, as `clamp_group_sizes` reads it, instead of wrapping negative), zero-padded
    (empty groups) to a power of two >= 16 lanes. The kernels sum the clipped sizes in int32 and
    saturate the total at M, exact while E * M < 2**31; beyond, the exact clamp runs first. At
    decode nothing at all runs before the kernel."""
    num_groups = group_sizes.shape[0]
    if num_groups * num_rows >= 2**31:
        offsets = clamp_group_sizes(group_sizes, num_rows)
        sizes_E = offsets[1:] - offsets[:-1]
    else:
        sizes_E = jnp.clip(group_sizes, 0, num_rows).astype(jnp.int32)
    lanes = max(16, next_pow2(num_groups))
    return sizes_E if lanes == num_groups else jnp.pad(sizes_E, (0, lanes - num_groups))


def executed_at(group_sizes: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """Rows a kernel with `block_m`-row tiles laid from each group's first row multiplies:
    `sum_e ceil(t_e / block_m) * block_m` over the clamped sizes `t_e` (int32, traced)."""
    offsets = clamp_group_sizes(group_sizes, num_rows)
    t = offsets[1:] - offsets[:-1]
    return jnp.sum(-(-t // block_m) * block_m, dtype=jnp.int32)


def make_group_metadata(group_sizes: jax.Array, *, num_rows: int, block_m: int) -> GroupMetadata:
    """Build the tile schedule for `group_sizes[E]` over `num_rows` rows, on device.

    Negative sizes count as zero and rows past `num_rows` are ignored (see `clamp_group_sizes`),
    so even unchecked, traced `group_sizes` never make a kernel touch memory outside the operands.
    """
    num_groups = group_sizes.shape[0]
    offsets = clamp_group_sizes(group_sizes, num_rows)
    w = max_tiles(num_rows, num_groups, block_m)
    # Groups 0..E-1 plus the zero-fill pseudo-group E.
    starts_G = offsets  # [E+1]
    sizes_G = jnp.concatenate([offsets[1:] - offsets[:-1], jnp.array([num_rows], jnp.int32) - offsets[-1:]])
    tiles_G = (sizes_G + (block_m - 1)) // block_m
    tile_ends_G = jnp.cumsum(tiles_G).astype(jnp.int32)
    num_tiles = tile_ends_G[-1]

    t_W = jnp.arange(w, dtype=jnp.int32)
    # Group of tile t = number of groups whose tiles all end at or before t. A dense comparison
    # (W x (E+1)) is one fused kernel on GPU, unlike a sequential binary search.
    g_W = jnp.sum(tile_ends_G[None, :] <= t_W[:, None], axis=1, dtype=jnp.int32)
    g_W = jnp.minimum(g_W, num_groups)
    first_tile_W = tile_ends_G[g_W] - tiles_G[g_W]
    start_W = starts_G[g_W] + (t_W - first_tile_W) * block_m
    end_W = jnp.minimum(start_W + block_m, starts_G[g_W] + sizes_G[g_W])
    in_use = t_W < num_tiles
    return GroupMetadata(
        group_offsets_E1=offsets,
        tile_group_W=jnp.where(in_use, g_W, num_groups).astype(jnp.int32),
        tile_start_W=jnp.where(in_use, start_W, num_rows).astype(jnp.int32),
        tile_end_W=jnp.where(in_use, end_W, num_rows).astype(jnp.int32),
        num_tiles=num_tiles,
    )
