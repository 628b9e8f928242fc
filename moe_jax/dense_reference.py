"""fp32 dense reference of the MoE layer: every token runs its own K experts, no packing.

Legend (shape suffixes): B batch, S sequence, T = B*S tokens, D model width, L latent width,
Din routed-expert width (L with a latent, else D), F expert hidden width, Fs shared hidden width,
E experts, K experts per token.

`moe_reference` is the definition `moe_jax.layers.MoE` is tested against:

    x_l     = x @ W_ld^T                       (LatentMoE only; else x_l = x)
    r_t     = sum_k w_tk * FFN(x_l[t]; W_g[e_tk], W_u[e_tk], W_d[e_tk])   (0 for masked tokens)
    y_t     = r_t @ W_lu^T (latent) or r_t,  plus  g_t * FFN(x_t; shared weights) when present
    g_t     = sigmoid(W_sg x_t) with a shared-expert gate, else 1; masked tokens: y_t = 0
    FFN(v)  = (silu(v W_g^T) * (v W_u^T)) W_d^T

Each token gathers its K experts' weights and multiplies by them directly (vmap over tokens), so
nothing is shared with the packed path: no sort, no grouped GEMM, no permutation. Everything is
float32 at `Precision.HIGHEST`, and gradients come from ordinary autodiff (they reach `x`, every
weight and `routing.weights_TK`). Memory is `T*K*F*Din`: small shapes only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.routing import Routing, Router

__all__ = ["SwiGLUWeights", "LatentWeights", "router_reference", "moe_reference"]

_HI = jax.lax.Precision.HIGHEST


class SwiGLUWeights(NamedTuple):
    """One dense SwiGLU FFN (the shared experts): `w_gate_FD`, `w_up_FD` `[Fs, D]`, `w_down_DF`
    `[D, Fs]`, and optionally the sigmoid gate `w_gate_1D` `[1, D]` that scales its output."""

    w_gate_FD: jax.Array
    w_up_FD: jax.Array
    w_down_DF: jax.Array
    w_gate_1D: jax.Array | None = None


class LatentWeights(NamedTuple):
    """LatentMoE projections: `w_down_LD` `[L, D]` before the routed experts, `w_up_DL` `[D, L]` after."""

    w_down_LD: jax.Array
    w_up_DL: jax.Array


def _f32(a: jax.Array) -> jax.Array:
    return jnp.asarray(a, jnp.float32)


def _ffn(v_D: jax.Array, w_gate_FD: jax.Array, w_up_FD: jax.Array, w_down_DF: jax.Array) -> jax.Array:
    gate_F = jnp.dot(w_gate_FD, v_D, precision=_HI)
    up_F = jnp.dot(w_up_FD, v_D, precision=_HI)
    return jnp.dot(w_down_DF, jax.nn.silu(gate_F) * up_F, precision=_HI)


def router_reference(
    x: jax.Array, w_router_ED: jax.Array, router: Router, *, selection_bias_E: jax.Array | None = None
) -> Routing:
    """Routing of the flattened tokens of `x` (`[B, S, D]` or `[T, D]`): fp32 logits
    `x @ w_router_ED^T` at HIGHEST precision, then `router.route`."""
    x_TD = _f32(x).reshape(-1, x.shape[-1])
    logits_TE = jnp.dot(x_TD, _f32(w_router_ED).T, precision=_HI)
    return router.route(logits_TE, selection_bias_E=selection_bias_E)


def moe_reference(
    x: jax.Array,
    routing: Routing,
    w_gate_EFD: jax.Array,
    w_up_EFD: jax.Array,
    w_down_EDF: jax.Array,
    *,
    mask: jax.Array | None = None,
    shared: SwiGLUWeights | None = None,
    latent: LatentWeights | None = None,
) -> jax.Array:
    """The MoE layer output in float32, with the shape of `x`.

    Args:
      x: `[B, S, D]` or `[T, D]`.
      routing: `Routing` of the T flattened tokens (only `expert_idx_TK` and `weights_TK` are read).
      w_gate_EFD, w_up_EFD: `[E, F, Din]`; w_down_EDF: `[E, Din, F]` routed experts.
      mask: optional bool with the leading shape of `x` (True = real token); masked tokens get a
        zero output.
      shared: shared-expert weights, applied to every real token at width D (times the gate's
        sigmoid when `shared.w_gate_1D` is given).
      latent: LatentMoE projections (then Din = L).
    """
    x_TD = _f32(x).reshape(-1, x.shape[-1])
    if mask is not None:  # masked tokens may hold anything (NaN included): they reach nothing
        x_TD = jnp.where(jnp.asarray(mask).reshape(-1, 1), x_TD, 0.0)
    w_gate, w_up, w_down = _f32(w_gate_EFD), _f32(w_up_EFD), _f32(w_down_EDF)
    routed_in_TD = x_TD if latent is None else jnp.dot(x_TD, _f32(latent.w_down_LD).T, precision=_HI)

    def token(v_D, experts_K, weights_K):
        outs_KD = jax.vmap(lambda e: _ffn(v_D, w_gate[e], w_up[e], w_down[e]))(experts_K)
        return jnp.sum(weights_K[:, None] * outs_KD, axis=0)

    routed_TD = jax.vmap(token)(routed_in_TD, routing.expert_idx_TK, _f32(routing.weights_TK))
    y_TD = routed_TD if latent is None else jnp.dot(routed_TD, _f32(latent.w_up_DL).T, precision=_HI)
    if shared is not None:
        w_sg, w_su, w_sd = (_f32(w) for w in shared[:3])
        shared_TD = jax.vmap(lambda v: _ffn(v, w_sg, w_su, w_sd))(x_TD)
        if shared.w_gate_1D is not None:
            shared_TD = jax.nn.sigmoid(jnp.dot(x_TD, _f32(shared.w_gate_1D).T, precision=_HI)) * shared_TD
        y_TD = y_TD + shared_TD
    if mask is not None:
        y_TD = jnp.where(jnp.asarray(mask).reshape(-1, 1), y_TD, 0.0)
    return y_TD.reshape(x.shape[:-1] + (y_TD.shape[-1],))
