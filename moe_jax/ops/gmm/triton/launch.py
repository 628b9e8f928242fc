"""Launchers of the `triton` backend's kernels (`kernels`): grids and arguments built once,
run from JAX through `jax_triton.triton_call` (GPU), or from torch tensors (a CUDA GPU, or
Triton's interpreter on CPU tensors, which is how the kernels are checked off GPU: jax_triton
needs a CUDA jaxlib to import).

Legend: M packed rows, K reduction width, N output width, E groups, T rows of a gathered operand.
"""

from __future__ import annotations

import importlib
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.ops.fp8 import BLOCK as FP8_BLOCK
from moe_jax.ops.fp8 import Fp8Rows, Fp8Weights
from moe_jax.ops.gmm.schedule import lane_sizes, max_tiles
from moe_jax.ops.gmm.tiles import TileConfig
from moe_jax.ops.pallas_triton import cdiv, next_pow2
from moe_jax.ops.sharding import vary_to_union, varying_output

__all__ = ["Launch", "fp8_gmm_launch", "fp8_gmm_torch", "fp8_gmm_triton", "gmm_launch", "import_jax_triton",
           "gmm_triton", "gmm_torch", "tgmm_launch", "tgmm_triton", "tgmm_torch"]


def _precision(dtype, precision) -> str:
    """`tl.dot`'s input precision: IEEE fp32 products for fp32 at `Precision.HIGHEST`."""
    return "ieee" if np.dtype(dtype) == np.float32 and precision == jax.lax.Precision.HIGHEST else "tf32"


class Launch(NamedTuple):
    """Grid, launch parameters and constexpr arguments of one kernel launch."""

    grid: tuple[int]
    num_warps: int
    num_stages: int
    constants: dict


def gmm_launch(*, m: int, n: int, k: int, num_groups: int, transpose_rhs: bool, source_rows: int | None,
               tiles: TileConfig, dtype, precision, interpret: bool) -> Launch:
    """The launch of `gmm_kernel` for `M = m` packed rows against `rhs` `[E, N, K]`
    (`transpose_rhs`) or `[E, K, N]`; `lhs` is `[M, K]`, or with `source_rows = T` the `[T, K]`
    rows read through `[M]` row ids. Needs `M, N, K > 0` and `E * M < 2**31`."""
    if num_groups * m >= 2**31:
        raise ValueError(f"gmm (triton backend): E * M = {num_groups} * {m} must stay below 2**31.")
    num_tiles = max_tiles(m, num_groups, tiles.block_m)
    strides = dict(stride_be=n * k, stride_bk=1, stride_bn=k) if transpose_rhs else \
        dict(stride_be=k * n, stride_bk=n, stride_bn=1)
    constants = dict(
        M=m, N=n, K=k, E=num_groups, E_LANES=max(16, next_pow2(num_groups)), NUM_TILES=num_tiles,
        T=m if source_rows is None else source_rows, stride_am=k,
        **strides, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        GATHER=source_rows is not None, PRECISION=_precision(dtype, precision), INTERPRET=interpret,
    )
    return Launch((num_tiles * cdiv(n, tiles.block_n),), tiles.num_warps, tiles.num_stages, constants)


def tgmm_launch(*, m: int, n: int, k: int, num_groups: int, tiles: TileConfig, dtype, precision, interpret: bool,
                source_rows: int | None = None) -> Launch:
    """The launch of `tgmm_kernel` for a gradient `[E, N, K]` over `M = m` packed rows, one
    program per output tile, reading the `[E_LANES]` sizes (`schedule.lane_sizes`). With
    `source_rows = T`, `lhs` is the `[T, K]` rows read through row ids. Needs `N, K > 0`."""
    constants = dict(M=m, N=n, K=k, E=num_groups, E_LANES=max(16, next_pow2(num_groups)), T=source_rows or 1,
                     BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                     GATHER=source_rows is not None, PRECISION=_precision(dtype, precision), INTERPRET=interpret)
    grid = (num_groups * cdiv(n, tiles.block_n) * cdiv(k, tiles.block_k),)
    return Launch(grid, tiles.num_warps, tiles.num_stages, constants)


def fp8_gmm_launch(*, m: int, n: int, k: int, num_groups: int, source_rows: int | None, tiles: TileConfig,
                   interpret: bool) -> Launch:
    """The launch of `fp8_gmm_kernel` for `M = m` packed e4m3 rows `[M, K]` (or `[T, K]` read
    through row ids, `source_rows = T`) against e4m3 `rhs` `[E, N, K]`: `tiles.block_k` is the
    recipe's scale block (`moe_jax.ops.fp8.BLOCK`), each K step one scale. Needs `M, N, K > 0`
    and `E * M < 2**31`."""
    if num_groups * m >= 2**31:
        raise ValueError(f"gmm_fp8 (triton backend): E * M = {num_groups} * {m} must stay below 2**31.")
    if tiles.block_k != FP8_BLOCK:
        raise ValueError(f"tiles.block_k={tiles.block_k}: the FP8 kernel steps K one {FP8_BLOCK}-wide scale block at "
                         f"a time; pass block_k={FP8_BLOCK}.")
    num_tiles = max_tiles(m, num_groups, tiles.block_m)
    constants = dict(
        M=m, N=n, K=k, E=num_groups, E_LANES=max(16, next_pow2(num_groups)), NUM_TILES=num_tiles,
        T=m if source_rows is None else source_rows, K_BLOCKS=cdiv(k, FP8_BLOCK), N_BLOCKS=cdiv(n, FP8_BLOCK),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SCALE_BLOCK=FP8_BLOCK, GROUP_M=tiles.group_m,
        GATHER=source_rows is not None, INTERPRET=interpret,
    )
    return Launch((num_tiles * cdiv(n, tiles.block_n),), tiles.num_warps, tiles.num_stages, constants)


def import_jax_triton():
    """`jax_triton`, imported with the process's `TRITON_CACHE_DIR` left as it was: jax_triton
    0.3.1 blanks the variable at import (its own compile path keeps no file cache), after which
    every other `triton.jit` launch in the process (torch's, `parity`'s reference kernels) fails
    with "Could not create or locate cache dir". Raises ImportError where jax_triton does not
    import (it needs a CUDA jaxlib)."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        return importlib.import_module("jax_triton")
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved


def _triton_call(kernel, inputs, out_shape, launch, name: str):
    jax_triton = import_jax_triton()  # GPU-only dependency, imported where it is used
    _, inputs = vary_to_union(inputs)
    out = jax_triton.triton_call(*inputs, kernel=kernel, out_shape=out_shape, grid=launch.grid, name=name,
                                 num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.constants)
    # Inside shard_map the output varies as its operands do: triton_call ignores a declared
    # varying type (`varying_output` says why).
    return varying_output(out, inputs)


def gmm_triton(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool, tiles: TileConfig,
               out_dtype, precision, row_ids: jax.Array | None = None) -> jax.Array:
    """`gmm` on the `triton` backend, through `jax_triton` (GPU): on the packed `lhs` `[M, K]`, or
    with `row_ids` (int `[M]`) on `lhs` `[T, K]` read through them inside the kernel. Validated
    shapes with `M, N, K > 0` expected."""
    from moe_jax.ops.gmm.triton.kernels import gmm_kernel  # noqa: PLC0415  (triton imported on use)

    k = lhs.shape[1]
    m = lhs.shape[0] if row_ids is None else row_ids.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    launch = gmm_launch(m=m, n=n, k=k, num_groups=rhs.shape[0], transpose_rhs=transpose_rhs,
                        source_rows=None if row_ids is None else lhs.shape[0], tiles=tiles, dtype=lhs.dtype,
                        precision=precision, interpret=False)
    sizes = lane_sizes(group_sizes, m)
    # Without row ids the kernel never reads its row-id pointer; the sizes stand in for it.
    rows = sizes if row_ids is None else row_ids.astype(jnp.int32)
    return _triton_call(gmm_kernel, (sizes, rows, lhs, rhs), jax.ShapeDtypeStruct((m, n), out_dtype), launch,
                        "moe_jax_gmm_triton")


def tgmm_triton(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, tiles: TileConfig, out_dtype,
                precision, row_ids: jax.Array | None = None) -> jax.Array:
    """`tgmm` on the `triton` backend, through `jax_triton` (GPU): `[E, N, K]`; with `row_ids`
    (int `[M]`), `lhs` is `[T, K]` read through them."""
    from moe_jax.ops.gmm.triton.kernels import tgmm_kernel  # noqa: PLC0415

    m, k = dout.shape[0], lhs.shape[1]
    n = dout.shape[1]
    num_groups = group_sizes.shape[0]
    launch = tgmm_launch(m=m, n=n, k=k, num_groups=num_groups, tiles=tiles, dtype=lhs.dtype, precision=precision,
                         interpret=False, source_rows=None if row_ids is None else lhs.shape[0])
    sizes = lane_sizes(group_sizes, m)
    # Without row ids the kernel never reads its row-id pointer; the sizes stand in for it.
    rows = sizes if row_ids is None else row_ids.astype(jnp.int32)
    return _triton_call(tgmm_kernel, (sizes, rows, lhs, dout), jax.ShapeDtypeStruct((num_groups, n, k), out_dtype),
                        launch, "moe_jax_tgmm_triton")


def fp8_gmm_triton(lhs: Fp8Rows, rhs: Fp8Weights, group_sizes: jax.Array, *, tiles: TileConfig, out_dtype,
                   row_ids: jax.Array | None = None) -> jax.Array:
    """`gmm_fp8`'s forward orientation on the `triton` backend, through `jax_triton` (GPU):
    `[M, N]` of `out_dtype`, rows of group e the recipe's `lhs_e @ rhs[e]^T`; with `row_ids`
    (int `[M]`), `lhs` holds `[T, K]` rows read through them. Validated shapes with
    `M, N, K > 0` expected."""
    from moe_jax.ops.gmm.triton.kernels import fp8_gmm_kernel  # noqa: PLC0415  (triton imported on use)

    k = lhs.values_MK.shape[1]
    m = lhs.values_MK.shape[0] if row_ids is None else row_ids.shape[0]
    n = rhs.values_ENK.shape[1]
    launch = fp8_gmm_launch(m=m, n=n, k=k, num_groups=rhs.values_ENK.shape[0],
                            source_rows=None if row_ids is None else lhs.values_MK.shape[0], tiles=tiles,
                            interpret=False)
    sizes = lane_sizes(group_sizes, m)
    rows = sizes if row_ids is None else row_ids.astype(jnp.int32)
    return _triton_call(fp8_gmm_kernel, (sizes, rows, lhs.values_MK, lhs.scale_MKb, rhs.values_ENK, rhs.scale_ENbKb),
                        jax.ShapeDtypeStruct((m, n), out_dtype), launch, "moe_jax_fp8_gmm_triton")


def _torch_kernel(kernel, interpret: bool):
    """`kernel` for torch tensors; on CPU tensors it must have been defined interpreted."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415

    if interpret and not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            "moe_jax's Triton kernels run on CPU tensors only under Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported (the repository's conftest.py does)."
        )
    return kernel


def _run_torch(kernel, launch: Launch, index_args, operands, out, interpret: bool):
    """Launch `kernel(*index_args, *operands, out)` on torch tensors and return `out`. Interpreted
    on CPU, a bf16/fp16 `out` is stored through an fp32 buffer that torch rounds to nearest even
    (the interpreter truncates fp32 to bf16)."""
    target = out.float() if interpret and out.dtype.itemsize < 4 else out
    _torch_kernel(kernel, interpret)[launch.grid](
        *index_args, *(t.contiguous() for t in operands), target, num_warps=launch.num_warps,
        num_stages=launch.num_stages, **launch.constants)
    if target is not out:
        out.copy_(target.to(out.dtype))
    return out


def gmm_torch(lhs, rhs, group_sizes, *, transpose_rhs: bool, tiles: TileConfig, precision=None, row_ids=None,
              out=None):
    """`gmm_kernel` on torch tensors: compiled on CUDA tensors, interpreted on CPU tensors.
    Returns `out` (allocated `[M, N]` of `lhs.dtype` when None); with `row_ids` (int `[M]`), `lhs`
    is `[T, K]` read through them."""
    import torch  # noqa: PLC0415

    from moe_jax.ops.gmm.triton.kernels import gmm_kernel  # noqa: PLC0415

    interpret = lhs.device.type == "cpu"
    m = lhs.shape[0] if row_ids is None else row_ids.shape[0]
    k = lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    launch = gmm_launch(m=m, n=n, k=k, num_groups=rhs.shape[0], transpose_rhs=transpose_rhs,
                        source_rows=None if row_ids is None else lhs.shape[0], tiles=tiles,
                        dtype=_np_dtype(lhs.dtype), precision=precision, interpret=interpret)
    sizes = _torch_sizes(group_sizes, launch.constants["E_LANES"])
    rows = sizes if row_ids is None else row_ids.to(torch.int32)
    if out is None:
        out = torch.empty((m, n), dtype=lhs.dtype, device=lhs.device)
    return _run_torch(gmm_kernel, launch, (sizes, rows), (lhs, rhs), out, interpret)


def _torch_sizes(group_sizes, lanes: int):
    """The `[lanes]` int32 sizes vector the kernels read (`schedule.lane_sizes`), for torch
    tensors: clipped to `[0, M]` by the kernels themselves; here only padded."""
    import torch  # noqa: PLC0415

    sizes = torch.zeros(lanes, dtype=torch.int32, device=group_sizes.device)
    sizes[: group_sizes.shape[0]] = group_sizes.to(torch.int32)
    return sizes


def tgmm_torch(lhs, dout, group_sizes, *, tiles: TileConfig, precision=None, row_ids=None, out=None):
    """`tgmm_kernel` on torch tensors (CUDA compiled, CPU interpreted): `[E, N, K]` of `lhs.dtype`;
    with `row_ids` (int `[M]`), `lhs` is `[T, K]` read through them."""
    import torch  # noqa: PLC0415

    from moe_jax.ops.gmm.triton.kernels import tgmm_kernel  # noqa: PLC0415

    interpret = lhs.device.type == "cpu"
    m, k = dout.shape[0], lhs.shape[1]
    n = dout.shape[1]
    num_groups = group_sizes.shape[0]
    launch = tgmm_launch(m=m, n=n, k=k, num_groups=num_groups, tiles=tiles, dtype=_np_dtype(lhs.dtype),
                         precision=precision, interpret=interpret, source_rows=None if row_ids is None else lhs.shape[0])
    sizes = _torch_sizes(group_sizes, launch.constants["E_LANES"])
    rows = sizes if row_ids is None else row_ids.to(torch.int32)
    if out is None:
        out = torch.empty((num_groups, n, k), dtype=lhs.dtype, device=lhs.device)
    return _run_torch(tgmm_kernel, launch, (sizes, rows), (lhs, dout), out, interpret)


def fp8_gmm_torch(values, scale, rhs_values, rhs_scale, group_sizes, *, tiles: TileConfig, row_ids=None, out=None):
    """`fp8_gmm_kernel` on torch tensors (CUDA compiled, CPU interpreted): e4m3 `values` `[M, K]`
    (or `[T, K]` read through int `row_ids` `[M]`) with fp32 `scale` `[.., ceil(K/128)]`, e4m3
    `rhs_values` `[E, N, K]` with fp32 `rhs_scale` `[E, ceil(N/128), ceil(K/128)]`. Returns `out`
    (fp32 `[M, N]` allocated when None)."""
    import torch  # noqa: PLC0415

    from moe_jax.ops.gmm.triton.kernels import fp8_gmm_kernel  # noqa: PLC0415

    interpret = values.device.type == "cpu"
    m = values.shape[0] if row_ids is None else row_ids.shape[0]
    k = values.shape[1]
    n = rhs_values.shape[1]
    launch = fp8_gmm_launch(m=m, n=n, k=k, num_groups=rhs_values.shape[0],
                            source_rows=None if row_ids is None else values.shape[0], tiles=tiles, interpret=interpret)
    sizes = _torch_sizes(group_sizes, launch.constants["E_LANES"])
    rows = sizes if row_ids is None else row_ids.to(torch.int32)
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32, device=values.device)
    return _run_torch(fp8_gmm_kernel, launch, (sizes, rows), (values, scale, rhs_values, rhs_scale), out, interpret)


def _np_dtype(torch_dtype):
    import torch  # noqa: PLC0415

    return {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: jnp.bfloat16}[torch_dtype]
