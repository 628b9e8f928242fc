"""The row-gather kernel (`pallas_triton` backend of `gather_rows`): `out[i] = concat(xs)[rows[i]]`.

Legend: N source rows, M output rows, D width.

One program per (`block_rows` rows, `block_d` columns); each row is one contiguous vector load
and store. Rows whose id is outside `[0, sum N_i)` are written as zeros. The sources are never
concatenated in memory: there is one launch per source, in order, each writing its own rows into
the previous launch's output (aliased; the first also writes the zero rows). A launch depends
only on its own source, so XLA can run the first while a later source is still arriving (EP's
regroup reads this rank's tokens and the peer block that a `ppermute` delivers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.pallas_triton import cdiv, launch

__all__ = ["gather_rows_pallas"]


def _kernel(rows_ref, x_ref, out_ref, *, m: int, start: int, size: int, total: int, zeros: bool, d: int,
            block_rows: int, block_d: int):
    """One source's share: rows whose id falls in `[start, start + size)` are copied; with `zeros`,
    rows whose id is outside `[0, total)` are written as zeros; every other row is left as the
    (aliased) output buffer holds it."""
    c0 = pl.multiple_of(pl.program_id(1) * block_d, block_d)
    cols_ok = ((c0 + jnp.arange(block_d, dtype=jnp.int32)) < d) if d % block_d else None
    every_row = zeros and start == 0 and size == total  # a single source: no store mask
    # Unrolled, branch-free rows: every load can issue before the stores. Rows past `m` (last
    # program only) redo row m-1, writing the same values twice, instead of branching.
    for r in range(block_rows):
        i = jnp.minimum(pl.program_id(0) * block_rows + r, m - 1)
        row = rows_ref[i]
        local = row - start
        mine = (local >= 0) & (local < size)
        load_ok = jnp.full((block_d,), mine) if cols_ok is None else cols_ok & mine
        v = plgpu.load(x_ref.at[jnp.where(mine, local, 0), pl.ds(c0, block_d)], mask=load_ok,
                       other=jnp.zeros((), x_ref.dtype))
        if every_row:
            plgpu.store(out_ref.at[i, pl.ds(c0, block_d)], v, mask=cols_ok)
            continue
        store = (mine | ((row < 0) | (row >= total))) if zeros else mine
        store_ok = jnp.full((block_d,), store) if cols_ok is None else cols_ok & store
        plgpu.store(out_ref.at[i, pl.ds(c0, block_d)], v, mask=store_ok)


def gather_rows_pallas(
    xs: tuple[jax.Array, ...], rows: jax.Array, *, block_rows: int, block_d: int, num_warps: int, interpret: bool,
    out_init: jax.Array | None = None,
) -> jax.Array:
    """Launch the gather: `[M, D]` from the non-empty sources `xs` (`[N_i, D]`, one dtype) and
    int32 `rows` (`[M]`, M > 0, D > 0). Row offsets are int32 inside the kernel: `N_i * D` and
    `M * D` must stay below 2**31 (`backends.pallas_gather` sends larger problems to XLA)."""
    if not xs or any(x.shape[0] == 0 for x in xs):
        raise ValueError(f"gather_rows_pallas needs non-empty sources (drop empty ones first); got row counts "
                         f"{[x.shape[0] for x in xs]}.")
    d = xs[0].shape[1]
    m = rows.shape[0]
    total = sum(x.shape[0] for x in xs)
    out, start = out_init, 0
    for s, x in enumerate(xs):
        kernel = functools.partial(_kernel, m=m, start=start, size=x.shape[0], total=total, zeros=s == 0, d=d,
                                   block_rows=block_rows, block_d=block_d)
        out = launch(
            kernel, (rows, x), out_shape=jax.ShapeDtypeStruct((m, d), x.dtype),
            grid=(cdiv(m, block_rows), cdiv(d, block_d)), num_warps=num_warps, num_stages=1,
            interpret=interpret, name="moe_jax_gather_rows", out_init=out,
        )
        start += x.shape[0]
    return out
