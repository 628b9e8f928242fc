"""The parity problem: every operand of one run, drawn with numpy from the configuration's seed.

Legend (shape suffixes): T tokens, D model width, F routed-expert hidden width, E experts,
K experts per token (top-k), L latent width (LatentMoE), Fs shared-expert hidden width
(= F * shared_experts), Din routed-expert input width (L with a latent width, else D).

`build_problem(config)` draws `x_TD`, the upstream gradient `dy_TD`, the weights (named and
shaped by `param_shapes`), the injected routing (`expert_idx_TK` from the skew generators
`expert_popularity_logits` / `make_expert_idx`, `weights_TK`), and router logits with their
upstream gradients. Floating-point values are fp32 already rounded to the configuration's dtype
(`round_to_dtype`), so both sides receive bit-identical operands. `layer_tensor_names` names the
layer tensors both sides return, in report order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

from parity.config import ParityConfig

ZIPF_EXPONENT = 1.2  # popularity of the r-th most popular expert ~ r^-1.2
HOT_LOGIT_BIAS = 4.0  # router-logit lift of the hot expert (one_hot skew)
EMPTY_LOGIT_BIAS = -30.0  # router-logit drop of the experts that get no token (empty skew)


class ParityProblem(NamedTuple):
    """Every operand of one parity run: numpy fp32 values already rounded to the dtype.

    x_TD, dy_TD           input and upstream gradient of the layer output
    expert_idx_TK int32   injected choice; weights_TK fp32 injected combine weights (rows sum 1)
    probs_TE fp32         injected full-router probabilities (only the layer's statistics read them)
    logits_TE fp32        router logits for the router comparison (x W_router^T + skew bias)
    d_weights_TK, d_probs_TE  upstream gradients of the router's weights and probabilities
    params                name -> array, named like `moe_jax.layers.MoE`'s nnx.Param paths
                          joined by "." (e.g. "w_gate", "shared.w_down"); see `param_shapes`
    """

    x_TD: np.ndarray
    dy_TD: np.ndarray
    expert_idx_TK: np.ndarray
    weights_TK: np.ndarray
    probs_TE: np.ndarray
    logits_TE: np.ndarray
    d_weights_TK: np.ndarray
    d_probs_TE: np.ndarray
    params: dict[str, np.ndarray]


def param_shapes(config: ParityConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, in the torch/Hugging Face layout both sides use (docs/architecture.md)."""
    d, f, e, din = config.d_model, config.d_ff, config.num_experts, config.routed_width
    shapes: dict[str, tuple[int, ...]] = {"w_router": (e, d)}
    if config.fused_gate_up:
        shapes["w_gate_up"] = (e, 2 * f, din)
    else:
        shapes["w_gate"] = (e, f, din)
        shapes["w_up"] = (e, f, din)
    shapes["w_down"] = (e, din, f)
    if config.latent_dim is not None:
        shapes["w_latent_down"] = (config.latent_dim, d)
        shapes["w_latent_up"] = (d, config.latent_dim)
    if config.shared_experts:
        fs = config.shared_d_ff
        shapes.update({"shared.w_gate": (fs, d), "shared.w_up": (fs, d), "shared.w_down": (d, fs)})
    return shapes


def round_to_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 copy of `a` holding values exactly representable in `dtype` (round to nearest even)."""
    a32 = np.asarray(a, dtype=np.float32)
    if dtype == "bfloat16":
        return a32.astype(ml_dtypes.bfloat16).astype(np.float32)
    return a32


def expert_popularity_logits(config: ParityConfig, rng: np.random.Generator) -> np.ndarray:
    """`[E]` log-popularity of each expert under `config.skew` (-inf: never chosen, +inf: always)."""
    e = config.num_experts
    logp_E = np.zeros(e)
    if config.skew == "zipf":
        rank_E = rng.permutation(e) + 1.0
        logp_E = -ZIPF_EXPONENT * np.log(rank_E)
    elif config.skew == "one_hot":
        logp_E[rng.integers(e)] = np.inf
    elif config.skew == "empty":
        num_empty = max(1, (e - config.top_k) // 2)
        logp_E[rng.choice(e, num_empty, replace=False)] = -np.inf
    return logp_E


def make_expert_idx(config: ParityConfig, logp_E: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """int32 `[T, K]` distinct experts per token, drawn under the skew; slots in random order.

    "balanced" deals experts round-robin from a random permutation (counts differ by at most
    one); the other skews sample K experts without replacement with probabilities ~ exp(logp_E)
    (Gumbel top-k), so a +inf expert is always chosen and a -inf one never.
    """
    t, e, k = config.tokens, config.num_experts, config.top_k
    if config.skew == "balanced":
        deal_E = rng.permutation(e)
        idx_TK = deal_E[(np.arange(t)[:, None] * k + np.arange(k)[None, :]) % e]
    else:
        keys_TE = logp_E[None, :] + rng.gumbel(size=(t, e))
        idx_TK = np.argsort(-keys_TE, axis=1, kind="stable")[:, :k]
    return rng.permuted(idx_TK, axis=1).astype(np.int32)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def build_problem(config: ParityConfig) -> ParityProblem:
    """Draw the problem of `config` from `config.seed` (deterministic, device independent)."""
    rng = np.random.default_rng(config.seed)
    t, d, e = config.tokens, config.d_model, config.num_experts
    dt = config.dtype

    # Weights ~ N(0, 1/fan_in), so every activation stays O(1).
    params = {
        name: round_to_dtype(rng.standard_normal(shape) / math.sqrt(shape[-1]), dt)
        for name, shape in param_shapes(config).items()
    }
    x_TD = round_to_dtype(rng.standard_normal((t, d)), dt)
    dy_TD = round_to_dtype(rng.standard_normal((t, d)), dt)

    logp_E = expert_popularity_logits(config, rng)
    expert_idx_TK = make_expert_idx(config, logp_E, rng)
    weights_TK = _softmax(rng.standard_normal((t, config.top_k))).astype(np.float32)

    # Router logits follow the same skew, with finite stand-ins for +-inf.
    bias_E = np.nan_to_num(logp_E, posinf=HOT_LOGIT_BIAS, neginf=EMPTY_LOGIT_BIAS)
    logits_TE = (x_TD.astype(np.float64) @ params["w_router"].astype(np.float64).T + bias_E).astype(np.float32)
    probs_TE = _softmax(logits_TE.astype(np.float64)).astype(np.float32)
    d_weights_TK = rng.standard_normal((t, config.top_k)).astype(np.float32)
    d_probs_TE = rng.standard_normal((t, e)).astype(np.float32)
    return ParityProblem(
        x_TD, dy_TD, expert_idx_TK, weights_TK, probs_TE, logits_TE, d_weights_TK, d_probs_TE, params,
    )


def grad_name(param: str) -> str:
    """The compared name of `param`'s gradient: "d_<param>"."""
    return f"d_{param}"


def layer_tensor_names(config: ParityConfig) -> tuple[str, ...]:
    """Names of the compared layer tensors, in report order.

    y (output), dx, d_weights (routing weights), then `d_<param>` for every parameter of the
    routed experts, latent projections and shared experts. The router weight is absent: with
    injected routing the layer's output does not depend on it (see
    `parity.harness.compare_routers`).
    """
    params = [p for p in param_shapes(config) if p != "w_router"]
    return ("y", "dx", "d_weights", *map(grad_name, params))
