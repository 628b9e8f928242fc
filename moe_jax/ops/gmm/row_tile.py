"""The row-tile family of the forward grouped GEMM: one program per (row tile, column block).

Legend: M packed rows, K reduction width, N output width, E groups, W worst-case row tiles.

`out[M,N]`: rows of group e are `lhs_e @ rhs[e]^T` (rhs `[E,N,K]`, `transpose_rhs=True`, the
linear-layer "NT" layout) or `lhs_e @ rhs[e]` (rhs `[E,K,N]`, the input gradient, so weights are
never transposed in memory). The tile schedule (`schedule.make_group_metadata`) is built on the
device; every program has about the same work whatever the skew. Tiles of the zero-fill
pseudo-group write the rows past the last group as zeros, so the output needs no memset.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_jax.ops.gmm.config import TileConfig
from moe_jax.ops.gmm.schedule import GroupMetadata
from moe_jax.ops.gmm.tile import row_block
from moe_jax.ops.pallas_triton import cdiv, launch

__all__ = ["gmm_row_tile_pallas"]


def _swizzle(pid, num_tiles: int, num_n: int, group_m: int):
    """Map a 1-D program id to (row tile, column block), `group_m` row tiles per column sweep.

    Consecutive programs cover `group_m` row tiles (usually one expert's rows) for column block 0,
    then block 1, ...: the expert's weight block and its rows stay in L2 across the sweep.
    """
    per_group = group_m * num_n
    group = pid // per_group
    first = group * group_m
    size = jnp.minimum(num_tiles - first, group_m)
    local = pid % per_group
    return first + local % size, local // size


def _kernel(tile_group_ref, tile_start_ref, tile_end_ref, lhs_ref, rhs_ref, out_ref, *, num_groups: int, n: int,
            k: int, num_tiles: int, tiles: TileConfig, transpose_rhs: bool, precision):
    num_n = cdiv(n, tiles.block_n)
    tile, n_blk = _swizzle(pl.program_id(0), num_tiles, num_n, tiles.group_m)
    group = tile_group_ref[tile]
    start = tile_start_ref[tile]
    end = tile_end_ref[tile]
    # Zero-fill tiles (group == E) and unused tiles run no K steps and store zeros / nothing.
    # An int32 product, not a select of literals: scf.for needs one integer type for its bounds.
    has_work = (group < num_groups) & (end > start)
    row_block(
        lhs_ref, rhs_ref, out_ref, group=jnp.minimum(group, num_groups - 1), start=start, end=end,
        n0=pl.multiple_of(n_blk * tiles.block_n, tiles.block_n),
        k_steps=has_work.astype(jnp.int32) * cdiv(k, tiles.block_k),
        n=n, k=k, tiles=tiles, transpose_rhs=transpose_rhs, precision=precision,
    )


def gmm_row_tile_pallas(
    lhs: jax.Array, rhs: jax.Array, meta: GroupMetadata, *, transpose_rhs: bool, tiles: TileConfig, out_dtype,
    precision, interpret: bool, out_init: jax.Array | None = None,
) -> jax.Array:
    """Launch the row-tile kernel. `meta` must come from `make_group_metadata(..., block_m=tiles.block_m)`.

    Expects validated shapes with `M, N, K > 0`. `out_init` (tests): see `pallas_triton.launch`.
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    num_tiles = meta.tile_group_W.shape[0]
    kernel = functools.partial(_kernel, num_groups=num_groups, n=n, k=k, num_tiles=num_tiles, tiles=tiles,
                               transpose_rhs=transpose_rhs, precision=precision)
    return launch(
        kernel, (meta.tile_group_W, meta.tile_start_W, meta.tile_end_W, lhs, rhs),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(num_tiles * cdiv(n, tiles.block_n),),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, interpret=interpret, name="moe_jax_gmm",
        out_init=out_init,
    )
