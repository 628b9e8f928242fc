"""fp32 references for the grouped-GEMM ops, with the ops' signatures.

Legend: M rows, K reduction width, N output width, E groups.

Both gather each row's group weight explicitly (memory `M*N*K`), so they are for tests and small
shapes only. They follow the same clamping of `group_sizes` as the kernels (negative sizes are
empty; rows past `M` are ignored), and rows outside every group come out zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.gmm.schedule import clamp_group_sizes

_HI = jax.lax.Precision.HIGHEST


def row_groups(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """`[M]` int32 group of each row; `E` for rows past the last group."""
    offsets = clamp_group_sizes(group_sizes, num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.sum(offsets[None, 1:] <= rows[:, None], axis=1, dtype=jnp.int32)


def gmm_reference(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = True,
) -> jax.Array:
    """fp32 `out[M,N]`: row r of group e is `lhs[r] @ rhs[e]^T` (rhs `[E,N,K]`) or `lhs[r] @ rhs[e]` (rhs `[E,K,N]`)."""
    num_groups = rhs.shape[0]
    g_M = row_groups(group_sizes, lhs.shape[0])
    w_EKN = rhs.astype(jnp.float32)
    if transpose_rhs:
        w_EKN = jnp.swapaxes(w_EKN, 1, 2)
    w_MKN = jnp.take(w_EKN, jnp.minimum(g_M, num_groups - 1), axis=0)
    out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), w_MKN, precision=_HI)
    return jnp.where((g_M < num_groups)[:, None], out, 0.0)


def tgmm_reference(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """fp32 `out[E,N,K]` with `out[e] = dout_e^T @ lhs_e` over the rows of group e (zero if empty)."""
    num_groups = group_sizes.shape[0]
    g_M = row_groups(group_sizes, lhs.shape[0])
    onehot_ME = (g_M[:, None] == jnp.arange(num_groups)[None, :]).astype(jnp.float32)
    return jnp.einsum(
        "me,mn,mk->enk", onehot_ME, dout.astype(jnp.float32), lhs.astype(jnp.float32), precision=_HI,
    )
