"""The blockwise-FP8 grouped GEMM on Pallas Mosaic GPU (`gmm_fp8_mosaic`): the recipe of
`moe_jax.ops.fp8` (DeepSeek-V3, arXiv:2412.19437, section 3.3) on Hopper's e4m3 wgmma, warp
specialized.

Legend: M packed rows, K reduction width, N output width, E groups, Kb = K / 128 scale steps.

`out[M, N]`: rows of group e are `dequant(a_e) @ dequant(b[e])^T` with `a` e4m3 `[M, K]` scaled per
1 x 128 tile and `b` e4m3 `[E, N, K]` scaled per 128 x 128 block. The row-tile contract and the work
list are the 16-bit kernel's (`kernel.aligned_tiles`, `kernel.store_rows`): tiles laid from each
group's first row, the zero-fill pseudo-group's tiles store zeros, every output element written
once.

Why a second kernel: the recipe ends the tensor-core sum at every 128-wide K step, scales it and
adds it to an fp32 accumulator. A kernel that waits for its MMA before scaling leaves the tensor
cores idle while it scales. Here each CTA (one per SM, a persistent loop over (row tile, column
block) items) has one memory warpgroup streaming the step's `[128, 128]` rows, `[tile_n, 128]`
weight block and their scales through TMA, and compute warpgroups that each own 64 of the tile's
rows: each sums its step on the tensor cores from zero, waits, and promotes, and they run
unsynchronized, so one's promotion overlaps another's MMA (the ping-pong of CUTLASS's
warp-specialized FP8 Hopper GEMMs and DeepGEMM). `Fp8MosaicTiles` chooses one or two weight
blocks of columns an item and the stages.

Scales travel in the layouts TMA copies per step: the row scales as `[Kb, M]` (a step's scales
of the tile's rows are contiguous) and the block scales broadcast over their 128 columns,
`[E, Kb, N]` (the wrapper builds both; 4 bytes per row and per column a step).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.fp8 import BLOCK, Fp8Rows, Fp8Weights
from moe_jax.ops.gmm.mosaic_gpu.config import BARRIER_BYTES, RESERVED_BYTES, ROW_ALIGN
from moe_jax.ops.gmm.mosaic_gpu.kernel import aligned_tiles, for_each_item, operand_transforms, store_rows
from moe_jax.ops.sharding import varying_output

__all__ = ["Fp8MosaicTiles", "fp8_mosaic_smem_bytes", "fp8_mosaic_support", "fp8_mosaic_tiles", "gmm_fp8_mosaic"]

WG_ROWS = 64  # rows of the item each compute warpgroup owns (wgmma's M)
WARPGROUPS = 2  # compute warpgroups: a 128-row item
TILE_M = WARPGROUPS * WG_ROWS
SMEM_ALIGN = 1024  # where Mosaic GPU starts each shared-memory buffer


@dataclasses.dataclass(frozen=True)
class Fp8MosaicTiles:
    """Tiles of the Mosaic FP8 kernel's `[128, tile_n]` items (two compute warpgroups of 64 rows):
    `tile_n` columns (128 or 256: one or two weight blocks, each with its own scale a step) and
    `stages` TMA stages of one 128-wide K step.

    A compute warpgroup's registers hold its fp32 accumulators and the partial sum in flight (64 a
    thread per 64 x 128 tile). Three warpgroups (192-row items) and stages of two K blocks (a
    warpgroup promoting one while the next one's MMA runs) measured slower (docs/decisions.md)."""

    tile_n: int = BLOCK
    stages: int = 4

    def __post_init__(self):
        if self.tile_n not in (BLOCK, 2 * BLOCK) or not 1 <= self.stages <= 8:
            raise ValueError(f"{self}: tile_n {BLOCK} or {2 * BLOCK}, stages in [1, 8].")


def fp8_mosaic_tiles(n: int) -> Fp8MosaicTiles:
    """The tiles the FP8 path runs for `n` output columns: 128 x 256 items with 3 stages where N
    is a multiple of 256, else 128 x 128 with 4 (on one H200 the 256-wide items were 4-17% faster
    at the Qwen3-30B-A3B and Mixtral-8x7B forward shapes: a step's weight block is read once for
    twice the columns; 4 of their stages do not fit in shared memory)."""
    return Fp8MosaicTiles(tile_n=2 * BLOCK, stages=3) if n % (2 * BLOCK) == 0 else Fp8MosaicTiles(stages=4)


def fp8_mosaic_smem_bytes(tiles: Fp8MosaicTiles, out_dtype) -> int:
    """Shared memory the kernel allocates: the stages of the e4m3 rows, their fp32 scales, the
    weight block(s) and theirs, each compute warpgroup's `[64, 128]` output buffer, each buffer
    starting on a multiple of `SMEM_ALIGN` (128-byte swizzled tiles need 1024-byte alignment: a
    buffer the size of none of those leaves a gap), then two barriers per stage (loaded, consumed); exact
    against Mosaic GPU's lowering for sm_90 (tests/test_fp8_mosaic.py), plus `RESERVED_BYTES` as
    the 16-bit kernel's model keeps."""
    per_stage = (TILE_M * BLOCK, 4 * TILE_M, tiles.tile_n * BLOCK, 4 * tiles.tile_n)
    buffers = [tiles.stages * b for b in per_stage]
    buffers.append(WARPGROUPS * WG_ROWS * BLOCK * jnp.dtype(out_dtype).itemsize)
    offset = 0
    for size in buffers:
        offset = -(-offset // SMEM_ALIGN) * SMEM_ALIGN + size
    return offset + 2 * tiles.stages * BARRIER_BYTES + RESERVED_BYTES


def fp8_mosaic_support(m: int, n: int, k: int, tiles: Fp8MosaicTiles, out_dtype, smem_limit: int) -> str | None:
    """None where the kernel takes `[M, K]` rows against `[E, N, K]` weights with `tiles` in
    `smem_limit` bytes of shared memory per block, else why not."""
    if n % tiles.tile_n or k % BLOCK:
        return f"the Mosaic FP8 kernel needs N % {tiles.tile_n} == 0 and K % {BLOCK} == 0; got N={n}, K={k}"
    if m < TILE_M or m % ROW_ALIGN:
        return f"the Mosaic FP8 kernel needs M >= {TILE_M} and M % {ROW_ALIGN} == 0; got M={m}"
    need = fp8_mosaic_smem_bytes(tiles, out_dtype)
    if need > smem_limit:
        return f"the Mosaic FP8 kernel's {tiles} need {need} B of shared memory, over the {smem_limit} B per block here"
    return None


def _body(meta_ref, real_tiles_ref, a_ref, a_scale_ref, b_ref, b_scale_ref, out_ref, *, tiles: Fp8MosaicTiles,
          num_tiles: int):
    tile_m, tile_n, wgs = TILE_M, tiles.tile_n, WARPGROUPS
    n, k = b_ref.shape[1], b_ref.shape[2]
    n_iters, k_steps = n // tile_n, k // BLOCK
    out_dtype = out_ref.dtype
    col_blocks = tile_n // BLOCK  # each with its own block scale; summed and promoted one at a time
    spec = functools.partial(plgpu.BlockSpec, transforms=operand_transforms(BLOCK, a_ref.dtype),
                             memory_space=plgpu.SMEM)
    in_specs = [spec((tile_m, BLOCK), lambda kk: (0, kk)),  # rows
                plgpu.BlockSpec((1, tile_m), lambda kk: (kk, 0), memory_space=plgpu.SMEM),  # their scales
                spec((tile_n, BLOCK), lambda kk: (0, kk)),  # weight block(s)
                plgpu.BlockSpec((1, tile_n), lambda kk: (kk, 0), memory_space=plgpu.SMEM)]  # per column

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=40, in_specs=in_specs, wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=min(tiles.stages, k_steps), compute_context=compute_context)

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    operands = (a_ref.at[pl.ds(0, tile_m), :], a_scale_ref.at[:, pl.ds(0, tile_m)], b_ref.at[0, pl.ds(0, tile_n), :],
                b_scale_ref.at[0, :, pl.ds(0, tile_n)])

    @functools.partial(pl.run_scoped, allocations=pipeline(ignore, ignore).get_allocations(*operands),
                       out_smem=plgpu.SMEM((wgs, WG_ROWS, BLOCK), out_dtype), collective_axes="wg")
    def scope(allocations, out_smem):
        wg = lax.axis_index("wg")
        mine_rows = pl.ds(wg * WG_ROWS, WG_ROWS)
        shape = (WG_ROWS, BLOCK)

        def epilogue(outs, start, end, a_start, n_blk):
            for c, out in enumerate(outs):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read out_smem
                store_rows(out, out_smem.at[wg], out_ref, start=start, end=end, a_start=a_start + wg * WG_ROWS,
                           cols=pl.ds(n_blk * tile_n + c * BLOCK, BLOCK))

        def step(_, a_smem, a_scale_smem, b_smem, b_scale_smem, accs):
            rows = plgpu.load(a_scale_smem.at[0, mine_rows], layout=plgpu.Layout.WGMMA.reduce(1))
            new = []
            for c, acc in enumerate(accs):
                # A 128 x 128 block has one scale (its columns carry it repeated for TMA): taken
                # into the rows' scales before this warpgroup waits for its MMA, so promoting is
                # one FMA an element.
                folded = rows * b_scale_smem[0, c * BLOCK]

                def product(part_ref, c=c):
                    ks = pl.ds(0, BLOCK)
                    plgpu.wgmma(part_ref, a_smem.at[mine_rows, ks], b_smem.at[pl.ds(c * BLOCK, BLOCK), ks].T)
                    return part_ref[...]  # the scope waits for this warpgroup's MMA

                part = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
                new.append(acc + part * lax.broadcast_in_dim(folded, shape, [0]))
            return tuple(new)

        @for_each_item(meta_ref, real_tiles_ref, num_tiles=num_tiles, n_iters=n_iters)
        def _(item):
            n_blk, start, end, a_start = item.n_blk, item.start, item.end, item.a_start

            def compute_context(run_pipeline):
                zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
                accs = run_pipeline((zeros,) * col_blocks)
                epilogue([acc.astype(out_dtype) for acc in accs], start, end, a_start, n_blk)

            @pl.when(item.index < item.mine)
            def _():
                group, cols = item.group, pl.ds(n_blk * tile_n, tile_n)
                rows = pl.ds(a_start, tile_m)
                pipeline(step, compute_context)(a_ref.at[rows, :], a_scale_ref.at[:, rows], b_ref.at[group, cols, :],
                                                b_scale_ref.at[group, :, cols], allocations=allocations)

            @pl.when((item.index >= item.mine) & (start < end) & (wg < wgs))
            def _():
                zeros = plgpu.layout_cast(jnp.zeros(shape, out_dtype), plgpu.Layout.WGMMA)
                epilogue([zeros] * col_blocks, start, end, a_start, n_blk)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gmm_fp8_mosaic(rows: Fp8Rows, weights: Fp8Weights, group_sizes: jax.Array, *, out_dtype, num_ctas: int,
                   tiles: Fp8MosaicTiles, interpret: bool = False) -> jax.Array:
    """`[M, N]` of `out_dtype`: the recipe's grouped GEMM of `rows` `[M, K]` against `weights`
    `[E, N, K]` on `group_sizes` `[E]` (clamped as `schedule.clamp_group_sizes` does), over a
    persistent grid of `num_ctas` CTAs. Expects shapes `fp8_mosaic_support` accepts; rows past the
    groups come out zero."""
    values_MK, scale_MKb = rows
    values_ENK, scale_ENbKb = weights
    m = values_MK.shape[0]
    num_groups, n, _ = values_ENK.shape
    scale_KbM = scale_MKb.T
    # One scale per column and step: each 128 x 128 block's scale repeated over its 128 columns.
    scale_EKbN = jnp.repeat(jnp.swapaxes(scale_ENbKb, 1, 2), BLOCK, axis=2)
    meta_4W = aligned_tiles(group_sizes, num_rows=m, tile_m=TILE_M)
    body = functools.partial(_body, tiles=tiles, num_tiles=meta_4W.shape[1])
    call = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(num_ctas,), grid_names=("sm",),
        num_threads=WARPGROUPS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    real_tiles_1 = jnp.sum(meta_4W[0] < num_groups, dtype=jnp.int32)[None]
    with jax.enable_x64(False):  # as `kernel.gmm_mosaic`: Mosaic's pipelines loop in 32 bits
        operands = (meta_4W, real_tiles_1, values_MK, scale_KbM, values_ENK, scale_EKbN)
        # Inside shard_map the output varies as its operands do (`varying_output` says why).
        return varying_output(call(*operands), operands)
