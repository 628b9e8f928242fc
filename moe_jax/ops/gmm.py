"""Pallas (Triton backend) grouped-GEMM kernels and the wrappers that launch them.

Legend: M packed rows, K reduction width, N output width, E groups, W worst-case row tiles.

- `gmm`: `out[M,N]`, rows of group e are `lhs_e @ rhs[e]^T` (rhs `[E,N,K]`, `transpose_rhs=True`,
  the seed's NT layout) or `lhs_e @ rhs[e]` (rhs `[E,K,N]`, used for the input gradient so the
  weights are never transposed in memory).
- `tgmm`: `out[E,N,K]`, `out[e] = dout_e^T @ lhs_e`, the weight gradient.

Kernels take refs only; wrappers own grids and compiler parameters. Accumulation is fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.config import TileConfig
from moe_jax.ops.metadata import GroupMetadata


def _cdiv(a, b):
    return (a + b - 1) // b


def _outer_and(row_ok, col_ok, shape):
    """Block mask of `shape` from optional row and column masks (None: that edge needs no mask)."""
    if row_ok is None and col_ok is None:
        return None
    rows = jnp.ones((shape[0],), jnp.bool_) if row_ok is None else row_ok
    cols = jnp.ones((shape[1],), jnp.bool_) if col_ok is None else col_ok
    return rows[:, None] & cols[None, :]


def _load(ref, mask):
    """Masked load with zeros where `mask` is False; a plain load when no mask is needed."""
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=0.0)


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


def _gmm_kernel(
    tile_group_ref, tile_start_ref, tile_end_ref, lhs_ref, rhs_ref, out_ref,
    *, num_groups: int, n: int, k: int, num_tiles: int, config: TileConfig,
    transpose_rhs: bool, precision,
):
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    num_n = _cdiv(n, bn)
    tile, n_blk = _swizzle(pl.program_id(0), num_tiles, num_n, config.group_m)
    group = tile_group_ref[tile]
    start = tile_start_ref[tile]
    end = tile_end_ref[tile]
    n0 = pl.multiple_of(n_blk * bn, bn)

    rows_ok = (start + jnp.arange(bm, dtype=jnp.int32)) < end
    cols_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < n
    # Zero-fill tiles (group == E) and unused tiles run no K steps and store zeros / nothing.
    has_work = (group < num_groups) & (end > start)
    # An int32 product, not a select of literals: scf.for needs one integer type for its bounds.
    k_steps = has_work.astype(jnp.int32) * _cdiv(k, bk)
    g = jnp.minimum(group, num_groups - 1)

    def k_step(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        # Edge masks only where the shape leaves a partial block: a mask-free load vectorizes.
        k_ok = ((k0 + jnp.arange(bk, dtype=jnp.int32)) < k) if k % bk else None
        n_ok = cols_ok if n % bn else None
        a = _load(lhs_ref.at[pl.ds(start, bm), pl.ds(k0, bk)], _outer_and(rows_ok, k_ok, (bm, bk)))
        if transpose_rhs:
            b = _load(rhs_ref.at[g, pl.ds(n0, bn), pl.ds(k0, bk)], _outer_and(n_ok, k_ok, (bn, bk)))
            return acc + plgpu.dot(a, b, trans_b=True, precision=precision)
        b = _load(rhs_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)], _outer_and(k_ok, n_ok, (bk, bn)))
        return acc + plgpu.dot(a, b, precision=precision)

    acc = lax.fori_loop(0, k_steps, k_step, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(
        out_ref.at[pl.ds(start, bm), pl.ds(n0, bn)],
        acc.astype(out_ref.dtype),
        mask=rows_ok[:, None] & cols_ok[None, :],
    )


def gmm_pallas(
    lhs: jax.Array, rhs: jax.Array, meta: GroupMetadata, *, transpose_rhs: bool,
    config: TileConfig, out_dtype, precision, interpret: bool,
) -> jax.Array:
    """Launch the forward kernel. `meta` must come from `make_group_metadata(..., block_m=config.block_m)`.

    Expects validated shapes (see `moe_jax.ops.grouped_linear.gmm`); `M, N, K > 0`.
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    num_tiles = meta.tile_group_W.shape[0]
    grid = (num_tiles * _cdiv(n, config.block_n),)
    kernel = functools.partial(
        _gmm_kernel, num_groups=num_groups, n=n, k=k, num_tiles=num_tiles, config=config,
        transpose_rhs=transpose_rhs, precision=precision,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="moe_jax_gmm",
    )(meta.tile_group_W, meta.tile_start_W, meta.tile_end_W, lhs, rhs)


def _tgmm_kernel(
    offsets_ref, lhs_ref, dout_ref, out_ref, *, n: int, k: int, config: TileConfig, precision,
):
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    num_n, num_k = _cdiv(n, bn), _cdiv(k, bk)
    pid = pl.program_id(0)
    group = pid // (num_n * num_k)
    rest = pid % (num_n * num_k)
    n0 = pl.multiple_of((rest // num_k) * bn, bn)
    k0 = pl.multiple_of((rest % num_k) * bk, bk)
    start = offsets_ref[group]
    end = offsets_ref[group + 1]
    cols_n_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < n
    cols_k_ok = (k0 + jnp.arange(bk, dtype=jnp.int32)) < k

    def m_step(i, acc):
        r0 = start + i * bm
        rows_ok = (r0 + jnp.arange(bm, dtype=jnp.int32)) < end
        d = _load(dout_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], _outer_and(rows_ok, cols_n_ok if n % bn else None, (bm, bn)))
        a = _load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], _outer_and(rows_ok, cols_k_ok if k % bk else None, (bm, bk)))
        return acc + plgpu.dot(d, a, trans_a=True, precision=precision)

    # An empty group runs no steps and stores exact zeros.
    acc = lax.fori_loop(0, _cdiv(end - start, bm), m_step, jnp.zeros((bn, bk), jnp.float32))
    plgpu.store(
        out_ref.at[group, pl.ds(n0, bn), pl.ds(k0, bk)],
        acc.astype(out_ref.dtype),
        mask=cols_n_ok[:, None] & cols_k_ok[None, :],
    )


def tgmm_pallas(
    lhs: jax.Array, dout: jax.Array, group_offsets_E1: jax.Array, *, config: TileConfig,
    out_dtype, precision, interpret: bool,
) -> jax.Array:
    """Launch the weight-gradient kernel: `out[e] = dout_e^T @ lhs_e`, `[E, N, K]`.

    `group_offsets_E1` from `clamp_group_sizes`. Expects validated shapes; `N, K > 0`.
    """
    k = lhs.shape[1]
    n = dout.shape[1]
    num_groups = group_offsets_E1.shape[0] - 1
    grid = (num_groups * _cdiv(n, config.block_n) * _cdiv(k, config.block_k),)
    kernel = functools.partial(_tgmm_kernel, n=n, k=k, config=config, precision=precision)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, n, k), out_dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="moe_jax_tgmm",
    )(group_offsets_E1, lhs, dout)
