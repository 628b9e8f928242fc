"""The two backends of `gather_rows`: `xla` (`jnp` indexing and a select) and `pallas_triton`
(`kernel.gather_rows_pallas`; problems past its int32 offsets go to the XLA gather).

Both take `(xs, rows_M)`: a non-empty tuple of `[N_i, D]` sources read as their concatenation and
int32 row ids, `M, D > 0`; ids outside `[0, sum N_i)` give zero rows.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_jax.ops.gather.kernel import gather_rows_pallas
from moe_jax.ops.pallas_triton import next_pow2
from moe_jax.ops.platform import interpret, register

BLOCK_ROWS = 8  # rows per program (docs/decisions.md: 4-16 within 5% at prefill sizes)
BLOCK_D = 512  # bf16: one 16-byte access per thread of 2 warps
NUM_WARPS = 2
_INT32_LIMIT = 2**31


@register("gather_rows", "xla")
def xla_gather(xs, rows_M):
    d, dtype = xs[0].shape[1], xs[0].dtype
    xs = tuple(x for x in xs if x.shape[0])  # an empty source shifts no offsets (and cannot be indexed)
    if not xs:
        return jnp.zeros((rows_M.shape[0], d), dtype)
    x_ND = xs[0] if len(xs) == 1 else jnp.concatenate(xs)
    ok_M = (rows_M >= 0) & (rows_M < x_ND.shape[0])
    return jnp.where(ok_M[:, None], x_ND[jnp.where(ok_M, rows_M, 0)], jnp.zeros((), x_ND.dtype))


@register("gather_rows", "pallas_triton")
def pallas_gather(xs, rows_M):
    d, dtype = xs[0].shape[1], xs[0].dtype
    xs = tuple(x for x in xs if x.shape[0])  # an empty source shifts no offsets
    if not xs:
        return jnp.zeros((rows_M.shape[0], d), dtype)
    if max(rows_M.shape[0], *(x.shape[0] for x in xs)) * d >= _INT32_LIMIT:
        return xla_gather(xs, rows_M)
    return gather_rows_pallas(xs, rows_M, block_rows=BLOCK_ROWS, block_d=min(BLOCK_D, next_pow2(d)),
                              num_warps=NUM_WARPS, interpret=interpret())
