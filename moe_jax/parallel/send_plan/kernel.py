"""The send-plan kernel (`pallas_triton` backend of `plan_sends`): a sender's whole plan in one launch.

Legend: R routes, E experts, P ranks of the ep axis, El = E/P, C capacity, S send-buffer rows.

Program g owns routes `[g*block, (g+1)*block)` and compares them with all R routes, `chunk` at a
time: a running count per destination gives every route's capacity decision, (expert, route)
compares give its slot. It also owns a slice of experts (their kept counts) and a slice of send
rows (the padding rows, written as -1), so no program waits for another and every output element
has exactly one writer. Its work grows as R*R/block per program, so `api.plan_sends` uses it only
up to `api.PALLAS_MAX_ROUTES` routes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.pallas_triton import cdiv, launch, next_pow2

__all__ = ["send_plan_pallas"]


def _kernel(*refs, routes: int, num_experts: int, local: int, ep: int, capacity: int, top_k: int,
                      padded: bool, masked: bool, block: int, chunk: int, ep_pow2: int, e_block: int,
                      s_block: int, send_rows: int):
    """Program g plans routes `[g*block, (g+1)*block)` against all R routes, `chunk` at a time.

    A route r (expert e, destination p = e // local) is valid if e is in `[0, E)` (and its token
    is real). Its destination rank is #{valid r' < r to p}; it is kept if that is below C. Its
    slot in p's block is #{kept r' to p with (e', r') < (e, r)}: blocks are ordered by (local
    expert, route). Every program recomputes all routes' keep flags (a running count per
    destination) and compares its own routes with every kept route, so no program waits for
    another. Program g also owns experts `[g*e_block, ...)` (kept counts) and send rows
    `[g*s_block, ...)`: the rows no kept route fills, written as -1. The send rows that kept routes
    fill are disjoint from those, so the scatter of tokens and the padding fill never race.
    """
    expert_ref, *refs = refs
    real_ref = refs.pop(0) if masked else None
    row_ref, ids_ref, kept_ref, counts_ref, sizes_ref = refs
    g = pl.program_id(0)
    iota_p = jnp.arange(ep_pow2, dtype=jnp.int32)

    def routes_at(first, size):
        r = first + jnp.arange(size, dtype=jnp.int32)
        safe = jnp.minimum(r, routes - 1)  # vector loads of clamped ids: no out-of-bounds reads
        e = expert_ref[safe]
        valid = (r < routes) & (e >= 0) & (e < num_experts)
        if masked:
            valid &= real_ref[safe] != 0
        return r, e, valid, jnp.where(valid, lax.div(jnp.maximum(e, 0), local), ep)

    def count(mask, axis):
        return jnp.sum(jnp.where(mask, 1, 0), axis=axis)

    r_B, e_B, valid_B, dest_B = routes_at(g * block, block)
    my_experts = g * e_block + jnp.arange(e_block, dtype=jnp.int32)

    def body(i, carry):
        seen_P, kept_P, slot_B, rank_B, kept_e = carry
        r_C, e_C, valid_C, dest_C = routes_at(i * chunk, chunk)
        hot_CP = valid_C[:, None] & (dest_C[:, None] == iota_p[None, :])
        upto_CP = jnp.cumsum(jnp.where(hot_CP, 1, 0), axis=0)  # inclusive, within the chunk
        rank_C = jnp.sum(jnp.where(hot_CP, upto_CP + seen_P[None, :] - 1, 0), axis=1)
        kept_C = valid_C & (rank_C < capacity)
        same = dest_B[:, None] == dest_C[None, :]
        earlier = r_C[None, :] < r_B[:, None]
        before = (e_C[None, :] < e_B[:, None]) | ((e_C[None, :] == e_B[:, None]) & earlier)
        return (
            seen_P + count(hot_CP, 0),
            kept_P + count(hot_CP & kept_C[:, None], 0),
            slot_B + count(same & kept_C[None, :] & before, 1),
            rank_B + count(same & valid_C[None, :] & earlier, 1),
            kept_e + count((e_C[:, None] == my_experts[None, :]) & kept_C[:, None], 0),
        )

    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)
    seen_P, kept_P, slot_B, rank_B, kept_e = lax.fori_loop(
        0, cdiv(routes, chunk), body, (zeros(ep_pow2), zeros(ep_pow2), zeros(block), zeros(block), zeros(e_block)))

    keep_B = valid_B & (rank_B < capacity)
    if padded:
        base_B = dest_B * capacity
    else:  # blocks packed tightly in destination order
        base_B = jnp.sum(jnp.where(iota_p[None, :] < dest_B[:, None], kept_P[None, :], 0), axis=1)
    row_B = jnp.where(keep_B, base_B + slot_B, -1)
    plgpu.store(row_ref.at[pl.ds(g * block, block)], row_B)
    # Not-kept lanes point at the spare row `send_rows` (masked off; the wrapper drops that row).
    plgpu.store(ids_ref.at[jnp.where(keep_B, row_B, send_rows)], lax.div(r_B, top_k), mask=keep_B)

    s = g * s_block + jnp.arange(s_block, dtype=jnp.int32)
    if padded:
        p_s = lax.div(s, capacity)
        filled = s - p_s * capacity < jnp.sum(jnp.where(p_s[:, None] == iota_p[None, :], kept_P[None, :], 0), axis=1)
    else:
        filled = s < jnp.sum(kept_P)
    plgpu.store(ids_ref.at[pl.ds(g * s_block, s_block)], jnp.full((s_block,), -1, jnp.int32), mask=~filled)
    plgpu.store(kept_ref.at[pl.ds(g * e_block, e_block)], kept_e)

    @pl.when(g == 0)
    def _():
        plgpu.store(counts_ref.at[pl.ds(0, ep_pow2)], seen_P)
        plgpu.store(sizes_ref.at[pl.ds(0, ep_pow2)], kept_P)


def send_plan_pallas(
    expert_R: jax.Array, real_R: jax.Array | None, *, num_experts: int, ep: int, capacity: int, top_k: int,
    padded: bool, send_rows: int, block: int, chunk: int, num_warps: int, interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Launch the send-plan kernel; returns `(route_row_R, send_ids_S, kept_E, send_counts_P,
    send_sizes_P)`, int32, as `api.SendPlan` documents them.

    `expert_R` int32 `[R]`, R > 0; `real_R` int32 `[R]` (nonzero = real token) or None. One
    program per `block` routes, each looping over all R routes `chunk` at a time: R*R/block
    compares per program, so this suits small R (decode).
    """
    routes = expert_R.shape[0]
    grid = cdiv(routes, block)
    ep_pow2 = max(2, next_pow2(ep))
    e_block = next_pow2(cdiv(num_experts, grid))
    s_block = next_pow2(cdiv(send_rows + 1, grid))  # + 1: the spare row of not-kept lanes
    kernel = functools.partial(
        _kernel, routes=routes, num_experts=num_experts, local=num_experts // ep, ep=ep,
        capacity=capacity, top_k=top_k, padded=padded, masked=real_R is not None, block=block,
        chunk=chunk, ep_pow2=ep_pow2, e_block=e_block, s_block=s_block, send_rows=send_rows,
    )
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    out_shape = (i32((grid * block,)), i32((grid * s_block,)), i32((grid * e_block,)), i32((ep_pow2,)),
                 i32((ep_pow2,)))
    rows, ids, kept, counts, sizes = launch(
        kernel, (expert_R,) if real_R is None else (expert_R, real_R), out_shape=out_shape, grid=(grid,),
        num_warps=num_warps, num_stages=1, interpret=interpret, name="moe_jax_send_plan", out_init=None,
    )
    return rows[:routes], ids[:send_rows], kept[:num_experts], counts[:ep], sizes[:ep]
