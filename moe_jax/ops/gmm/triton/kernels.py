"""The `triton` backend's kernels: official Triton (`triton.jit`), called from JAX through
`jax_triton.triton_call` (`launch`), and from torch CPU tensors under Triton's interpreter
in the tests.

Legend: M packed rows, K reduction width, N output width, E groups, T rows of a gathered operand.

The 16-bit kernels keep the contracts of the `pallas_triton` backend's row-tile and weight-gradient kernels:
- `gmm_kernel`: `c[M, N]`, rows of group e are `a_e @ b[e]^T` (or `a_e @ b[e]`), one program per
  (row tile, column block), the tile schedule computed in the program from the raw sizes; tiles of
  the zero-fill pseudo-group store zeros for the rows past the last group, so `c` needs no memset.
  With `GATHER`, packed row r is read from `a[rows[r]]` (`a` is `[T, K]`): the row gather of the
  layer's packing happens in the A-operand load instead of a separate pass through memory.
- `tgmm_kernel`: `o[E, N, K]`, `o[e] = d_e^T @ a_e`, one program per (group, N block, K block),
  its group's rows computed in the program from the raw sizes; an empty group stores exact zeros;
  one writer per element (no atomics), so repeated runs give the same bits. `GATHER` reads `a`'s
  rows through row ids here too.
- `fp8_gmm_kernel`: `gmm_kernel`'s forward orientation and row contract on the blockwise FP8 recipe
  (`moe_jax.ops.fp8`): e4m3 operands, the K loop one 128-wide scale block per step, each step's
  tensor-core partial sum promoted into the fp32 accumulator times its row and weight-block scales.
Products accumulate in fp32; `PRECISION` is `tl.dot`'s `input_precision` ("ieee" for fp32 inputs
at `Precision.HIGHEST`, else "tf32"; bf16/fp16 ignore it).

`INTERPRET` selects the forms Triton 3.6's interpreter needs and leaves the compiled kernel
unchanged: its `tl.dot` reads bf16 and e4m3 operands as raw bits (so tiles are widened to fp32
first, which is exact for their products), and under NumPy >= 2.5 it cannot take a loaded value as a
`range` bound (so the weight gradients walk their row steps in a `while` loop; compiled, a `for`
loop lets the software pipeliner overlap loads with the tensor-core work).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_gmm_kernel", "gmm_kernel", "tgmm_kernel"]


@triton.jit
def _source_rows(ids, rows, row_ok, T: tl.constexpr, GATHER: tl.constexpr):
    """(int64 rows of `a` to read, which of them to read) for the packed rows `rows` (`row_ok`):
    `rows` themselves, or with `GATHER` their ids `ids`, those outside `[0, T)` not read."""
    if GATHER:
        read_ok = row_ok & (ids >= 0) & (ids < T)
        src = tl.where(read_ok, ids, 0).to(tl.int64)
    else:
        read_ok = row_ok
        src = rows.to(tl.int64)
    return src, read_ok


@triton.jit
def _row_ids(rows_ptr, r0, end, BLOCK_M: tl.constexpr, GATHER: tl.constexpr):
    """With `GATHER`, int32 `[BLOCK_M]`: the ids `rows_ptr[r0 + i]` of the `BLOCK_M` rows from
    `r0`, 0 (not read) for those at or past `end`; else 0 (the rows are read as they are)."""
    ids = 0
    if GATHER:
        rows = r0 + tl.arange(0, BLOCK_M)
        ids = tl.load(rows_ptr + rows, mask=rows < end, other=0)
    return ids


@triton.jit
def _group_spans(sizes_ptr, M: tl.constexpr, E: tl.constexpr, E_LANES: tl.constexpr):
    """(lanes, first rows, one-past-last rows), int32 `[E_LANES]`, of the groups whose sizes
    `sizes_ptr` holds (`[E_LANES]`, lanes past E ignored): `schedule.clamp_group_sizes`'s offsets,
    sizes clipped to [0, M] and the running total saturating at M, exact while E * M < 2**31 (the
    launchers' contract; `schedule.lane_sizes` clamps exactly first beyond it)."""
    lanes = tl.arange(0, E_LANES)
    sizes = tl.load(sizes_ptr + lanes, mask=lanes < E, other=0)
    sizes = tl.minimum(tl.maximum(sizes, 0), M)
    inclusive = tl.cumsum(sizes, 0)
    return lanes, tl.minimum(inclusive - sizes, M), tl.minimum(inclusive, M)


@triton.jit
def _row_tile(sizes_ptr, M: tl.constexpr, N: tl.constexpr, E: tl.constexpr, E_LANES: tl.constexpr,
              NUM_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's `(group, first row, one-past-last row, in a group, column block)` of a row-tile
    kernel over `M` packed rows: the tiles of `moe_jax.ops.gmm.schedule.make_group_metadata`
    computed from the sizes vector, then the zero-fill pseudo-group's tiles (`in a group` False)
    up to M. A program past the schedule gets an empty span."""
    pid = tl.program_id(0)
    # Row-tile-major swizzle: GROUP_M row tiles (usually one group's rows) sweep the column
    # blocks together, so their weight block and rows stay in L2.
    num_n = tl.cdiv(N, BLOCK_N)
    per_sweep = GROUP_M * num_n
    first = (pid // per_sweep) * GROUP_M
    height = tl.minimum(NUM_TILES - first, GROUP_M)
    local = pid % per_sweep
    tile = first + local % height
    n_blk = local // height

    lanes, starts, ends = _group_spans(sizes_ptr, M, E, E_LANES)
    tiles_e = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles_e, 0)
    group_tiles = tl.sum(tiles_e, 0)
    group = tl.sum((tile_ends <= tile).to(tl.int32), 0)
    is_group = tile < group_tiles
    here = lanes == group
    g_start = tl.sum(tl.where(here, starts, 0), 0) + (tile - tl.sum(tl.where(here, tile_ends - tiles_e, 0), 0)) * BLOCK_M
    g_end = tl.minimum(g_start + BLOCK_M, tl.sum(tl.where(here, ends, 0), 0))
    f_start = tl.minimum(tl.max(ends, 0) + (tile - group_tiles) * BLOCK_M, M)
    f_end = tl.minimum(f_start + BLOCK_M, M)
    return group, tl.where(is_group, g_start, f_start), tl.where(is_group, g_end, f_end), is_group, n_blk


@triton.jit
def gmm_kernel(
    sizes_ptr, rows_ptr, a_ptr, b_ptr, c_ptr,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, E_LANES: tl.constexpr,
    NUM_TILES: tl.constexpr, T: tl.constexpr,
    stride_am: tl.constexpr, stride_be: tl.constexpr, stride_bk: tl.constexpr, stride_bn: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATHER: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One (row tile, column block) of `c = a_g @ b[g]` with `b[g]` addressed as `[K, N]` through
    its strides (the NT layout `[E, N, K]` has `stride_bk == 1`). `sizes_ptr`: int32 `[E_LANES]`
    sizes, lanes past E ignored. `rows_ptr`: int32 `[M]` source rows of `a` `[T, K]` (read only
    with `GATHER`; ids outside `[0, T)` read zeros)."""
    group, start, end, is_group, n_blk = _row_tile(sizes_ptr, M, N, E, E_LANES, NUM_TILES, BLOCK_M, BLOCK_N, GROUP_M)
    if start >= end:  # a tile past the schedule: nothing to read or write
        return

    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end  # rows stored
    src, read_ok = _source_rows(_row_ids(rows_ptr, start, end, BLOCK_M, GATHER), rows, row_ok, T, GATHER)
    cols = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_group = b_ptr + tl.minimum(group, E - 1).to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if is_group:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + src[:, None] * stride_am + ks[None, :], mask=read_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(b_group + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _tgmm_rows(ids, a_ptr, d_ptr, r0, end, ns, ks, acc,
               N: tl.constexpr, K: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr,
               GATHER: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """`acc + d[rows, ns]^T @ a[rows, ks]` for the `BLOCK_M` rows from `r0`, those at or past
    `end` (and columns past `N`, `K`) read as zeros; with `GATHER`, row r of `a` is `a[ids[r - r0]]`
    (`_row_ids`)."""
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    d = tl.load(d_ptr + rows.to(tl.int64)[:, None] * N + ns[None, :], mask=row_ok[:, None] & (ns < N)[None, :],
                other=0.0)
    src, read_ok = _source_rows(ids, rows, row_ok, T, GATHER)
    a = tl.load(a_ptr + src[:, None] * K + ks[None, :], mask=read_ok[:, None] & (ks < K)[None, :], other=0.0)
    if INTERPRET:
        d = d.to(tl.float32)
        a = a.to(tl.float32)
    return tl.dot(tl.trans(d), a, acc, input_precision=PRECISION)


@triton.jit
def _tgmm_store(o_ptr, group, ns, ks, acc, N: tl.constexpr, K: tl.constexpr):
    """`o[group][ns, ks] = acc`, the rows past `N` and columns past `K` left out."""
    out = o_ptr + group.to(tl.int64) * N * K
    tl.store(out + ns[:, None] * K + ks[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=(ns < N)[:, None] & (ks < K)[None, :])


@triton.jit
def tgmm_kernel(
    sizes_ptr, rows_ptr, a_ptr, d_ptr, o_ptr,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, E_LANES: tl.constexpr, T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One `[BLOCK_N, BLOCK_K]` block of `o[g] = d_g^T @ a_g` for `d` `[M, N]`. `sizes_ptr`: int32
    `[E_LANES]` sizes, lanes past E ignored, as `gmm_kernel` reads them (the group's rows follow
    from them in the program, so nothing runs before the kernel). With `GATHER`, row r of `a` is
    `a[rows[r]]` (`a` is `[T, K]`, ids outside `[0, T)` read zeros), as in `gmm_kernel`."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    group = pid // (num_n * num_k)
    rest = pid % (num_n * num_k)
    ns = (rest // num_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (rest % num_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    lanes, starts, ends = _group_spans(sizes_ptr, M, E, E_LANES)
    start = tl.sum(tl.where(lanes == group, starts, 0), 0)
    end = tl.sum(tl.where(lanes == group, ends, 0), 0)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # Each step's row ids are loaded a step ahead and carried: Triton's pipeliner gives every load
    # `(num_stages - 1) // (levels + 1)` stages, a load feeding another load's addresses in the
    # same iteration counting as a level; a carried value is none, so the loads keep all stages.
    ids = _row_ids(rows_ptr, start, end, BLOCK_M, GATHER)
    if INTERPRET:
        r0 = start
        while r0 < end:
            acc = _tgmm_rows(ids, a_ptr, d_ptr, r0, end, ns, ks, acc, N, K, T, BLOCK_M, GATHER, PRECISION, INTERPRET)
            ids = _row_ids(rows_ptr, r0 + BLOCK_M, end, BLOCK_M, GATHER)
            r0 += BLOCK_M
    else:
        for r0 in range(start, end, BLOCK_M):
            acc = _tgmm_rows(ids, a_ptr, d_ptr, r0, end, ns, ks, acc, N, K, T, BLOCK_M, GATHER, PRECISION, INTERPRET)
            ids = _row_ids(rows_ptr, r0 + BLOCK_M, end, BLOCK_M, GATHER)
    _tgmm_store(o_ptr, group, ns, ks, acc, N, K)


@triton.jit
def fp8_gmm_kernel(
    sizes_ptr, rows_ptr, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, E_LANES: tl.constexpr,
    NUM_TILES: tl.constexpr, T: tl.constexpr, K_BLOCKS: tl.constexpr, N_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr, GROUP_M: tl.constexpr,
    GATHER: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One (row tile, column block) of `c = a_g @ b[g]^T` by the blockwise FP8 recipe
    (`moe_jax.ops.fp8`): `a` e4m3 `[M, K]` (or with `GATHER` `[T, K]` read through `rows_ptr`, ids
    outside `[0, T)` read zeros) with fp32 `a_scale` `[M or T, K_BLOCKS]` per 1 x SCALE_BLOCK tile;
    `b` e4m3 `[E, N, K]` with fp32 `b_scale` `[E, N_BLOCKS, K_BLOCKS]` per SCALE_BLOCK x SCALE_BLOCK
    block. The K loop steps SCALE_BLOCK at a time: each step's e4m3 products are summed by the
    tensor cores from a zero accumulator, and that partial sum, times the step's row scales and
    column-block scales, is added to the fp32 accumulator (the recipe's promotion every 128).
    Schedule, zero fill and row contract as `gmm_kernel`'s."""
    group, start, end, is_group, n_blk = _row_tile(sizes_ptr, M, N, E, E_LANES, NUM_TILES, BLOCK_M, BLOCK_N, GROUP_M)
    if start >= end:  # a tile past the schedule: nothing to read or write
        return

    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end  # rows stored
    src, read_ok = _source_rows(_row_ids(rows_ptr, start, end, BLOCK_M, GATHER), rows, row_ok, T, GATHER)
    cols = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    g = tl.minimum(group, E - 1).to(tl.int64)
    steps = tl.arange(0, SCALE_BLOCK)
    # Pointers of step 0, advanced by a constant per step; K's mask only where K has a partial block.
    a_tile = a_ptr + src[:, None] * K + steps[None, :]
    a_scales = a_scale_ptr + src * K_BLOCKS
    b_tile = b_ptr + g * N * K + steps[:, None] + cols[None, :] * K
    EVEN_K: tl.constexpr = K % SCALE_BLOCK == 0
    # A column block within one 128-row weight block has one scale per step: a scalar, so the
    # promotion multiplies the partial sum by a per-row vector only (no second tile of scales).
    ONE_COLUMN_SCALE: tl.constexpr = SCALE_BLOCK % BLOCK_N == 0
    if ONE_COLUMN_SCALE:
        b_scales = b_scale_ptr + (g * N_BLOCKS + (n_blk * BLOCK_N) // SCALE_BLOCK) * K_BLOCKS
    else:
        b_scales = b_scale_ptr + g * N_BLOCKS * K_BLOCKS + (cols // SCALE_BLOCK) * K_BLOCKS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if is_group:
        for kb in range(0, K_BLOCKS):
            if EVEN_K:
                a = tl.load(a_tile + kb * SCALE_BLOCK, mask=read_ok[:, None], other=0.0)
                b = tl.load(b_tile + kb * SCALE_BLOCK, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = kb * SCALE_BLOCK + steps < K
                a = tl.load(a_tile + kb * SCALE_BLOCK, mask=read_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_tile + kb * SCALE_BLOCK, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            a_s = tl.load(a_scales + kb, mask=read_ok, other=0.0)
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if ONE_COLUMN_SCALE:
                acc += tl.dot(a, b) * (a_s * tl.load(b_scales + kb))[:, None]
            else:
                acc += tl.dot(a, b) * a_s[:, None] * tl.load(b_scales + kb, mask=col_ok, other=0.0)[None, :]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
