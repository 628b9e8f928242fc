"""The in-kernel body both forward families share: one block of output rows of one group.

Legend: M packed rows, K reduction width, N output width.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.gmm.config import TileConfig
from moe_jax.ops.pallas_triton import masked_load, outer_and

__all__ = ["row_block"]


def row_block(lhs_ref, rhs_ref, out_ref, *, group, start, end, n0, k_steps, n: int, k: int,
              tiles: TileConfig, transpose_rhs: bool, precision, k_first=0, plane=None):
    """`out[start:end, n0:n0+bn] = lhs[start:end] @ rhs[group]^T` (or `rhs[group]`) over `k_steps`
    K blocks from block `k_first` on, accumulated in fp32; with `k_steps == 0` the rows are
    written as zeros. `end - start <= block_m`; rows at and past `end` are neither read nor
    written. With `plane`, `out_ref` is `[planes, M, N]` and the block goes to `out[plane]`."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    rows_ok = (start + jnp.arange(bm, dtype=jnp.int32)) < end
    cols_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < n

    def k_step(i, acc):
        k0 = pl.multiple_of((k_first + i) * bk, bk)
        # Edge masks only where the shape leaves a partial block: a mask-free load vectorizes.
        k_ok = ((k0 + jnp.arange(bk, dtype=jnp.int32)) < k) if k % bk else None
        n_ok = cols_ok if n % bn else None
        a = masked_load(lhs_ref.at[pl.ds(start, bm), pl.ds(k0, bk)], outer_and(rows_ok, k_ok, (bm, bk)))
        if transpose_rhs:
            b = masked_load(rhs_ref.at[group, pl.ds(n0, bn), pl.ds(k0, bk)], outer_and(n_ok, k_ok, (bn, bk)))
            return acc + plgpu.dot(a, b, trans_b=True, precision=precision)
        b = masked_load(rhs_ref.at[group, pl.ds(k0, bk), pl.ds(n0, bn)], outer_and(k_ok, n_ok, (bk, bn)))
        return acc + plgpu.dot(a, b, precision=precision)

    acc = lax.fori_loop(0, k_steps, k_step, jnp.zeros((bm, bn), jnp.float32))
    rows, cols = pl.ds(start, bm), pl.ds(n0, bn)
    plgpu.store(
        out_ref.at[rows, cols] if plane is None else out_ref.at[plane, rows, cols],
        acc.astype(out_ref.dtype),
        mask=rows_ok[:, None] & cols_ok[None, :],
    )
