"""Pack token rows by expert for the grouped GEMM, and combine expert outputs back into tokens.

Legend (shape suffixes): T tokens, D row width, K experts per token (top-k), R = T*K routes
(route r = t*K + k is token t's k-th choice), E experts.

`pack` orders the R routes by expert (stably, so within an expert routes keep token order; by
dense counts, `stable_rank`, not a sort), which gives the grouped-GEMM layout: expert 0's rows,
then expert 1's, ... with `group_sizes_E` rows each (docs/architecture.md, "The routed stage").
Routes of masked tokens (and routes with an expert id outside `[0, E)`) are not counted in any
group and sort past `sum(group_sizes_E)`: the grouped GEMM skips them and `pack_rows` zeroes them.
`pack_rows` gathers the token rows into that layout; `combine` is the reverse: every route reads
its packed row through the inverse permutation and the K rows of a token are summed with the
routing weights in float32; its backward works in the packed order (each packed row reads its
token's cotangent through `order_R`), so both directions are gathers.

Everything is `jnp` (the row gather is `moe_jax.ops.gather_rows`) with static shapes (R rows
whatever the routing), traceable under `jit`, and differentiable in the float arrays: `pack_rows`'
backward sums each token's K packed-row cotangents in float32 (a gather through `inverse_R`, no
atomics, the same bits every run), `combine`'s backward gathers each packed row's token cotangent
(no scatter); gradients reach `x_TD`, `y_RD` and `weights_TK`; the integer `Packing` is not
differentiated.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax import ops
from moe_jax.ops.fp8 import exact_float32
from moe_jax.ops.platform import BackendName
from moe_jax.validation import check_int

__all__ = ["Packing", "pack", "pack_rows", "packed_row_source", "gather_rows", "combine", "stable_rank", "exclusive_cumsum", "check_mask"]

_RANK_BLOCK = 256


class Packing(NamedTuple):
    """Where each route sits in the packed, expert-grouped layout (all int32).

    order_R: packed row i holds route `order_R[i]` (stable sort by expert; unpacked routes last).
    token_R: token of packed row i (`order_R // K`).
    inverse_R: packed row of route r (`order_R[inverse_R[r]] == r`).
    group_sizes_E: rows per expert. Masked tokens' routes are not counted and sit past
      `sum(group_sizes_E)`.
    """

    order_R: jax.Array
    token_R: jax.Array
    inverse_R: jax.Array
    group_sizes_E: jax.Array


def check_mask(mask_T, num_tokens: int, fn: str) -> jax.Array | None:
    """None, or `mask_T` checked to be bool `[T]`; ValueError (naming `fn`) for any other shape,
    TypeError for any other dtype (a mask is never cast: 0.5 or 2 would silently mean True)."""
    if mask_T is None:
        return None
    mask_T = jnp.asarray(mask_T)
    if mask_T.shape != (num_tokens,):
        raise ValueError(
            f"{fn}: mask_T must be bool [T] = ({num_tokens},) (True = real token); got shape "
            f"{tuple(mask_T.shape)}. Flatten a [B, S] mask with mask.reshape(-1)."
        )
    if mask_T.dtype != jnp.bool_:
        raise TypeError(f"{fn}: mask_T must be a bool array (True = real token); got dtype {mask_T.dtype}. Pass "
                        "mask_T.astype(bool) if nonzero means real.")
    return mask_T


def exclusive_cumsum(a, axis: int = 0):
    """`cumsum(a) - a` along `axis`: the start of each segment of sizes `a`."""
    return jnp.cumsum(a, axis=axis) - a


def stable_rank(key_R: jax.Array, num_keys: int) -> tuple[jax.Array, jax.Array]:
    """`(rank_R, counts_K)`: `rank_R[r]` = #{r' < r : key_R[r'] == key_R[r]} for keys in
    `[0, num_keys)` (other keys get unspecified ranks), what a stable sort by key would tell, from
    dense counts instead; `counts_K` int32, routes per key (keys outside `[0, num_keys)` are not
    counted), the histogram the ranks are built from, so callers need no scatter of their own.

    Routes form blocks of B: within a block, a `[B, B]` comparison counts the earlier equal keys;
    across blocks, an exclusive running sum of the `[blocks, num_keys]` block histograms. Both are
    single fused reductions (`R * B` and `R * num_keys` compares) where XLA's sort is a chain of
    kernels (docs/decisions.md, "dense counts instead of sorts").
    """
    routes = key_R.shape[0]
    block = max(1, min(_RANK_BLOCK, routes))
    blocks = -(-routes // block)
    # Padding keys sit after every real route, so they never count as "earlier".
    key_NB = jnp.pad(key_R, (0, blocks * block - routes), constant_values=num_keys).reshape(blocks, block)
    earlier_BB = jnp.arange(block)[None, :] < jnp.arange(block)[:, None]
    in_block_NB = jnp.sum((key_NB[:, :, None] == key_NB[:, None, :]) & earlier_BB, axis=2, dtype=jnp.int32)
    hist_NK = jnp.sum(key_NB[:, :, None] == jnp.arange(num_keys, dtype=key_R.dtype), axis=1, dtype=jnp.int32)
    before_NK = exclusive_cumsum(hist_NK, axis=0)
    prior_NB = jnp.take_along_axis(before_NK, jnp.clip(key_NB, 0, num_keys - 1), axis=1)
    return (prior_NB + in_block_NB).reshape(-1)[:routes], jnp.sum(hist_NK, axis=0, dtype=jnp.int32)


def pack(expert_idx_TK: jax.Array, num_experts: int, *, mask_T: jax.Array | None = None) -> Packing:
    """Sort the T*K routes by expert.

    Args:
      expert_idx_TK: int `[T, K]` chosen experts.
      num_experts: E.
      mask_T: optional bool `[T]`, True for real tokens. Routes of other tokens are left out of
        `group_sizes_E` and placed after every packed route (so are ids outside `[0, E)`).

    Returns a `Packing`. `sum(group_sizes_E)` is the number of real routes.
    """
    num_experts = check_int("num_experts", num_experts)
    if expert_idx_TK.ndim != 2:
        raise ValueError(f"pack: expert_idx_TK must be 2-D [T, K]; got shape {tuple(expert_idx_TK.shape)}.")
    if not jnp.issubdtype(expert_idx_TK.dtype, jnp.integer):
        raise TypeError(f"pack: expert_idx_TK must hold integer expert ids; got dtype {expert_idx_TK.dtype}.")
    num_tokens, top_k = expert_idx_TK.shape
    mask_T = check_mask(mask_T, num_tokens, "pack")

    expert_R = expert_idx_TK.reshape(-1).astype(jnp.int32)
    packed_R = (expert_R >= 0) & (expert_R < num_experts)
    if mask_T is not None:
        packed_R &= jnp.repeat(mask_T, top_k)
    # Unpacked routes get key E: they go after every expert and fall out of group_sizes_E.
    key_R = jnp.where(packed_R, expert_R, num_experts)
    rank_R, counts = stable_rank(key_R, num_experts + 1)
    inverse_R = exclusive_cumsum(counts)[key_R] + rank_R
    route_R = jnp.arange(key_R.shape[0], dtype=jnp.int32)
    order_R = jnp.zeros_like(route_R).at[inverse_R].set(route_R, unique_indices=True)  # a permutation
    group_sizes_E = counts[:num_experts]
    return Packing(order_R=order_R, token_R=order_R // top_k, inverse_R=inverse_R, group_sizes_E=group_sizes_E)


def _packed_routes(packing: Packing) -> jax.Array:
    """bool `[R]`: route r sits in an expert group (its packed row is below sum(group_sizes))."""
    return packing.inverse_R < jnp.sum(packing.group_sizes_E)


def _packed_rows(packing: Packing) -> jax.Array:
    """bool `[R]`: packed row i belongs to an expert group (i < sum(group_sizes))."""
    num_routes = packing.order_R.shape[0]
    return jnp.arange(num_routes, dtype=jnp.int32) < jnp.sum(packing.group_sizes_E)


def packed_row_source(x_TD: jax.Array, packing: Packing) -> ops.RowGather:
    """Where each packed row reads `x_TD` `[T, D]`: `ids_M[i] = token_R[i]`, -1 past
    `sum(group_sizes_E)`; `readers_TK[t]` = token t's packed rows (-1 for routes left out), the
    inverse that makes the backward a fixed-order fp32 sum. For `pack_rows`, and for grouped GEMMs
    that read the rows through the ids themselves (`moe_jax.ops.grouped_linear(rows=...)`)."""
    if x_TD.ndim != 2:
        raise ValueError(f"pack_rows: x_TD must be 2-D [T, D]; got shape {tuple(x_TD.shape)}.")
    num_tokens, num_routes = x_TD.shape[0], packing.token_R.shape[0]
    fits = num_routes == 0 if num_tokens == 0 else num_routes % num_tokens == 0
    if not fits:
        raise ValueError(
            f"pack_rows: x_TD has {num_tokens} tokens but the packing has {num_routes} routes; "
            "pack the same tokens' expert_idx_TK."
        )
    readers_TK = jnp.where(_packed_routes(packing), packing.inverse_R, -1).reshape(num_tokens, num_routes // max(num_tokens, 1))
    return ops.RowGather(jnp.where(_packed_rows(packing), packing.token_R, -1), readers_TK)


def pack_rows(x_TD: jax.Array, packing: Packing, *, backend: BackendName = "auto") -> jax.Array:
    """Packed rows `x_RD[i] = x_TD[token_R[i]]`; rows past `sum(group_sizes_E)` are zero.

    `moe_jax.ops.gather_rows` (`backend` as there) never reads the rows it zeroes, so whatever
    masked tokens hold (even NaN) never reaches the packed rows, and their gradient is exactly zero.
    """
    rows = packed_row_source(x_TD, packing)
    # The backward sums each token's K packed rows (its routes' inverse), in float32, without atomics.
    return ops.gather_rows(x_TD, rows.ids_M, inverse_N=rows.readers_TK, backend=backend)


# The name this function had before `moe_jax.ops.gather_rows` existed; kept for callers of that name.
gather_rows = pack_rows


def combine(
    y_RD: jax.Array, weights_TK: jax.Array, packing: Packing, *, mask_T: jax.Array | None = None
) -> jax.Array:
    """Weighted sum of each token's K expert outputs: `y_t = sum_k w_tk * y_RD[inverse_R[t*K+k]]`.

    Args:
      y_RD: expert outputs in the packed layout `[R, D]`. Rows past `sum(group_sizes_E)` are never
        read (they may hold anything, NaN included).
      weights_TK: routing weights `[T, K]`.
      packing: the `Packing` of the same routes, as `pack` returns it (`inverse_R` a permutation of
        `[R]` and `order_R` its inverse: the backward reads each packed row's token through
        `order_R` and each route's weight gradient through `inverse_R`).
      mask_T: optional bool `[T]`; tokens with False get a zero output (as do routes `pack` left
        out).

    Returns `y_TD` in `y_RD.dtype`, accumulated in float32. Differentiable in `y_RD` and
    `weights_TK`; unpacked routes and masked tokens get exactly zero gradient.
    """
    if y_RD.ndim != 2:
        raise ValueError(f"combine: y_RD must be 2-D [R, D]; got shape {tuple(y_RD.shape)}.")
    if weights_TK.ndim != 2:
        raise ValueError(f"combine: weights_TK must be 2-D [T, K]; got shape {tuple(weights_TK.shape)}.")
    num_tokens, top_k = weights_TK.shape
    num_routes = packing.inverse_R.shape[0]
    if num_tokens * top_k != num_routes or y_RD.shape[0] != num_routes:
        raise ValueError(
            f"combine: weights_TK {tuple(weights_TK.shape)} and y_RD {tuple(y_RD.shape)} must cover the "
            f"packing's R = {num_routes} routes (T*K weights, R rows)."
        )
    mask_T = check_mask(mask_T, num_tokens, "combine")

    valid_R = _packed_routes(packing)
    if mask_T is not None:
        valid_R &= jnp.repeat(mask_T, top_k)
    return _weighted_sum(y_RD, weights_TK, packing.inverse_R, packing.order_R, valid_R)


@jax.custom_vjp
def _weighted_sum(y_RD, weights_TK, inverse_R, order_R, valid_R):
    num_tokens, top_k = weights_TK.shape
    valid_TK1 = valid_R.reshape(num_tokens, top_k, 1)
    # Select before multiplying: w * garbage would send 0 * NaN into the weight gradient.
    y_TKD = y_RD[inverse_R].reshape(num_tokens, top_k, y_RD.shape[1]).astype(jnp.float32)
    y_TKD = jnp.where(valid_TK1, y_TKD, 0.0)
    w_TK1 = jnp.where(valid_TK1, weights_TK.astype(jnp.float32)[:, :, None], 0.0)
    return jnp.sum(w_TK1 * y_TKD, axis=1).astype(y_RD.dtype)


def _weighted_sum_fwd(y_RD, weights_TK, inverse_R, order_R, valid_R):
    return _weighted_sum(y_RD, weights_TK, inverse_R, order_R, valid_R), (y_RD, weights_TK, inverse_R, order_R, valid_R)


def _weighted_sum_bwd(res, g_TD):
    # Both gradients are computed in the packed order, reading each packed row's token cotangent
    # through `order_R`: a gather, where the transpose of the forward's gather would be a scatter of
    # [R, D] rows (and a [T, K, D] product materialized before it).
    y_RD, weights_TK, inverse_R, order_R, valid_R = res
    top_k = weights_TK.shape[1]
    valid_R1 = valid_R[order_R][:, None]  # packed row i's route is counted
    # The cotangent at its bf16 values: the FP8 experts quantize the rows computed from it.
    g_RD = exact_float32(g_TD)[order_R // top_k]
    w_R1 = weights_TK.astype(jnp.float32).reshape(-1)[order_R][:, None]
    dy_RD = jnp.where(valid_R1, w_R1 * g_RD, 0.0).astype(y_RD.dtype)
    dw_R = jnp.sum(jnp.where(valid_R1, g_RD * y_RD.astype(jnp.float32), 0.0), axis=1)
    dw_TK = dw_R[inverse_R].reshape(weights_TK.shape).astype(weights_TK.dtype)
    return dy_RD, dw_TK, None, None, None


_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)
