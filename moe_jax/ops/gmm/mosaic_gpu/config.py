"""The `mosaic_gpu` backend's configuration, its shared-memory model and its tile rule.

Legend: M packed rows, K reduction width, N output width.

Mosaic GPU allocates what the kernel asks for (`kernel._body`'s scoped allocations), so the model
is that sum: the pipeline's A and B stages, the two compute warpgroups' output buffers and the
stages' barriers, plus `RESERVED_BYTES` for what Mosaic adds beside them (on the H200, under Nsight
Compute, 2026-12-03: one byte more than the sum, at both configurations the rule runs).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

__all__ = ["EPILOGUE_ROWS", "MosaicConfig", "ROW_ALIGN", "SHORT_K", "SHORT_K_STEPS", "mosaic_config", "runs_across_items",
           "shape_support", "smem_bytes"]

ROW_ALIGN = 8  # TMA boxes into the swizzled tiles start on a multiple of the 8-row tiling
EPILOGUE_ROWS = 64  # Mosaic slices the wgmma accumulator's registers in blocks of 64 rows
BARRIER_BYTES = 8  # one mbarrier
RESERVED_BYTES = 1024  # beside the scoped buffers (1 B measured; docs/decisions.md)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # wgmma operands this kernel is written for


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiles of the Mosaic GPU kernel: `tile_m` rows x `2 * tile_n` columns per CTA (one
    `tile_n` half per compute warpgroup), K steps of `tile_k`, `max_concurrent_steps` TMA stages.

    `pipeline_across_items`: the memory warpgroup runs one pipeline over all the K steps of its
    CTA's items, so the next item's first stages load while this item's last MMAs and its epilogue
    run, instead of filling and draining the stages at every item. It applies where the K steps are
    a multiple of the stages in use (`min(max_concurrent_steps, K / tile_k)`); other shapes run one
    pipeline per item.

    `out_buffer_rows`: rows of each warpgroup's shared-memory output buffer, None for `tile_m`; a
    power of two in `[64, tile_m]` stores the tile in `tile_m / out_buffer_rows` passes through a
    smaller buffer, which leaves shared memory for more stages (128 x 256 x 64 tiles fit 4 stages
    with 64 rows).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3
    pipeline_across_items: bool = False
    out_buffer_rows: int | None = None

    @property
    def cta_n(self) -> int:
        """Columns of one CTA's work item: both compute warpgroups' halves."""
        return 2 * self.tile_n

    def __post_init__(self):
        for name in ("tile_m", "tile_n", "tile_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 64 or v & (v - 1):
                raise ValueError(f"MosaicConfig.{name}={v!r}: must be a power of two >= 64 (wgmma tiles).")
        steps = self.max_concurrent_steps
        if not isinstance(steps, int) or not 1 <= steps <= 8:
            raise ValueError(f"MosaicConfig.max_concurrent_steps={steps!r}: must be in [1, 8].")
        r = self.out_buffer_rows
        if r is not None and (not isinstance(r, int) or r < EPILOGUE_ROWS or r & (r - 1) or r > self.tile_m):
            raise ValueError(
                f"MosaicConfig.out_buffer_rows={r!r}: must be None (a buffer of tile_m rows) or a power of two in "
                f"[{EPILOGUE_ROWS}, tile_m={self.tile_m}] (the accumulator splits in {EPILOGUE_ROWS}-row blocks).")

    def __str__(self) -> str:
        extra = (" across-items" if self.pipeline_across_items else "") + (
            f" out{self.out_buffer_rows}" if self.out_buffer_rows else "")
        return f"mosaic {self.tile_m}x{self.cta_n}x{self.tile_k} s{self.max_concurrent_steps}{extra}"


def smem_bytes(config: MosaicConfig, dtype, out_dtype) -> int:
    """Shared memory the kernel allocates (an upper bound): the pipeline's A and B stages, the two
    warpgroups' output buffers, two barriers per stage (loaded, consumed) and `RESERVED_BYTES`."""
    stages = config.max_concurrent_steps * (config.tile_m + config.cta_n) * config.tile_k
    out_rows = config.out_buffer_rows or config.tile_m
    return (stages * jnp.dtype(dtype).itemsize + 2 * out_rows * config.tile_n * jnp.dtype(out_dtype).itemsize
            + 2 * config.max_concurrent_steps * BARRIER_BYTES + RESERVED_BYTES)


# The most K steps at which `mosaic_config` runs one pipeline across items with 4 stages: on an H200
# that gained 1-15% on most cells at 12-32 steps and lost 2-12% at 64-112 (docs/decisions.md, "Mosaic forward rule").
SHORT_K_STEPS = 32
SHORT_K = MosaicConfig(max_concurrent_steps=4, pipeline_across_items=True, out_buffer_rows=64)


def runs_across_items(config: MosaicConfig, k_steps: int) -> bool:
    """Whether `config.pipeline_across_items` applies at `k_steps` K steps. The pipeline shrinks its
    stages to the K steps; passing stages from one item's pipeline to the next keeps each stage's
    barrier phase only when every item uses all of them equally often."""
    return config.pipeline_across_items and k_steps % min(config.max_concurrent_steps, k_steps) == 0


def mosaic_config(k: int, dtype, out_dtype=None, *, smem_limit: int = 227 * 1024) -> MosaicConfig:
    """The configuration the backend runs for a reduction width `k` when none is given: 128 x 256 x 64
    tiles; where K has at most `SHORT_K_STEPS` steps, one pipeline across items applies to them (4,
    or fewer than 4, divides them) and the tiles fit `smem_limit`, 4 stages through 64-row output
    buffers in one pipeline across each CTA's items (`SHORT_K`), else 3 stages per item
    (`MosaicConfig()`). Short reductions are where filling and draining the stages at every item
    costs most of an item."""
    steps = k // SHORT_K.tile_k
    short = 0 < steps <= SHORT_K_STEPS and runs_across_items(SHORT_K, steps)
    return SHORT_K if short and smem_bytes(SHORT_K, dtype, out_dtype or dtype) <= smem_limit else MosaicConfig()


def shape_support(m: int, n: int, k: int, dtype, config: MosaicConfig) -> str | None:
    """None where the kernel takes `lhs [M, K]` x `rhs` of N columns with `config`'s tiles, else why
    not: bf16/fp16, N a multiple of the CTA width, K of `tile_k`, at least `tile_m` rows and a
    multiple of `ROW_ALIGN`."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"mosaic_gpu multiplies bf16/fp16 only (wgmma), not {jnp.dtype(dtype).name}"
    if n % config.cta_n or k % config.tile_k:
        return f"mosaic_gpu needs N % {config.cta_n} == 0 and K % {config.tile_k} == 0; got N={n}, K={k}"
    if m < config.tile_m or m % ROW_ALIGN:
        return f"mosaic_gpu needs M >= {config.tile_m} and M % {ROW_ALIGN} == 0; got M={m}"
    return None
