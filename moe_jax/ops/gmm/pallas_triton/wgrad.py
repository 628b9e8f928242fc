"""The weight-gradient kernel of the grouped GEMM: `out[e] = dout_e^T @ lhs_e`, `[E, N, K]`.

Legend: M packed rows, K input width, N output width, E groups.

One program per (group, `block_n x block_k` tile of its gradient) walks the group's rows
`block_m` at a time, accumulating in fp32; an empty group runs no steps and stores exact zeros.
Every output element has one writer, so the result is the same bits on every run. With row ids
the `lhs` rows are read through them (the fused row gather of `gmm(row_ids=)`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.gmm.tiles import TileConfig
from moe_jax.ops.pallas_triton import cdiv, launch, masked_load, outer_and

__all__ = ["tgmm_pallas"]


def _kernel(offsets_ref, *refs, n: int, k: int, tiles: TileConfig, precision, gather: bool):
    row_ids_ref, lhs_ref, dout_ref, out_ref = refs if gather else (None, *refs)
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    num_n, num_k = cdiv(n, bn), cdiv(k, bk)
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
        d = masked_load(dout_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], outer_and(rows_ok, cols_n_ok if n % bn else None,
                                                                             (bm, bn)))
        k_ok = cols_k_ok if k % bk else None
        if row_ids_ref is None:
            a = masked_load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], outer_and(rows_ok, k_ok, (bm, bk)))
        else:  # the rows read through their ids, as `tile.row_block` does
            ids = masked_load(row_ids_ref.at[pl.ds(r0, bm)], rows_ok)
            reads_ok = rows_ok & (ids >= 0) & (ids < lhs_ref.shape[0])
            src = jnp.where(reads_ok, ids, 0)
            cols = k0 + jnp.arange(bk, dtype=jnp.int32)
            a = masked_load(lhs_ref.at[src[:, None], cols[None, :]], outer_and(reads_ok, k_ok, (bm, bk)))
        return acc + plgpu.dot(d, a, trans_a=True, precision=precision)

    acc = lax.fori_loop(jnp.int32(0), cdiv(end - start, bm), m_step, jnp.zeros((bn, bk), jnp.float32))
    plgpu.store(
        out_ref.at[group, pl.ds(n0, bn), pl.ds(k0, bk)],
        acc.astype(out_ref.dtype),
        mask=cols_n_ok[:, None] & cols_k_ok[None, :],
    )


def tgmm_pallas(
    lhs: jax.Array, dout: jax.Array, group_offsets_E1: jax.Array, *, tiles: TileConfig, out_dtype, precision,
    interpret: bool, out_init: jax.Array | None = None, row_ids: jax.Array | None = None,
) -> jax.Array:
    """Launch the weight-gradient kernel. `group_offsets_E1` from `schedule.clamp_group_sizes`.
    Expects validated shapes with `N, K > 0`. `row_ids`: int32 `[M]`; `lhs` is then `[T, K]` and
    row r of the groups is read from `lhs[row_ids[r]]` (ids outside `[0, T)` read zeros)."""
    k = lhs.shape[1]
    n = dout.shape[1]
    num_groups = group_offsets_E1.shape[0] - 1
    kernel = functools.partial(_kernel, n=n, k=k, tiles=tiles, precision=precision, gather=row_ids is not None)
    ids = () if row_ids is None else (row_ids.astype(jnp.int32),)
    return launch(
        kernel, (group_offsets_E1, *ids, lhs, dout),
        out_shape=jax.ShapeDtypeStruct((num_groups, n, k), out_dtype),
        grid=(num_groups * cdiv(n, tiles.block_n) * cdiv(k, tiles.block_k),), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, interpret=interpret, name="moe_jax_tgmm", out_init=out_init,
    )
