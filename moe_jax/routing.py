"""Routers and load-balancing objectives for Mixture-of-Experts layers.

Legend (shape suffixes): T tokens, E experts, K experts chosen per token (top-k), G expert groups,
P experts per group (E / G), Gk groups kept per token (topk_group), B batch (sequences),
S sequence length. `logits_TE` is `[T, E]`, `mask_BS` is `[B, S]`, and so on.

A router turns router logits into a `Routing`: which K experts each token uses
(`expert_idx_TK`), the weights that combine their outputs (`weights_TK`), and the full-router
probabilities the balancing losses read (`probs_TE`). Three rules are provided:

* `SelectedSoftmax` -- top-k by logit, softmax over the selected logits (Mixtral, Jiang
  et al. 2024; Shazeer et al. 2017's noisy top-k gating without the noise).
* `SoftmaxTopK` -- softmax over all experts, top-k by probability, optional renormalisation
  (Qwen3-MoE's `norm_topk_prob`).
* `SigmoidGroupedTopK` -- sigmoid affinities, group-limited top-k, normalisation and a routed
  scaling factor (DeepSeek-V3).

All three accept a per-expert `selection_bias_E` (loss-free balancing): it changes *which* experts
are chosen, never the weight values. Router math runs in float32 whatever the logits' dtype.
Expert selection is discrete, so gradients reach `logits_TE` only through `weights_TK` (and
through `probs_TE` for the losses).

`router_logits(x_TD, w_ED)` computes the logits a router reads: `x @ w^T` in float32 (below).

Balancing: `aux_loss` (Switch/Megatron, counts held constant), `seq_aux_loss` (DeepSeek-V3's
sequence-wise form), `z_loss` (router logit magnitude), and `update_selection_bias` (the loss-free
feedback rule, applied outside the gradient from observed `expert_counts`). Every statistic takes
an optional boolean mask (True = real token); padding tokens never count in loads, means or
losses, and a fully masked batch yields zero losses rather than NaN.

Everything here is traceable under `jax.jit`: configuration is static (frozen dataclasses) and
all data-dependent work is `jnp`/`lax`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.validation import check_bool, check_int, check_number

__all__ = [
    "Routing",
    "SelectedSoftmax",
    "SoftmaxTopK",
    "SigmoidGroupedTopK",
    "Router",
    "router_logits",
    "expert_counts",
    "aux_loss",
    "seq_aux_loss",
    "z_loss",
    "update_selection_bias",
]

_HI = jax.lax.Precision.HIGHEST


def router_logits(x_TD: jax.Array, w_ED: jax.Array) -> jax.Array:
    """float32 `[T, E]` router logits `x_TD @ w_ED^T`, every product exact and summed in float32.

    bfloat16 `x_TD` with bfloat16 or float32 `w_ED` (a bf16 layer, with bf16 or the default fp32
    parameters): each float32 operand is split into bfloat16 parts whose sum it is (three
    parts hold a float32 exactly), and a bfloat16 one is its own part, so every product of
    parts is exact in float32 and runs on tensor cores accumulating in float32. The forward is the
    float32 product's value up to the rounding of its sum (each term enters as its exact parts). The backward's float32 cotangent is split
    into two parts for `dx` (equal to it within 2^-16 relative; `dx` returns in bfloat16, whose own
    rounding, 2^-9, is far coarser) and into three for a float32 `dw`, which is then the float32
    product's value up to the rounding of its sum (two for a bfloat16 `dw`). Any other dtypes
    (float32 or float16 `x_TD`, float16 `w_ED`): both operands in float32 at `Precision.HIGHEST`.
    """
    if x_TD.dtype == jnp.bfloat16 and w_ED.dtype in (jnp.bfloat16, jnp.float32):
        return _split_logits(x_TD, w_ED)
    return jnp.dot(x_TD.astype(jnp.float32), w_ED.astype(jnp.float32).T, precision=_HI)


def _bf16_parts(a: jax.Array, n: int) -> list[jax.Array]:
    """`n` bfloat16 arrays whose float32 sum is `a` (a bfloat16 `a` is its own single part): each
    part is the rest rounded to bfloat16, so each takes at least 8 more of float32's 24 significant
    bits and three hold a float32 exactly (down to magnitudes near 2^-110, where the last part
    would be subnormal); two hold it within 2^-16 relative."""
    if a.dtype == jnp.bfloat16:
        return [a]
    parts, rest = [], a.astype(jnp.float32)
    for _ in range(n - 1):
        parts.append(rest.astype(jnp.bfloat16))
        rest = rest - parts[-1].astype(jnp.float32)
    return parts + [rest.astype(jnp.bfloat16)]


def _dot_f32(a_MK: jax.Array, b_NK: jax.Array) -> jax.Array:
    """`a @ b^T` with float32 accumulation and output."""
    return jax.lax.dot_general(a_MK, b_NK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _sum_of_dots(a_parts, b_parts):
    """`sum_ij a_i @ b_j^T` where the contraction is long and the output small: one product each."""
    return functools.reduce(jnp.add, (_dot_f32(a, b) for a in a_parts for b in b_parts))


@jax.custom_vjp
def _split_logits(x_TD, w_ED):
    return _sum_of_dots([x_TD], _bf16_parts(w_ED, 3))


def _split_logits_fwd(x_TD, w_ED):
    return _split_logits(x_TD, w_ED), (x_TD, w_ED)


def _split_logits_bwd(res, g_TE):
    x_TD, w_ED = res
    g_TE = g_TE.astype(jnp.float32)
    g_parts, w_parts = _bf16_parts(g_TE, 2), _bf16_parts(w_ED, 3)
    # dx's contraction (E) is short and its output [T, D] large: one product over the concatenated
    # contraction [g_0 | g_0 | .. | g_1 | ..] . [w_0 ; w_1 ; .. ; w_0 ; ..] writes the output once.
    a_TC = jnp.concatenate([g for g in g_parts for _ in w_parts], axis=1)
    b_CD = jnp.concatenate([w for _ in g_parts for w in w_parts], axis=0)
    dx_TD = _dot_f32(a_TC, b_CD.T)
    dw_parts = g_parts if w_ED.dtype == jnp.bfloat16 else _bf16_parts(g_TE, 3)
    dw_ED = _sum_of_dots([g.T for g in dw_parts], [x_TD.T])
    return dx_TD.astype(x_TD.dtype), dw_ED.astype(w_ED.dtype)


_split_logits.defvjp(_split_logits_fwd, _split_logits_bwd)


# DeepSeek-V3 adds this to the normaliser of the selected sigmoid scores.
_NORM_EPS = 1e-20


class Routing(NamedTuple):
    """The output of a router for T tokens over E experts, K chosen per token.

    Fields:
      expert_idx_TK: int32 `[T, K]`, chosen experts per token, ordered by descending selection
        score (the score *with* any selection bias). Indices are distinct within a row.
      weights_TK: float32 `[T, K]`, combine weights of the chosen experts; differentiable with
        respect to the logits.
      probs_TE: float32 `[T, E]`, full-router probabilities over all experts, for the balancing
        losses (`aux_loss`, `seq_aux_loss`).
    """

    expert_idx_TK: jax.Array
    weights_TK: jax.Array
    probs_TE: jax.Array


# ---------------------------------------------------------------------------------------------
# Validation helpers (all static: they read shapes and Python config, never traced values).


def _check_top_k(router) -> None:
    """`router.top_k` checked (an int >= 1, the number of experts each token uses) and stored as an int."""
    object.__setattr__(router, "top_k", check_int(f"{type(router).__name__}.top_k", router.top_k))


def _check_logits(owner: str, logits_TE: jax.Array) -> int:
    if logits_TE.ndim != 2:
        raise ValueError(
            f"{owner}.route: logits_TE must be 2-D [T, E], got shape {tuple(logits_TE.shape)}; "
            "flatten leading batch/sequence axes into T first."
        )
    num_experts = logits_TE.shape[-1]
    if num_experts < 1:
        raise ValueError(f"{owner}.route: logits_TE has num_experts=0 columns; need at least one expert.")
    return num_experts


def _check_top_k_fits(owner: str, top_k: int, num_experts: int) -> None:
    if top_k > num_experts:
        raise ValueError(
            f"{owner}.top_k={top_k} exceeds num_experts={num_experts} (the logits' last axis); "
            f"set top_k <= {num_experts}."
        )


def _bias_or_none(owner: str, selection_bias_E, num_experts: int) -> jax.Array | None:
    """Validate and cast the selection bias; it is a constant as far as gradients go."""
    if selection_bias_E is None:
        return None
    shape = tuple(jnp.shape(selection_bias_E))
    if shape != (num_experts,):
        raise ValueError(
            f"{owner}.route: selection_bias_E must have shape ({num_experts},) = [num_experts], "
            f"got {shape}."
        )
    return jax.lax.stop_gradient(jnp.asarray(selection_bias_E, jnp.float32))


def _select(scores_TE: jax.Array, top_k: int) -> jax.Array:
    """Indices `[T, K]` of the K largest scores per row, descending.

    Only indices leave this function, so the scores are cut from the graph: the backward pass
    should not differentiate through `top_k` at all.
    """
    _, idx_TK = jax.lax.top_k(jax.lax.stop_gradient(scores_TE), top_k)
    return idx_TK.astype(jnp.int32)


def _gather(values_TE: jax.Array, idx_TK: jax.Array) -> jax.Array:
    """`values_TE[t, idx_TK[t, k]]` for the indices `_select` returns.

    `take_along_axis` with its indices declared unique: `top_k` picks K distinct experts per row, so
    the transpose (the backward) writes each entry at most once, and XLA scatters it without atomics
    or the sort its deterministic scatter adds for indices that may repeat.
    """
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=(), collapsed_slice_dims=(1,), start_index_map=(1,),
        operand_batching_dims=(0,), start_indices_batching_dims=(0,))
    return jax.lax.gather(values_TE, idx_TK[:, :, None], dims, slice_sizes=(1, 1), unique_indices=True,
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@jax.custom_jvp
def _normalize(s_TN: jax.Array) -> jax.Array:
    """`s / (sum(s, -1) + 1e-20)` for non-negative scores (DeepSeek-V3's normalisation).

    The derivative is written as `(ds - w * sum(ds)) / (S + 1e-20)`: autodiff of the quotient
    would square `S + 1e-20`, which underflows to zero once every score is below ~1e-20
    (logits below about -45), and turn the gradient into 0/0 = NaN.
    """
    return s_TN / (jnp.sum(s_TN, axis=-1, keepdims=True) + _NORM_EPS)


@_normalize.defjvp
def _normalize_jvp(primals, tangents):
    (s_TN,), (ds_TN,) = primals, tangents
    denom = jnp.sum(s_TN, axis=-1, keepdims=True) + _NORM_EPS
    w_TN = s_TN / denom
    return w_TN, (ds_TN - w_TN * jnp.sum(ds_TN, axis=-1, keepdims=True)) / denom


# ---------------------------------------------------------------------------------------------
# Routers.


@dataclasses.dataclass(frozen=True)
class SelectedSoftmax:
    """Top-k by logit, then softmax over the selected logits (Mixtral).

    `route(logits_TE[T, E], *, selection_bias_E[E] | None) -> Routing`:
      expert_idx_TK = top_k(logits + bias); the bias only affects which experts are chosen.
      weights_TK = softmax(logits[chosen]) -- equal to the full softmax renormalised over the
        chosen experts, but computed from the selected logits so it never divides by an
        underflowed sum.
      probs_TE = softmax(logits) over all experts.
    """

    top_k: int

    def __post_init__(self):
        _check_top_k(self)

    def route(self, logits_TE: jax.Array, *, selection_bias_E: jax.Array | None = None) -> Routing:
        num_experts = _check_logits("SelectedSoftmax", logits_TE)
        _check_top_k_fits("SelectedSoftmax", self.top_k, num_experts)
        bias_E = _bias_or_none("SelectedSoftmax", selection_bias_E, num_experts)

        logits_TE = logits_TE.astype(jnp.float32)
        scores_TE = logits_TE if bias_E is None else logits_TE + bias_E
        expert_idx_TK = _select(scores_TE, self.top_k)
        weights_TK = jax.nn.softmax(_gather(logits_TE, expert_idx_TK), axis=-1)
        probs_TE = jax.nn.softmax(logits_TE, axis=-1)
        return Routing(expert_idx_TK, weights_TK, probs_TE)


@dataclasses.dataclass(frozen=True)
class SoftmaxTopK:
    """Softmax over all experts, then top-k by probability (Qwen3-MoE).

    `route(logits_TE[T, E], *, selection_bias_E[E] | None) -> Routing`:
      p = softmax(logits) over all E experts.
      expert_idx_TK = top_k(p + bias): the loss-free bias is added after the softmax and before
        the top-k (as loss-free balancing, Wang et al. 2024, adds it to the gating scores), so it
        is on the probability scale.
      weights_TK = p[chosen] (unbiased); with `renormalize` (Qwen3's `norm_topk_prob`) divided by
        their sum, which is computed as softmax(logits[chosen]) -- the same value, but immune to
        every chosen probability underflowing when a large bias picks far-off experts.
      probs_TE = p.
    """

    top_k: int
    renormalize: bool = False

    def __post_init__(self):
        _check_top_k(self)
        object.__setattr__(self, "renormalize", check_bool("SoftmaxTopK.renormalize", self.renormalize))

    def route(self, logits_TE: jax.Array, *, selection_bias_E: jax.Array | None = None) -> Routing:
        num_experts = _check_logits("SoftmaxTopK", logits_TE)
        _check_top_k_fits("SoftmaxTopK", self.top_k, num_experts)
        bias_E = _bias_or_none("SoftmaxTopK", selection_bias_E, num_experts)

        logits_TE = logits_TE.astype(jnp.float32)
        probs_TE = jax.nn.softmax(logits_TE, axis=-1)
        scores_TE = probs_TE if bias_E is None else probs_TE + bias_E
        expert_idx_TK = _select(scores_TE, self.top_k)
        if self.renormalize:
            weights_TK = jax.nn.softmax(_gather(logits_TE, expert_idx_TK), axis=-1)
        else:
            weights_TK = _gather(probs_TE, expert_idx_TK)
        return Routing(expert_idx_TK, weights_TK, probs_TE)


@dataclasses.dataclass(frozen=True)
class SigmoidGroupedTopK:
    """Sigmoid affinities with group-limited top-k (DeepSeek-V3).

    `route(logits_TE[T, E], *, selection_bias_E[E] | None) -> Routing`:
      s = sigmoid(logits); biased = s + bias (bias 0 when None).
      The E experts form `n_group` contiguous groups of E / n_group. A group scores the sum of its
        two highest *biased* scores (its only score if it has one expert). The `topk_group` best
        groups are kept and every other expert is excluded (score -inf) before choosing the
        top_k experts by biased score.
      weights_TK = s[chosen] (unbiased); if `normalize`, divided by (their sum + 1e-20); then
        multiplied by `routed_scaling_factor`.
      probs_TE = s / sum_E(s), the normalised affinities of DeepSeek-V3's sequence-wise aux loss.

    Config constraints: top_k >= 1; n_group >= 1; 1 <= topk_group <= n_group;
    routed_scaling_factor > 0; and, once E is known, E % n_group == 0, top_k <= E and
    top_k <= topk_group * (E // n_group) (the kept groups must hold enough experts).
    """

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        name = "SigmoidGroupedTopK"
        _check_top_k(self)
        n_group = check_int(f"{name}.n_group", self.n_group)
        topk_group = check_int(f"{name}.topk_group", self.topk_group)
        if topk_group > n_group:
            raise ValueError(f"{name}.topk_group={topk_group}: must be an int with 1 <= topk_group <= n_group={n_group}.")
        for field, value in (("n_group", n_group), ("topk_group", topk_group),
                             ("normalize", check_bool(f"{name}.normalize", self.normalize)),
                             ("routed_scaling_factor", check_number(f"{name}.routed_scaling_factor",
                                                                    self.routed_scaling_factor))):
            object.__setattr__(self, field, value)

    def _check_experts(self, num_experts: int) -> None:
        name = "SigmoidGroupedTopK"
        _check_top_k_fits(name, self.top_k, num_experts)
        if num_experts % self.n_group:
            raise ValueError(
                f"{name}.n_group={self.n_group} does not divide num_experts={num_experts}; "
                "choose n_group among the divisors of num_experts."
            )
        kept = self.topk_group * (num_experts // self.n_group)
        if self.top_k > kept:
            raise ValueError(
                f"{name}.top_k={self.top_k} exceeds the {kept} experts in the kept groups "
                f"(topk_group={self.topk_group} x {num_experts // self.n_group} experts per group); "
                "raise topk_group or lower top_k."
            )

    def _group_mask(self, biased_TE: jax.Array) -> jax.Array:
        """Boolean `[T, E]`: True for experts in one of the `topk_group` best groups."""
        num_tokens, num_experts = biased_TE.shape
        per_group = num_experts // self.n_group
        grouped_TGP = biased_TE.reshape(num_tokens, self.n_group, per_group)
        if per_group >= 2:
            group_score_TG = jax.lax.top_k(grouped_TGP, 2)[0].sum(axis=-1)
        else:
            group_score_TG = grouped_TGP[..., 0]
        _, kept_group_idx_TGk = jax.lax.top_k(group_score_TG, self.topk_group)
        kept_TG = jnp.any(
            kept_group_idx_TGk[:, :, None] == jnp.arange(self.n_group, dtype=kept_group_idx_TGk.dtype),
            axis=1,
        )
        return jnp.repeat(kept_TG, per_group, axis=1)

    def route(self, logits_TE: jax.Array, *, selection_bias_E: jax.Array | None = None) -> Routing:
        num_experts = _check_logits("SigmoidGroupedTopK", logits_TE)
        self._check_experts(num_experts)
        bias_E = _bias_or_none("SigmoidGroupedTopK", selection_bias_E, num_experts)

        logits_TE = logits_TE.astype(jnp.float32)
        scores_TE = jax.nn.sigmoid(logits_TE)
        biased_TE = jax.lax.stop_gradient(scores_TE if bias_E is None else scores_TE + bias_E)
        # Grouping only changes the choice when some groups are dropped.
        if self.topk_group < self.n_group:
            # -inf, not 0: biased scores can be negative, and a masked expert must never win.
            biased_TE = jnp.where(self._group_mask(biased_TE), biased_TE, -jnp.inf)
        expert_idx_TK = _select(biased_TE, self.top_k)

        weights_TK = _gather(scores_TE, expert_idx_TK)
        if self.normalize:
            weights_TK = _normalize(weights_TK)
        weights_TK = weights_TK * jnp.float32(self.routed_scaling_factor)
        probs_TE = _normalize(scores_TE)
        return Routing(expert_idx_TK, weights_TK, probs_TE)


Router = SelectedSoftmax | SoftmaxTopK | SigmoidGroupedTopK
"""Any router of this module: a frozen (hashable, so jit-static) config with `.route`."""


# ---------------------------------------------------------------------------------------------
# Load statistics and balancing objectives.


def _real_mask(mask, lead_shape: tuple[int, ...], arg: str, fn: str) -> jax.Array:
    """Boolean mask of real tokens with shape `lead_shape` (all True when `mask` is None)."""
    if mask is None:
        return jnp.ones(lead_shape, jnp.bool_)
    mask = jnp.asarray(mask)
    if tuple(mask.shape) != tuple(lead_shape):
        raise ValueError(f"{fn}: {arg} must have shape {tuple(lead_shape)}, got {tuple(mask.shape)}.")
    if mask.dtype != jnp.bool_:
        raise TypeError(f"{fn}: {arg} must be a bool array (True = real token); got dtype {mask.dtype}.")
    return mask


def _check_same_tokens(fn: str, a_name: str, a, b_name: str, b) -> None:
    if a.shape[:-1] != b.shape[:-1]:
        raise ValueError(
            f"{fn}: {a_name} {tuple(a.shape)} and {b_name} {tuple(b.shape)} must share their "
            "leading (token) axes."
        )


def expert_counts(
    expert_idx_TK: jax.Array, num_experts: int, *, mask_T: jax.Array | None = None
) -> jax.Array:
    """Token-expert assignments per expert: int32 `[E]`.

    `expert_idx_TK` is `[T, K]` (or any `[..., K]`, with `mask_T` matching the leading axes).
    Padding tokens (mask False) contribute nothing; indices outside `[0, E)` are dropped. A
    one-hot reduction (not a scatter), so the result is exact, deterministic, and works on
    arrays sharded over a mesh's Explicit axes.
    """
    num_experts = check_int("expert_counts: num_experts", num_experts)
    if expert_idx_TK.ndim < 1:
        raise ValueError("expert_counts: expert_idx_TK must have a trailing K axis, got a scalar.")
    real = _real_mask(mask_T, expert_idx_TK.shape[:-1], "mask_T", "expert_counts")
    hit = expert_idx_TK[..., None] == jnp.arange(num_experts, dtype=expert_idx_TK.dtype)  # [..., K, E]
    hit = hit & real[..., None, None]
    return jnp.sum(hit.reshape(-1, num_experts), axis=0, dtype=jnp.int32)


def aux_loss(probs_TE: jax.Array, expert_idx_TK: jax.Array, *, mask_T: jax.Array | None = None) -> jax.Array:
    """Switch/Megatron load-balancing loss: `E * sum_e f_e * Pbar_e`, a float32 scalar.

    f_e = count_e / (T_real * K) is the fraction of real assignments to expert e, held constant
    (the hard counts carry no gradient); Pbar_e is the mean of `probs_TE[:, e]` over real tokens,
    the differentiable part. Perfectly uniform routing gives 1.0. Shapes: `probs_TE [T, E]`,
    `expert_idx_TK [T, K]`, `mask_T [T]` (or matching leading axes, e.g. `[B, S]`). Zero when no
    token is real.
    """
    _check_same_tokens("aux_loss", "probs_TE", probs_TE, "expert_idx_TK", expert_idx_TK)
    num_experts, top_k = probs_TE.shape[-1], expert_idx_TK.shape[-1]
    real = _real_mask(mask_T, probs_TE.shape[:-1], "mask_T", "aux_loss")
    num_real = real.sum(dtype=jnp.float32)
    denom = jnp.maximum(num_real, 1.0)

    counts_E = expert_counts(expert_idx_TK, num_experts, mask_T=real).astype(jnp.float32)
    frac_E = jax.lax.stop_gradient(counts_E / (denom * top_k))
    # where, not multiply: padding rows may hold garbage (even NaN) and must not leak in.
    real_probs = jnp.where(real[..., None], probs_TE.astype(jnp.float32), 0.0)
    mean_prob_E = real_probs.reshape(-1, num_experts).sum(axis=0) / denom
    return num_experts * jnp.sum(frac_E * mean_prob_E)


def seq_aux_loss(
    probs_BSE: jax.Array, expert_idx_BSK: jax.Array, *, mask_BS: jax.Array | None = None
) -> jax.Array:
    """DeepSeek-V3 sequence-wise balance loss (without its alpha coefficient), float32 scalar.

    Per sequence b with S_b real tokens: f_be = E / (K * S_b) * count_be (constant, no gradient),
    P_be = mean of `probs_BSE[b, :, e]` over its real tokens, L_b = sum_e f_be * P_be. Returns the
    mean of L_b over sequences with at least one real token (0 if there are none). Uniform routing
    gives 1.0. Shapes: `probs_BSE [B, S, E]`, `expert_idx_BSK [B, S, K]`, `mask_BS [B, S]`.
    """
    if probs_BSE.ndim != 3 or expert_idx_BSK.ndim != 3:
        raise ValueError(
            f"seq_aux_loss: probs_BSE {tuple(probs_BSE.shape)} and expert_idx_BSK "
            f"{tuple(expert_idx_BSK.shape)} must be 3-D [B, S, E] and [B, S, K]."
        )
    _check_same_tokens("seq_aux_loss", "probs_BSE", probs_BSE, "expert_idx_BSK", expert_idx_BSK)
    num_experts, top_k = probs_BSE.shape[-1], expert_idx_BSK.shape[-1]
    real_BS = _real_mask(mask_BS, probs_BSE.shape[:-1], "mask_BS", "seq_aux_loss")
    num_real_B = real_BS.sum(axis=-1, dtype=jnp.float32)
    denom_B1 = jnp.maximum(num_real_B, 1.0)[:, None]

    hit_BSKE = (expert_idx_BSK[..., None] == jnp.arange(num_experts, dtype=expert_idx_BSK.dtype)) & real_BS[..., None, None]
    counts_BE = jnp.sum(hit_BSKE, axis=(1, 2), dtype=jnp.int32).astype(jnp.float32)
    frac_BE = jax.lax.stop_gradient(counts_BE * (num_experts / top_k) / denom_B1)
    real_probs = jnp.where(real_BS[..., None], probs_BSE.astype(jnp.float32), 0.0)
    mean_prob_BE = real_probs.sum(axis=1) / denom_B1
    loss_B = jnp.sum(frac_BE * mean_prob_BE, axis=-1)

    has_real_B = num_real_B > 0
    num_seqs = jnp.maximum(has_real_B.sum(dtype=jnp.float32), 1.0)
    return jnp.sum(jnp.where(has_real_B, loss_B, 0.0)) / num_seqs


def z_loss(logits_TE: jax.Array, *, mask_T: jax.Array | None = None) -> jax.Array:
    """Router z-loss: mean over real tokens of logsumexp(logits)^2, a float32 scalar.

    Keeps router logits small so the fp32 softmax stays well conditioned. `logits_TE [T, E]` (or
    `[..., E]` with a matching mask). Zero when no token is real.
    """
    real = _real_mask(mask_T, logits_TE.shape[:-1], "mask_T", "z_loss")
    # Padding rows are zeroed *before* logsumexp: masking only the result would still send
    # 0 * NaN into the gradient of a garbage (inf/NaN) padding row.
    logits_TE = jnp.where(real[..., None], logits_TE.astype(jnp.float32), 0.0)
    sq = jnp.where(real, jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)), 0.0)
    return sq.sum() / jnp.maximum(real.sum(dtype=jnp.float32), 1.0)


def _check_step_size(step_size):
    """`step_size` of `update_selection_bias`: a real number >= 0 (Python or NumPy) or a float scalar
    array (e.g. a schedule's value, possibly traced); TypeError or ValueError naming it otherwise."""
    if isinstance(step_size, (jax.Array, np.ndarray)):
        if step_size.shape != () or not jnp.issubdtype(step_size.dtype, jnp.floating):
            raise TypeError(f"update_selection_bias: step_size must be a number >= 0 or a float scalar array; got an "
                            f"array of shape {tuple(step_size.shape)} and dtype {step_size.dtype}.")
        return step_size
    if not isinstance(step_size, numbers.Real) or isinstance(step_size, (bool, np.bool_)):
        raise TypeError(f"update_selection_bias: step_size must be a number >= 0 (e.g. 1e-3) or a float scalar "
                        f"array; got {type(step_size).__name__} {step_size!r}.")
    if not (math.isfinite(step_size) and step_size >= 0):
        raise ValueError(f"update_selection_bias: step_size={step_size!r} must be a finite number >= 0.")
    return float(step_size)


def update_selection_bias(bias_E: jax.Array, counts_E: jax.Array, step_size) -> jax.Array:
    """One step of DeepSeek-V3 loss-free balancing: float32 `[E]`.

    Returns `bias_E + step_size * sign(mean(counts_E) - counts_E)`: an under-loaded expert's bias
    rises, an over-loaded one's falls, a balanced one's stays. The bias starts at zero (the
    caller's job) and is feedback, not a parameter: nothing here is differentiated (inputs pass
    through `stop_gradient`), so call it outside `jax.grad` and feed the result to the next
    `route(..., selection_bias_E=...)`. Pass counts already reduced over whatever group should be
    balanced (e.g. `psum` over data-parallel ranks). `step_size` may be traced (a schedule).
    """
    if tuple(jnp.shape(bias_E)) != tuple(jnp.shape(counts_E)) or jnp.ndim(bias_E) != 1:
        raise ValueError(
            f"update_selection_bias: bias_E {tuple(jnp.shape(bias_E))} and counts_E "
            f"{tuple(jnp.shape(counts_E))} must both be 1-D [num_experts] of equal length."
        )
    step_size = _check_step_size(step_size)
    bias_E = jax.lax.stop_gradient(jnp.asarray(bias_E, jnp.float32))
    counts_E = jax.lax.stop_gradient(jnp.asarray(counts_E, jnp.float32))
    step = jax.lax.stop_gradient(jnp.asarray(step_size, jnp.float32))
    return bias_E + step * jnp.sign(jnp.mean(counts_E) - counts_E)
