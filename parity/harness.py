"""Parity harness: one MoE problem through `moe_jax` and through the torch reference, compared.

Legend (shape suffixes): T tokens, D model width, F routed-expert hidden width, E experts,
K experts per token (top-k), L latent width (LatentMoE), Fs shared-expert hidden width
(= F * shared_experts), Din routed-expert input width (L with a latent width, else D).

This module is the public entry: it runs the comparisons (`compare_layer`, `compare_routers`,
`run_parity`) and re-exports the pieces, each of which lives in a module with one job:

- `parity.config`: `ParityConfig` (frozen, validated) and the router grouping (`router_groups`).
- `parity.problem`: `build_problem` and its generators (skews, parameter shapes, rounding).
- `parity.ours`: the `moe_jax` side (layer construction, state loading, step, router).
- `parity.theirs`: the torch/Triton reference side (graph, step, router).
- `parity.compare`: `Comparison`, `ParityReport`, `compare_tensor`, `compare_sides`,
  `compare_quantized`, `format_table`, `check`.

Flow:

1. `ParityConfig` (frozen) names the problem; `build_problem(config)` draws everything from its
   seed with numpy: `x_TD`, the upstream gradient `dy_TD`, the weights, the injected routing
   (`expert_idx_TK` from a skew generator, `weights_TK`), and router logits with their upstream
   gradients. Floating-point values are fp32 already rounded to the configuration's dtype, so
   both sides receive bit-identical operands.
2. `run_ours` feeds the problem to `moe_jax.layers.MoE` (weights loaded through
   `nnx.state`/`nnx.update`, see `load_state`; routing injected as a `moe_jax.routing.Routing`)
   and differentiates with `jax.vjp` w.r.t. x, the routing weights and every parameter; with
   `ep_size > 1` the layer runs expert-parallel on a mesh. `run_reference` builds the
   same graph in torch from `parity.reference` (Triton grouped GEMMs with autograd for the routed
   experts; plain torch for the shared SwiGLU and the latent projections) and differentiates with
   `torch.autograd.grad` and the same upstream gradient.
3. `compare_sides` measures, per tensor, the max abs error and the relative Frobenius error
   `||ours - ref|| / ||ref||` against the dtype's threshold (`THRESHOLDS`). `compare_routers`
   runs the router of `config.router` on both sides on the *same* logits and compares the choice
   (exactly), the weights, the probabilities, the balancing losses and the gradients w.r.t. the
   logits and the router weight.
4. `format_table(report)` prints it; `check(report)` raises `AssertionError` naming every failing
   tensor, the configuration and the error figures.

FP8 (`ParityConfig(fp8=True)`): our layer runs `GemmOptions(quantization=Fp8Blockwise())`, the
reference `parity.reference.fp8` (DeepSeek-V3's blockwise recipe written again in torch, with its
straight-through backward), on the same routing; the layers are held to `layer_threshold` (both
sides quantize to the same e4m3 bits; `FP8_THRESHOLD`, or `FP8_KERNEL_THRESHOLD` where our FP8
products run on the FP8 kernel, whose tensor-core step sums carry fewer bits than fp32; see
`parity.compare`). `compare_quantization` (and
`run_parity` for an FP8 configuration) also reports what FP8 gives up: our FP8 layer against our
unquantized layer (at parity with the reference's by the unquantized cases),
`fp8_vs_unquantized.<tensor>`, within `FP8_QUANTIZATION_BOUND`.

Precision: fp32 runs with full-precision products on both sides (jax `Precision.HIGHEST` passed
to the layer; torch under `precise_matmuls`, TF32 off, and the reference's Triton kernels use IEEE
products). bf16 runs the layer in bf16 (params and activations; products accumulate in fp32 on
both sides); routing weights and router math are fp32 on both sides.

Devices: torch runs on CUDA when available (kernels compiled), else on CPU with its kernels under
Triton's interpreter (importing `parity.reference` selects it). jax runs on its default device;
with `ep_size > 1` on ep_size of its devices, else on the host's CPU devices (`ep_mesh`).
"""

from __future__ import annotations

import dataclasses

from parity.compare import (
    FP8_QUANTIZATION_BOUND,
    FP8_QUANTIZATION_FLOOR,
    FP8_KERNEL_THRESHOLD,
    FP8_THRESHOLD,
    QUANTIZATION_PREFIX,
    ROUTER_THRESHOLD,
    THRESHOLDS,
    Comparison,
    ParityReport,
    check,
    compare_quantized,
    compare_sides,
    compare_tensor,
    format_table,
    fp8_products_threshold,
    layer_threshold,
)
from parity.config import (
    BACKENDS,
    DTYPES,
    EP_STRATEGIES,
    ROUTED_SCALING_FACTOR,
    ROUTERS,
    SKEWS,
    ParityConfig,
    router_groups,
)
from parity.ours import (
    ep_mesh,
    jax_precision,
    jax_router,
    load_state,
    make_layer,
    make_our_step,
    run_ours,
    run_router_ours,
)
from parity.problem import (
    EMPTY_LOGIT_BIAS,
    HOT_LOGIT_BIAS,
    ZIPF_EXPONENT,
    ParityProblem,
    build_problem,
    expert_popularity_logits,
    layer_tensor_names,
    make_expert_idx,
    param_shapes,
    round_to_dtype,
)
from parity.theirs import (
    ReferenceOperands,
    precise_matmuls,
    reference_forward,
    reference_operands,
    reference_step,
    run_reference,
    run_router_reference,
    torch_device,
    torch_route,
)

__all__ = [
    # parity.config
    "BACKENDS", "DTYPES", "EP_STRATEGIES", "ROUTED_SCALING_FACTOR", "ROUTERS", "SKEWS",
    "ParityConfig", "router_groups",
    # parity.problem
    "EMPTY_LOGIT_BIAS", "HOT_LOGIT_BIAS", "ZIPF_EXPONENT", "ParityProblem", "build_problem",
    "expert_popularity_logits", "layer_tensor_names", "make_expert_idx", "param_shapes",
    "round_to_dtype",
    # parity.ours
    "ep_mesh", "jax_precision", "jax_router", "load_state", "make_layer", "make_our_step",
    "run_ours", "run_router_ours",
    # parity.theirs
    "ReferenceOperands", "precise_matmuls", "reference_forward", "reference_operands",
    "reference_step", "run_reference", "run_router_reference", "torch_device", "torch_route",
    # parity.compare
    "FP8_KERNEL_THRESHOLD", "FP8_QUANTIZATION_BOUND", "FP8_QUANTIZATION_FLOOR", "FP8_THRESHOLD",
    "QUANTIZATION_PREFIX", "ROUTER_THRESHOLD", "THRESHOLDS", "Comparison", "ParityReport", "check",
    "compare_quantized", "compare_sides", "compare_tensor", "format_table", "fp8_products_threshold",
    "layer_threshold",
    # this module
    "compare_layer", "compare_quantization", "compare_routers", "run_parity",
]


def compare_layer(config: ParityConfig, problem: ParityProblem | None = None) -> ParityReport:
    """Run both layers on the (injected-routing) problem and compare outputs and gradients."""
    problem = problem if problem is not None else build_problem(config)
    return compare_sides(config, run_ours(config, problem), run_reference(config, problem))


def compare_routers(config: ParityConfig, problem: ParityProblem | None = None) -> ParityReport:
    """Compare `config.router` on both sides on the same fp32 logits.

    The choice must match exactly (ties go to the lower expert on both sides); weights, probs,
    aux/z losses and the gradients w.r.t. the logits and the router weight (from the same upstream
    gradients of weights and probs) are held to the fp32 threshold: router math is fp32 on both
    sides whatever the layer's dtype.
    """
    problem = problem if problem is not None else build_problem(config)
    ours = run_router_ours(config, problem)
    theirs = run_router_reference(config, problem)
    return ParityReport(
        config, tuple(compare_tensor(name, ours[name], theirs[name], ROUTER_THRESHOLD) for name in theirs),
    )


def _unquantized(config: ParityConfig) -> ParityConfig:
    return dataclasses.replace(config, fp8=False)


def compare_quantization(config: ParityConfig, problem: ParityProblem | None = None) -> ParityReport:
    """What FP8 gives up: our FP8 layer against our unquantized layer of the same dtype on the same
    problem (`compare_quantized`). ValueError unless `config.fp8`."""
    if not config.fp8:
        raise ValueError(f"config: compare_quantization measures an FP8 layer; got fp8=False ({config.describe()}).")
    problem = problem if problem is not None else build_problem(config)
    return compare_quantized(config, run_ours(config, problem), run_ours(_unquantized(config), problem))


def run_parity(config: ParityConfig) -> ParityReport:
    """The full comparison of `config`: layer (injected routing), for an FP8 layer also what FP8
    gives up (`compare_quantized`, on the same run of our layer), then router (same logits)."""
    problem = build_problem(config)
    ours = run_ours(config, problem)
    report = compare_sides(config, ours, run_reference(config, problem))
    if config.fp8:
        report += compare_quantized(config, ours, run_ours(_unquantized(config), problem))
    return report + compare_routers(config, problem)
