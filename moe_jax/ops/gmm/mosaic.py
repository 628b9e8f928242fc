"""The `mosaic_gpu` backend's grouped GEMMs: Pallas Mosaic GPU (TMA, wgmma, warp specialization,
a persistent tile loop), for the forward and the input gradient (`gmm_mosaic`), and the weight
gradient (`tgmm_mosaic`).

Legend: M packed rows, K reduction width, N output width, E groups, W worst-case row tiles.

`out[M, N]`: rows of group e are `lhs_e @ rhs[e]^T` (rhs `[E, N, K]`, `transpose_rhs=True`) or
`lhs_e @ rhs[e]` (rhs `[E, K, N]`). The contract is `row_tile`'s: tiles of `tile_m` rows laid from
each group's first row (rounded down to 8 rows, `aligned_tiles`, built before the launch), tiles
of the zero-fill pseudo-group store zeros, every output element is written once, fp32
accumulation.

Each CTA (one per SM) walks (row tile, column block) work items: one memory warpgroup streams
`[tile_m, tile_k]` blocks of the tile's rows and `[2 tile_n, tile_k]` blocks of its group's weight
into shared memory through TMA, `max_concurrent_steps` deep, while two compute warpgroups each
accumulate a `[tile_m, tile_n]` half with wgmma (Hopper's asynchronous warpgroup MMA; the pattern of
NVIDIA's CUTLASS "warp-specialized" Hopper GEMMs). A tile that starts within `tile_m` of the last
row reads the `tile_m` rows ending at M instead, so no read leaves `lhs`; the tile's own rows `[start, end)` are stored from shared memory by up to `log2(tile_m) + 1`
predicated TMA copies of power-of-two heights (TMA boxes are static), rows of neighbouring groups
that the tile also computed are never stored.

Two `MosaicConfig` options, off by default: `mma_in_flight=1` keeps one wgmma running while the
next K step's is issued (the pipeline releases each stage one step late, `delay_release`), instead
of waiting for each; `epilogue_tile_m` stores full tiles (whose rows are exactly their 8-row aligned
read window) through a swizzled, tiled buffer, one TMA copy per sub-tile of `epilogue_tile_m` rows,
which spares the row-major buffer's shared-memory bank conflicts. Partial tiles keep the ladder,
whose boxes start on any row; both views share each warpgroup's tile of shared memory.

`pipeline_across_items=True` runs a CTA's items as one pipeline of pipelines (`pipeline_state`),
so the next item's first stages load while this item's last MMAs and epilogue run (where the K
steps are a multiple of the stages). `out_buffer_rows` stores each warpgroup's tile through a
smaller buffer, in passes, so more stages fit. `mosaic_config` (the configuration run when none is
passed) takes both, with 4 stages, where K has at most `SHORT_K_STEPS` steps.

`schedule="pingpong"` (`_pingpong_body`) gives each compute warpgroup every other work item, a
`tile_m x tile_n` tile and a ring of stages of its own, so one warpgroup's epilogue can run under
the other's MMAs. It is opt-in: measured slower than the cooperative schedule above
(docs/backends.md).

The weight gradient `out[E, N, K]`, `out[e] = dout_e^T @ lhs_e`: one work item per (group,
`tile_n x tile_k` block), persistent over the SMs; one warpgroup walks the group's rows in blocks
of `tile_r` laid on the global `tile_r` grid (a TMA pipeline of `max_concurrent_steps` stages,
wgmma with the dout block read transposed from shared memory). The first and last blocks of a group
also hold other rows: they are zeroed in shared memory, in both operands (rows past the last group
may hold anything, NaN included), before their MMA. An empty group's block is stored as zeros.
One writer per element, no atomics: the same bits on every run.

Off GPU the same kernels run in Pallas's GPU interpret mode (`plgpu.InterpretGPUParams`: shared
memory, warpgroups, barriers and TMA simulated on the CPU), which is how the tests check it there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.ops.gmm.schedule import clamp_group_sizes

__all__ = ["MosaicConfig", "MosaicWgradConfig", "ROW_ALIGN", "SHORT_K", "SHORT_K_STEPS", "SMEM_BYTES", "aligned_tiles",
           "gmm_mosaic", "mosaic_config", "mosaic_supports", "mosaic_wgrad_supports", "num_work_tiles", "smem_bytes",
           "tgmm_mosaic"]

H200_SMS = 132
ROW_ALIGN = 8  # TMA boxes into the swizzled tiles start on a multiple of the 8-row tiling
EPILOGUE_ROWS = 64  # Mosaic slices the wgmma accumulator's registers in blocks of 64 rows
SCHEDULES = ("cooperative", "pingpong")


def _check_tiles(config, names: tuple[str, ...], *, min_steps: int) -> None:
    kind = type(config).__name__
    for name in names:
        v = getattr(config, name)
        if not isinstance(v, int) or v < 64 or v & (v - 1):
            raise ValueError(f"{kind}.{name}={v!r}: must be a power of two >= 64 (wgmma tiles).")
    steps = config.max_concurrent_steps
    if not isinstance(steps, int) or not min_steps <= steps <= 8:
        raise ValueError(f"{kind}.max_concurrent_steps={steps!r}: must be in [{min_steps}, 8].")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiles of the Mosaic GPU kernel: `tile_m` rows x `2 * tile_n` columns per CTA (one
    `tile_n` half per compute warpgroup), K steps of `tile_k`, `max_concurrent_steps` TMA stages.

    `mma_in_flight`: wgmmas left running when the next K step's is issued, 0 or 1 (1 releases each
    stage one step late, so it needs two stages). `epilogue_tile_m`: None stores every tile through
    the row ladder; a power of two in `[64, tile_m]` stores full tiles through swizzled sub-tiles of
    that many rows instead.

    `schedule`: `"cooperative"` (both compute warpgroups on one `tile_m x 2 tile_n` item) or
    `"pingpong"` (each warpgroup on its own `tile_m x tile_n` item, every other item of the CTA,
    through a ring of `max_concurrent_steps` stages of its own, so one warpgroup's epilogue runs
    while the other multiplies).

    `pipeline_across_items` (cooperative schedule, `mma_in_flight=0`): the memory warpgroup runs
    one pipeline over all the K steps of its CTA's items, so the next item's first stages load
    while this item's last MMAs and its epilogue run, instead of filling and draining the stages
    at every item. It applies where the K steps are a multiple of the stages in use
    (`min(max_concurrent_steps, K / tile_k)`); other shapes run one pipeline per item.

    `out_buffer_rows` (row-ladder epilogue): rows of each warpgroup's shared-memory output buffer,
    None for `tile_m`; a power of two in `[64, tile_m]` stores the tile in `tile_m / out_buffer_rows`
    passes through a smaller buffer, which leaves shared memory for more stages (128 x 256 x 64
    tiles fit 4 stages with 64 rows).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3
    mma_in_flight: int = 0
    epilogue_tile_m: int | None = None
    schedule: str = "cooperative"
    pipeline_across_items: bool = False
    out_buffer_rows: int | None = None

    @property
    def cta_n(self) -> int:
        """Columns of one CTA's work item: both warpgroups' halves, or (ping-pong) one warpgroup's."""
        return self.tile_n if self.schedule == "pingpong" else 2 * self.tile_n

    def __post_init__(self):
        _check_tiles(self, ("tile_m", "tile_n", "tile_k"), min_steps=1)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"MosaicConfig.schedule={self.schedule!r}: use one of {SCHEDULES}.")
        if self.schedule == "pingpong" and (self.mma_in_flight or self.epilogue_tile_m is not None):
            raise ValueError("MosaicConfig(schedule='pingpong') takes neither mma_in_flight nor epilogue_tile_m "
                             "(they are options of the cooperative schedule); leave them at 0 and None.")
        if self.pipeline_across_items and (self.schedule != "cooperative" or self.mma_in_flight):
            raise ValueError("MosaicConfig.pipeline_across_items=True needs schedule='cooperative' and mma_in_flight=0 "
                             "(a stage released one step late cannot pass to the next item's pipeline); "
                             f"got schedule={self.schedule!r}, mma_in_flight={self.mma_in_flight}.")
        if self.mma_in_flight not in (0, 1):
            raise ValueError(f"MosaicConfig.mma_in_flight={self.mma_in_flight!r}: must be 0 (wait for each wgmma) "
                             "or 1 (keep one in flight).")
        if self.mma_in_flight and self.max_concurrent_steps < 2:
            raise ValueError(
                f"MosaicConfig.mma_in_flight=1 releases each stage one step late, so it needs max_concurrent_steps "
                f">= 2; got {self.max_concurrent_steps}. Raise max_concurrent_steps or set mma_in_flight=0.")
        r = self.out_buffer_rows
        if r is not None and (not isinstance(r, int) or r < EPILOGUE_ROWS or r & (r - 1) or r > self.tile_m):
            raise ValueError(
                f"MosaicConfig.out_buffer_rows={r!r}: must be None (a buffer of tile_m rows) or a power of two in "
                f"[{EPILOGUE_ROWS}, tile_m={self.tile_m}] (the accumulator splits in {EPILOGUE_ROWS}-row blocks).")
        if r is not None and self.epilogue_tile_m is not None:
            raise ValueError("MosaicConfig.out_buffer_rows and epilogue_tile_m are two epilogues (the row ladder through "
                             "a smaller buffer, the swizzled sub-tiles); set at most one of them.")
        e = self.epilogue_tile_m
        if e is not None and (not isinstance(e, int) or e < EPILOGUE_ROWS or e & (e - 1) or e > self.tile_m):
            raise ValueError(
                f"MosaicConfig.epilogue_tile_m={e!r}: must be None (the row ladder for every tile) or a power of two "
                f"in [{EPILOGUE_ROWS}, tile_m={self.tile_m}] (the accumulator splits in {EPILOGUE_ROWS}-row blocks).")


SMEM_BYTES = 227 * 1024  # shared memory per block on sm_90 (opt-in maximum)


def smem_bytes(config: MosaicConfig, dtype, out_dtype) -> int:
    """Shared memory the kernel allocates: the pipeline's A and B stages (one ring per warpgroup
    with `schedule="pingpong"`) and the two warpgroups' output tiles (which `epilogue_tile_m`'s
    swizzled sub-tiles alias)."""
    rings = 2 if config.schedule == "pingpong" else 1
    stages = rings * config.max_concurrent_steps * (config.tile_m + config.cta_n) * config.tile_k
    out_rows = config.out_buffer_rows or config.tile_m
    return stages * jnp.dtype(dtype).itemsize + 2 * out_rows * config.tile_n * jnp.dtype(out_dtype).itemsize


# The most K steps at which `mosaic_config` runs one pipeline across items with 4 stages: on an H200
# that gained 1-15% on most cells at 12-32 steps and lost 2-12% at 64-112 (docs/decisions.md, "Mosaic forward rule").
SHORT_K_STEPS = 32
SHORT_K = MosaicConfig(max_concurrent_steps=4, pipeline_across_items=True, out_buffer_rows=64)


def _runs_across_items(config: MosaicConfig, k_steps: int) -> bool:
    """Whether `config.pipeline_across_items` applies at `k_steps` K steps. The pipeline shrinks its
    stages to the K steps; passing stages from one item's pipeline to the next keeps each stage's
    barrier phase only when every item uses all of them equally often."""
    return config.pipeline_across_items and k_steps % min(config.max_concurrent_steps, k_steps) == 0


def mosaic_config(k: int, dtype, out_dtype=None) -> MosaicConfig:
    """The configuration `gmm_mosaic` runs for a reduction width `k` when none is given: 128 x 256 x 64
    tiles; where K has at most `SHORT_K_STEPS` steps, one pipeline across items applies to them (4,
    or fewer than 4, divides them) and the tiles fit, 4 stages through 64-row output buffers in one
    pipeline across each CTA's items (`SHORT_K`), else 3 stages per item (`MosaicConfig()`). Short
    reductions are where filling and draining the stages at every item costs most of an item."""
    steps = k // SHORT_K.tile_k
    short = 0 < steps <= SHORT_K_STEPS and _runs_across_items(SHORT_K, steps)
    return SHORT_K if short and smem_bytes(SHORT_K, dtype, out_dtype or dtype) <= SMEM_BYTES else MosaicConfig()


def mosaic_supports(m: int, n: int, k: int, dtype, config: MosaicConfig | None = None, out_dtype=None) -> bool:
    """Whether the kernel takes this shape: bf16/fp16, `N` a multiple of the CTA width
    (`config.cta_n`), `K` of `tile_k`, at least `tile_m` rows and a multiple of `ROW_ALIGN`, and
    tiles that fit in shared memory. `config=None` checks `mosaic_config`'s choice."""
    config = mosaic_config(k, dtype, out_dtype) if config is None else config
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and n % config.cta_n == 0
            and k % config.tile_k == 0 and m >= config.tile_m and m % ROW_ALIGN == 0
            and smem_bytes(config, dtype, out_dtype or dtype) <= SMEM_BYTES)


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


def _num_sms(interpret: bool) -> int:
    """CTAs of the persistent grid: one per SM of the GPU compiled for (an H200's 132 when lowering
    ahead of time without a core count); two in interpret mode, which simulates each CTA."""
    if interpret:
        return 2
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and getattr(device, "num_cores", None):
        return device.num_cores
    local = jax.devices()[0]
    return local.core_count if local.platform == "gpu" else H200_SMS


def _store_rows(out, rows_smem, out_ref, *, start, end, a_start, cols):
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


def _operand_transforms(tile_k: int, dtype):
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _pingpong_body(meta_ref, a_ref, b_ref, out_ref, *, config: MosaicConfig, num_groups: int, num_tiles: int,
                   transpose_rhs: bool):
    """`schedule="pingpong"`: the CTA's work items alternate between the two compute warpgroups
    (its local item j goes to warpgroup j % 2), each with a `tile_m x tile_n` item and a ring of
    `max_concurrent_steps` stages of its own. The memory warpgroup fills the rings in item order:
    it starts on item j + 1 once item j's last loads are issued, so warpgroup (j + 1) % 2 starts
    its MMAs while warpgroup j % 2 finishes and stores item j (CUTLASS's "ping-pong" Hopper
    schedule)."""
    tile_m, tile_n, tile_k, steps = config.tile_m, config.tile_n, config.tile_k, config.max_concurrent_steps
    n, k = (b_ref.shape[1], b_ref.shape[2]) if transpose_rhs else (b_ref.shape[2], b_ref.shape[1])
    n_iters, k_iters = n // tile_n, k // tile_k
    dtype, out_dtype = a_ref.dtype, out_ref.dtype
    transforms = _operand_transforms(tile_k, dtype)
    b_block = (tile_n, tile_k) if transpose_rhs else (tile_k, tile_n)
    items = (num_tiles * n_iters,)

    def item(it):
        """(group, first and one-past-last row to store, first row read, columns) of item `it`."""
        tile, n_blk = it // n_iters, it % n_iters
        return (meta_ref[0, tile], meta_ref[1, tile], meta_ref[2, tile], pl.multiple_of(meta_ref[3, tile], ROW_ALIGN),
                pl.ds(n_blk * tile_n, tile_n))

    @functools.partial(
        pl.run_scoped,
        a_smem=plgpu.SMEM((2, steps, tile_m, tile_k), dtype, transforms=transforms),
        b_smem=plgpu.SMEM((2, steps, *b_block), dtype, transforms=transforms),
        out_smem=plgpu.SMEM((2, config.out_buffer_rows or tile_m, tile_n), out_dtype),
        loaded=plgpu.Barrier(num_arrivals=2, num_barriers=2 * steps),  # the A and the B copy of a stage
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=2 * steps),
        collective_axes="wg",
    )
    def scope(a_smem, b_smem, out_smem, loaded, consumed):
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def memory():
            plgpu.set_max_registers(40, action="decrease")
            for slot in range(2 * steps):  # every stage starts empty
                plgpu.barrier_arrive(consumed.at[slot])

            # Carry: the stages each ring has been given so far.
            @plgpu.nd_loop(items, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
            def _(info, *, carry):
                (it,) = info.index
                ring = lax.rem(info.local_index, 2)
                group, start, end, a_start, cols = item(it)
                real = (start < end) & (group < num_groups)
                given = jnp.where(ring == 0, carry[0], carry[1])
                g = jnp.minimum(group, num_groups - 1)

                @pl.when(real)
                def _():
                    @pl.loop(0, k_iters)
                    def _(kk):
                        stage = lax.rem(given + kk, steps)
                        slot = ring * steps + stage
                        plgpu.barrier_wait(consumed.at[slot])
                        ks = pl.ds(kk * tile_k, tile_k)
                        plgpu.copy_gmem_to_smem(a_ref.at[pl.ds(a_start, tile_m), ks], a_smem.at[ring, stage],
                                                loaded.at[slot])
                        b_src = b_ref.at[g, cols, ks] if transpose_rhs else b_ref.at[g, ks, cols]
                        plgpu.copy_gmem_to_smem(b_src, b_smem.at[ring, stage], loaded.at[slot])

                used = jnp.where(real, k_iters, 0)
                return carry[0] + jnp.where(ring == 0, used, 0), carry[1] + jnp.where(ring == 1, used, 0)

            # Each stage's last release (one more than the waits above, from the initial arrival):
            # every load has been consumed before the barriers go.
            for slot in range(2 * steps):
                plgpu.barrier_wait(consumed.at[slot])

        @pl.when(wg < 2)
        def compute():
            plgpu.set_max_registers(232, action="increase")

            # Carry: the stages of this warpgroup's ring consumed so far.
            @plgpu.nd_loop(items, collective_axes="sm", init_carry=jnp.int32(0))
            def _(info, *, carry):
                taken = carry
                (it,) = info.index
                mine = lax.rem(info.local_index, 2) == wg
                group, start, end, a_start, cols = item(it)
                is_group = group < num_groups
                real = (start < end) & is_group

                def epilogue(out):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous stores
                    _store_rows(out, out_smem.at[wg], out_ref, start=start, end=end, a_start=a_start, cols=cols)

                @pl.when(mine & real)
                def _():
                    def multiply(acc_ref):
                        @pl.loop(0, k_iters)
                        def _(kk):
                            stage = lax.rem(taken + kk, steps)
                            slot = wg * steps + stage
                            plgpu.barrier_wait(loaded.at[slot])
                            b = b_smem.at[wg, stage]
                            plgpu.wgmma(acc_ref, a_smem.at[wg, stage], b.T if transpose_rhs else b)
                            plgpu.wgmma_wait(0)
                            plgpu.barrier_arrive(consumed.at[slot])

                        return acc_ref[...]

                    epilogue(pl.run_scoped(multiply, plgpu.ACC((tile_m, tile_n), jnp.float32)).astype(out_dtype))

                # Zero-fill tiles (rows past the last group) load nothing and store zeros.
                @pl.when(mine & (start < end) & jnp.logical_not(is_group))
                def _():
                    epilogue(plgpu.layout_cast(jnp.zeros((tile_m, tile_n), out_dtype), plgpu.Layout.WGMMA))

                return taken + jnp.where(mine & real, k_iters, 0)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _body(meta_ref, group_tiles_ref, a_ref, b_ref, out_ref, *, config: MosaicConfig, num_tiles: int,
          transpose_rhs: bool):
    """The cooperative schedule. `group_tiles_ref` `[1]`: how many of `meta_ref`'s tiles belong to
    real groups (they come first; the zero-fill tiles follow)."""
    tile_m, tile_n, tile_k, cta_n = config.tile_m, config.tile_n, config.tile_k, config.cta_n
    n, k = (b_ref.shape[1], b_ref.shape[2]) if transpose_rhs else (b_ref.shape[2], b_ref.shape[1])
    n_iters, k_iters = n // cta_n, k // tile_k
    # A single K step has no next wgmma to overlap, and with delay_release the pipeline would never
    # release its only stage: the memory warpgroup could refill it for the next item while it is read.
    in_flight = config.mma_in_flight if k_iters > 1 else 0
    across = _runs_across_items(config, k_iters)
    dtype, out_dtype = a_ref.dtype, out_ref.dtype
    transforms = _operand_transforms(tile_k, dtype)
    spec = functools.partial(plgpu.BlockSpec, transforms=transforms, memory_space=plgpu.SMEM, delay_release=in_flight)
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

    # Each compute warpgroup's `[tile_m, tile_n]` output tile, row-major for the row ladder. With
    # `epilogue_tile_m` it is a union of that view and the swizzled sub-tiles over the same bytes,
    # one union per warpgroup: a view's lifetime then ends where the warpgroup's stores from it are
    # awaited, at the start of its next epilogue.
    epi_m = config.epilogue_tile_m
    if epi_m is None:
        out_alloc = plgpu.SMEM((2, config.out_buffer_rows or tile_m, tile_n), out_dtype)
    else:
        out_itemsize = jnp.dtype(out_dtype).itemsize
        out_swizzle = plgpu.find_swizzle(tile_n * out_itemsize * 8)
        out_transforms = (plgpu.TilingTransform((8, out_swizzle // out_itemsize)), plgpu.SwizzleTransform(out_swizzle))
        out_alloc = [plgpu.RefUnion(plgpu.SMEM((tile_m, tile_n), out_dtype),
                                    plgpu.SMEM((tile_m // epi_m, epi_m, tile_n), out_dtype, transforms=out_transforms))
                     for _ in range(2)]

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
            if epi_m is None:
                _store_rows(out, out_smem.at[wg], out_ref, start=start, end=end, a_start=a_start, cols=cols)
                return

            def store_tiles(tiles_smem):
                """All `tile_m` rows of `out`, from `a_start`, through the swizzled
                `[tile_m // epi_m, epi_m, tile_n]` `tiles_smem`: each sub-tile's copy runs while the
                next one is written."""
                for i in range(tile_m // epi_m):
                    tiles_smem[i] = out[i * epi_m:(i + 1) * epi_m]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(tiles_smem.at[i], out_ref.at[pl.ds(a_start + i * epi_m, epi_m), cols])

            # A tile whose rows are its whole read window (8-row aligned) fits the swizzled
            # sub-tiles; the others start or end at any row.
            full = (start == a_start) & (end == a_start + tile_m)

            def store(views):
                rows_smem, tiles_smem = views
                lax.cond(full, lambda: store_tiles(tiles_smem),
                         lambda: _store_rows(out, rows_smem, out_ref, start=start, end=end, a_start=a_start, cols=cols))

            lax.cond(wg == 0, lambda: store(out_smem[0]), lambda: store(out_smem[1]))

        def mma(idx, a_smem, b_smem, acc_ref):
            half = pl.ds(wg * tile_n, tile_n)
            b = b_smem.at[half].T if transpose_rhs else b_smem.at[:, half]
            plgpu.wgmma(acc_ref, a_smem, b)
            plgpu.wgmma_wait(in_flight)
            if in_flight:
                # The pipeline never releases the last step's stage (delay_release): the memory
                # warpgroup refills it for the next item once the step before is released,
                # right after this body, so the last wgmma must be done here.
                @pl.when(idx[0] == k_iters - 1)
                def _():
                    plgpu.wgmma_wait(0)

            return acc_ref

        # The items of real groups come first in the list (`aligned_tiles`), `real_items` of them;
        # this CTA's share of them is its first `mine` items. With `across`, the first of those
        # pipelines fills the stages, the last one drains them, and a lone item has one of its own.
        real_items = group_tiles_ref[0] * n_iters
        sm, num_ctas = lax.axis_index("sm"), lax.axis_size("sm")
        mine = jnp.maximum(real_items - sm + num_ctas - 1, 0) // num_ctas

        @plgpu.nd_loop((num_tiles * n_iters,), collective_axes="sm")
        def _(info):
            (it,) = info.index
            tile, n_blk = it // n_iters, it % n_iters
            start, end = meta_ref[1, tile], meta_ref[2, tile]
            a_start = pl.multiple_of(meta_ref[3, tile], ROW_ALIGN)

            def compute_context(run_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _(acc_ref):
                    run_pipeline(acc_ref)
                    epilogue(acc_ref[...].astype(out_dtype), start, end, a_start, n_blk)  # waits for every wgmma

            def run(state=None):
                group, b_cols = meta_ref[0, tile], pl.ds(n_blk * cta_n, cta_n)
                b_group = b_ref.at[group, b_cols, :] if transpose_rhs else b_ref.at[group, :, b_cols]
                pipeline(mma, compute_context, state)(a_ref.at[pl.ds(a_start, tile_m), :], b_group,
                                                      allocations=allocations)

            j = info.local_index
            if across:
                state = jnp.where(j == 0, plgpu.PipelinePipeline.START,
                                  jnp.where(j == mine - 1, plgpu.PipelinePipeline.STOP, plgpu.PipelinePipeline.STEADY))
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
               config: MosaicConfig | None = None, interpret: bool = False) -> jax.Array:
    """Launch the Mosaic GPU grouped GEMM on `group_sizes` `[E]` (clamped as
    `schedule.clamp_group_sizes` does), with `config` or `mosaic_config`'s choice. Expects validated
    shapes that `mosaic_supports`."""
    m, k = lhs.shape
    config = mosaic_config(k, lhs.dtype, out_dtype) if config is None else config
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if not mosaic_supports(m, n, k, lhs.dtype, config, out_dtype):
        raise ValueError(
            f"backend='mosaic_gpu' takes bf16/fp16 with N % {config.cta_n} == 0, K % {config.tile_k} == 0, "
            f"M >= {config.tile_m}, M % {ROW_ALIGN} == 0 and tiles within {SMEM_BYTES} bytes of shared memory; got M={m}, N={n}, K={k}, "
            f"{jnp.dtype(lhs.dtype).name} -> {jnp.dtype(out_dtype).name} ({smem_bytes(config, lhs.dtype, out_dtype)} "
            "bytes). Use backend='auto', which runs such shapes on another backend, or smaller tiles."
        )
    meta_4W = aligned_tiles(group_sizes, num_rows=m, tile_m=config.tile_m)
    if config.schedule == "pingpong":
        body = functools.partial(_pingpong_body, config=config, num_groups=num_groups, num_tiles=meta_4W.shape[1],
                                 transpose_rhs=transpose_rhs)
        operands = (meta_4W, lhs, rhs)
    else:
        body = functools.partial(_body, config=config, num_tiles=meta_4W.shape[1], transpose_rhs=transpose_rhs)
        operands = (meta_4W, jnp.sum(meta_4W[0] < num_groups, dtype=jnp.int32)[None], lhs, rhs)
    call = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(_num_sms(interpret),), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(*operands)


@dataclasses.dataclass(frozen=True)
class MosaicWgradConfig:
    """Tiles of the Mosaic GPU weight-gradient kernel: a `tile_n x tile_k` block of one group's
    gradient per work item, the group's rows walked `tile_r` at a time, `max_concurrent_steps`
    TMA stages."""

    tile_n: int = 128
    tile_k: int = 128
    tile_r: int = 64
    max_concurrent_steps: int = 4

    def __post_init__(self):
        # Two stages at least: each block is released one step late (`delay_release=1`), while
        # its wgmma may still read it.
        _check_tiles(self, ("tile_n", "tile_k", "tile_r"), min_steps=2)


def mosaic_wgrad_supports(m: int, n: int, k: int, dtype, config: MosaicWgradConfig = MosaicWgradConfig()) -> bool:
    """Whether the weight-gradient kernel takes `lhs [M, K]`, `dout [M, N]`: bf16/fp16, M a
    multiple of `tile_r`, N of `tile_n`, K of `tile_k`."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and m % config.tile_r == 0
            and n % config.tile_n == 0 and k % config.tile_k == 0 and m > 0)


def _wgrad_body(groups_ref, lhs_ref, dout_ref, out_ref, *, config: MosaicWgradConfig, n: int, k: int,
                num_groups: int):
    tile_n, tile_k, tile_r = config.tile_n, config.tile_k, config.tile_r
    n_iters, k_iters = n // tile_n, k // tile_k
    dtype = lhs_ref.dtype
    swizzle = plgpu.find_swizzle(min(tile_n, tile_k) * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
    out_itemsize = jnp.dtype(out_ref.dtype).itemsize
    out_swizzle = plgpu.find_swizzle(tile_k * out_itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // out_itemsize)), plgpu.SwizzleTransform(out_swizzle))
    m = lhs_ref.shape[0]

    @plgpu.nd_loop((num_groups, n_iters * k_iters), collective_axes="sm")
    def work(info):
        g, rest = info.index
        n_blk, k_blk = rest // k_iters, rest % k_iters
        start, end, first = groups_ref[0, g], groups_ref[1, g], groups_ref[2, g]
        num_blocks = groups_ref[3, g]
        first = pl.multiple_of(first, tile_r)

        def acc_scope(acc_ref):
            def step(idx, d_smem, a_smem):
                (r,) = idx

                # The first and last blocks hold rows of the neighbouring groups (or rows past the
                # last group, which may hold anything): zero them in both operands.
                @pl.when((r == 0) | (r == num_blocks - 1))
                def _():
                    row0 = first + r * tile_r
                    for smem, width in ((d_smem, tile_n), (a_smem, tile_k)):
                        rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (tile_r, width), 0), plgpu.Layout.WGMMA)
                        rows = rows + row0
                        smem[...] = jnp.where((rows >= start) & (rows < end), smem[...], jnp.zeros_like(smem[...]))
                    plgpu.commit_smem()

                plgpu.wgmma(acc_ref, d_smem.transpose((1, 0)), a_smem)

            @pl.when(num_blocks > 0)
            def _():
                plgpu.emit_pipeline(
                    step, grid=(num_blocks,),
                    in_specs=[
                        plgpu.BlockSpec((tile_r, tile_n), lambda r: (r, n_blk), delay_release=1, transforms=transforms),
                        plgpu.BlockSpec((tile_r, tile_k), lambda r: (r, k_blk), delay_release=1, transforms=transforms),
                    ],
                    max_concurrent_steps=config.max_concurrent_steps,
                )(dout_ref.at[pl.ds(first, m), :], lhs_ref.at[pl.ds(first, m), :])

            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, tile_k), jnp.float32))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tile_n, tile_k), out_ref.dtype, transforms=out_transforms))
        def _(o_smem):
            o_smem[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[g, pl.ds(n_blk * tile_n, tile_n), pl.ds(k_blk * tile_k, tile_k)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tgmm_mosaic(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, out_dtype,
                config: MosaicWgradConfig = MosaicWgradConfig(), interpret: bool = False) -> jax.Array:
    """`out[E, N, K]`, `out[e] = dout_e^T @ lhs_e`, on the Mosaic GPU weight-gradient kernel
    (sizes clamped as `schedule.clamp_group_sizes` does). Expects validated shapes that
    `mosaic_wgrad_supports`."""
    m, k = lhs.shape
    n = dout.shape[1]
    num_groups = group_sizes.shape[0]
    if not mosaic_wgrad_supports(m, n, k, lhs.dtype, config):
        raise ValueError(
            f"backend='mosaic_gpu' computes weight gradients of bf16/fp16 with M % {config.tile_r} == 0, "
            f"N % {config.tile_n} == 0 and K % {config.tile_k} == 0; got M={m}, N={n}, K={k}, "
            f"{jnp.dtype(lhs.dtype).name}. Use backend='auto' or 'pallas_triton'."
        )
    offsets = clamp_group_sizes(group_sizes, m)
    starts, ends = offsets[:-1], offsets[1:]
    firsts = starts // config.tile_r * config.tile_r
    blocks = jnp.where(ends > starts, (ends - firsts + config.tile_r - 1) // config.tile_r, 0)
    groups_4E = jnp.stack([starts, ends, firsts, blocks]).astype(jnp.int32)
    body = functools.partial(_wgrad_body, config=config, n=n, k=k, num_groups=num_groups)
    call = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((num_groups, n, k), out_dtype), grid=(_num_sms(interpret),),
        grid_names=("sm",), compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(groups_4E, lhs, dout)
