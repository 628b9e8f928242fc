"""The reference side of the parity harness: the problem through `parity.reference` (torch/Triton).

Legend (shape suffixes): T tokens, D model width, F routed-expert hidden width, E experts,
K experts per token (top-k), L latent width (LatentMoE), Fs shared-expert hidden width
(= F * shared_experts), Din routed-expert input width (L with a latent width, else D).

`run_reference` builds the layer's graph in torch (`reference_forward`: Triton grouped GEMMs with
autograd for the routed experts; plain torch for the shared SwiGLU (the FP8 recipe's grouped
linear when the layer is FP8) and the latent projections)
and differentiates with `torch.autograd.grad` and the problem's upstream gradient.
`run_router_reference` runs the configuration's `parity.reference` router on the problem's logits.

Precision: everything runs under `precise_matmuls` (TF32 and reduced-precision reductions off);
the reference's Triton kernels use IEEE products.

Devices: torch runs on CUDA when available (kernels compiled), else on CPU with its kernels under
Triton's interpreter (importing `parity.reference` selects it).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import numpy as np
import torch

from parity import reference as ref
from parity.config import ROUTED_SCALING_FACTOR, ParityConfig, router_groups
from parity.problem import ParityProblem, grad_name, layer_tensor_names


def torch_device() -> torch.device:
    """CUDA when torch sees a GPU (kernels compiled), else CPU (kernels interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_PRECISE_MATMUL_FLAGS = (
    (torch.backends.cuda.matmul, "allow_tf32"),
    (torch.backends.cudnn, "allow_tf32"),
    (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
)


@contextlib.contextmanager
def precise_matmuls() -> Iterator[None]:
    """torch matmuls at full precision for the duration: TF32 off (fp32 products in fp32), and no
    reduced-precision (bf16/fp16) split-K reductions; the previous settings come back after."""
    saved = [getattr(owner, flag) for owner, flag in _PRECISE_MATMUL_FLAGS]
    for owner, flag in _PRECISE_MATMUL_FLAGS:
        setattr(owner, flag, False)
    try:
        yield
    finally:
        for (owner, flag), value in zip(_PRECISE_MATMUL_FLAGS, saved):
            setattr(owner, flag, value)


def _torch(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def reference_forward(
    config: ParityConfig,
    x_TD: torch.Tensor,
    expert_idx_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    p: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The layer's forward in torch: `y[T, D]` (differentiable by autograd).

    latent: x_l = x W_latent_down^T; routed experts at width Din; y_routed = r W_latent_up^T.
    fp8: the routed experts' projections run `parity.reference.fp8.fp8_grouped_linear`, and so do
    the shared experts' (one group of every token), as the layer runs them with master weights.
    shared: y += (silu(x Ws_gate^T) * (x Ws_up^T)) Ws_down^T, nonlinearity in fp32 like the
    reference's `swiglu`.
    """
    h_TD = x_TD if config.latent_dim is None else x_TD @ p["w_latent_down"].T
    if config.fused_gate_up:
        r_TD = ref.moe_experts_autograd_fused(h_TD, expert_idx_TK, weights_TK, p["w_gate_up"], p["w_down"])
    else:
        linear = ref.fp8_grouped_linear if config.fp8 else ref.grouped_linear
        r_TD = ref.moe_experts_autograd(h_TD, expert_idx_TK, weights_TK, p["w_gate"], p["w_up"], p["w_down"],
                                        linear=linear)
    y_TD = r_TD if config.latent_dim is None else r_TD @ p["w_latent_up"].T
    if config.shared_experts and config.fp8:
        one_group = torch.tensor([0, x_TD.shape[0]], device=x_TD.device)
        y_TD = y_TD + ref.expert_swiglu(x_TD, one_group, *(p[f"shared.{n}"][None] for n in ("w_gate", "w_up", "w_down")),
                                        linear=ref.fp8_grouped_linear)
    elif config.shared_experts:
        hidden = ref.swiglu(x_TD @ p["shared.w_gate"].T, x_TD @ p["shared.w_up"].T)
        y_TD = y_TD + hidden @ p["shared.w_down"].T
    return y_TD


class ReferenceOperands(NamedTuple):
    """Autograd leaves and constants of the reference graph on one device."""

    x_TD: torch.Tensor
    expert_idx_TK: torch.Tensor
    weights_TK: torch.Tensor
    params: dict[str, torch.Tensor]
    dy_TD: torch.Tensor

    def leaves(self) -> list[torch.Tensor]:
        return [self.x_TD, self.weights_TK, *self.params.values()]


def reference_operands(config: ParityConfig, problem: ParityProblem, device: torch.device) -> ReferenceOperands:
    """The problem as torch leaves (x, routing weights, every non-router parameter)."""
    dtype = getattr(torch, config.dtype)
    params = {
        name: _torch(value, dtype, device).requires_grad_()
        for name, value in problem.params.items()
        if name != "w_router"
    }
    return ReferenceOperands(
        _torch(problem.x_TD, dtype, device).requires_grad_(),
        _torch(problem.expert_idx_TK, torch.int64, device),
        _torch(problem.weights_TK, torch.float32, device).requires_grad_(),
        params,
        _torch(problem.dy_TD, dtype, device),
    )


def reference_step(config: ParityConfig, ops: ReferenceOperands) -> dict[str, torch.Tensor]:
    """Forward + backward of the reference graph: `{name: tensor}` like `layer_tensor_names`."""
    with precise_matmuls():
        y_TD = reference_forward(config, ops.x_TD, ops.expert_idx_TK, ops.weights_TK, ops.params)
        grads = torch.autograd.grad(y_TD, ops.leaves(), ops.dy_TD)
    out = {"y": y_TD.detach(), "dx": grads[0], "d_weights": grads[1]}
    out.update({grad_name(name): g for name, g in zip(ops.params, grads[2:])})
    return out


def run_reference(
    config: ParityConfig, problem: ParityProblem, device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """The reference's output and gradients: `{name: tensor}` for `layer_tensor_names(config)`."""
    out = reference_step(config, reference_operands(config, problem, device or torch_device()))
    return {name: out[name] for name in layer_tensor_names(config)}


def torch_route(config: ParityConfig, logits_TE: torch.Tensor):
    """The `parity.reference` router named by `config.router`: `(idx, weights, probs)`."""
    k = config.top_k
    if config.router == "selected_softmax":
        return ref.route_selected_softmax(logits_TE, k)
    if config.router == "softmax_topk":
        return ref.route_softmax_topk(logits_TE, k, renormalize=True)
    n_group, topk_group = router_groups(config.num_experts, k)
    return ref.route_sigmoid_grouped(
        logits_TE, k, n_group=n_group, topk_group=topk_group, normalize=True,
        routed_scaling_factor=ROUTED_SCALING_FACTOR,
    )


def run_router_reference(
    config: ParityConfig, problem: ParityProblem, device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """`parity.reference.routers` on the same logits, differentiated by autograd (same loss as
    `run_router_ours`)."""
    device = device or torch_device()
    logits_TE = _torch(problem.logits_TE, torch.float32, device).requires_grad_()
    with precise_matmuls():
        idx_TK, weights_TK, probs_TE = torch_route(config, logits_TE)
        loss = (weights_TK * _torch(problem.d_weights_TK, torch.float32, device)).sum() + (
            probs_TE * _torch(problem.d_probs_TE, torch.float32, device)
        ).sum()
        (d_logits_TE,) = torch.autograd.grad(loss, logits_TE)
        x_TD = _torch(problem.x_TD, torch.float32, device)
        d_w_router = d_logits_TE.T @ x_TD
    return {
        "router.expert_idx": idx_TK,
        "router.weights": weights_TK.detach(),
        "router.probs": probs_TE.detach(),
        "router.aux_loss": ref.aux_loss(probs_TE.detach(), idx_TK),
        "router.z_loss": ref.z_loss(logits_TE.detach()),
        "router.d_logits": d_logits_TE,
        "router.d_w_router": d_w_router,
    }
