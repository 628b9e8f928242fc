"""The `mosaic_gpu` backend's grouped GEMM: Pallas Mosaic GPU (TMA, wgmma, warp specialization, a
persistent tile loop) for the forward and the input gradient (`gmm_mosaic`).

Legend: M packed rows, K reduction width, N output width, E groups, W worst-case row tiles.

`out[M, N]`: rows of group e are `lhs_e @ rhs[e]^T` (rhs `[E, N, K]`, `transpose_rhs=True`) or
`lhs_e @ rhs[e]` (rhs `[E, K, N]`). The contract is the row-tile family's: tiles of `tile_m` rows
laid from each group's first row (rounded down to 8 rows, `aligned_tiles`, built before the launch),
tiles of the zero-fill pseudo-group store zeros, every output element is written once, fp32
accumulation.

Each CTA (one per SM) walks (row tile, column block) work items: one memory warpgroup streams
`[tile_m, tile_k]` blocks of the tile's rows and `[2 tile_n, tile_k]` blocks of its group's weight
into shared memory through TMA, `max_concurrent_steps` deep, while two compute warpgroups each
accumulate a `[tile_m, tile_n]` half with wgmma (Hopper's asynchronous warpgroup MMA; the pattern of
NVIDIA's CUTLASS "warp-specialized" Hopper GEMMs). A tile that starts within `tile_m` of the last
row reads the `tile_m` rows ending at M instead, so no read leaves `lhs`; the tile's own rows
`[start, end)` are stored from shared memory by up to `log2(tile_m) + 1` predicated TMA copies of
power-of-two heights (TMA boxes are static), rows of neighbouring groups that the tile also
computed are never stored.

`MosaicConfig.pipeline_across_items` runs a CTA's items as one pipeline of pipelines
(`pipeline_state`), so the next item's first stages load while this item's last MMAs and epilogue
run (where the K steps are a multiple of the stages). `out_buffer_rows` stores each warpgroup's tile
through a smaller buffer, in passes, so more stages fit.

Off GPU the same kernel runs in Pallas's GPU interpret mode (`plgpu.InterpretGPUParams`: shared
memory, warpgroups, barriers and TMA simulated on the CPU), which is how the tests check it there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.gmm.mosaic_gpu.config import ROW_ALIGN, MosaicConfig, runs_across_items
from moe_jax.ops.gmm.schedule import clamp_group_sizes
from moe_jax.ops.sharding import varying_output

__all__ = ["WorkItem", "aligned_tiles", "for_each_item", "gmm_mosaic", "group_tiles", "num_work_tiles",
           "operand_transforms", "store_rows"]


def aligned_tiles(group_sizes: jax.Array, *, num_rows: int, tile_m: int) -> jax.Array:
    """`[4, W]` int32 work list: per tile its group (E for the zero-fill pseudo-group of the rows
    past the last group), first and one-past-last row to store, and the first of the `tile_m` rows
    it reads (a multiple of `ROW_ALIGN`, at most `M - tile_m`).

    A group's tiles are laid from its first row rounded down to `ROW_ALIGN`, every `tile_m` rows,
    so each read starts on the 8-row tiling TMA needs here; a group costs at most one tile more
    than `ceil(size / tile_m)`. The tiles of real groups come first, in group order, then the
    zero-fill pseudo-group's; tiles past the list have `lo == hi == M`.
    """
    num_groups = group_sizes.shape[0]
    starts_G, ends_G, bases_G, tiles_G = _group_spans(group_sizes, num_rows, tile_m)
    tile_ends_G = jnp.cumsum(tiles_G).astype(jnp.int32)
    w = num_work_tiles(num_rows, num_groups, tile_m)
    t_W = jnp.arange(w, dtype=jnp.int32)
    g_W = jnp.minimum(jnp.sum(tile_ends_G[None, :] <= t_W[:, None], axis=1, dtype=jnp.int32), num_groups)
    j_W = t_W - (tile_ends_G[g_W] - tiles_G[g_W])
    first_W = bases_G[g_W] + j_W * tile_m
    in_use = t_W < tile_ends_G[-1]
    lo_W = jnp.where(in_use, jnp.maximum(starts_G[g_W], first_W), num_rows)
    hi_W = jnp.where(in_use, jnp.minimum(ends_G[g_W], first_W + tile_m), num_rows)
    read_W = jnp.minimum(first_W, num_rows - tile_m)
    return jnp.stack([jnp.where(in_use, g_W, num_groups), lo_W, hi_W, read_W]).astype(jnp.int32)


def _group_spans(group_sizes: jax.Array, num_rows: int, tile_m: int):
    """`[E + 1]` first row, one-past-last row, aligned first read and tile count of each group and
    of the zero-fill pseudo-group (the rows past the last group)."""
    starts_G = clamp_group_sizes(group_sizes, num_rows)
    ends_G = jnp.concatenate([starts_G[1:], jnp.array([num_rows], jnp.int32)])
    bases_G = starts_G // ROW_ALIGN * ROW_ALIGN
    tiles_G = jnp.where(ends_G > starts_G, (ends_G - bases_G + tile_m - 1) // tile_m, 0).astype(jnp.int32)
    return starts_G, ends_G, bases_G, tiles_G


def group_tiles(group_sizes: jax.Array, *, num_rows: int, tile_m: int) -> jax.Array:
    """`[E + 1]` int32: each group's tiles in `aligned_tiles`' list, the zero-fill pseudo-group's
    last; `tile_m * sum(group_tiles(...)[:-1])` are the rows the kernel multiplies."""
    return _group_spans(group_sizes, num_rows, tile_m)[3]


def num_work_tiles(num_rows: int, num_groups: int, tile_m: int) -> int:
    """Static bound on `aligned_tiles`' list: `sum_g ceil((size_g + ROW_ALIGN - 1) / tile_m)` over the
    E + 1 groups, which is at most `(M + (E + 1) (ROW_ALIGN + tile_m - 2)) / tile_m`."""
    return (num_rows + (num_groups + 1) * (ROW_ALIGN + tile_m - 2)) // tile_m


class WorkItem(NamedTuple):
    """One (row tile, column block) item of a CTA's persistent loop (`for_each_item`)."""

    group: jax.Array  # the tile's group; E for the zero-fill pseudo-group
    n_blk: jax.Array  # its column block
    start: jax.Array  # its first row stored
    end: jax.Array  # one past its last row stored
    a_start: jax.Array  # the first of the tile's rows read, a multiple of ROW_ALIGN
    index: jax.Array  # its place among this CTA's items
    mine: jax.Array  # how many of this CTA's items are of real groups (they come first)


def for_each_item(meta_ref, real_tiles_ref, *, num_tiles: int, n_iters: int):
    """Decorator running its body once per `WorkItem` of this CTA's share (CTAs stride over the
    items) of the `num_tiles * n_iters` (row tile of `aligned_tiles`' `meta_ref`, column block)
    items. The items of real groups come first in the list, `real_tiles_ref[0] * n_iters` of
    them, so this CTA's share of them is its first `mine` items; the rest store zeros or nothing."""
    def decorate(body):
        real_items = real_tiles_ref[0] * n_iters
        sm, num_ctas = lax.axis_index("sm"), lax.axis_size("sm")
        mine = jnp.maximum(real_items - sm + num_ctas - 1, 0) // num_ctas

        @plgpu.nd_loop((num_tiles * n_iters,), collective_axes="sm")
        def _(info):
            (it,) = info.index
            tile = it // n_iters
            body(WorkItem(group=meta_ref[0, tile], n_blk=it % n_iters, start=meta_ref[1, tile], end=meta_ref[2, tile],
                          a_start=pl.multiple_of(meta_ref[3, tile], ROW_ALIGN), index=info.local_index, mine=mine))

    return decorate


def store_rows(out, rows_smem, out_ref, *, start, end, a_start, cols):
    """Rows `[start, end)` of a warpgroup's `[tile_m, tile_n]` result `out` (which holds the rows
    from `a_start`), through the row-major `rows_smem` of `R` rows, `tile_m / R` passes of `R` rows
    (each pass waits for the previous one's copies to have read the buffer), each stored by one
    predicated TMA copy per set bit of its row count (TMA boxes are static)."""
    height = rows_smem.shape[0]
    for p in range(out.shape[0] // height):
        if p:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        rows_smem[...] = out[p * height:(p + 1) * height]
        plgpu.commit_smem()
        window = a_start + p * height
        lo, hi = jnp.maximum(start, window), jnp.minimum(end, window + height)
        count = jnp.maximum(hi - lo, 0)
        src, dst, box = lo - window, lo, height
        while box >= 1:
            part = count & box

            @pl.when(part != 0)
            def _(src=src, dst=dst, box=box):
                plgpu.copy_smem_to_gmem(rows_smem.at[pl.ds(src, box)], out_ref.at[pl.ds(dst, box), cols])

            src, dst = src + part, dst + part
            box //= 2


def operand_transforms(tile_k: int, dtype):
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _body(meta_ref, group_tiles_ref, a_ref, b_ref, out_ref, *, config: MosaicConfig, num_tiles: int,
          transpose_rhs: bool):
    """The cooperative schedule. `group_tiles_ref` `[1]`: how many of `meta_ref`'s tiles belong to
    real groups (they come first; the zero-fill tiles follow)."""
    tile_m, tile_n, tile_k, cta_n = config.tile_m, config.tile_n, config.tile_k, config.cta_n
    n, k = (b_ref.shape[1], b_ref.shape[2]) if transpose_rhs else (b_ref.shape[2], b_ref.shape[1])
    n_iters, k_iters = n // cta_n, k // tile_k
    across = runs_across_items(config, k_iters)
    dtype, out_dtype = a_ref.dtype, out_ref.dtype
    transforms = operand_transforms(tile_k, dtype)
    spec = functools.partial(plgpu.BlockSpec, transforms=transforms, memory_space=plgpu.SMEM)
    if transpose_rhs:
        b_spec = spec((cta_n, tile_k), lambda kk: (0, kk))
    else:
        b_spec = spec((tile_k, cta_n), lambda kk: (kk, 0))
    a_spec = spec((tile_m, tile_k), lambda kk: (0, kk))

    def pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, in_specs=[a_spec, b_spec], wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=config.max_concurrent_steps, compute_context=compute_context, pipeline_state=state,
        )

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    b_block = b_ref.at[0, pl.ds(0, cta_n), :] if transpose_rhs else b_ref.at[0, :, pl.ds(0, cta_n)]

    # Each compute warpgroup's output tile (or a `out_buffer_rows` slice of it), row-major for the
    # row ladder.
    out_alloc = plgpu.SMEM((2, config.out_buffer_rows or tile_m, tile_n), out_dtype)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(a_ref.at[pl.ds(0, tile_m), :], b_block),
        out_smem=out_alloc,
        collective_axes="wg",
    )
    def scope(allocations, out_smem):
        wg = lax.axis_index("wg")

        def epilogue(out, start, end, a_start, n_blk):
            """Store the compute warpgroup's `[tile_m, tile_n]` result `out` (rows `[start, end)`
            of its columns)."""
            cols = pl.ds(n_blk * cta_n + wg * tile_n, tile_n)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores read out_smem
            store_rows(out, out_smem.at[wg], out_ref, start=start, end=end, a_start=a_start, cols=cols)

        def mma(idx, a_smem, b_smem, acc_ref):
            half = pl.ds(wg * tile_n, tile_n)
            b = b_smem.at[half].T if transpose_rhs else b_smem.at[:, half]
            plgpu.wgmma(acc_ref, a_smem, b)
            plgpu.wgmma_wait(0)
            return acc_ref

        # With `across`, the first of this CTA's pipelines fills the stages, the last one drains
        # them, and a lone item has one of its own.
        @for_each_item(meta_ref, group_tiles_ref, num_tiles=num_tiles, n_iters=n_iters)
        def _(item):
            n_blk, start, end, a_start, j, mine = item.n_blk, item.start, item.end, item.a_start, item.index, item.mine

            def compute_context(run_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _(acc_ref):
                    run_pipeline(acc_ref)
                    epilogue(acc_ref[...].astype(out_dtype), start, end, a_start, n_blk)  # waits for every wgmma

            def run(state=None):
                group, b_cols = item.group, pl.ds(n_blk * cta_n, cta_n)
                b_group = b_ref.at[group, b_cols, :] if transpose_rhs else b_ref.at[group, :, b_cols]
                pipeline(mma, compute_context, state)(a_ref.at[pl.ds(a_start, tile_m), :], b_group,
                                                      allocations=allocations)

            if across:
                # int32 also under jax_enable_x64, where a select of Python ints would be int64.
                state = jnp.where(j == 0, jnp.int32(plgpu.PipelinePipeline.START),
                                  jnp.where(j == mine - 1, jnp.int32(plgpu.PipelinePipeline.STOP),
                                            jnp.int32(plgpu.PipelinePipeline.STEADY)))
                pl.when((j < mine) & (mine == 1))(run)
                pl.when((j < mine) & (mine > 1))(lambda: run(state))
            else:
                pl.when(j < mine)(run)

            # The zero-fill tiles (rows past the last group) store zeros without a pipeline, so the
            # MMA loop of the others carries no branch; tiles past the schedule have start == end.
            @pl.when((j >= mine) & (start < end) & (wg < 2))
            def _():
                zeros = plgpu.layout_cast(jnp.zeros((tile_m, tile_n), out_dtype), plgpu.Layout.WGMMA)
                epilogue(zeros, start, end, a_start, n_blk)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gmm_mosaic(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool, out_dtype,
               config: MosaicConfig, num_ctas: int, interpret: bool = False) -> jax.Array:
    """Launch the Mosaic GPU grouped GEMM with `config` on `group_sizes` `[E]` (clamped as
    `schedule.clamp_group_sizes` does) over a persistent grid of `num_ctas` CTAs (one per SM).
    Expects validated shapes that the backend supports (`config.shape_support`)."""
    m = lhs.shape[0]
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    meta_4W = aligned_tiles(group_sizes, num_rows=m, tile_m=config.tile_m)
    body = functools.partial(_body, config=config, num_tiles=meta_4W.shape[1], transpose_rhs=transpose_rhs)
    call = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(num_ctas,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    real_tiles_1 = jnp.sum(meta_4W[0] < num_groups, dtype=jnp.int32)[None]
    # Traced with 32-bit defaults: Mosaic GPU's pipelines loop over Python-int bounds, which under
    # jax_enable_x64 give 64-bit loop indices beside their 32-bit carries (a verifier error).
    with jax.enable_x64(False):
        operands = (meta_4W, real_tiles_1, lhs, rhs)
        # Inside shard_map the output varies as its operands do (`varying_output` says why).
        return varying_output(call(*operands), operands)
