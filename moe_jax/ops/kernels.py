"""Pallas (Triton backend) grouped-GEMM kernels and the wrappers that launch them.

Legend: M packed rows, K reduction width, N output width, E groups, W worst-case row tiles.

- `gmm`: `out[M,N]`, rows of group e are `lhs_e @ rhs[e]^T` (rhs `[E,N,K]`, `transpose_rhs=True`,
  the seed's NT layout) or `lhs_e @ rhs[e]` (rhs `[E,K,N]`, used for the input gradient so the
  weights are never transposed in memory).
- `tgmm`: `out[E,N,K]`, `out[e] = dout_e^T @ lhs_e`, the weight gradient.
- `gather_rows`: `out[i] = concat(xs)[rows[i]]`, zero where `rows[i]` is out of range (the row
  moves of expert-parallel dispatch and combine).
- `send_plan`: expert-parallel dispatch's sender-side plan (capacity, send-buffer row of each
  route, token of each send row, kept counts) in one launch.

Kernels take refs only; wrappers own grids and compiler parameters. Accumulation is fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.config import TileConfig
from moe_jax.ops.metadata import GroupMetadata


def _cdiv(a, b):
    return (a + b - 1) // b


def _outer_and(row_ok, col_ok, shape):
    """Block mask of `shape` from optional row and column masks (None: that edge needs no mask)."""
    if row_ok is None and col_ok is None:
        return None
    rows = jnp.ones((shape[0],), jnp.bool_) if row_ok is None else row_ok
    cols = jnp.ones((shape[1],), jnp.bool_) if col_ok is None else col_ok
    return rows[:, None] & cols[None, :]


def _load(ref, mask):
    """Masked load with zeros where `mask` is False; a plain load when no mask is needed."""
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=jnp.zeros((), ref.dtype))


def _swizzle(pid, num_tiles: int, num_n: int, group_m: int):
    """Map a 1-D program id to (row tile, column block), `group_m` row tiles per column sweep.

    Consecutive programs cover `group_m` row tiles (usually one expert's rows) for column block 0,
    then block 1, ...: the expert's weight block and its rows stay in L2 across the sweep.
    """
    per_group = group_m * num_n
    group = pid // per_group
    first = group * group_m
    size = jnp.minimum(num_tiles - first, group_m)
    local = pid % per_group
    return first + local % size, local // size


def _row_tile(lhs_ref, rhs_ref, out_ref, *, group, start, end, n0, k_steps, n: int, k: int,
              config: TileConfig, transpose_rhs: bool, precision):
    """out[start:end, n0:n0+bn] = lhs[start:end] @ rhs[group]^T (or rhs[group]), over `k_steps`
    K blocks; with `k_steps == 0` the rows are written as zeros. `end - start <= block_m`."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    rows_ok = (start + jnp.arange(bm, dtype=jnp.int32)) < end
    cols_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < n

    def k_step(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        # Edge masks only where the shape leaves a partial block: a mask-free load vectorizes.
        k_ok = ((k0 + jnp.arange(bk, dtype=jnp.int32)) < k) if k % bk else None
        n_ok = cols_ok if n % bn else None
        a = _load(lhs_ref.at[pl.ds(start, bm), pl.ds(k0, bk)], _outer_and(rows_ok, k_ok, (bm, bk)))
        if transpose_rhs:
            b = _load(rhs_ref.at[group, pl.ds(n0, bn), pl.ds(k0, bk)], _outer_and(n_ok, k_ok, (bn, bk)))
            return acc + plgpu.dot(a, b, trans_b=True, precision=precision)
        b = _load(rhs_ref.at[group, pl.ds(k0, bk), pl.ds(n0, bn)], _outer_and(k_ok, n_ok, (bk, bn)))
        return acc + plgpu.dot(a, b, precision=precision)

    acc = lax.fori_loop(0, k_steps, k_step, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(
        out_ref.at[pl.ds(start, bm), pl.ds(n0, bn)],
        acc.astype(out_ref.dtype),
        mask=rows_ok[:, None] & cols_ok[None, :],
    )


def _gmm_kernel(
    tile_group_ref, tile_start_ref, tile_end_ref, lhs_ref, rhs_ref, out_ref,
    *, num_groups: int, n: int, k: int, num_tiles: int, config: TileConfig,
    transpose_rhs: bool, precision,
):
    num_n = _cdiv(n, config.block_n)
    tile, n_blk = _swizzle(pl.program_id(0), num_tiles, num_n, config.group_m)
    group = tile_group_ref[tile]
    start = tile_start_ref[tile]
    end = tile_end_ref[tile]
    # Zero-fill tiles (group == E) and unused tiles run no K steps and store zeros / nothing.
    # An int32 product, not a select of literals: scf.for needs one integer type for its bounds.
    has_work = (group < num_groups) & (end > start)
    _row_tile(
        lhs_ref, rhs_ref, out_ref, group=jnp.minimum(group, num_groups - 1), start=start, end=end,
        n0=pl.multiple_of(n_blk * config.block_n, config.block_n),
        k_steps=has_work.astype(jnp.int32) * _cdiv(k, config.block_k),
        n=n, k=k, config=config, transpose_rhs=transpose_rhs, precision=precision,
    )


def gmm_pallas(
    lhs: jax.Array, rhs: jax.Array, meta: GroupMetadata, *, transpose_rhs: bool,
    config: TileConfig, out_dtype, precision, interpret: bool, out_init: jax.Array | None = None,
) -> jax.Array:
    """Launch the row-tile kernel. `meta` must come from `make_group_metadata(..., block_m=config.block_m)`.

    One program per (row tile, column block) of the on-device schedule: every program has about
    the same work whatever the skew. Expects validated shapes; `M, N, K > 0`.
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    num_tiles = meta.tile_group_W.shape[0]
    grid = (num_tiles * _cdiv(n, config.block_n),)
    kernel = functools.partial(
        _gmm_kernel, num_groups=num_groups, n=n, k=k, num_tiles=num_tiles, config=config,
        transpose_rhs=transpose_rhs, precision=precision,
    )
    return _launch(
        kernel, (meta.tile_group_W, meta.tile_start_W, meta.tile_end_W, lhs, rhs),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=grid, num_warps=config.num_warps,
        num_stages=config.num_stages, interpret=interpret, name="moe_jax_gmm", out_init=out_init,
    )


def vary_to_union(arrays: tuple, also: tuple = ()) -> tuple[frozenset, tuple]:
    """Inside `jax.shard_map(check_vma=True)`: the union of the mesh axes that `arrays` and `also`
    vary over, and `arrays` cast to vary over all of it (`pcast`, whose transpose sums the
    gradient over the added axes). Outside `shard_map` the union is empty and nothing changes."""
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in (*arrays, *also)))
    missing = [tuple(varying - jax.typeof(a).manual_axis_type.varying) for a in arrays]
    return varying, tuple(jax.lax.pcast(a, axes, to="varying") if axes else a for a, axes in zip(arrays, missing))


def _varying_like(out_shape, inputs) -> tuple:
    """Inside `jax.shard_map(check_vma=True)` (the MoE layer's mesh path) Pallas must be told over
    which mesh axes its outputs (a `ShapeDtypeStruct` or a tuple of them) vary: the union of the
    inputs' varying axes. The inputs are cast to that union too, since the kernel reads them all
    as one per-device program."""
    varying, inputs = vary_to_union(inputs)
    if not varying:
        return out_shape, inputs
    mat = jax.sharding.ManualAxisType(varying=varying)
    return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=mat), out_shape), inputs


def _launch(kernel, inputs, *, out_shape, grid, num_warps: int, num_stages: int, interpret: bool, name: str,
            out_init):
    """pallas_call with the project's compiler params. `out_shape` may be a tuple (several outputs)
    when there is no `out_init`. `out_init`, if given, is aliased as the output buffer: tests pass
    NaN there to prove that every output element gets written."""
    if out_init is None:
        call_kernel, aliases = kernel, {}
    else:
        if out_init.shape != out_shape.shape or out_init.dtype != out_shape.dtype:
            raise ValueError(f"out_init must be {out_shape}; got {out_init.shape} {out_init.dtype}.")
        inputs = (*inputs, out_init)
        aliases = {len(inputs) - 1: 0}

        def call_kernel(*refs):
            return kernel(*refs[:-2], refs[-1])  # drop the aliased input ref

    if interpret and jax.sharding.get_abstract_mesh().manual_axes:
        raise ValueError(
            f"{name}: the Pallas interpreter (off GPU) cannot run inside shard_map; use "
            "backend='auto' or 'xla' on meshes of CPU devices."
        )
    out_shape, inputs = _varying_like(out_shape, inputs)
    return pl.pallas_call(
        call_kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)


def _pow2_at_least(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _gmm_by_group_kernel(
    sizes_ref, lhs_ref, rhs_ref, out_ref, *, num_groups: int, num_slots: int, num_fill: int, m: int,
    n: int, k: int, config: TileConfig, transpose_rhs: bool, precision,
):
    bm = config.block_m
    num_n = _cdiv(n, config.block_n)
    pid = pl.program_id(0)
    slot, n_blk = pid // num_n, pid % num_n
    n0 = pl.multiple_of(n_blk * config.block_n, config.block_n)
    # Each program finds its group's rows from the raw sizes (one vector load, a cumsum and a few
    # sums), so the launch needs no schedule arrays: nothing runs before this kernel.
    e_pad = max(16, _pow2_at_least(num_groups))
    idx = jnp.arange(e_pad, dtype=jnp.int32)
    sizes = jnp.maximum(_load(sizes_ref.at[pl.ds(0, e_pad)], idx < num_groups), 0)
    # Slot j < num_slots serves the j-th group with rows (at most min(E, M) groups have any), so
    # at decode every group program has work and none of the E - active idle ones is launched.
    active_before = jnp.cumsum((sizes > 0).astype(jnp.int32))  # inclusive count of active groups
    group = jnp.sum((active_before <= slot).astype(jnp.int32))  # index of the slot-th active group
    is_group = (slot < num_slots) & (group < num_groups)
    before = jnp.minimum(jnp.sum(jnp.where(idx < group, sizes, 0)), m)
    total = jnp.minimum(jnp.sum(sizes), m)
    group_end = jnp.minimum(before + jnp.sum(jnp.where(idx == group, sizes, 0)), m)
    # Group programs walk their group's row tiles; the `num_fill` fill programs (slots past
    # `num_slots`) share the rows past the last group, tile j going to fill program j % num_fill.
    # Slots without an active group walk nothing.
    # Selects on int32 values only: a select of two Python literals lowers to i1 in Triton.
    is_fill = slot >= num_slots
    first = jnp.where(is_group, before, total + (slot - num_slots) * bm)
    end = jnp.where(is_group, group_end, jnp.where(is_fill, jnp.int32(m), first))
    stride = (1 + (1 - is_group.astype(jnp.int32)) * (num_fill - 1)) * bm
    tiles = jnp.maximum(end - first + stride - 1, 0) // stride
    k_steps = is_group.astype(jnp.int32) * _cdiv(k, config.block_k)
    group = jnp.minimum(group, num_groups - 1)

    def tile(j, carry):
        start = first + j * stride
        _row_tile(lhs_ref, rhs_ref, out_ref, group=group, start=start, end=jnp.minimum(start + bm, end),
                  n0=n0, k_steps=k_steps, n=n, k=k, config=config, transpose_rhs=transpose_rhs,
                  precision=precision)
        return carry

    lax.fori_loop(0, tiles, tile, 0)


def gmm_by_group_pallas(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool,
    config: TileConfig, out_dtype, precision, interpret: bool, num_fill: int = 8,
    out_init: jax.Array | None = None,
) -> jax.Array:
    """Launch the group-major kernel: one program per (active-group slot, column block) walks
    that group's row tiles, plus `num_fill` programs per column block that zero the rows past the
    last group. There are `min(E, M)` slots: slot j serves the j-th group with rows.

    For decode-sized problems (a few rows per group): no schedule is built on device, the launch
    is the only kernel, and only as many group programs as rows can exist (8 of 128 experts at one
    token, top-8). Under heavy skew a hot group is walked by few programs, so prefill uses
    `gmm_pallas`. Expects validated shapes.
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    num_slots = min(num_groups, m)
    num_fill = max(1, min(num_fill, _cdiv(m, config.block_m)))
    grid = ((num_slots + num_fill) * _cdiv(n, config.block_n),)
    kernel = functools.partial(
        _gmm_by_group_kernel, num_groups=num_groups, num_slots=num_slots, num_fill=num_fill, m=m, n=n,
        k=k, config=config, transpose_rhs=transpose_rhs, precision=precision,
    )
    return _launch(
        kernel, (group_sizes.astype(jnp.int32), lhs, rhs),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=grid, num_warps=config.num_warps,
        num_stages=config.num_stages, interpret=interpret, name="moe_jax_gmm_by_group", out_init=out_init,
    )


def _tgmm_kernel(
    offsets_ref, lhs_ref, dout_ref, out_ref, *, n: int, k: int, config: TileConfig, precision,
):
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    num_n, num_k = _cdiv(n, bn), _cdiv(k, bk)
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
        d = _load(dout_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], _outer_and(rows_ok, cols_n_ok if n % bn else None, (bm, bn)))
        a = _load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], _outer_and(rows_ok, cols_k_ok if k % bk else None, (bm, bk)))
        return acc + plgpu.dot(d, a, trans_a=True, precision=precision)

    # An empty group runs no steps and stores exact zeros.
    acc = lax.fori_loop(0, _cdiv(end - start, bm), m_step, jnp.zeros((bn, bk), jnp.float32))
    plgpu.store(
        out_ref.at[group, pl.ds(n0, bn), pl.ds(k0, bk)],
        acc.astype(out_ref.dtype),
        mask=cols_n_ok[:, None] & cols_k_ok[None, :],
    )


def tgmm_pallas(
    lhs: jax.Array, dout: jax.Array, group_offsets_E1: jax.Array, *, config: TileConfig,
    out_dtype, precision, interpret: bool, out_init: jax.Array | None = None,
) -> jax.Array:
    """Launch the weight-gradient kernel: `out[e] = dout_e^T @ lhs_e`, `[E, N, K]`.

    `group_offsets_E1` from `clamp_group_sizes`. Expects validated shapes; `N, K > 0`.
    """
    k = lhs.shape[1]
    n = dout.shape[1]
    num_groups = group_offsets_E1.shape[0] - 1
    grid = (num_groups * _cdiv(n, config.block_n) * _cdiv(k, config.block_k),)
    kernel = functools.partial(_tgmm_kernel, n=n, k=k, config=config, precision=precision)
    return _launch(
        kernel, (group_offsets_E1, lhs, dout),
        out_shape=jax.ShapeDtypeStruct((num_groups, n, k), out_dtype), grid=grid, num_warps=config.num_warps,
        num_stages=config.num_stages, interpret=interpret, name="moe_jax_tgmm", out_init=out_init,
    )


def _gather_rows_kernel(rows_ref, x_ref, out_ref, *, m: int, start: int, size: int, total: int, zeros: bool,
                        d: int, block_rows: int, block_d: int):
    """One source's share of the gather: the rows whose id falls in `[start, start + size)` are
    copied; with `zeros`, rows whose id is outside `[0, total)` are written as zeros; every other
    row is left as the (aliased) output buffer holds it."""
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
    xs: tuple[jax.Array, ...], rows: jax.Array, *, block_rows: int, block_d: int, num_warps: int,
    interpret: bool, out_init: jax.Array | None = None,
) -> jax.Array:
    """Launch the row-gather kernel: `out[i] = concat(xs)[rows[i]]` (`[M, D]`), zero where
    `rows[i]` is outside `[0, sum N_i)`; the sources `xs` (`[N_i, D]`, one dtype, none empty) are
    never concatenated in memory. One program per (`block_rows` rows, `block_d` columns); each row
    is one contiguous vector load and store. Expects `M, D > 0` and int32 `rows`.

    One launch per source, in order, each writing its own rows into the previous launch's output
    (aliased; the first also writes the zero rows). A launch depends only on its own source, so
    XLA can run the first while a later source is still arriving (EP's regroup reads this rank's
    tokens and the peer block that a `ppermute` delivers).

    Row offsets are int32 inside the kernel: `N_i * D` and `M * D` must stay below 2**31.
    """
    if not xs or any(x.shape[0] == 0 for x in xs):
        raise ValueError(f"gather_rows_pallas needs non-empty sources (drop empty ones first); got row counts "
                         f"{[x.shape[0] for x in xs]}.")
    d = xs[0].shape[1]
    m = rows.shape[0]
    total = sum(x.shape[0] for x in xs)
    out, start = out_init, 0
    for s, x in enumerate(xs):
        kernel = functools.partial(_gather_rows_kernel, m=m, start=start, size=x.shape[0], total=total,
                                   zeros=s == 0, d=d, block_rows=block_rows, block_d=block_d)
        out = _launch(
            kernel, (rows, x), out_shape=jax.ShapeDtypeStruct((m, d), x.dtype),
            grid=(_cdiv(m, block_rows), _cdiv(d, block_d)), num_warps=num_warps, num_stages=1,
            interpret=interpret, name="moe_jax_gather_rows", out_init=out,
        )
        start += x.shape[0]
    return out


def _send_plan_kernel(*refs, routes: int, num_experts: int, local: int, ep: int, capacity: int, top_k: int,
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
        0, _cdiv(routes, chunk), body, (zeros(ep_pow2), zeros(ep_pow2), zeros(block), zeros(block), zeros(e_block)))

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
    send_sizes_P)`, int32, as `moe_jax.ops.send_plan.plan_sends` documents them.

    `expert_R` int32 `[R]`, R > 0; `real_R` int32 `[R]` (nonzero = real token) or None. One
    program per `block` routes, each looping over all R routes `chunk` at a time: R*R/block
    compares per program, so this suits small R (decode); `plan_sends` picks XLA for large R.
    """
    routes = expert_R.shape[0]
    grid = _cdiv(routes, block)
    ep_pow2 = max(2, _pow2_at_least(ep))
    e_block = _pow2_at_least(_cdiv(num_experts, grid))
    s_block = _pow2_at_least(_cdiv(send_rows + 1, grid))  # + 1: the spare row of not-kept lanes
    kernel = functools.partial(
        _send_plan_kernel, routes=routes, num_experts=num_experts, local=num_experts // ep, ep=ep,
        capacity=capacity, top_k=top_k, padded=padded, masked=real_R is not None, block=block,
        chunk=chunk, ep_pow2=ep_pow2, e_block=e_block, s_block=s_block, send_rows=send_rows,
    )
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    out_shape = (i32((grid * block,)), i32((grid * s_block,)), i32((grid * e_block,)), i32((ep_pow2,)),
                 i32((ep_pow2,)))
    rows, ids, kept, counts, sizes = _launch(
        kernel, (expert_R,) if real_R is None else (expert_R, real_R), out_shape=out_shape, grid=(grid,),
        num_warps=num_warps, num_stages=1, interpret=interpret, name="moe_jax_send_plan", out_init=None,
    )
    return rows[:routes], ids[:send_rows], kept[:num_experts], counts[:ep], sizes[:ep]
