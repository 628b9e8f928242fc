"""What the forward families share: the in-kernel body (one block of output rows of one group)
and the gate that lets one launch of a chain run (their programs read the sizes vector of
`moe_jax.ops.gmm.schedule.lane_sizes`).

Legend: M packed rows, K reduction width, N output width, E groups.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.gmm.tiles import TileConfig
from moe_jax.ops.pallas_triton import masked_load, outer_and

__all__ = ["Gate", "gate_inputs", "gated_kernel", "row_block"]


class Gate(NamedTuple):
    """Device-side choice among the launches of a chain: launch `index` runs only where
    `choice_1[0] == index`; the others return at once and leave the (aliased) output alone."""

    choice_1: jax.Array  # int32 [1]
    index: int


def gate_inputs(gate: Gate | None) -> tuple[jax.Array, ...]:
    """The launch inputs a gate adds after the sizes vector: its choice, or nothing."""
    return () if gate is None else (gate.choice_1,)


def gated_kernel(body, gate: Gate | None):
    """The kernel `(sizes_ref, [choice_ref,] lhs_ref, rhs_ref, out_ref)` that runs
    `body(pid, sizes_ref, lhs_ref, rhs_ref, out_ref)` in every program, or, with a gate, only where
    the choice is `gate.index`. The program id is read outside the gate: the interpreter resolves
    it at the top level only."""
    index = None if gate is None else gate.index

    def kernel(sizes_ref, *refs):
        pid = pl.program_id(0)
        if index is None:
            body(pid, sizes_ref, *refs)
        else:
            choice_ref, *rest = refs
            pl.when(choice_ref[0] == index)(lambda: body(pid, sizes_ref, *rest))

    return kernel


def row_block(lhs_ref, rhs_ref, out_ref, *, group, start, end, n0, k_steps, n: int, k: int,
              tiles: TileConfig, transpose_rhs: bool, precision, k_first=0, plane=None, row_ids_ref=None):
    """`out[start:end, n0:n0+bn] = lhs[start:end] @ rhs[group]^T` (or `rhs[group]`) over `k_steps`
    K blocks from block `k_first` on, accumulated in fp32; with `k_steps == 0` the rows are
    written as zeros. `end - start <= block_m`; rows at and past `end` are neither read nor
    written. With `plane`, `out_ref` is `[planes, M, N]` and the block goes to `out[plane]`.
    With `row_ids_ref` (int32 `[M]`), row r of the block is read from `lhs[row_ids[r]]` (`lhs` is
    `[T, K]`, ids outside `[0, T)` read zeros): the row gather fused into the A-operand loads."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    rows_ok = (start + jnp.arange(bm, dtype=jnp.int32)) < end
    cols_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < n
    reads_ok = rows_ok  # rows stored, and rows read (less those whose id is out of range)
    if row_ids_ref is not None:
        ids = masked_load(row_ids_ref.at[pl.ds(start, bm)], rows_ok)
        reads_ok = rows_ok & (ids >= 0) & (ids < lhs_ref.shape[0])
        src_rows = jnp.where(reads_ok, ids, 0)

    def k_step(i, acc):
        k0 = pl.multiple_of((k_first + i) * bk, bk)
        # Edge masks only where the shape leaves a partial block: a mask-free load vectorizes.
        k_ok = ((k0 + jnp.arange(bk, dtype=jnp.int32)) < k) if k % bk else None
        n_ok = cols_ok if n % bn else None
        if row_ids_ref is None:
            a = masked_load(lhs_ref.at[pl.ds(start, bm), pl.ds(k0, bk)], outer_and(rows_ok, k_ok, (bm, bk)))
        else:
            # Both indices as arrays: Pallas's interpreter gathers only with no slice among them.
            # The columns stay a plain `k0 + arange` (masked, never clamped), so Triton still sees
            # each row's block as contiguous and vectorizes its loads.
            cols = k0 + jnp.arange(bk, dtype=jnp.int32)
            a = masked_load(lhs_ref.at[src_rows[:, None], cols[None, :]], outer_and(reads_ok, k_ok, (bm, bk)))
        if transpose_rhs:
            b = masked_load(rhs_ref.at[group, pl.ds(n0, bn), pl.ds(k0, bk)], outer_and(n_ok, k_ok, (bn, bk)))
            return acc + plgpu.dot(a, b, trans_b=True, precision=precision)
        b = masked_load(rhs_ref.at[group, pl.ds(k0, bk), pl.ds(n0, bn)], outer_and(k_ok, n_ok, (bk, bn)))
        return acc + plgpu.dot(a, b, precision=precision)

    # An int32 lower bound: under jax_enable_x64 a Python 0 would make the index (and the
    # slices built from it) int64 beside int32 row offsets.
    acc = lax.fori_loop(jnp.int32(0), k_steps, k_step, jnp.zeros((bm, bn), jnp.float32))
    rows, cols = pl.ds(start, bm), pl.ds(n0, bn)
    plgpu.store(
        out_ref.at[rows, cols] if plane is None else out_ref.at[plane, rows, cols],
        acc.astype(out_ref.dtype),
        mask=rows_ok[:, None] & cols_ok[None, :],
    )
