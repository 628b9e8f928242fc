"""Blockwise FP8 in torch, DeepSeek-V3's recipe: quantization, the recipe's grouped GEMM, and a
differentiable grouped linear layer on it.

Legend: M packed rows, K reduction width, N output width, E experts (groups); Kb = ceil(K / 128),
Nb = ceil(N / 128), C the contraction width of one product and O its output width.

The recipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 3.3):

- Values in e4m3 (`torch.float8_e4m3fn`: largest finite 448, no infinities), one fp32 scale per
  1 x 128 tile of a row (activations, gradients) and per 128 x 128 block of a weight; the last
  tile or block of a width that is not a multiple of 128 is narrower and has its own scale.
- A tile's scale is `amax / 448` (its largest magnitude lands on 448; computed as
  `amax * INV_FP8_MAX`, see there), 1 for an all-zero tile;
  `x / scale` is clipped to +-448 (a value rounded just past 448 would cast to NaN) and cast to
  e4m3, rounding to nearest even. NaN or infinity in a tile makes that tile's amax, and so every
  dequantized value of the tile, non-finite; no other tile is touched.
- A product sums each 128-wide step of the contraction in fp32 (products of e4m3 values are exact
  in fp32), multiplies the step's partial sum by its activation-tile scale times its weight-block
  scale, and adds it to an fp32 accumulator, step after step.

The layer (`fp8_grouped_linear`, a `torch.autograd.Function`):

- forward: `y = rows @ w^T` by the recipe, rows quantized per 1 x 128 tile of K, the master
  weights per 128 x 128 block in every call; `y` in x's dtype;
- input gradient: `dy` (in x's dtype) quantized per 1 x 128 tile of N, `dx = dy @ w` by the recipe
  on the same weight blocks read over N;
- weight gradient: `dw_e = dy_e^T @ deq(rows)_e` with the dequantized FP8 rows rounded to x's
  dtype and the unquantized `dy`, summed in fp32, rounded to x's dtype, then to w's;
- the quantizations are differentiated as the identity (straight-through estimator).

Products run as fp32 torch matmuls: on CUDA they need TF32 off (`parity.theirs.precise_matmuls`).
This is an oracle (a loop over experts and 128-wide steps), written from the recipe; it does not
import `moe_jax`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 128  # the recipe's tile width: activations 1 x BLOCK, weights BLOCK x BLOCK
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A tile's scale is `amax * fp32(1 / 448)`: the product with the reciprocal rounded to fp32, which
# is what XLA compiles a division by the constant 448 into (its algebraic simplifier), so both
# sides' scales agree to the bit. The correctly rounded quotient `amax / 448` differs from it in the
# last bit for about half the tiles; that moves `x / scale` across e4m3 rounding ties, which
# bf16 inputs hit often (their ratios to the tile's amax are short binary fractions).
INV_FP8_MAX = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))


class Fp8Rows(NamedTuple):
    """`values[M, C]` e4m3 and `scale[M, Cb]` fp32: row m, columns `[128 b, 128 (b + 1))` are
    `values * scale[m, b]`."""

    values: torch.Tensor
    scale: torch.Tensor


class Fp8Weights(NamedTuple):
    """`values[E, N, K]` e4m3 and `scale[E, Nb, Kb]` fp32, one per 128 x 128 block of each expert."""

    values: torch.Tensor
    scale: torch.Tensor


def _blocks(width: int) -> int:
    return -(-width // BLOCK)


def _check_input(x: torch.Tensor, name: str, ndim: int) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in FP8_INPUT_DTYPES:
        raise TypeError(f"{name}: expected one of {FP8_INPUT_DTYPES} to quantize, got {x.dtype}")


def _tile_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax == 0, torch.ones_like(amax), amax * INV_FP8_MAX)


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows(x_MC: torch.Tensor) -> Fp8Rows:
    """`x[M, C]` -> `Fp8Rows`: one scale per 1 x 128 tile of each row."""
    _check_input(x_MC, "x_MC", 2)
    m, c = x_MC.shape
    cb = _blocks(c)
    x = torch.nn.functional.pad(x_MC.float(), (0, cb * BLOCK - c)).reshape(m, cb, BLOCK)
    scale_MCb = _tile_scale(x.abs().amax(dim=2))
    values = _to_e4m3(x, scale_MCb[:, :, None]).reshape(m, cb * BLOCK)[:, :c]
    return Fp8Rows(values, scale_MCb)


def quantize_weights(w_ENK: torch.Tensor) -> Fp8Weights:
    """`w[E, N, K]` -> `Fp8Weights`: one scale per 128 x 128 block of each expert's `[N, K]`."""
    _check_input(w_ENK, "w_ENK", 3)
    e, n, k = w_ENK.shape
    nb, kb = _blocks(n), _blocks(k)
    w = torch.nn.functional.pad(w_ENK.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    w = w.reshape(e, nb, BLOCK, kb, BLOCK)
    scale_ENbKb = _tile_scale(w.abs().amax(dim=(2, 4)))
    values = _to_e4m3(w, scale_ENbKb[:, :, None, :, None]).reshape(e, nb * BLOCK, kb * BLOCK)[:, :n, :k]
    return Fp8Weights(values, scale_ENbKb)


def _expand(scale: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, width)


def dequantize_rows(rows: Fp8Rows) -> torch.Tensor:
    """fp32 `[M, C]`: `values * scale`, tile by tile."""
    return rows.values.float() * _expand(rows.scale, 1, rows.values.shape[1])


def dequantize_weights(weights: Fp8Weights) -> torch.Tensor:
    """fp32 `[E, N, K]`: `values * scale`, block by block."""
    _, n, k = weights.values.shape
    return weights.values.float() * _expand(_expand(weights.scale, 1, n), 2, k)


def _bounds(offsets: torch.Tensor, num_experts: int, num_rows: int) -> list[int]:
    """Host copy of `offsets[E + 1]`, checked (starts at 0, never decreases, ends within the rows)."""
    if not isinstance(offsets, torch.Tensor) or offsets.ndim != 1 or offsets.dtype.is_floating_point:
        raise ValueError(f"offsets: expected a 1-D integer tensor of E + 1 = {num_experts + 1} entries")
    bounds = [int(v) for v in offsets.tolist()]
    if len(bounds) != num_experts + 1 or bounds[0] != 0 or bounds[-1] > num_rows or any(
        b < a for a, b in zip(bounds, bounds[1:])
    ):
        raise ValueError(f"offsets {bounds}: expected E + 1 = {num_experts + 1} non-decreasing entries from 0 "
                         f"to at most M = {num_rows}")
    return bounds


def fp8_grouped_mm(lhs: Fp8Rows, rhs: Fp8Weights, offsets: torch.Tensor, *, contract_k: bool = True) -> torch.Tensor:
    """The recipe's grouped GEMM, fp32 `[M, O]`; rows past `offsets[E]` are zero.

    `contract_k=True` (forward): `lhs[M, K]` (tiles along K), row r of expert e is
    `lhs[r] @ rhs[e]^T`, O = N. False (input gradient): `lhs[M, N]` (tiles along N),
    `lhs[r] @ rhs[e]`, O = K; the same 128 x 128 blocks and scales, read transposed.
    """
    w_ENK, s_ENbKb = rhs
    e = w_ENK.shape[0]
    if not contract_k:
        w_ENK, s_ENbKb = w_ENK.transpose(1, 2), s_ENbKb.transpose(1, 2)  # [E, O=K, C=N]
    _, o, c = w_ENK.shape
    m = lhs.values.shape[0]
    if lhs.values.shape[1] != c or tuple(lhs.scale.shape) != (m, _blocks(c)):
        raise ValueError(f"lhs {tuple(lhs.values.shape)} (scale {tuple(lhs.scale.shape)}) does not contract with "
                         f"rhs {tuple(rhs.values.shape)} (contract_k={contract_k}): expected {c} columns")
    bounds = _bounds(offsets, e, m)
    a_MC = lhs.values.float()
    out_MO = torch.zeros((m, o), dtype=torch.float32, device=a_MC.device)
    for g, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if start == end:
            continue
        w_OC = w_ENK[g].float()
        s_OCb = _expand(s_ENbKb[g], 0, o)  # each output channel's block scale, per step
        acc = torch.zeros((end - start, o), dtype=torch.float32, device=a_MC.device)
        for step in range(_blocks(c)):
            cols = slice(step * BLOCK, min((step + 1) * BLOCK, c))
            partial = a_MC[start:end, cols] @ w_OC[:, cols].T
            acc += partial * (lhs.scale[start:end, step, None] * s_OCb[None, :, step])
        out_MO[start:end] = acc
    return out_MO


class Fp8GroupedLinear(torch.autograd.Function):
    """Differentiable `y[M, N]` of the recipe from `x[M, K]`, master weights `w[E, N, K]` and
    `offsets[E + 1]` (module docstring); `offsets` gets no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        rows, wq = quantize_rows(x), quantize_weights(w)
        ctx.save_for_backward(*rows, *wq, offsets)
        ctx.dtypes = (x.dtype, w.dtype)
        return fp8_grouped_mm(rows, wq, offsets).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        values, scale, w_values, w_scale, offsets = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        rows, wq = Fp8Rows(values, scale), Fp8Weights(w_values, w_scale)
        dy = dy.to(x_dtype)
        dx = fp8_grouped_mm(quantize_rows(dy), wq, offsets, contract_k=False).to(x_dtype)
        a = dequantize_rows(rows).to(x_dtype).float()
        dy32 = dy.float()
        bounds = _bounds(offsets, w_values.shape[0], values.shape[0])
        dw = torch.stack([dy32[s:t].T @ a[s:t] for s, t in zip(bounds, bounds[1:])])
        return dx, dw.to(x_dtype).to(w_dtype), None


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`Fp8GroupedLinear.apply`: `x[M, K]` (fp32/bf16/fp16), `w[E, N, K]`, `offsets[E + 1]` ->
    `y[M, N]` in x's dtype, differentiable w.r.t. x and w (the recipe's gradients)."""
    _check_input(x, "x", 2)
    _check_input(w, "w", 3)
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"w: expected [E, N, K] with K = x.shape[1] = {x.shape[1]}, got {tuple(w.shape)}")
    return Fp8GroupedLinear.apply(x, w, offsets)
