"""The backends of `gmm`/`tgmm`, registered with `moe_jax.ops.platform`.

- `pallas_triton`: choose a candidate (`config` None takes the per-shape table,
  `config.gmm_config` / `config.tgmm_config`; a bare `TileConfig` for `gmm` means the row-tile
  family with those tiles; a `selector.SelectorTable` picks one on device from the histogram and
  runs it through a chain of gated launches), launch the family's kernel.
- `triton`: official Triton kernels through `jax_triton` (`triton_kernels`, `triton_launch`), the
  row-tile family only: a row-tile candidate runs with its tiles; a group-major or split-K choice,
  `"auto"` or a `SelectorTable` runs `triton_candidate`; `tgmm` without a `TileConfig` runs
  `triton_tgmm_config`'s tiles.
- `mosaic_gpu`: `gmm` and `tgmm` on the Mosaic GPU kernels (`mosaic`), with a `MosaicConfig` /
  `MosaicWgradConfig` or their default tiles.
- `xla`: `jax.lax.ragged_dot_general`, XLA's grouped dot; tile configs are ignored (XLA picks its
  own tiling).

All receive validated arguments (see `api`) with `M, N, K > 0`, and clamp group sizes the same
way (`schedule.clamp_group_sizes`), so they agree on unchecked, traced sizes. With `row_ids`,
the `lhs` of `gmm` and `tgmm` is `[T, K]` read through them: the Pallas row-tile and weight-gradient
kernels and both Triton kernels gather inside their loads; the group-major and split-K families,
`mosaic_gpu` and `xla` gather the rows first (`gathered`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_jax.ops.gather import gather_rows
from moe_jax.ops.gmm.config import (CANDIDATES, GmmConfig, TileConfig, gmm_config, tgmm_config, triton_candidate,
                                    triton_tgmm_config)
from moe_jax.ops.gmm.group_major import gmm_group_major_pallas
from moe_jax.ops.gmm.mosaic import MosaicConfig, MosaicWgradConfig, gmm_mosaic, tgmm_mosaic
from moe_jax.ops.gmm.row_tile import gmm_row_tile_pallas
from moe_jax.ops.gmm.schedule import clamp_group_sizes
from moe_jax.ops.gmm.selector import SelectorTable, select
from moe_jax.ops.gmm.tile import Gate
from moe_jax.ops.gmm.triton_launch import gmm_triton, tgmm_triton
from moe_jax.ops.gmm.wgrad import tgmm_pallas
from moe_jax.ops.platform import interpret, register
from moe_jax.ops.sharding import explicit_out_sharding


def _candidate(config: GmmConfig | TileConfig | None, m: int, n: int, k: int, num_groups: int) -> GmmConfig:
    """The candidate `gmm` runs: `config`, the row-tile family for a `TileConfig`, or the table's."""
    if config is None or isinstance(config, MosaicConfig):
        return gmm_config(m, n, k, num_groups)
    if isinstance(config, TileConfig):
        return GmmConfig("row_tile", config)
    return config


def gathered(lhs, row_ids, backend: str = "auto"):
    """`lhs` `[M, K]` for a kernel without a fused row gather: `lhs[row_ids]` (zeros for ids
    outside `[0, T)`) through `moe_jax.ops.gather_rows`, or `lhs` itself without row ids."""
    return lhs if row_ids is None else gather_rows(lhs, row_ids, backend=backend)


def _run(config: GmmConfig, lhs, rhs, group_sizes, row_ids, packed, **common):
    """Launch `config`'s family; with `row_ids`, the row-tile kernel gathers in its loads and the
    group-major one reads `packed()` (the gathered rows, built once per call of `pallas_gmm`)."""
    if config.family in ("group_major", "split_k"):
        return gmm_group_major_pallas(packed(), rhs, group_sizes, splits=config.splits, tiles=config.tiles, **common)
    return gmm_row_tile_pallas(lhs, rhs, group_sizes, tiles=config.tiles, row_ids=row_ids, **common)


@register("gmm", "pallas_triton")
def pallas_gmm(lhs, rhs, group_sizes, *, transpose_rhs, config, out_dtype, precision, row_ids=None):
    k = lhs.shape[1]
    m = lhs.shape[0] if row_ids is None else row_ids.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    common = dict(transpose_rhs=transpose_rhs, out_dtype=out_dtype, precision=precision, interpret=interpret())
    run = functools.partial(_run, lhs=lhs, rhs=rhs, group_sizes=group_sizes, row_ids=row_ids,
                            packed=functools.cache(lambda: gathered(lhs, row_ids)), **common)
    if not isinstance(config, SelectorTable):
        return run(_candidate(config, m, n, k, rhs.shape[0]))
    names = config.candidates_for(m)
    if len(names) == 1:
        return run(CANDIDATES[names[0]])
    # One gated launch per candidate of this row, chained through one output buffer: the chosen
    # launch writes every element, the others return at once (no XLA conditional, which on GPU
    # copies its predicate to the host and waits for it).
    choice_1 = select(group_sizes, m, config).branch.reshape(1)
    out = None
    for i, name in enumerate(names):
        out = run(CANDIDATES[name], gate=Gate(choice_1, i), out_init=out)
    return out


@register("tgmm", "pallas_triton")
def pallas_tgmm(lhs, dout, group_sizes, *, config, out_dtype, precision, row_ids=None):
    m, k = dout.shape[0], lhs.shape[1]
    tiles = config if isinstance(config, TileConfig) else tgmm_config(m, dout.shape[1], k, group_sizes.shape[0])
    return tgmm_pallas(lhs, dout, clamp_group_sizes(group_sizes, m), tiles=tiles, out_dtype=out_dtype,
                       precision=precision, interpret=interpret(), row_ids=row_ids)


def triton_tiles(config, m: int, n: int, k: int, num_groups: int) -> TileConfig:
    """The `triton` backend's tiles for `gmm`'s `config`: a `TileConfig` or row-tile candidate's
    own, else `triton_candidate`'s (group-major and split-K have no Triton kernel, and the
    selector's tables were tuned on the Pallas kernels)."""
    if isinstance(config, TileConfig):
        return config
    if isinstance(config, GmmConfig) and config.family == "row_tile":
        return config.tiles
    return triton_candidate(m, n, k, num_groups).tiles


@register("gmm", "triton")
def triton_gmm(lhs, rhs, group_sizes, *, transpose_rhs, config, out_dtype, precision, row_ids=None):
    k = lhs.shape[1]
    m = lhs.shape[0] if row_ids is None else row_ids.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return gmm_triton(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                      tiles=triton_tiles(config, m, n, k, rhs.shape[0]), out_dtype=out_dtype, precision=precision,
                      row_ids=row_ids)


@register("tgmm", "triton")
def triton_tgmm(lhs, dout, group_sizes, *, config, out_dtype, precision, row_ids=None):
    m, k = dout.shape[0], lhs.shape[1]
    tiles = config if isinstance(config, TileConfig) else triton_tgmm_config(m, dout.shape[1], k, group_sizes.shape[0])
    return tgmm_triton(lhs, dout, group_sizes, tiles=tiles, out_dtype=out_dtype, precision=precision, row_ids=row_ids)


@register("gmm", "mosaic_gpu")
def mosaic_gmm(lhs, rhs, group_sizes, *, transpose_rhs, config, out_dtype, precision, row_ids=None):
    del precision  # bf16/fp16 only: wgmma accumulates in fp32
    # TMA copies boxes: Hopper's has no row gather, so the rows are gathered first.
    return gmm_mosaic(gathered(lhs, row_ids), rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                      config=config if isinstance(config, MosaicConfig) else None, interpret=interpret())


@register("tgmm", "mosaic_gpu")
def mosaic_tgmm(lhs, dout, group_sizes, *, config, out_dtype, precision, row_ids=None):
    del precision
    return tgmm_mosaic(gathered(lhs, row_ids), dout, group_sizes, out_dtype=out_dtype,
                       config=config if isinstance(config, MosaicWgradConfig) else MosaicWgradConfig(),
                       interpret=interpret())


def _clamped_sizes(group_sizes, num_rows):
    offsets = clamp_group_sizes(group_sizes, num_rows)
    return offsets[1:] - offsets[:-1]


@register("gmm", "xla")
def xla_gmm(lhs, rhs, group_sizes, *, transpose_rhs, config, out_dtype, precision, row_ids=None):
    del config
    lhs = gathered(lhs, row_ids, backend="xla")
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out = jax.lax.ragged_dot_general(
        lhs, rhs, _clamped_sizes(group_sizes, lhs.shape[0]), dims, precision=precision,
        preferred_element_type=jnp.float32, out_sharding=explicit_out_sharding(),
    )
    return out.astype(out_dtype)


@register("tgmm", "xla")
def xla_tgmm(lhs, dout, group_sizes, *, config, out_dtype, precision, row_ids=None):
    del config
    lhs = gathered(lhs, row_ids, backend="xla")
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(
        dout, lhs, _clamped_sizes(group_sizes, lhs.shape[0]), dims, precision=precision,
        preferred_element_type=jnp.float32, out_sharding=explicit_out_sharding(),
    )
    return out.astype(out_dtype)
