"""Triton grouped GEMM over a contiguous expert schedule, "NT" layout, with its backward.

Legend: M packed rows, K reduction width, N output width, E experts.

Contract shared by every function here:

- `a[M, K]` holds the rows of all experts back to back in expert order. `offsets[E + 1]`
  (integer, any device) is the exclusive prefix sum of the per-expert row counts: expert `e` owns
  rows `offsets[e]:offsets[e + 1]`. `offsets[0] == 0`, offsets never decrease, and
  `offsets[E] <= M`. Rows past `offsets[E]` belong to no expert: they are never read, and the
  rows they produce come out zero. Empty experts are legal and cost nothing.
- Weights are stored like a linear layer, `b[E, N, K]`, so expert `e` computes `a_e @ b[e]^T`.
- Products accumulate in fp32 (fp64 for fp64 inputs); fp32 inputs use IEEE products (no TF32).
  Outputs have the input dtype. Supported dtypes: bfloat16, float16, float32, float64.

The row-tile schedule `(tile_expert, tile_m)` is built on the host from the counts (docs/reference-algorithm.md, Eq. 4);
that costs one device-to-host copy of `offsets` per call, which a reference can afford.

Kernels run compiled on CUDA tensors, or under Triton's interpreter (`TRITON_INTERPRET=1`, CPU
tensors). Two interpreter limits of Triton 3.6 shape the kernels (both compile unchanged):

- The interpreter's `tl.dot` multiplies bfloat16 operands as their raw 16-bit patterns, so in
  interpret mode bf16 tiles are widened to fp32 before the product. bf16 x bf16 products are exact
  in fp32, so this computes what the tensor-core product with fp32 accumulation computes.
- Under NumPy >= 2.5 the interpreter cannot use a loaded value as a `range` bound, so the
  weight-gradient kernel walks an expert's rows with a `while` loop instead.
- The interpreter converts fp32 to bfloat16 by truncation (round toward zero), where compiled
  kernels round to nearest even. In interpret mode bf16 results are therefore stored as fp32 and
  rounded by torch (round to nearest even), which is what the compiled store does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@triton.jit
def _grouped_mm_nt_kernel(
    A, B, C, offsets, tile_expert, tile_m,
    N: tl.constexpr,
    K: tl.constexpr,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """One (row tile of one expert, column tile) of C = A_e @ B[e]^T."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 before any stride product: E*N*K and M*K can exceed int32 at real sizes.
    expert = tl.load(tile_expert + pid_m).to(tl.int64)
    local_tile = tl.load(tile_m + pid_m).to(tl.int64)
    start = tl.load(offsets + expert).to(tl.int64)
    end = tl.load(offsets + expert + 1).to(tl.int64)

    rows = start + local_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_expert = B + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC_DTYPE)

    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            A + rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        # B[expert] is stored [N, K]; addressing it with (k, n) strides reads B[expert]^T.
        b = tl.load(
            b_expert + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=ACC_DTYPE)

    tl.store(
        C + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
        acc.to(C.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _grouped_weight_grad_kernel(
    A, dC, dB, offsets,
    N: tl.constexpr,
    K: tl.constexpr,
    stride_am, stride_ak,
    stride_cm, stride_cn,
    stride_be, stride_bn, stride_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """One [BLOCK_N, BLOCK_K] tile of dB[e] = dC_e^T @ A_e, summed over expert e's rows only."""
    pid_nk = tl.program_id(0)
    expert = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    ns = (pid_nk % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (pid_nk // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = ns < N
    k_ok = ks < K

    row = tl.load(offsets + expert).to(tl.int64)
    end = tl.load(offsets + expert + 1).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), ACC_DTYPE)
    # An empty expert runs no iteration and stores the zero accumulator: its dB is exactly 0.
    while row < end:
        rows = row + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        dc = tl.load(
            dC + rows[:, None] * stride_cm + ns[None, :] * stride_cn,
            mask=row_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        a = tl.load(
            A + rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            dc = dc.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(tl.trans(dc), a, acc, input_precision="ieee", out_dtype=ACC_DTYPE)
        row += BLOCK_M

    tl.store(
        dB + expert * stride_be + ns[:, None] * stride_bn + ks[None, :] * stride_bk,
        acc.to(dB.dtype.element_ty),
        mask=n_ok[:, None] & k_ok[None, :],
    )


def interpreting() -> bool:
    """Whether this module's kernels were defined under Triton's interpreter."""
    return isinstance(_grouped_mm_nt_kernel, InterpretedFunction)


def make_contiguous_schedule(
    counts: torch.Tensor, block_m: int, *, device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-tile schedule of a contiguous grouped GEMM.

    `counts[E]` rows per expert -> `(tile_expert[P], tile_m[P])`, int32, with
    `P = sum_e cdiv(counts[e], block_m)`: program `p` computes row tile `tile_m[p]` of expert
    `tile_expert[p]`. Experts appear in order and empty experts get no tile.
    """
    counts = counts.detach().to("cpu", torch.int64)
    tiles = (counts + block_m - 1) // block_m
    tile_expert = torch.repeat_interleave(torch.arange(counts.numel()), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    tile_m = torch.arange(tile_expert.numel()) - torch.repeat_interleave(first_tile, tiles)
    return (
        tile_expert.to(device=device, dtype=torch.int32),
        tile_m.to(device=device, dtype=torch.int32),
    )


def _check_blocks(**blocks: int) -> None:
    for name, value in blocks.items():
        # tl.arange needs powers of two; tensor-core tl.dot needs every tile side >= 16.
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")


def _check_launchable(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}")
    if not interpreting() and tensors[0].device.type != "cuda":
        raise ValueError(
            "the Triton kernels were compiled for the GPU but got tensors on "
            f"{tensors[0].device}; on a machine without CUDA set TRITON_INTERPRET=1 before "
            "importing parity.reference (importing parity.reference does so when unset)"
        )


def _check_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"operands must share one dtype, got {sorted(map(str, dtypes))}")
    dtype = tensors[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {SUPPORTED_DTYPES}")
    return dtype


def _check_offsets(offsets: torch.Tensor, num_experts: int | None, num_rows: int) -> torch.Tensor:
    """Validate `offsets` and return a host int64 copy of it."""
    if not isinstance(offsets, torch.Tensor) or offsets.ndim != 1:
        raise ValueError("offsets must be a 1-D integer tensor of length E + 1")
    if offsets.dtype.is_floating_point or offsets.dtype.is_complex or offsets.dtype == torch.bool:
        raise ValueError(f"offsets must have an integer dtype, got {offsets.dtype}")
    if offsets.numel() < 1:
        raise ValueError("offsets must hold at least one entry (E + 1 with E >= 0)")
    if num_experts is not None and offsets.numel() != num_experts + 1:
        raise ValueError(f"offsets has {offsets.numel()} entries; expected E + 1 = {num_experts + 1}")
    host = offsets.detach().to("cpu", torch.int64)
    if host[0] != 0:
        raise ValueError(f"offsets[0] must be 0, got {int(host[0])}")
    if bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"offsets must not decrease, got {host.tolist()}")
    if host[-1] > num_rows:
        raise ValueError(f"offsets[E] = {int(host[-1])} exceeds the {num_rows} rows given")
    return host


def _kernel_dtypes(dtype: torch.dtype) -> tuple[tl.dtype, bool]:
    """`(accumulator dtype, whether bf16 operands are widened to fp32)`: interpret-mode bf16 only."""
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    return acc, interpreting() and dtype == torch.bfloat16


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel writes: fp32 for interpret-mode bf16 (torch rounds it afterwards, to
    nearest even; the interpreter's own fp32 -> bf16 conversion truncates), else `dtype`."""
    return torch.float32 if interpreting() and dtype == torch.bfloat16 else dtype


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """Grouped GEMM forward: `a[M, K]`, `b[E, N, K]`, `offsets[E + 1]` -> `c[M, N]`.

    `c[offsets[e]:offsets[e+1]] = a[offsets[e]:offsets[e+1]] @ b[e]^T`; rows past `offsets[E]`
    are zero. Any strides are accepted (a transposed view of `b` is read in place).
    """
    if a.ndim != 2 or b.ndim != 3:
        raise ValueError(f"expected a[M, K] and b[E, N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if b.shape[2] != a.shape[1]:
        raise ValueError(f"reduction widths differ: a[M, K={a.shape[1]}] vs b[E, N, K={b.shape[2]}]")
    _check_blocks(block_m=block_m, block_n=block_n, block_k=block_k)
    dtype = _check_dtype(a, b)
    _check_launchable(a, b)
    num_experts, n, k = b.shape
    host_offsets = _check_offsets(offsets, num_experts, a.shape[0])

    out = torch.zeros((a.shape[0], n), device=a.device, dtype=_store_dtype(dtype))
    tile_expert, tile_m = make_contiguous_schedule(
        host_offsets[1:] - host_offsets[:-1], block_m, device=a.device,
    )
    if tile_expert.numel() == 0 or n == 0 or k == 0:
        return out.to(dtype)

    acc_dtype, dot_in_fp32 = _kernel_dtypes(dtype)
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_mm_nt_kernel[grid](
        a, b, out, host_offsets.to(a.device), tile_expert, tile_m,
        n, k,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ACC_DTYPE=acc_dtype,
        DOT_IN_FP32=dot_in_fp32,
    )
    return out.to(dtype)


def grouped_weight_grad(
    a: torch.Tensor,
    dc: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """Grouped weight gradient: `a[M, K]`, `dc[M, N]`, `offsets[E + 1]` -> `db[E, N, K]`.

    `db[e] = dc_e^T @ a_e` over expert e's rows, in the NT layout of the forward's `b`. Rows past
    `offsets[E]` are never read; the gradient of an empty expert is exactly zero.
    """
    if a.ndim != 2 or dc.ndim != 2:
        raise ValueError(f"expected a[M, K] and dc[M, N], got {tuple(a.shape)} and {tuple(dc.shape)}")
    if a.shape[0] != dc.shape[0]:
        raise ValueError(f"row counts differ: a has {a.shape[0]} rows, dc has {dc.shape[0]}")
    _check_blocks(block_m=block_m, block_n=block_n, block_k=block_k)
    dtype = _check_dtype(a, dc)
    _check_launchable(a, dc)
    host_offsets = _check_offsets(offsets, None, a.shape[0])
    num_experts, k, n = host_offsets.numel() - 1, a.shape[1], dc.shape[1]

    db = torch.zeros((num_experts, n, k), device=a.device, dtype=_store_dtype(dtype))
    if num_experts == 0 or n == 0 or k == 0 or host_offsets[-1] == 0:
        return db.to(dtype)

    acc_dtype, dot_in_fp32 = _kernel_dtypes(dtype)
    grid = (triton.cdiv(n, block_n) * triton.cdiv(k, block_k), num_experts)
    _grouped_weight_grad_kernel[grid](
        a, dc, db, host_offsets.to(a.device),
        n, k,
        a.stride(0), a.stride(1),
        dc.stride(0), dc.stride(1),
        db.stride(0), db.stride(1), db.stride(2),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ACC_DTYPE=acc_dtype,
        DOT_IN_FP32=dot_in_fp32,
    )
    return db.to(dtype)


def grouped_mm_backward(
    a: torch.Tensor,
    b: torch.Tensor,
    dc: torch.Tensor,
    offsets: torch.Tensor,
    **blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `c = grouped_mm(a, b, offsets)` given `dc[M, N]` -> `(da[M, K], db[E, N, K])`.

    `da_e = dc_e @ b[e]` is itself an NT grouped GEMM with weights `b[e]^T` (read through a
    transposed view, no copy); `db_e = dc_e^T @ a_e`. Rows of `da` past `offsets[E]` are zero.
    `blocks` (block_m, block_n, block_k) go to both kernels.
    """
    if b.ndim != 3 or dc.ndim != 2 or dc.shape[1] != b.shape[1]:
        raise ValueError(f"expected b[E, N, K] and dc[M, N], got {tuple(b.shape)} and {tuple(dc.shape)}")
    da = grouped_mm(dc, b.transpose(1, 2), offsets, **blocks)
    db = grouped_weight_grad(a, dc, offsets, **blocks)
    return da, db


class GroupedLinear(torch.autograd.Function):
    """Differentiable `grouped_mm(a, b, offsets)`; `offsets` gets no gradient."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, offsets)
        return grouped_mm(a, b, offsets)

    @staticmethod
    def backward(ctx, dc: torch.Tensor):
        a, b, offsets = ctx.saved_tensors
        dc = dc.to(a.dtype)
        da = grouped_mm(dc, b.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        db = grouped_weight_grad(a, dc, offsets) if ctx.needs_input_grad[1] else None
        return da, db, None


def grouped_linear(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` with autograd: `a[M, K]`, `b[E, N, K]`, `offsets[E + 1]` -> `[M, N]`."""
    return GroupedLinear.apply(a, b, offsets)
