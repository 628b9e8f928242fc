"""`gmm_fp8`: the grouped GEMM of the blockwise FP8 recipe (`moe_jax.ops.fp8`), on a kernel or on
the reference path.

Legend: M packed rows, C contraction width, O output width, E groups (experts), T source rows.

Backends (`FP8_GEMM_BACKENDS`):
- `mosaic_gpu`: the warp-specialized FP8 kernel (`moe_jax.ops.gmm.mosaic_gpu.fp8_kernel`, Pallas
  Mosaic GPU): per CTA one warpgroup streams rows, weight blocks and scales through TMA while two
  compute warpgroups each sum a step on the tensor cores and promote it, one's promotion
  overlapping the other's MMA. Hopper (sm_90) only (wgmma); off GPU it runs in Pallas's GPU
  interpret mode. Needs N and K multiples of 128 and at least 128 rows (`fp8_mosaic_support`);
  with `row_ids` the FP8 rows are gathered first (TMA copies boxes).
- `triton`: the FP8 kernel (`moe_jax.ops.gmm.triton.kernels.fp8_gmm_kernel`): e4m3 operands on
  the tensor cores (Hopper's wgmma), each 128-wide K step summed from zero and promoted into an
  fp32 accumulator with its scales, as the recipe prescribes. It needs e4m3 tensor cores (compute
  capability >= 8.9) and jax_triton. Hopper's 8-bit MMA reads both operands K-major, so the
  input-gradient orientation (`transpose_rhs=False`, contraction over the weights' N) runs on an
  e4m3 copy of the weights transposed to `[E, K, N]` (a byte per weight; the 128 x 128 blocks and
  their scales transpose with it).
- `xla`, `pallas_triton`: the operands dequantized to fp32 and multiplied by `gmm` at
  `Precision.HIGHEST` on that backend: `gmm_fp8_reference`'s value up to fp32 summation order,
  slower than a bf16 `gmm`.
- `auto`: on a GPU where a kernel runs, per problem `fp8_kernel`'s choice: `mosaic_gpu` on Hopper
  for prefill-sized problems it supports (at least `MOSAIC_MIN_ROWS` rows per group on average, no
  row ids), else `triton`, else (no jax_triton) `xla` with a warning; off such a GPU `xla`.

Contract as `gmm`'s: rows of group e are `lhs_e @ rhs[e]^T` (`transpose_rhs=True`) or
`lhs_e @ rhs[e]` (False); empty groups are legal; rows past `sum(group_sizes)` are zero; under
`jit` sizes are clamped as `gmm` documents. With `row_ids`, packed row i is source row
`row_ids[i]` of `lhs` (values and scales; ids outside `[0, T)` read zeros): rows quantized once
per token, read by every expert that token goes to.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from moe_jax.ops.fp8 import (BLOCK, FP8_DTYPE, Fp8Rows, Fp8Weights, check_rows, check_weights, dequantize_rows,
                             dequantize_weights, transpose_weights)
from moe_jax.ops.gather import gather_rows
from moe_jax.ops.gmm.api import as_primitive, check_group_sizes, check_row_ids, gmm
from moe_jax.ops.gmm.mosaic_gpu.backend import INTERPRET_CTAS
from moe_jax.ops.gmm.mosaic_gpu.fp8_kernel import Fp8MosaicTiles, fp8_mosaic_support, fp8_mosaic_tiles, gmm_fp8_mosaic
from moe_jax.ops.gmm.tiles import TileConfig, fit_tiles
from moe_jax.ops.gmm.triton.backend import BACKEND as TRITON
from moe_jax.ops.gmm.triton.launch import fp8_gmm_triton
from moe_jax.ops.gmm.triton.rules import fp8_gmm_tiles
from moe_jax.ops.platform import device_facts, interpret, on_gpu
from moe_jax.ops.sharding import replicate_explicit

__all__ = ["FP8_GEMM_BACKENDS", "FP8_KERNEL_CAPABILITY", "MOSAIC_MIN_ROWS", "fp8_backend", "fp8_kernel", "fp8_tiles",
           "gmm_fp8"]

FP8_GEMM_BACKENDS = ("auto", "triton", "mosaic_gpu", "xla", "pallas_triton")
FP8_KERNEL_CAPABILITY = (8, 9)  # e4m3 tensor-core MMA: Ada and Hopper on
HOPPER = 9  # the Mosaic FP8 kernel's wgmma is sm_90's
# Rows per group on average from which `auto` takes the Mosaic kernel: its items are 128 rows, so
# below one item per group most of each would be padding (decode runs the Triton kernel's 16-row tiles).
MOSAIC_MIN_ROWS = 128


def _kernel_unavailable() -> str | None:
    """None where the FP8 kernel runs here, else why not."""
    reason = TRITON.available()
    if reason:
        return reason
    device = device_facts()
    if device.capability is None or device.capability < FP8_KERNEL_CAPABILITY:
        return (f"the FP8 kernel needs e4m3 tensor cores (compute capability >= 8.9); {device.kind} has "
                f"{device.capability}")
    return None


def _mosaic_unavailable() -> str | None:
    """None where the Mosaic FP8 kernel runs here (compiled on Hopper, or interpreted off GPU)."""
    if interpret():
        return ("the Mosaic FP8 kernel in interpret mode (off GPU) does not run under jax_enable_x64"
                if jax.config.jax_enable_x64 else None)
    device = device_facts()
    if device.capability is None or device.capability[0] != HOPPER:
        return f"the Mosaic FP8 kernel needs Hopper's wgmma (compute capability 9.x); {device.kind} has {device.capability}"
    return None


def _unavailable(backend: str) -> str | None:
    """None where `backend` runs here (the reference paths always do), else why not."""
    return {"triton": _kernel_unavailable, "mosaic_gpu": _mosaic_unavailable}.get(backend, lambda: None)()


def fp8_backend(backend: str) -> str:
    """What runs `gmm_fp8` for `backend`: `auto` stays `auto` where the FP8 kernels run (each
    problem then takes `fp8_kernel`'s choice), else it is `xla`. ValueError for a name outside
    `FP8_GEMM_BACKENDS`, or a kernel backend that cannot run here (naming why)."""
    if not isinstance(backend, str) or backend not in FP8_GEMM_BACKENDS:
        raise ValueError(f"backend={backend!r}: the FP8 grouped GEMM runs on one of {FP8_GEMM_BACKENDS} (`triton` "
                         "and `mosaic_gpu` are its kernels; `xla` and `pallas_triton` multiply the dequantized "
                         "operands in fp32).")
    if backend == "auto":
        return "auto" if on_gpu() and not (_kernel_unavailable() and _mosaic_unavailable()) else "xla"
    reason = _unavailable(backend)
    if reason:
        raise ValueError(f"backend={backend!r}: {reason}; pass backend='auto' (the reference path where no kernel "
                         "runs) or 'xla'.")
    return backend


def fp8_kernel(m: int, n: int, k: int, num_groups: int, *, gather: bool = False, out_dtype=jnp.bfloat16) -> str:
    """`auto`'s choice for `m` rows against `[num_groups, n, k]` weights (`gather`: read through
    row ids): `mosaic_gpu` where it runs here and supports the problem with at least
    `MOSAIC_MIN_ROWS` rows per group on average and no row ids, else `triton`; `xla` (the
    reference path, with a warning) on a GPU where the Triton kernel cannot run (no jax_triton)."""
    mosaic = not (gather or _mosaic_unavailable() or m < MOSAIC_MIN_ROWS * num_groups
                  or fp8_mosaic_support(m, n, k, fp8_mosaic_tiles(n), out_dtype, device_facts().smem_per_block))
    if mosaic:
        return "mosaic_gpu"
    reason = _kernel_unavailable() if on_gpu() else None
    if reason:
        warnings.warn(f"gmm_fp8: {m} rows against [{num_groups}, {n}, {k}] weights run on the reference path (fp32 "
                      f"products, slower than bf16) because {reason}.", UserWarning, stacklevel=2)
        return "xla"
    return "triton"


def fp8_tiles(m: int, n: int, k: int, num_groups: int, config: TileConfig | None = None) -> TileConfig:
    """The FP8 kernel's tiles for `m` packed rows against `[num_groups, n, k]` weights: `config`, or
    the rule (`fp8_gmm_tiles`), fitted to the device's shared memory (`tiles.fit_tiles`: a
    `config` that does not fit is a ValueError naming the bytes)."""
    if config is not None and not isinstance(config, TileConfig):
        raise TypeError(f"config={config!r}: the FP8 kernel takes a TileConfig (block_k={BLOCK}) or None.")
    if config is not None and config.block_k != BLOCK:
        raise ValueError(f"config.block_k={config.block_k}: the FP8 kernel steps K one {BLOCK}-wide scale block at a "
                         f"time; pass block_k={BLOCK}.")
    tiles = config or fp8_gmm_tiles(m, n, k, num_groups)
    fitted, _, _ = fit_tiles(tiles, wgrad=False, dtype=FP8_DTYPE, ieee_fp32=False, device=device_facts(),
                             explicit=config is not None)
    return fitted


def _check_operands(lhs, rhs, transpose_rhs: bool, row_ids) -> tuple[int, int, int, int]:
    rows, c = check_rows(lhs, "lhs")
    e, n, k = check_weights(rhs, "rhs")
    contraction, out = (k, n) if transpose_rhs else (n, k)
    if c != contraction:
        raise ValueError(f"lhs has {c} columns but rhs {tuple(rhs.values_ENK.shape)} contracts over {contraction} "
                         f"(transpose_rhs={transpose_rhs}); check transpose_rhs.")
    if e == 0:
        raise ValueError("rhs has zero groups (E=0); a grouped GEMM needs at least one group.")
    m = rows
    if row_ids is not None:
        check_row_ids("row_ids", row_ids)
        m = row_ids.shape[0]
    return m, out, c, e


def gmm_fp8(lhs: Fp8Rows, rhs: Fp8Weights, group_sizes: jax.Array, *, transpose_rhs: bool = True,
            backend: str = "auto", config: TileConfig | Fp8MosaicTiles | None = None, out_dtype=jnp.float32,
            row_ids: jax.Array | None = None) -> jax.Array:
    """The recipe's grouped GEMM (module docstring): `[M, O]` of `out_dtype`.

    Args:
      lhs: `Fp8Rows` `[M, C]` (or `[T, C]` with `row_ids`) quantized per 1 x 128 tile of C.
      rhs: `Fp8Weights` `[E, N, K]`: contracted over K (`transpose_rhs=True`, the forward, O = N)
        or over N (False, the input gradient, O = K).
      group_sizes: `[E]` integer rows per group.
      backend: one of `FP8_GEMM_BACKENDS`.
      config: the Triton FP8 kernel's `TileConfig` (`block_k=128`) or the Mosaic kernel's
        `Fp8MosaicTiles` (under `auto` either also picks its kernel), or None for the rules.
      out_dtype: the output dtype (the fp32 accumulator is rounded once, at the store).
      row_ids: optional int `[M]` source rows of `lhs`.
    """
    m, out, c, e = _check_operands(lhs, rhs, transpose_rhs, row_ids)
    check_group_sizes(group_sizes, e, m, "rhs")
    name = fp8_backend(backend)
    out_dtype = jnp.dtype(out_dtype)
    if name == "auto" and config is not None:  # the configuration names its kernel, which must run here
        name = "mosaic_gpu" if isinstance(config, Fp8MosaicTiles) else "triton"
        reason = _unavailable(name)
        if reason:
            raise ValueError(f"config={config!r} is the {name} FP8 kernel's, which cannot run here: {reason}. Pass "
                             "config=None (auto chooses what runs).")
    elif name == "auto":
        name = fp8_kernel(m, out, c, e, gather=row_ids is not None, out_dtype=out_dtype)
    if name in ("xla", "pallas_triton"):
        if config is not None:
            raise ValueError(f"config={config!r} is the FP8 kernels'; backend {name!r} multiplies dequantized operands "
                             "and takes none.")
        return gmm(dequantize_rows(lhs), dequantize_weights(rhs), group_sizes, transpose_rhs=transpose_rhs,
                   backend=name, precision=jax.lax.Precision.HIGHEST, preferred_element_type=out_dtype,
                   row_ids=row_ids)
    if m == 0 or out == 0 or c == 0 or lhs.values_MK.shape[0] == 0:
        return jnp.zeros((m, out), out_dtype)
    if not transpose_rhs:
        rhs = transpose_weights(rhs)
    arrays = replicate_explicit(*lhs, *rhs, group_sizes, *(() if row_ids is None else (row_ids.astype(jnp.int32),)))
    if name == "mosaic_gpu":
        tiles = _mosaic_tiles(m, out, c, config, out_dtype)

        def impl(a, a_s, b, b_s, sizes, *ids):
            # TMA copies boxes: rows read through ids are gathered first (values and scales; ids
            # outside [0, T) give zero rows, which multiply to zero).
            rows = Fp8Rows(a, a_s) if not ids else Fp8Rows(gather_rows(a, ids[0]), gather_rows(a_s, ids[0]))
            return gmm_fp8_mosaic(rows, Fp8Weights(b, b_s), sizes, out_dtype=out_dtype, tiles=tiles,
                                  num_ctas=INTERPRET_CTAS if interpret() else device_facts().num_sms,
                                  interpret=interpret())
    else:
        tiles = fp8_tiles(m, out, c, e, config)

        def impl(a, a_s, b, b_s, sizes, *ids):
            return fp8_gmm_triton(Fp8Rows(a, a_s), Fp8Weights(b, b_s), sizes, tiles=tiles, out_dtype=out_dtype,
                                  row_ids=ids[0] if ids else None)

    return as_primitive("gmm_fp8", impl, *arrays, differentiable="fp8_grouped_linear")


def _mosaic_tiles(m: int, n: int, k: int, config, out_dtype) -> Fp8MosaicTiles:
    """The Mosaic kernel's tiles: `config`, or its rule (`fp8_mosaic_tiles`); ValueError naming why
    where they do not run the problem."""
    if config is not None and not isinstance(config, Fp8MosaicTiles):
        raise TypeError(f"config={config!r}: backend 'mosaic_gpu' takes an Fp8MosaicTiles or None.")
    tiles = config or fp8_mosaic_tiles(n)
    reason = fp8_mosaic_support(m, n, k, tiles, out_dtype, device_facts().smem_per_block)
    if reason:
        raise ValueError(f"backend='mosaic_gpu': {reason}. Use backend='auto', which runs such problems on the Triton "
                         "FP8 kernel.")
    return tiles

