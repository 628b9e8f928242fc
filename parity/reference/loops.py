"""Plain PyTorch loop oracles: the definitions themselves, with nothing packed or fused.

Legend: M packed rows, K reduction width (or experts per token in `moe_experts_loop`), N output
width, E experts, T tokens, D model width, F expert hidden width.

They compute in the dtype they are given (pass float64 for an oracle), are differentiable by
autograd, and are meant for small shapes only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _bounds(offsets: torch.Tensor) -> list[int]:
    return [int(v) for v in offsets.detach().cpu().tolist()]


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`a[M, K]`, `b[E, N, K]`, `offsets[E + 1]` -> `[M, N]`, one matmul per expert; tail rows zero."""
    bounds = _bounds(offsets)
    pieces = [a[s:e] @ b[i].transpose(0, 1) for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
    pieces.append(a.new_zeros((a.shape[0] - bounds[-1], b.shape[1])))
    return torch.cat(pieces, dim=0)


def grouped_weight_grad_loop(a: torch.Tensor, dc: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`a[M, K]`, `dc[M, N]`, `offsets[E + 1]` -> `[E, N, K]` with `[e] = dc_e^T a_e`."""
    bounds = _bounds(offsets)
    return torch.stack(
        [dc[s:e].transpose(0, 1) @ a[s:e] for s, e in zip(bounds[:-1], bounds[1:])]
    ) if len(bounds) > 1 else a.new_zeros((0, dc.shape[1], a.shape[1]))


def swiglu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert on rows `x[..., D]` with `w_gate[F, D]`, `w_up[F, D]`, `w_down[D, F]`."""
    return (F.silu(x @ w_gate.transpose(0, 1)) * (x @ w_up.transpose(0, 1))) @ w_down.transpose(0, 1)


def moe_experts_loop(
    x: torch.Tensor,
    selected_expert: torch.Tensor,
    selected_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """`out[t] = sum_k selected_weight[t, k] * F_{selected_expert[t, k]}(x[t])`, token by token.

    `x[T, D]`, `selected_expert[T, K]`, `selected_weight[T, K]`, `w_gate/w_up[E, F, D]`,
    `w_down[E, D, F]` -> `out[T, D]` in the dtype of `x`.
    """
    choices = selected_expert.detach().cpu().tolist()  # one host copy, not one per pair
    rows = []
    for t, experts in enumerate(choices):
        acc = x.new_zeros(x.shape[1])
        for k, e in enumerate(experts):
            acc = acc + selected_weight[t, k].to(x.dtype) * swiglu_expert(x[t], w_gate[e], w_up[e], w_down[e])
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(x.shape)
