"""SwiGLU expert FFNs on packed rows (the grouped-GEMM layout of `moe_jax.permute`).

Legend (shape suffixes): M packed rows, D expert input/output width, F expert hidden width,
E experts.

Expert e maps its rows `x_e` to `y_e = (silu(x_e W_g[e]^T) * (x_e W_u[e]^T)) W_d[e]^T` with
`W_g[e], W_u[e]` of shape `[F, D]` and `W_d[e]` of shape `[D, F]` (the torch/checkpoint layout).
Rows of `x_MD` are grouped contiguously by expert, `group_sizes_E[e]` rows each; rows past
`sum(group_sizes_E)` come out zero and get zero gradient (the grouped GEMMs skip them).

All three projections go through `moe_jax.ops.grouped_linear`, whose custom VJP supplies the
backward (input gradient `gmm`, weight gradient `tgmm`); the SwiGLU nonlinearity in between is
differentiated by JAX. The fused variant reads gate and up from one `[E, 2F, D]` weight (gate rows
first), so the input is read once for both.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.ops import (Fp8Copies, LinearPlan, RowGather, fp8_grouped_linear, gmm_reference, grouped_linear,
                         plan_linear)
from moe_jax.ops.fp8 import Fp8Rows, Fp8Weights, exact_float32
from moe_jax.ops.platform import BackendName
from moe_jax.validation import check_int

__all__ = [
    "ExpertPlans",
    "exact_swiglu",
    "expert_plans",
    "fuse_gate_up",
    "split_gate_up",
    "swiglu_experts",
    "swiglu_experts_fp8",
    "swiglu_experts_fused",
    "swiglu_experts_reference",
]


class ExpertPlans(NamedTuple):
    """The grouped GEMMs' plans of one SwiGLU expert stage: the gate and up projections (one plan
    for both, or for the fused one) and the down projection (`moe_jax.ops.plan_linear`)."""

    gate_up: LinearPlan
    down: LinearPlan


def expert_plans(num_rows: int, d_in: int, d_ff: int, num_experts: int, dtype, *, fused_gate_up: bool,
                 backend: BackendName = "auto", precision: jax.lax.Precision | None = None, kernel: str | None = None,
                 gather: bool = False) -> ExpertPlans:
    """Plans of `swiglu_experts` (`fused_gate_up=False`) or `swiglu_experts_fused` on `num_rows`
    packed rows of width `d_in` (`gather`: the gate/up GEMMs read them through row ids); `kernel` as
    for `swiglu_experts`."""
    common = dict(backend=backend, precision=precision, fwd_config=kernel, dgrad_config=kernel)
    up_rows = 2 * d_ff if fused_gate_up else d_ff
    return ExpertPlans(plan_linear(num_rows, (num_experts, up_rows, d_in), dtype, gather=gather, **common),
                       plan_linear(num_rows, (num_experts, d_in, d_ff), dtype, **common))


def _plans(plans, x_MD, rows, hidden: int, num_experts: int, fused: bool, **options) -> ExpertPlans:
    if plans is not None:
        if not isinstance(plans, ExpertPlans):
            raise TypeError(f"plans must be a moe_jax.experts.ExpertPlans (from expert_plans) or None; got "
                            f"{type(plans).__name__}.")
        return plans
    num_rows = x_MD.shape[0] if rows is None else rows.ids_M.shape[0]
    return expert_plans(num_rows, x_MD.shape[1], hidden, num_experts, x_MD.dtype, fused_gate_up=fused,
                        gather=rows is not None, **options)


def _check_shards(shards, hidden: int, what: str) -> int:
    shards = check_int("shards", shards)
    if hidden % shards:
        raise ValueError(f"shards={shards} does not divide F = {hidden} of {what}; pick shards from the divisors "
                         f"of {hidden}.")
    return shards


def fuse_gate_up(w_gate_EFD, w_up_EFD, *, shards: int = 1):
    """`[E, F, D]` gate and up weights -> `w_gate_up_E2FD` `[E, 2F, D]`, gate rows first.

    shards: the expert-tensor-parallel size n (F % n == 0). The 2F rows are then n blocks of 2F/n,
    block j holding gate rows `[j*F/n, (j+1)*F/n)` then the same up rows, so splitting the fused
    weight's rows evenly over n ranks gives every rank a fused weight of its own F/n slice, gate
    rows first (Megatron-Core's layout of a tensor-parallel gated MLP). n = 1 (default) is the
    plain concatenation. NumPy in, NumPy out; JAX arrays otherwise.
    """
    if w_gate_EFD.ndim != 3 or w_gate_EFD.shape != w_up_EFD.shape:
        raise ValueError(
            f"fuse_gate_up: w_gate_EFD {tuple(w_gate_EFD.shape)} and w_up_EFD {tuple(w_up_EFD.shape)} "
            "must both be [E, F, D] of the same shape."
        )
    e, hidden, d = w_gate_EFD.shape
    n = _check_shards(shards, hidden, "w_gate_EFD")
    xp = np if isinstance(w_gate_EFD, np.ndarray) and isinstance(w_up_EFD, np.ndarray) else jnp
    blocks = (w_gate_EFD.reshape(e, n, hidden // n, d), w_up_EFD.reshape(e, n, hidden // n, d))
    return xp.concatenate(blocks, axis=2).reshape(e, 2 * hidden, d)


def _fused_hidden(w_gate_up_E2FD: jax.Array) -> int:
    """F of a fused `[E, 2F, D]` gate/up weight (ValueError unless 3-D with an even middle axis)."""
    if w_gate_up_E2FD.ndim != 3 or w_gate_up_E2FD.shape[1] % 2:
        raise ValueError(
            f"w_gate_up_E2FD must be [E, 2F, D] with an even middle axis; got {tuple(w_gate_up_E2FD.shape)}."
        )
    return w_gate_up_E2FD.shape[1] // 2


def split_gate_up(w_gate_up_E2FD, *, shards: int = 1):
    """`w_gate_up_E2FD` `[E, 2F, D]` -> `(w_gate_EFD, w_up_EFD)`, the inverse of `fuse_gate_up`
    with the same `shards` (1: rows `[:F]` and `[F:]`)."""
    hidden = _fused_hidden(w_gate_up_E2FD)
    n = _check_shards(shards, hidden, "w_gate_up_E2FD")
    e, _, d = w_gate_up_E2FD.shape
    blocks = w_gate_up_E2FD.reshape(e, n, 2 * hidden // n, d)
    return (blocks[:, :, :hidden // n].reshape(e, hidden, d), blocks[:, :, hidden // n:].reshape(e, hidden, d))


def _check_down(x_MD, w_down_EDF, num_experts: int, hidden: int) -> None:
    if x_MD.ndim != 2:
        raise ValueError(f"x_MD must be 2-D [M, D] packed rows; got shape {tuple(x_MD.shape)}.")
    expected = (num_experts, x_MD.shape[1], hidden)
    if w_down_EDF.ndim != 3 or tuple(w_down_EDF.shape) != expected:
        raise ValueError(
            f"w_down_EDF must be [E, D, F] = {expected} for x_MD {tuple(x_MD.shape)} and the gate/up "
            f"weights; got {tuple(w_down_EDF.shape)}."
        )


def _check_gate_up(x_MD, w_EXD, name: str) -> None:
    if w_EXD.ndim != 3 or w_EXD.shape[2] != x_MD.shape[-1]:
        raise ValueError(
            f"{name} must be [E, *, D] with D = x_MD.shape[1] = {x_MD.shape[-1]}; got {tuple(w_EXD.shape)}."
        )


def _swiglu(gate_MF: jax.Array, up_MF: jax.Array) -> jax.Array:
    """silu(gate) * up in float32, returned in the inputs' dtype (bf16 stays bf16 for the GEMM)."""
    gate = gate_MF.astype(jnp.float32)
    return (jax.nn.silu(gate) * up_MF.astype(jnp.float32)).astype(gate_MF.dtype)


@jax.custom_vjp
def exact_swiglu(gate_MF: jax.Array, up_MF: jax.Array) -> jax.Array:
    """silu(gate) * up `[M, F]` in float32, returned in the inputs' dtype, reading gate, up and, in
    the backward, the output's cotangent at their own values (`moe_jax.ops.fp8.exact_float32`), as
    FP8 projections around it need (`swiglu_experts_fp8`): the e4m3 rows of the down projection's
    input and of gate's and up's gradients must not depend on whether the compiler kept the fp32
    values those bf16 arrays were rounded from."""
    if gate_MF.shape != up_MF.shape or gate_MF.dtype != up_MF.dtype:
        raise ValueError(f"exact_swiglu: gate_MF {gate_MF.shape} {gate_MF.dtype} and up_MF {up_MF.shape} {up_MF.dtype} "
                         "must share one shape and dtype.")
    return (jax.nn.silu(exact_float32(gate_MF)) * exact_float32(up_MF)).astype(gate_MF.dtype)


def _exact_swiglu_fwd(gate_MF, up_MF):
    return exact_swiglu(gate_MF, up_MF), (gate_MF, up_MF)


def _exact_swiglu_bwd(res, dh_MF):
    gate_MF, up_MF = res
    gate, up, dh = exact_float32(gate_MF), exact_float32(up_MF), exact_float32(dh_MF)
    sig = jax.nn.sigmoid(gate)
    d_gate = dh * up * (sig * (1.0 + gate * (1.0 - sig)))  # d silu(g) / dg = s + g s (1 - s)
    return d_gate.astype(gate_MF.dtype), (dh * gate * sig).astype(up_MF.dtype)


exact_swiglu.defvjp(_exact_swiglu_fwd, _exact_swiglu_bwd)


def _check_separate(x_MD, w_gate_EFD, w_up_EFD, w_down_EDF) -> tuple[int, int]:
    """E and F of separate gate, up and down weights that fit `x_MD` and each other."""
    _check_gate_up(x_MD, w_gate_EFD, "w_gate_EFD")
    if w_up_EFD.shape != w_gate_EFD.shape:
        raise ValueError(
            f"w_up_EFD {tuple(w_up_EFD.shape)} must have the shape of w_gate_EFD {tuple(w_gate_EFD.shape)}."
        )
    num_experts, hidden, _ = w_gate_EFD.shape
    _check_down(x_MD, w_down_EDF, num_experts, hidden)
    return num_experts, hidden


def swiglu_experts(
    x_MD: jax.Array,
    group_sizes_E: jax.Array,
    w_gate_EFD: jax.Array,
    w_up_EFD: jax.Array,
    w_down_EDF: jax.Array,
    *,
    backend: BackendName = "auto",
    precision: jax.lax.Precision | None = None,
    kernel: str | None = None,
    rows: RowGather | None = None,
    plans: ExpertPlans | None = None,
) -> jax.Array:
    """SwiGLU experts with separate gate and up weights: `y_MD` `[M, D]` in `x_MD.dtype`.

    All arrays must share one float dtype (cast weights to the compute dtype first). The grouped
    GEMMs run `plans` (`expert_plans` for these shapes), or the plans of `backend`, `precision` and
    `kernel` (the forward and input-gradient GEMMs' `config`: `"auto"` for the backend's on-device
    choice, None for its static one).
    `rows` (a `moe_jax.ops.RowGather`): `x_MD` is then the `[T, D]` source and the gate and up
    GEMMs read the packed rows `x_MD[rows.ids_M]` through the ids (M = `rows.ids_M.shape[0]`).
    """
    num_experts, hidden = _check_separate(x_MD, w_gate_EFD, w_up_EFD, w_down_EDF)
    plans = _plans(plans, x_MD, rows, hidden, num_experts, False, backend=backend, precision=precision, kernel=kernel)
    gate_MF = grouped_linear(x_MD, w_gate_EFD, group_sizes_E, rows=rows, plans=plans.gate_up)
    up_MF = grouped_linear(x_MD, w_up_EFD, group_sizes_E, rows=rows, plans=plans.gate_up)
    h_MF = _swiglu(gate_MF, up_MF)
    return grouped_linear(h_MF, w_down_EDF, group_sizes_E, plans=plans.down)


def swiglu_experts_fused(
    x_MD: jax.Array,
    group_sizes_E: jax.Array,
    w_gate_up_E2FD: jax.Array,
    w_down_EDF: jax.Array,
    *,
    backend: BackendName = "auto",
    precision: jax.lax.Precision | None = None,
    kernel: str | None = None,
    rows: RowGather | None = None,
    plans: ExpertPlans | None = None,
) -> jax.Array:
    """SwiGLU experts with fused gate/up weights `[E, 2F, D]` (`[:F]` gate, `[F:]` up).

    One grouped GEMM computes gate and up together (`x_MD` is read once); equal to
    `swiglu_experts` on `split_gate_up(w_gate_up_E2FD)`. `kernel`, `rows`, `plans`: as for
    `swiglu_experts` (`expert_plans(..., fused_gate_up=True)`).
    """
    _check_gate_up(x_MD, w_gate_up_E2FD, "w_gate_up_E2FD")
    hidden = _fused_hidden(w_gate_up_E2FD)
    _check_down(x_MD, w_down_EDF, w_gate_up_E2FD.shape[0], hidden)
    plans = _plans(plans, x_MD, rows, hidden, w_gate_up_E2FD.shape[0], True, backend=backend, precision=precision,
                   kernel=kernel)
    gate_up_M2F = grouped_linear(x_MD, w_gate_up_E2FD, group_sizes_E, rows=rows, plans=plans.gate_up)
    h_MF = _swiglu(gate_up_M2F[:, :hidden], gate_up_M2F[:, hidden:])
    return grouped_linear(h_MF, w_down_EDF, group_sizes_E, plans=plans.down)


def swiglu_experts_fp8(
    x_MD: jax.Array,
    group_sizes_E: jax.Array,
    w_gate_EFD: jax.Array | Fp8Weights,
    w_up_EFD: jax.Array | Fp8Weights,
    w_down_EDF: jax.Array | Fp8Weights,
    *,
    backend: BackendName = "xla",
    rows: RowGather | None = None,
    input_gradient: str = "fp8",
    copies: tuple[Fp8Copies, Fp8Copies, Fp8Copies] | None = None,
    quantized: Fp8Rows | None = None,
) -> jax.Array:
    """`swiglu_experts` with its three projections in DeepSeek-V3's blockwise FP8
    (`moe_jax.ops.fp8_grouped_linear`: rows per 1 x 128 tile), on packed rows `x_MD`; `y_MD` in
    `x_MD.dtype`. The SwiGLU in between runs in fp32 as in `swiglu_experts`.

    The weights are all master weights (bf16/fp16/fp32, quantized per 128 x 128 block in each call,
    straight-through weight gradients) or all `moe_jax.ops.fp8.Fp8Weights` (e4m3 values with fp32
    block scales, used as they are, no weight gradient); shapes as `swiglu_experts`' (the values'
    for `Fp8Weights`). With `rows` (a `RowGather`), `x_MD` is the `[T, D]` token rows: each token
    is quantized once and the gate and up products read its FP8 row through `rows.ids_M`
    (`fp8_grouped_linear(rows=)`), no packed copy is written. `input_gradient`: as
    `fp8_grouped_linear`'s, for all three projections. `copies`: for master weights, the three
    weights quantized ahead (`fp8_weight_copies((w_gate_EFD, w_up_EFD, w_down_EDF), backend=,
    input_gradient=)`, e.g. once for all the micro-batches of a step), read instead of quantizing
    the weights in this call (`fp8_grouped_linear(copies=)`; the same result). `quantized`: the rows
    `x_MD` in FP8 made already (an `Fp8Rows` row for row with `x_MD`, e.g. as an FP8 exchange
    delivered them), which the gate and up products read instead of quantizing `x_MD`
    (`fp8_grouped_linear(quantized=)`)."""
    weights = (w_gate_EFD, w_up_EFD, w_down_EDF)
    if copies is not None and (not isinstance(copies, (tuple, list)) or isinstance(copies, Fp8Copies)
                               or len(copies) != 3):
        raise TypeError("swiglu_experts_fp8: copies must be the three Fp8Copies of (w_gate_EFD, w_up_EFD, "
                        f"w_down_EDF), as fp8_weight_copies of that tuple returns; got {type(copies).__name__}.")
    gate_up_copies, down_copies = (None, None) if copies is None else (tuple(copies[:2]), copies[2])
    stored = [isinstance(w, Fp8Weights) for w in weights]
    if any(stored) and not all(stored):
        raise TypeError("swiglu_experts_fp8: w_gate_EFD, w_up_EFD and w_down_EDF must be all master weights or all "
                        f"Fp8Weights; got {', '.join(type(w).__name__ for w in weights)}.")
    _check_separate(x_MD, *(w.values_ENK if s else w for w, s in zip(weights, stored)))
    # Gate and up in one call: the rows are quantized and kept once for both.
    gate_MF, up_MF = fp8_grouped_linear(x_MD, (w_gate_EFD, w_up_EFD), group_sizes_E, backend=backend, rows=rows,
                                        input_gradient=input_gradient, copies=gate_up_copies,
                                        quantized=quantized)
    return fp8_grouped_linear(exact_swiglu(gate_MF, up_MF), w_down_EDF, group_sizes_E, backend=backend,
                              input_gradient=input_gradient, copies=down_copies)


def swiglu_experts_reference(
    x_MD: jax.Array,
    group_sizes_E: jax.Array,
    w_gate_EFD: jax.Array,
    w_up_EFD: jax.Array,
    w_down_EDF: jax.Array,
) -> jax.Array:
    """fp32 reference of `swiglu_experts` through `moe_jax.ops.gmm_reference` (plain `jnp`,
    HIGHEST precision): `[M, D]` float32, zero past `sum(group_sizes_E)`, and its gradients come
    from ordinary dense autodiff, independent of the grouped GEMMs. Small shapes only (it
    gathers one weight matrix per row)."""
    gate_MF = gmm_reference(x_MD, w_gate_EFD, group_sizes_E)
    up_MF = gmm_reference(x_MD, w_up_EFD, group_sizes_E)
    return gmm_reference(jax.nn.silu(gate_MF) * up_MF, w_down_EDF, group_sizes_E)
