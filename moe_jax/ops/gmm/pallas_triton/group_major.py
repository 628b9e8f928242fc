"""The group-major and split-K families of the forward grouped GEMM: one program per
(active-group slot, column block), or per (slot, column block, K split).

Legend: M packed rows, K reduction width, N output width, E groups.

Slot j of the `min(E, M)` slots serves the j-th group that has rows and walks its row tiles;
`num_fill` more programs per column block zero the rows past the last group. Each program finds
its group's rows from the raw sizes, so no schedule is built before the launch: at decode the
launch is the only kernel, and only as many group programs as rows can exist (8 of 128 experts
at one token, top-8). Under heavy skew a hot group is walked by few programs, so prefill uses
the row-tile family.

Split-K (the `split_k` family) splits each program's K loop over `splits` programs, so a launch
with few active groups and column blocks still fills the GPU. Each writes its fp32 partial sums
into its own plane of a `[splits, M, N]` buffer (every element of every plane has one writer,
fill programs zero theirs), and a fixed-order sum over the planes gives the result: no atomics,
the same bits every run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from moe_jax.ops.gmm.tiles import TileConfig
from moe_jax.ops.gmm.pallas_triton.tile import Gate, gate_inputs, gated_kernel, row_block
from moe_jax.ops.gmm.schedule import lane_sizes
from moe_jax.ops.pallas_triton import cdiv, launch

__all__ = ["gmm_group_major_pallas"]


def _body(pid, sizes_ref, lhs_ref, rhs_ref, out_ref, *, num_groups: int, num_slots: int, num_fill: int, m: int, n: int,
          k: int, tiles: TileConfig, transpose_rhs: bool, precision, splits: int):
    bm = tiles.block_m
    num_n = cdiv(n, tiles.block_n)
    slot, rest = pid // (num_n * splits), pid % (num_n * splits)
    n_blk, split = rest // splits, rest % splits  # a tile's splits are neighbours: they share its rows in L2
    n0 = pl.multiple_of(n_blk * tiles.block_n, tiles.block_n)
    # One vector load of the whole (power-of-two, >= 16; zero-padded by the launcher otherwise)
    # sizes vector, a cumsum and a few sums give this program's group and rows. Clipped to
    # [0, M], and E * M < 2**31 (the launcher's contract), so no sum below overflows; every sum is
    # int32, also under jax_enable_x64 (where an integer sum would be int64).
    e_pad = sizes_ref.shape[0]
    idx = jnp.arange(e_pad, dtype=jnp.int32)
    sizes = jnp.clip(sizes_ref[...], 0, m)
    active_before = jnp.cumsum(sizes > 0, dtype=jnp.int32)  # inclusive count of active groups
    group = jnp.sum(active_before <= slot, dtype=jnp.int32)  # index of the slot-th active group
    is_group = (slot < num_slots) & (group < num_groups)
    before = jnp.minimum(jnp.sum(jnp.where(idx < group, sizes, 0), dtype=jnp.int32), m)
    total = jnp.minimum(jnp.sum(sizes, dtype=jnp.int32), m)
    group_end = jnp.minimum(before + jnp.sum(jnp.where(idx == group, sizes, 0), dtype=jnp.int32), m)
    # Group programs walk their group's row tiles; the `num_fill` fill programs (slots past
    # `num_slots`) share the rows past the last group, tile j going to fill program j % num_fill.
    # Slots without an active group walk nothing.
    # Selects on int32 values only: a select of two Python literals lowers to i1 in Triton.
    is_fill = slot >= num_slots
    first = jnp.where(is_group, before, total + (slot - num_slots) * bm)
    end = jnp.where(is_group, group_end, jnp.where(is_fill, jnp.int32(m), first))
    stride = (1 + (1 - is_group.astype(jnp.int32)) * (num_fill - 1)) * bm
    num_row_tiles = jnp.maximum(end - first + stride - 1, 0) // stride
    # This split's K blocks: a contiguous share of the cdiv(K, bk) blocks (the last shares may be
    # shorter or empty; an empty share writes zeros).
    k_blocks = cdiv(k, tiles.block_k)
    per_split = cdiv(k_blocks, splits)
    k_first = split * per_split
    k_steps = is_group.astype(jnp.int32) * jnp.clip(k_blocks - k_first, 0, per_split)
    group = jnp.minimum(group, num_groups - 1)

    def tile(j, carry):
        start = first + j * stride
        row_block(lhs_ref, rhs_ref, out_ref, group=group, start=start, end=jnp.minimum(start + bm, end), n0=n0,
                  k_steps=k_steps, n=n, k=k, tiles=tiles, transpose_rhs=transpose_rhs, precision=precision,
                  k_first=k_first, plane=None if splits == 1 else split)
        return carry

    lax.fori_loop(jnp.int32(0), num_row_tiles, tile, 0)  # int32 under x64 too (`tile.row_block`)


def gmm_group_major_pallas(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool, tiles: TileConfig, out_dtype,
    precision, interpret: bool, num_fill: int = 8, splits: int = 1, out_init: jax.Array | None = None,
    gate: Gate | None = None,
) -> jax.Array:
    """Launch the group-major kernel, or with `splits > 1` the split-K one (see the module
    docstring). Expects validated shapes with `M, N, K > 0`; unchecked `group_sizes` are clamped
    as `schedule.clamp_group_sizes` does (negative sizes count as zero, rows past M dropped).
    `out_init`: the `[M, N]` output, or with splits the `[splits, M, N]` fp32 partials (tests
    pass NaN; a chain passes the previous launch). `gate` (not with splits): see `tile.Gate`."""
    if gate is not None and splits > 1:
        raise ValueError("split-K launches cannot be gated: their planes are summed after the launch.")
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    num_slots = min(num_groups, m)
    num_fill = max(1, min(num_fill, cdiv(m, tiles.block_m)))
    body = functools.partial(_body, num_groups=num_groups, num_slots=num_slots, num_fill=num_fill, m=m, n=n,
                             k=k, tiles=tiles, transpose_rhs=transpose_rhs, precision=precision, splits=splits)
    out_shape = jax.ShapeDtypeStruct((m, n), out_dtype) if splits == 1 else jax.ShapeDtypeStruct((splits, m, n),
                                                                                                    jnp.float32)
    out = launch(
        gated_kernel(body, gate), (lane_sizes(group_sizes, m), *gate_inputs(gate), lhs, rhs), out_shape=out_shape,
        grid=((num_slots + num_fill) * cdiv(n, tiles.block_n) * splits,), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, interpret=interpret,
        name="moe_jax_gmm_group_major" if splits == 1 else "moe_jax_gmm_split_k", out_init=out_init,
    )
    return out if splits == 1 else jnp.sum(out, axis=0).astype(out_dtype)
