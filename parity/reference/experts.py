"""SwiGLU experts over selected token-expert pairs: pack, grouped GEMMs, weighted combine.

Legend: T tokens, D model width, F expert hidden width, E experts, K experts per token (top-k),
P = T*K packed token-expert pairs.

Weights: `w_gate[E, F, D]`, `w_up[E, F, D]` (or fused `w_gate_up[E, 2F, D]`, gate rows first),
`w_down[E, D, F]`; expert e computes `F_e(x) = (silu(x W_gate[e]^T) * (x W_up[e]^T)) W_down[e]^T`
and token t's output is `sum_k selected_weight[t, k] * F_{selected_expert[t, k]}(x_t)`.

Three forms compute it, for checking one another:

- `selected_expert_path_forward` / `_backward`: the explicit forward and hand-written
  backward of docs/reference-algorithm.md (Eqs. 1-8) (Triton grouped GEMMs and their weight-gradient kernel).
- `moe_experts_autograd`: the same forward built from `grouped_linear`, differentiated by torch.
- `parity.reference.loops.moe_experts_loop`: a plain per-token loop.

Dtypes: activations and expert weights share one dtype (bf16, fp16, fp32 or fp64). The SwiGLU
nonlinearity and both the combine and the scatter back to tokens are computed in fp32 (fp64 for
fp64 inputs) and rounded once; grouped GEMMs accumulate in fp32 and return the input dtype.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from parity.reference.grouped_gemm import grouped_linear, grouped_mm, grouped_mm_backward

# A differentiable grouped linear layer: `(a[M, K], w[E, N, K], offsets[E + 1]) -> [M, N]`.
GroupedLinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Packing(NamedTuple):
    """Token-expert pairs sorted by expert (stable, so ties keep token order).

    token_ids[P]  int64  token of each packed row
    expert_ids[P] int64  expert of each packed row (non-decreasing)
    order[P]      int64  packed row p is the flat (token, slot) pair `order[p]` = t*K + k
    offsets[E+1]  int32  exclusive prefix sum of the per-expert counts
    """

    token_ids: torch.Tensor
    expert_ids: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor


class ExpertPathCache(NamedTuple):
    """What the explicit backward needs from the forward (all packed in expert order).

    pair_weight[P] routing weight of each packed row, a[P, D] packed inputs, gate/up/hidden[P, F],
    pair_out[P, D] unweighted expert outputs; the rest is the `Packing`.
    """

    token_ids: torch.Tensor
    expert_ids: torch.Tensor
    pair_weight: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    a: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    hidden: torch.Tensor
    pair_out: torch.Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and nonlinearities are computed in: fp64 for fp64 data, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack_by_expert(selected_expert: torch.Tensor, num_experts: int) -> Packing:
    """Sort the T*K pairs of `selected_expert[T, K]` by expert and count them."""
    if selected_expert.ndim != 2:
        raise ValueError(f"selected_expert must be [T, K], got {tuple(selected_expert.shape)}")
    if selected_expert.dtype.is_floating_point or selected_expert.dtype == torch.bool:
        raise ValueError(f"selected_expert must be integer, got {selected_expert.dtype}")
    if selected_expert.numel() and (
        int(selected_expert.min()) < 0 or int(selected_expert.max()) >= num_experts
    ):
        raise ValueError(f"selected_expert values must lie in [0, {num_experts})")
    return sort_by_key(selected_expert.reshape(-1), num_experts, top_k=selected_expert.shape[1])


def sort_by_key(flat: torch.Tensor, num_keys: int, *, top_k: int = 1) -> Packing:
    """`pack_by_expert` of a flat `[N]` key vector already known to lie in `[0, num_keys)`: no
    checks, so no host sync (the EP reference regroups by keys it built itself)."""
    flat = flat.long()
    order = torch.argsort(flat, stable=True)
    expert_ids = flat[order]
    counts = torch.bincount(expert_ids, minlength=num_keys)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return Packing(order // max(top_k, 1), expert_ids, order, offsets)


def fuse_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """`w_gate[E, F, D]`, `w_up[E, F, D]` -> `w_gate_up[E, 2F, D]` (gate rows first)."""
    if w_gate.shape != w_up.shape or w_gate.ndim != 3:
        raise ValueError(f"expected two [E, F, D] weights, got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    return torch.cat([w_gate, w_up], dim=1)


def split_gate_up(w_gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w_gate_up[E, 2F, D]` -> views `(w_gate[E, F, D], w_up[E, F, D])`."""
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2F, D], got {tuple(w_gate_up.shape)}")
    f = w_gate_up.shape[1] // 2
    return w_gate_up[:, :f], w_gate_up[:, f:]


def _check_shapes(
    x: torch.Tensor,
    selected_expert: torch.Tensor,
    selected_weight: torch.Tensor,
    w_gate_up_shape: tuple[int, int, int],
    w_down: torch.Tensor,
    gate_up_name: str,
) -> tuple[int, int]:
    """Validate the expert-path operands; returns (E, F)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    t, d = x.shape
    if selected_expert.ndim != 2 or selected_expert.shape[0] != t:
        raise ValueError(f"selected_expert must be [T={t}, K], got {tuple(selected_expert.shape)}")
    if selected_weight.shape != selected_expert.shape:
        raise ValueError(
            f"selected_weight {tuple(selected_weight.shape)} must match selected_expert "
            f"{tuple(selected_expert.shape)}"
        )
    if not selected_weight.dtype.is_floating_point:
        raise ValueError(f"selected_weight must be floating point, got {selected_weight.dtype}")
    e, f, d_w = w_gate_up_shape
    if d_w != d:
        raise ValueError(f"{gate_up_name} has model width {d_w}, x has {d}")
    if w_down.ndim != 3 or tuple(w_down.shape) != (e, d, f):
        raise ValueError(f"w_down must be [E={e}, D={d}, F={f}], got {tuple(w_down.shape)}")
    return e, f


def _check_weight_pair(w_gate: torch.Tensor, w_up: torch.Tensor) -> tuple[int, int, int]:
    if w_gate.ndim != 3 or w_gate.shape != w_up.shape:
        raise ValueError(
            f"w_gate and w_up must both be [E, F, D], got {tuple(w_gate.shape)} and {tuple(w_up.shape)}"
        )
    return tuple(w_gate.shape)


def _fused_shape(w_gate_up: torch.Tensor) -> tuple[int, int, int]:
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2F, D], got {tuple(w_gate_up.shape)}")
    e, f2, d = w_gate_up.shape
    return e, f2 // 2, d


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, computed in the accumulation dtype and rounded once."""
    acc = acc_dtype(gate.dtype)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def _swiglu_backward(
    d_hidden: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `swiglu` (same rounding points as autograd of it): `(d_gate, d_up)`."""
    acc = acc_dtype(gate.dtype)
    g, u, dh = gate.to(acc), up.to(acc), d_hidden.to(acc)
    sig = torch.sigmoid(g)
    d_silu = sig * (1.0 + g * (1.0 - sig))  # d/dz [z * sigmoid(z)]
    return (dh * u * d_silu).to(gate.dtype), (dh * g * sig).to(up.dtype)


def combine_pairs(
    pair_out: torch.Tensor, pair_weight: torch.Tensor, token_ids: torch.Tensor, num_tokens: int,
) -> torch.Tensor:
    """Weighted sum of expert outputs into their tokens: `out[t] = sum_{p: token_ids[p] = t} w[p] y[p]`.

    `pair_out[P, D]`, `pair_weight[P]`, `token_ids[P]` int64 in [0, num_tokens) -> `out[num_tokens,
    D]` in the dtype of `pair_out`, accumulated in fp32 (fp64 for fp64 data) and rounded once.
    Differentiable with respect to `pair_out` and `pair_weight`. Shared by the single-process path
    and `parity.reference.ep.ep_combine`.
    """
    acc = acc_dtype(pair_out.dtype)
    out = torch.zeros((num_tokens, pair_out.shape[1]), device=pair_out.device, dtype=acc)
    # Out-of-place index_add so that autograd can differentiate the same code path.
    out = out.index_add(0, token_ids, pair_out.to(acc) * pair_weight.to(acc)[:, None])
    return out.to(pair_out.dtype)


def _pack(
    x: torch.Tensor, selected_expert: torch.Tensor, selected_weight: torch.Tensor, num_experts: int,
) -> tuple[Packing, torch.Tensor, torch.Tensor]:
    """Packing, packed routing weights `[P]`, packed inputs `[P, D]` (differentiable gathers)."""
    if x.device != selected_expert.device or x.device != selected_weight.device:
        raise ValueError("x, selected_expert and selected_weight must be on one device")
    packing = pack_by_expert(selected_expert, num_experts)
    pair_weight = selected_weight.reshape(-1)[packing.order]
    return packing, pair_weight, x[packing.token_ids]


def selected_expert_path_forward(
    x: torch.Tensor,
    selected_expert: torch.Tensor,
    selected_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> tuple[torch.Tensor, ExpertPathCache]:
    """Explicit expert path: `x[T, D]`, routing `[T, K]` -> `(out[T, D], cache)`.

    Not differentiated by autograd; pair it with `selected_expert_path_backward`.
    """
    e, _ = _check_shapes(x, selected_expert, selected_weight, _check_weight_pair(w_gate, w_up),
                         w_down, "w_gate")
    with torch.no_grad():
        packing, pair_weight, a = _pack(x, selected_expert, selected_weight, e)
        gate = grouped_mm(a, w_gate, packing.offsets)
        up = grouped_mm(a, w_up, packing.offsets)
        hidden = swiglu(gate, up)
        pair_out = grouped_mm(hidden, w_down, packing.offsets)
        out = combine_pairs(pair_out, pair_weight, packing.token_ids, x.shape[0])
    cache = ExpertPathCache(
        packing.token_ids, packing.expert_ids, pair_weight, packing.order, packing.offsets,
        a, gate, up, hidden, pair_out,
    )
    return out, cache


def selected_expert_path_forward_fused(
    x: torch.Tensor,
    selected_expert: torch.Tensor,
    selected_weight: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> tuple[torch.Tensor, ExpertPathCache]:
    """`selected_expert_path_forward` with fused `w_gate_up[E, 2F, D]`: one grouped GEMM for both."""
    e, f = _check_shapes(x, selected_expert, selected_weight, _fused_shape(w_gate_up), w_down,
                         "w_gate_up")
    with torch.no_grad():
        packing, pair_weight, a = _pack(x, selected_expert, selected_weight, e)
        gate_up = grouped_mm(a, w_gate_up, packing.offsets)
        gate, up = gate_up[:, :f], gate_up[:, f:]
        hidden = swiglu(gate, up)
        pair_out = grouped_mm(hidden, w_down, packing.offsets)
        out = combine_pairs(pair_out, pair_weight, packing.token_ids, x.shape[0])
    cache = ExpertPathCache(
        packing.token_ids, packing.expert_ids, pair_weight, packing.order, packing.offsets,
        a, gate, up, hidden, pair_out,
    )
    return out, cache


def _shape_of(shape_or_tensor: Sequence[int] | torch.Tensor) -> torch.Size:
    if isinstance(shape_or_tensor, torch.Tensor):
        return shape_or_tensor.shape
    return torch.Size(shape_or_tensor)


def _backward_through_combine_and_down(
    dout: torch.Tensor, cache: ExpertPathCache, w_down: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine and down-projection backward -> `(d_gate, d_up, d_pair_weight[P], d_w_down)`.

    Combine: `dH_p = w_p dY_t` and `dw_p = <H_p, dY_t>` (docs/reference-algorithm.md, Eq. 7), in the accumulation dtype.
    """
    acc = acc_dtype(cache.pair_out.dtype)
    dout_pairs = dout[cache.token_ids].to(acc)
    d_pair_out = (dout_pairs * cache.pair_weight.to(acc)[:, None]).to(cache.pair_out.dtype)
    d_pair_weight = (dout_pairs * cache.pair_out.to(acc)).sum(dim=1)
    d_hidden, d_w_down = grouped_mm_backward(cache.hidden, w_down, d_pair_out, cache.offsets)
    d_gate, d_up = _swiglu_backward(d_hidden, cache.gate, cache.up)
    return d_gate, d_up, d_pair_weight, d_w_down


def _scatter_back(
    d_a_parts: Sequence[torch.Tensor],
    d_pair_weight: torch.Tensor,
    cache: ExpertPathCache,
    x_shape: torch.Size,
    routing_shape: torch.Size,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed input gradients -> `d_x[T, D]`; packed weight gradients -> `[T, K]` routing order."""
    acc = acc_dtype(dtype)
    d_a = sum(part.to(acc) for part in d_a_parts)
    d_x = torch.zeros(x_shape, device=d_a.device, dtype=acc).index_add_(0, cache.token_ids, d_a)
    # d_pair_weight is expert-major; packed row p came from flat routing slot order[p].
    d_routing = torch.zeros(routing_shape.numel(), device=d_a.device, dtype=cache.pair_weight.dtype)
    d_routing.scatter_(0, cache.order, d_pair_weight.to(cache.pair_weight.dtype))
    return d_x.to(dtype), d_routing.reshape(routing_shape)


def _check_backward_args(
    dout: torch.Tensor, cache: ExpertPathCache, x_shape, routing_shape,
) -> tuple[torch.Size, torch.Size]:
    x_shape, routing_shape = _shape_of(x_shape), _shape_of(routing_shape)
    if dout.shape != x_shape:
        raise ValueError(f"dout {tuple(dout.shape)} must have the shape of x {tuple(x_shape)}")
    if routing_shape.numel() != cache.order.numel() or len(routing_shape) != 2:
        raise ValueError(f"routing_shape {tuple(routing_shape)} does not match the {cache.order.numel()} cached pairs")
    return x_shape, routing_shape


def selected_expert_path_backward(
    dout: torch.Tensor,
    cache: ExpertPathCache,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    x_shape: Sequence[int] | torch.Tensor,
    routing_shape: Sequence[int] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Explicit backward of `selected_expert_path_forward` given `dout[T, D]`.

    `x_shape` is `(T, D)` and `routing_shape` `(T, K)` (a tensor of that shape also works).
    Returns `(d_x[T, D], d_selected_weight[T, K], d_w_gate[E, F, D], d_w_up[E, F, D],
    d_w_down[E, D, F])`. The selected experts are constants: no gradient flows into the choice.
    """
    x_shape, routing_shape = _check_backward_args(dout, cache, x_shape, routing_shape)
    with torch.no_grad():
        d_gate, d_up, d_pair_weight, d_w_down = _backward_through_combine_and_down(dout, cache, w_down)
        d_a_gate, d_w_gate = grouped_mm_backward(cache.a, w_gate, d_gate, cache.offsets)
        d_a_up, d_w_up = grouped_mm_backward(cache.a, w_up, d_up, cache.offsets)
        d_x, d_routing = _scatter_back(
            (d_a_gate, d_a_up), d_pair_weight, cache, x_shape, routing_shape, dout.dtype,
        )
    return d_x, d_routing, d_w_gate, d_w_up, d_w_down


def selected_expert_path_backward_fused(
    dout: torch.Tensor,
    cache: ExpertPathCache,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    x_shape: Sequence[int] | torch.Tensor,
    routing_shape: Sequence[int] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of `selected_expert_path_forward_fused`:
    `(d_x[T, D], d_selected_weight[T, K], d_w_gate_up[E, 2F, D], d_w_down[E, D, F])`.

    The gate and up gradients travel together through one grouped GEMM and one weight gradient.
    """
    x_shape, routing_shape = _check_backward_args(dout, cache, x_shape, routing_shape)
    with torch.no_grad():
        d_gate, d_up, d_pair_weight, d_w_down = _backward_through_combine_and_down(dout, cache, w_down)
        d_gate_up = torch.cat([d_gate, d_up], dim=1)
        d_a, d_w_gate_up = grouped_mm_backward(cache.a, w_gate_up, d_gate_up, cache.offsets)
        d_x, d_routing = _scatter_back(
            (d_a,), d_pair_weight, cache, x_shape, routing_shape, dout.dtype,
        )
    return d_x, d_routing, d_w_gate_up, d_w_down


def expert_swiglu(
    a: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    *, linear: GroupedLinearFn = grouped_linear,
) -> torch.Tensor:
    """SwiGLU experts over packed rows `a[R, D]` grouped by `offsets[E + 1]`: `[R, D]`. The three
    projections run `linear` (default the Triton grouped GEMMs with autograd; `fp8_grouped_linear`
    for the blockwise FP8 recipe); the nonlinearity in float32, rounded once."""
    hidden = swiglu(linear(a, w_gate, offsets), linear(a, w_up, offsets))
    return linear(hidden, w_down, offsets)


def moe_experts_autograd(
    x: torch.Tensor,
    selected_expert: torch.Tensor,
    selected_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    linear: GroupedLinearFn = grouped_linear,
) -> torch.Tensor:
    """The expert path as a differentiable torch graph over `linear`: `out[T, D]`.

    `linear(a[M, K], w[E, N, K], offsets[E + 1]) -> [M, N]` runs the three projections:
    `grouped_linear` (default), or `parity.reference.fp8.fp8_grouped_linear` for DeepSeek-V3's
    blockwise FP8 recipe. Gradients reach `x`, `selected_weight` and the three weights (not the
    integer choice).
    """
    e, _ = _check_shapes(x, selected_expert, selected_weight, _check_weight_pair(w_gate, w_up),
                         w_down, "w_gate")
    packing, pair_weight, a = _pack(x, selected_expert, selected_weight, e)
    pair_out = expert_swiglu(a, packing.offsets, w_gate, w_up, w_down, linear=linear)
    return combine_pairs(pair_out, pair_weight, packing.token_ids, x.shape[0])


def moe_experts_autograd_fused(
    x: torch.Tensor,
    selected_expert: torch.Tensor,
    selected_weight: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts_autograd` with fused `w_gate_up[E, 2F, D]`: `out[T, D]`."""
    e, f = _check_shapes(x, selected_expert, selected_weight, _fused_shape(w_gate_up), w_down,
                         "w_gate_up")
    packing, pair_weight, a = _pack(x, selected_expert, selected_weight, e)
    gate_up = grouped_linear(a, w_gate_up, packing.offsets)
    hidden = swiglu(gate_up[:, :f], gate_up[:, f:])
    pair_out = grouped_linear(hidden, w_down, packing.offsets)
    return combine_pairs(pair_out, pair_weight, packing.token_ids, x.shape[0])
