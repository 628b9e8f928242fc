"""Routers, their explicit backward, and the balancing terms. Router math runs in float32.

Legend: T tokens, D model width, E experts, K experts per token (top-k).

Every router maps `logits[T, E]` to `(expert_idx[T, K] int64, weights[T, K] float32,
probs[T, E] float32)`. `expert_idx` lists each token's experts by descending selection score;
equal scores go to the lower expert index (a stable sort, as `jax.lax.top_k` does). `probs` is the
full-router distribution that the auxiliary loss uses. A `selection_bias[E]` (loss-free balancing)
changes which experts are chosen, never the weights. Weights are differentiable functions of the
logits; the choice of experts is not.
"""

from __future__ import annotations

import torch

_NORM_EPS = 1e-20  # DeepSeek-V3 adds it to the sum of the selected sigmoid scores.


def router_logits(x: torch.Tensor, w_router: torch.Tensor) -> torch.Tensor:
    """`x[T, D]`, `w_router[E, D]` -> float32 `logits[T, E] = x W_router^T`."""
    if x.ndim != 2 or w_router.ndim != 2 or x.shape[1] != w_router.shape[1]:
        raise ValueError(f"expected x[T, D] and w_router[E, D], got {tuple(x.shape)} and {tuple(w_router.shape)}")
    return x.float() @ w_router.float().transpose(0, 1)


def _check_logits(logits: torch.Tensor, top_k: int, selection_bias: torch.Tensor | None) -> torch.Tensor:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")
    if selection_bias is not None and tuple(selection_bias.shape) != (num_experts,):
        raise ValueError(f"selection_bias must be [E={num_experts}], got {tuple(selection_bias.shape)}")
    return logits.float()


def _select(scores: torch.Tensor, k: int, selection_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k best `scores (+ selection_bias)` per row, best first, lower index on ties."""
    with torch.no_grad():
        if selection_bias is not None:
            scores = scores + selection_bias.float()
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def route_selected_softmax(
    logits: torch.Tensor, top_k: int, selection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixtral (docs/reference-algorithm.md, Eq. 2): top-k by logit, weights = softmax over the selected logits."""
    r = _check_logits(logits, top_k, selection_bias)
    idx = _select(r, top_k, selection_bias)
    weights = torch.softmax(r.gather(1, idx), dim=-1)
    return idx, weights, torch.softmax(r, dim=-1)


def route_softmax_topk(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool = False,
    selection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen-MoE style: p = softmax over all experts, top-k by p, weights = the selected p.

    `renormalize=True` divides the selected p by their sum (Qwen3-MoE's `norm_topk_prob`).
    """
    r = _check_logits(logits, top_k, selection_bias)
    p = torch.softmax(r, dim=-1)
    idx = _select(p, top_k, selection_bias)
    weights = p.gather(1, idx)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx, weights, p


def route_sigmoid_grouped(
    logits: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    normalize: bool = True,
    routed_scaling_factor: float = 1.0,
    selection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores, group-limited top-k on biased scores, unbiased weights.

    s = sigmoid(logits); the E experts form `n_group` groups of E/n_group contiguous experts; a
    group scores the sum of its two highest biased scores (its only score if it has one expert);
    the `topk_group` best groups stay and the top-k experts by biased score among them are chosen.
    weights = s of the chosen, divided by their sum (+1e-20) if `normalize`, times
    `routed_scaling_factor`. probs = s / sum(s).
    """
    r = _check_logits(logits, top_k, selection_bias)
    num_tokens, num_experts = r.shape
    if not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must divide E={num_experts}, got {n_group!r}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
    group_size = num_experts // n_group
    if top_k > topk_group * group_size:
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_group * group_size} experts in the {topk_group} kept groups"
        )

    s = torch.sigmoid(r)
    with torch.no_grad():
        biased = s if selection_bias is None else s + selection_bias.float()
        grouped = biased.reshape(num_tokens, n_group, group_size)
        group_score = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)
        kept_groups = _select(group_score, topk_group)
        kept = torch.zeros((num_tokens, n_group), dtype=torch.bool, device=r.device)
        kept.scatter_(1, kept_groups, True)
        kept_experts = kept.repeat_interleave(group_size, dim=1)
        # -inf, not 0: a kept expert with a negative biased score must still beat a dropped one.
        idx = _select(biased.masked_fill(~kept_experts, float("-inf")), top_k)

    weights = s.gather(1, idx)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    weights = weights * routed_scaling_factor
    return idx, weights, s / s.sum(dim=-1, keepdim=True)


def selected_router_backward(
    x: torch.Tensor,
    w_router: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    d_selected_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit backward of `route_selected_softmax(router_logits(x, w_router), k)` (docs/reference-algorithm.md, Eq. 10).

    `x[T, D]`, `w_router[E, D]`, `topk_idx[T, K]`, `topk_weight[T, K]` (the softmax over the
    selected logits), `d_selected_weight[T, K]` -> `(d_x_router[T, D] in x.dtype,
    d_w_router[E, D] float32)`. Selected-logit gradient: `p * (dp - sum(p * dp))`, zero elsewhere.
    """
    if x.ndim != 2 or w_router.ndim != 2 or x.shape[1] != w_router.shape[1]:
        raise ValueError(f"expected x[T, D] and w_router[E, D], got {tuple(x.shape)} and {tuple(w_router.shape)}")
    if (
        topk_idx.ndim != 2
        or topk_idx.shape[0] != x.shape[0]
        or topk_weight.shape != topk_idx.shape
        or d_selected_weight.shape != topk_idx.shape
    ):
        raise ValueError(
            f"topk_idx {tuple(topk_idx.shape)}, topk_weight {tuple(topk_weight.shape)} and "
            f"d_selected_weight {tuple(d_selected_weight.shape)} must all be [T={x.shape[0]}, K]"
        )
    p = topk_weight.float()
    dp = d_selected_weight.float()
    d_selected_logits = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
    d_logits = torch.zeros((x.shape[0], w_router.shape[0]), device=x.device, dtype=torch.float32)
    d_logits.scatter_add_(1, topk_idx.long(), d_selected_logits)
    d_w_router = d_logits.transpose(0, 1) @ x.float()
    d_x_router = (d_logits @ w_router.float()).to(x.dtype)
    return d_x_router, d_w_router


def _token_mask(mask: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    """float32 `[T]`: 1 for real tokens, 0 for padding."""
    if mask is None:
        return torch.ones(num_tokens, device=device, dtype=torch.float32)
    if tuple(mask.shape) != (num_tokens,):
        raise ValueError(f"mask must be [T={num_tokens}], got {tuple(mask.shape)}")
    return (mask != 0).to(device=device, dtype=torch.float32)


def expert_counts(expert_idx: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """int64 `counts[E]`: token-expert assignments per expert over real tokens (`mask[T]` True)."""
    if expert_idx.ndim != 2:
        raise ValueError(f"expert_idx must be [T, K], got {tuple(expert_idx.shape)}")
    real = _token_mask(mask, expert_idx.shape[0], expert_idx.device).bool()
    return torch.bincount(expert_idx[real].reshape(-1).long(), minlength=num_experts)


def aux_loss(probs: torch.Tensor, expert_idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch / Megatron load-balancing loss `E * sum_e f_e * Pbar_e` (1.0 under uniform routing).

    `probs[T, E]` full-router probabilities, `expert_idx[T, K]`, `mask[T]` (True = real token).
    `f_e = count_e / (T_real * K)` is a constant (no gradient); `Pbar_e` is the mean of
    `probs[:, e]` over real tokens. Zero real tokens give 0.
    """
    if probs.ndim != 2 or expert_idx.ndim != 2 or probs.shape[0] != expert_idx.shape[0]:
        raise ValueError(f"expected probs[T, E] and expert_idx[T, K], got {tuple(probs.shape)} and {tuple(expert_idx.shape)}")
    num_tokens, num_experts = probs.shape
    m = _token_mask(mask, num_tokens, probs.device)
    t_real = m.sum().clamp_min(1.0)
    f = expert_counts(expert_idx, num_experts, mask).float() / (t_real * expert_idx.shape[1])
    p_bar = (probs.float() * m[:, None]).sum(dim=0) / t_real
    return num_experts * (f.detach() * p_bar).sum()


def z_loss(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss: mean over real tokens of `logsumexp(logits[t])^2` (float32)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    m = _token_mask(mask, logits.shape[0], logits.device)
    lse = torch.logsumexp(logits.float(), dim=-1)
    return (lse.square() * m).sum() / m.sum().clamp_min(1.0)


def update_selection_bias(bias: torch.Tensor, counts: torch.Tensor, step_size: float) -> torch.Tensor:
    """Loss-free balancing: `bias + step_size * sign(mean(counts) - counts)`, outside autograd.

    Underused experts (below the mean load) move up, overused ones down; `counts[E]` should come
    from real tokens only (`expert_counts(..., mask=...)`).
    """
    if bias.ndim != 1 or counts.shape != bias.shape:
        raise ValueError(f"bias and counts must both be [E], got {tuple(bias.shape)} and {tuple(counts.shape)}")
    with torch.no_grad():
        load = counts.float()
        return (bias.float() + step_size * torch.sign(load.mean() - load)).to(bias.dtype)
