"""fp32 references for the grouped-GEMM ops, with the ops' signatures, and of the FP8 recipe.

Legend: M rows, K reduction width, N output width, E groups.

They compute far more than the ops do (every row against every group's weight, a one-hot over
groups, or each row's weights gathered), so they are for tests and moderate shapes only. They
follow the same clamping of `group_sizes` as the kernels (negative sizes are empty; rows past `M`
are ignored), and rows outside every group come out zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.fp8 import BLOCK as FP8_BLOCK
from moe_jax.ops.fp8 import Fp8Rows, Fp8Weights
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
    """fp32 `out[M,N]`: row r of group e is `lhs[r] @ rhs[e]^T` (rhs `[E,N,K]`) or `lhs[r] @ rhs[e]` (rhs `[E,K,N]`).

    Every row against every group's weight, one group at a time, each row keeping its own group's
    product: `E` times the products, but memory `M*N` (a per-row gathered weight would be `M*K*N`)."""
    g_M = row_groups(group_sizes, lhs.shape[0])
    x_MK = lhs.astype(jnp.float32)

    def one_group(out_MN, group):
        e, w = group
        w_KN = w.T if transpose_rhs else w
        return jnp.where((g_M == e)[:, None], jnp.dot(x_MK, w_KN, precision=_HI), out_MN), None

    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    groups = (jnp.arange(rhs.shape[0], dtype=jnp.int32), rhs.astype(jnp.float32))
    return jax.lax.scan(one_group, jnp.zeros((lhs.shape[0], n), jnp.float32), groups)[0]


def tgmm_reference(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """fp32 `out[E,N,K]` with `out[e] = dout_e^T @ lhs_e` over the rows of group e (zero if empty)."""
    num_groups = group_sizes.shape[0]
    g_M = row_groups(group_sizes, lhs.shape[0])
    onehot_ME = (g_M[:, None] == jnp.arange(num_groups)[None, :]).astype(jnp.float32)
    return jnp.einsum(
        "me,mn,mk->enk", onehot_ME, dout.astype(jnp.float32), lhs.astype(jnp.float32), precision=_HI,
    )


def gmm_fp8_reference(lhs: Fp8Rows, rhs: Fp8Weights, group_sizes: jax.Array, *, transpose_rhs: bool = True) -> jax.Array:
    """fp32 `out` of the FP8 recipe (`moe_jax.ops.fp8`): for each 128-wide step of the contraction,
    the e4m3 products summed in fp32, times that step's activation-tile scale and weight-block
    scale, added in fp32. `transpose_rhs=True`: `out[M, N]`, row r of group e is `lhs[r] @ rhs[e]^T`
    (contraction K: the forward); False: `out[M, K] = lhs[r] @ rhs[e]` (contraction N: the input
    gradient, whose `lhs` is quantized per 1 x 128 tile of N; the 128 x 128 weight blocks serve both
    orientations). Rows outside every group are zero."""
    w_ENK, s_ENbKb = rhs.values_ENK, rhs.scale_ENbKb
    num_groups = w_ENK.shape[0]
    m, c = lhs.values_MK.shape
    cb = -(-c // FP8_BLOCK)
    want_c = w_ENK.shape[2] if transpose_rhs else w_ENK.shape[1]
    if c != want_c or lhs.scale_MKb.shape != (m, cb):
        raise ValueError(f"lhs {lhs.values_MK.shape} (scale {lhs.scale_MKb.shape}) does not contract with rhs "
                         f"{w_ENK.shape} (transpose_rhs={transpose_rhs}): expected {want_c} columns and {cb} scales per row.")
    g_M = row_groups(group_sizes, m)
    e_M = jnp.minimum(g_M, num_groups - 1)
    w_MOC = jnp.take(w_ENK, e_M, axis=0).astype(jnp.float32)
    s_MObCb = jnp.take(s_ENbKb, e_M, axis=0)
    if not transpose_rhs:
        w_MOC, s_MObCb = jnp.swapaxes(w_MOC, 1, 2), jnp.swapaxes(s_MObCb, 1, 2)
    o = w_MOC.shape[1]
    pad = cb * FP8_BLOCK - c
    x_MCbB = jnp.pad(lhs.values_MK.astype(jnp.float32), ((0, 0), (0, pad))).reshape(m, cb, FP8_BLOCK)
    w_MOCbB = jnp.pad(w_MOC, ((0, 0), (0, 0), (0, pad))).reshape(m, o, cb, FP8_BLOCK)
    partial_MOCb = jnp.einsum("mcb,mocb->moc", x_MCbB, w_MOCbB, precision=_HI)
    s_MOCb = jnp.repeat(s_MObCb, FP8_BLOCK, axis=1)[:, :o, :]
    out = jnp.sum(partial_MOCb * lhs.scale_MKb[:, None, :] * s_MOCb, axis=2)
    return jnp.where((g_M < num_groups)[:, None], out, 0.0)
