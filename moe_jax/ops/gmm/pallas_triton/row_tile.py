"""The row-tile family of the forward grouped GEMM: one program per (row tile, column block).

Legend: M packed rows, K reduction width, N output width, E groups, W worst-case row tiles.

`out[M,N]`: rows of group e are `lhs_e @ rhs[e]^T` (rhs `[E,N,K]`, `transpose_rhs=True`, the
linear-layer "NT" layout) or `lhs_e @ rhs[e]` (rhs `[E,K,N]`, the input gradient, so weights are
never transposed in memory). Every program has about the same work whatever the skew. Tiles of
the zero-fill pseudo-group write the rows past the last group as zeros, so the output needs no
memset.

The tile schedule is computed inside each program from the raw sizes (one vector of E lanes:
a clip, two cumsums and a few masked sums), the same tiles `schedule.make_group_metadata` lists:
no schedule kernels run before the launch, which is most of the time at decode-sized inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_jax.ops.gmm.tiles import TileConfig
from moe_jax.ops.gmm.schedule import lane_sizes, max_tiles
from moe_jax.ops.gmm.pallas_triton.tile import Gate, gate_inputs, gated_kernel, row_block
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


def _tile_rows(sizes_ref, tile, *, m: int, bm: int, num_groups: int):
    """(group, start, end, is_group) of row tile `tile`: tiles of groups 0..E-1 in order, then the
    zero-fill tiles of the rows past the last group; tiles past those have `start == end == M`.
    Sizes are clipped to [0, M] and the running total saturates at M (`clamp_group_sizes`);
    E * M < 2**31 (the launcher's contract), so no sum overflows. Every sum is int32, also under
    `jax_enable_x64` (where an integer sum would be int64 beside int32 row offsets)."""
    idx = jnp.arange(sizes_ref.shape[0], dtype=jnp.int32)
    sizes = jnp.clip(sizes_ref[...], 0, m)
    inclusive = jnp.cumsum(sizes, dtype=jnp.int32)
    ends = jnp.minimum(inclusive, m)
    starts = jnp.minimum(inclusive - sizes, m)
    tiles_E = (ends - starts + bm - 1) // bm
    tile_ends = jnp.cumsum(tiles_E, dtype=jnp.int32)
    group_tiles = jnp.sum(tiles_E, dtype=jnp.int32)
    group = jnp.sum(tile_ends <= tile, dtype=jnp.int32)  # groups wholly before this tile
    is_group = (tile < group_tiles) & (group < num_groups)
    here = idx == group
    first = jnp.sum(jnp.where(here, tile_ends - tiles_E, 0), dtype=jnp.int32)
    g_start = jnp.sum(jnp.where(here, starts, 0), dtype=jnp.int32) + (tile - first) * bm
    g_end = jnp.minimum(g_start + bm, jnp.sum(jnp.where(here, ends, 0), dtype=jnp.int32))
    total = jnp.max(ends)
    f_start = jnp.minimum(total + (tile - group_tiles) * bm, m)
    f_end = jnp.minimum(f_start + bm, m)
    # Selects on int32 values only: a select of two Python literals lowers to i1 in Triton.
    start = jnp.where(is_group, g_start, f_start)
    end = jnp.where(is_group, g_end, f_end)
    return jnp.minimum(group, num_groups - 1), start, end, is_group


def _body(pid, sizes_ref, *refs, num_groups: int, m: int, n: int, k: int, num_tiles: int, tiles: TileConfig,
          transpose_rhs: bool, precision, gather: bool):
    row_ids_ref, lhs_ref, rhs_ref, out_ref = refs if gather else (None, *refs)
    num_n = cdiv(n, tiles.block_n)
    tile, n_blk = _swizzle(pid, num_tiles, num_n, tiles.group_m)
    group, start, end, is_group = _tile_rows(sizes_ref, tile, m=m, bm=tiles.block_m, num_groups=num_groups)
    # Fill tiles run no K steps and store zeros; tiles past them store nothing. An int32
    # product, not a select of literals: scf.for needs one integer type for its bounds.
    row_block(
        lhs_ref, rhs_ref, out_ref, group=group, start=start, end=end,
        n0=pl.multiple_of(n_blk * tiles.block_n, tiles.block_n),
        k_steps=is_group.astype(jnp.int32) * cdiv(k, tiles.block_k),
        n=n, k=k, tiles=tiles, transpose_rhs=transpose_rhs, precision=precision, row_ids_ref=row_ids_ref,
    )


def gmm_row_tile_pallas(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool, tiles: TileConfig, out_dtype,
    precision, interpret: bool, out_init: jax.Array | None = None, gate: Gate | None = None,
    row_ids: jax.Array | None = None,
) -> jax.Array:
    """Launch the row-tile kernel on `group_sizes` `[E]` (unchecked sizes are clamped as
    `schedule.clamp_group_sizes` does).

    Expects validated shapes with `M, N, K > 0`. `out_init`: see `pallas_triton.launch`. `gate`:
    run only when the device-side choice equals its index (`tile.Gate`); then `out_init` is the
    previous launch of the chain. `row_ids`: int32 `[M]`; `lhs` is then `[T, K]` and packed row r
    is read from `lhs[row_ids[r]]` inside the kernel (`tile.row_block`).
    """
    k = lhs.shape[1]
    m = lhs.shape[0] if row_ids is None else row_ids.shape[0]
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    num_tiles = max_tiles(m, num_groups, tiles.block_m)
    body = functools.partial(_body, num_groups=num_groups, m=m, n=n, k=k, num_tiles=num_tiles, tiles=tiles,
                             transpose_rhs=transpose_rhs, precision=precision, gather=row_ids is not None)
    ids = () if row_ids is None else (row_ids.astype(jnp.int32),)
    return launch(
        gated_kernel(body, gate), (lane_sizes(group_sizes, m), *gate_inputs(gate), *ids, lhs, rhs),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(num_tiles * cdiv(n, tiles.block_n),),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, interpret=interpret, name="moe_jax_gmm",
        out_init=out_init,
    )
