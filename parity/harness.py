"""Parity harness: one MoE problem through `moe_jax` and through the torch reference, compared.

Legend (shape suffixes): T tokens, D model width, F routed-expert hidden width, E experts,
K experts per token (top-k), L latent width (LatentMoE), Fs shared-expert hidden width
(= F * shared_experts), Din routed-expert input width (L with a latent width, else D).

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

Precision: fp32 runs with full-precision products on both sides (jax `Precision.HIGHEST` passed
to the layer; torch under `precise_matmuls`, TF32 off, and the reference's Triton kernels use IEEE
products). bf16 runs the layer in bf16 (params and activations; products accumulate in fp32 on
both sides); routing weights and router math are fp32 on both sides.

Devices: torch runs on CUDA when available (kernels compiled), else on CPU with its kernels under
Triton's interpreter (importing `parity.reference` selects it). jax runs on its default device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx

from parity import reference as ref
from moe_jax import routing as jrouting

DTYPES = ("float32", "bfloat16")
SKEWS = ("balanced", "zipf", "one_hot", "empty")
ROUTERS = ("selected_softmax", "softmax_topk", "sigmoid_grouped")
BACKENDS = ("auto", "pallas_triton", "xla")
EP_STRATEGIES = ("padded", "ragged")

# Relative Frobenius error allowed between the two sides (DESIGN.md "Numerics").
THRESHOLDS = {"float32": 1e-5, "bfloat16": 1e-2}
# Router math is fp32 on both sides whatever the layer's dtype.
ROUTER_THRESHOLD = THRESHOLDS["float32"]

ZIPF_EXPONENT = 1.2  # popularity of the r-th most popular expert ~ r^-1.2
HOT_LOGIT_BIAS = 4.0  # router-logit lift of the hot expert (one_hot skew)
EMPTY_LOGIT_BIAS = -30.0  # router-logit drop of the experts that get no token (empty skew)
ROUTED_SCALING_FACTOR = 2.5  # DeepSeek-V3-like scaling for the sigmoid router


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class ParityConfig:
    """One parity problem. Sizes are per layer call; `seed` fixes every random draw.

    skew: how the injected routing spreads tokens over experts --
      "balanced" (every expert gets T*K/E routes, +-1), "zipf" (expert popularity ~ rank^-1.2),
      "one_hot" (one expert is in every token's top-k), "empty" (about half the experts, and at
      least one, get no token; needs num_experts > top_k).
    router: the router compared on the same logits (and the layer's router) --
      "selected_softmax" (Mixtral), "softmax_topk" (Qwen3-MoE, renormalised),
      "sigmoid_grouped" (DeepSeek-V3: groups, normalised, scaled by 2.5).
    shared_experts: number of shared experts; they form one SwiGLU of width d_ff * shared_experts.
    latent_dim: LatentMoE width of the routed experts (None: they work at d_model).
    backend: `moe_jax` GEMM backend of our side ("auto": Pallas/Triton on GPU, XLA elsewhere).
    ep_size: expert-parallel size of our side: >1 runs the layer on a `("data", "ep")` mesh of
      ep_size devices (data=1), exchanging rows with `ep_strategy` ("padded" everywhere, "ragged"
      GPU only). The reference side stays on one device: the torch EP reference is checked against
      it by parity/tests/test_reference_ep.py, so one-device parity carries over.
    """

    tokens: int = 64
    d_model: int = 32
    d_ff: int = 32
    num_experts: int = 8
    top_k: int = 2
    dtype: str = "float32"
    skew: str = "balanced"
    router: str = "softmax_topk"
    shared_experts: int = 0
    latent_dim: int | None = None
    fused_gate_up: bool = False
    backend: str = "auto"
    ep_size: int = 1
    ep_strategy: str = "padded"
    seed: int = 0

    def __post_init__(self):
        for name in ("tokens", "d_model", "d_ff", "num_experts", "top_k", "ep_size"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("shared_experts", self.shared_experts, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        if self.latent_dim is not None:
            _check_int("latent_dim", self.latent_dim, minimum=1)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("skew", self.skew, SKEWS)
        _check_choice("router", self.router, ROUTERS)
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("ep_strategy", self.ep_strategy, EP_STRATEGIES)
        if not isinstance(self.fused_gate_up, bool):
            raise TypeError(f"fused_gate_up={self.fused_gate_up!r}: must be a bool.")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}; choose top_k <= num_experts."
            )
        if self.skew == "empty" and self.num_experts <= self.top_k:
            raise ValueError(
                f"skew='empty' needs num_experts > top_k to leave an expert without tokens; got "
                f"num_experts={self.num_experts}, top_k={self.top_k}."
            )
        for name in ("tokens", "num_experts"):
            if getattr(self, name) % self.ep_size:
                raise ValueError(
                    f"{name}={getattr(self, name)} is not a multiple of ep_size={self.ep_size}; "
                    f"expert parallelism splits both over the ep_size devices."
                )

    @property
    def shared_d_ff(self) -> int:
        """Hidden width Fs of the shared SwiGLU (0 without shared experts)."""
        return self.d_ff * self.shared_experts

    @property
    def routed_width(self) -> int:
        """Din: the width the routed experts read and write."""
        return self.latent_dim if self.latent_dim is not None else self.d_model

    def describe(self) -> str:
        """One line naming every field that shapes the problem."""
        parts = [
            f"T={self.tokens}", f"D={self.d_model}", f"F={self.d_ff}", f"E={self.num_experts}",
            f"K={self.top_k}", self.dtype, f"skew={self.skew}", f"router={self.router}",
        ]
        if self.shared_experts:
            parts.append(f"shared={self.shared_experts}")
        if self.latent_dim is not None:
            parts.append(f"latent={self.latent_dim}")
        if self.fused_gate_up:
            parts.append("fused_gate_up")
        if self.ep_size > 1:
            parts.append(f"ep={self.ep_size}/{self.ep_strategy}")
        parts += [f"backend={self.backend}", f"seed={self.seed}"]
        return " ".join(parts)


def _check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}.")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}.")


def router_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """`(n_group, topk_group)` of the sigmoid router: DeepSeek-V3-like grouping that fits E, K.

    The most groups among 8, 4, 2 that leave at least two experts per group (1 if none), keeping
    half of them, or more when the kept groups must hold top_k experts.
    """
    n_group = next((g for g in (8, 4, 2) if num_experts % g == 0 and num_experts // g >= 2), 1)
    per_group = num_experts // n_group
    topk_group = min(n_group, max(n_group // 2, -(-top_k // per_group)))
    return n_group, topk_group


# ---------------------------------------------------------------------------------------------
# The problem (numpy, from the seed)


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
    """Parameter name -> shape, in the layout of DESIGN.md and the torch reference."""
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


def _grad_name(param: str) -> str:
    return f"d_{param}"


def layer_tensor_names(config: ParityConfig) -> tuple[str, ...]:
    """Names of the compared layer tensors, in report order.

    y (output), dx, d_weights (routing weights), then `d_<param>` for every parameter of the
    routed experts, latent projections and shared experts. The router weight is absent: with
    injected routing the layer's output does not depend on it (see `compare_routers`).
    """
    params = [p for p in param_shapes(config) if p != "w_router"]
    return ("y", "dx", "d_weights", *map(_grad_name, params))


# ---------------------------------------------------------------------------------------------
# Our side: moe_jax


def jax_router(config: ParityConfig):
    """The `moe_jax.routing` router named by `config.router`."""
    k = config.top_k
    if config.router == "selected_softmax":
        return jrouting.SelectedSoftmax(k)
    if config.router == "softmax_topk":
        return jrouting.SoftmaxTopK(k, renormalize=True)
    n_group, topk_group = router_groups(config.num_experts, k)
    return jrouting.SigmoidGroupedTopK(
        k, n_group=n_group, topk_group=topk_group, normalize=True,
        routed_scaling_factor=ROUTED_SCALING_FACTOR,
    )


def jax_precision(config: ParityConfig):
    """HIGHEST for fp32 (no TF32 anywhere), the default for bf16."""
    return jax.lax.Precision.HIGHEST if config.dtype == "float32" else None


def ep_mesh(config: ParityConfig):
    """The `("data", "ep")` mesh of `config.ep_size` devices (data=1), or None for ep_size=1."""
    if config.ep_size == 1:
        return None
    from moe_jax.parallel import make_mesh

    devices = jax.devices()
    if len(devices) < config.ep_size:
        raise ValueError(
            f"ep_size={config.ep_size} needs {config.ep_size} devices but jax sees {len(devices)}; "
            f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={config.ep_size} before "
            "jax starts (python -m parity does so), or lower ep_size."
        )
    return make_mesh(ep=config.ep_size, data=1, devices=devices[: config.ep_size])


def make_layer(config: ParityConfig, params: dict[str, np.ndarray]):
    """A `moe_jax.layers.MoE` for `config` holding `params` (see `load_state`).

    Built abstractly (`nnx.eval_shape`): the random initialisation it skips would be overwritten
    anyway, and eagerly it costs seconds per layer on CPU.
    """
    from moe_jax.layers import MoE

    dtype = jnp.dtype(config.dtype)
    model = nnx.eval_shape(lambda: MoE(
        config.d_model, config.d_ff, config.num_experts, config.top_k,
        router=jax_router(config),
        num_shared_experts=config.shared_experts,
        shared_d_ff=config.shared_d_ff or None,
        latent_dim=config.latent_dim,
        fused_gate_up=config.fused_gate_up,
        dtype=dtype,
        param_dtype=dtype,
        backend=config.backend,
        precision=jax_precision(config),
        mesh=ep_mesh(config),
        ep_strategy=config.ep_strategy,
        rngs=nnx.Rngs(config.seed),
    ))
    load_state(model, params)
    return model


def _path_name(path) -> str:
    return ".".join(str(p) for p in path)


def load_state(model, params: dict[str, np.ndarray]) -> None:
    """Fill `model`'s variables: every nnx.Param from `params` (keys: paths joined by "."), in
    the parameter's dtype and mesh sharding; every other variable (the loss-free selection bias)
    with zeros, its initial value.

    Raises ValueError when the layer's parameter names or shapes differ from the problem's.
    """
    param_state, other_state = nnx.state(model, nnx.Param, nnx.Not(nnx.Param))
    flat = list(nnx.to_flat_state(param_state))
    names = {_path_name(path) for path, _ in flat}
    if names != set(params):
        raise ValueError(
            f"the layer's parameters {sorted(names)} differ from the harness's {sorted(params)}; "
            "align parity.harness.param_shapes with moe_jax.layers.MoE."
        )
    for path, var in flat:
        name, current = _path_name(path), var.get_value()  # an array or a ShapeDtypeStruct
        if tuple(current.shape) != params[name].shape:
            raise ValueError(
                f"parameter {name}: the layer has shape {tuple(current.shape)}, the harness "
                f"{params[name].shape}; align parity.harness.param_shapes with moe_jax.layers.MoE."
            )
        value = params[name].astype(current.dtype)
        sharding = getattr(current, "sharding", None)
        var.set_value(jnp.asarray(value) if sharding is None else jax.device_put(value, sharding))
    for _, var in nnx.to_flat_state(other_state):
        current = var.get_value()
        var.set_value(jnp.zeros(current.shape, current.dtype))
    nnx.update(model, param_state, other_state)


def make_our_step(config: ParityConfig, problem: ParityProblem):
    """`(step, args)`: `step(*args)` is a jitted forward + vjp of our layer on the problem.

    It returns `{name: array}` keyed like `layer_tensor_names`. Kept separate from `run_ours` so
    that timing can call the same compiled function repeatedly.
    """
    graphdef, params, rest = nnx.split(make_layer(config, problem.params), nnx.Param, ...)
    dtype = jnp.dtype(config.dtype)

    def step(params, x_TD, weights_TK, expert_idx_TK, probs_TE, dy_TD):
        def forward(params, x_TD, weights_TK):
            layer = nnx.merge(graphdef, params, rest)
            y_TD, _ = layer(x_TD, routing=jrouting.Routing(expert_idx_TK, weights_TK, probs_TE))
            return y_TD

        y_TD, vjp = jax.vjp(forward, params, x_TD, weights_TK)
        d_params, dx_TD, d_weights_TK = vjp(dy_TD.astype(y_TD.dtype))
        out = {"y": y_TD, "dx": dx_TD, "d_weights": d_weights_TK}
        for path, var in nnx.to_flat_state(d_params):
            out[_grad_name(_path_name(path))] = var[...]
        return out

    args = (
        params,
        jnp.asarray(problem.x_TD, dtype),
        jnp.asarray(problem.weights_TK),
        jnp.asarray(problem.expert_idx_TK),
        jnp.asarray(problem.probs_TE),
        jnp.asarray(problem.dy_TD, dtype),
    )
    return jax.jit(step), args


def run_ours(config: ParityConfig, problem: ParityProblem) -> dict[str, jax.Array]:
    """Our layer's output and gradients: `{name: jax array}` for `layer_tensor_names(config)`."""
    step, args = make_our_step(config, problem)
    out = step(*args)
    return {name: out[name] for name in layer_tensor_names(config)}


# ---------------------------------------------------------------------------------------------
# Reference side: parity.reference (torch / Triton)


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
    shared: y += (silu(x Ws_gate^T) * (x Ws_up^T)) Ws_down^T, nonlinearity in fp32 like the
    reference's `swiglu`.
    """
    h_TD = x_TD if config.latent_dim is None else x_TD @ p["w_latent_down"].T
    if config.fused_gate_up:
        r_TD = ref.moe_experts_autograd_fused(h_TD, expert_idx_TK, weights_TK, p["w_gate_up"], p["w_down"])
    else:
        r_TD = ref.moe_experts_autograd(h_TD, expert_idx_TK, weights_TK, p["w_gate"], p["w_up"], p["w_down"])
    y_TD = r_TD if config.latent_dim is None else r_TD @ p["w_latent_up"].T
    if config.shared_experts:
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
    out.update({_grad_name(name): g for name, g in zip(ops.params, grads[2:])})
    return out


def run_reference(
    config: ParityConfig, problem: ParityProblem, device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """The reference's output and gradients: `{name: tensor}` for `layer_tensor_names(config)`."""
    out = reference_step(config, reference_operands(config, problem, device or torch_device()))
    return {name: out[name] for name in layer_tensor_names(config)}


# ---------------------------------------------------------------------------------------------
# Comparison


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Our tensor against the reference's.

    max_abs: max |ours - ref|; rel_fro: ||ours - ref||_F / ||ref||_F (||ours - ref||_F when the
    reference is all zeros). Integer tensors (the router's choice) are compared exactly: rel_fro
    is then the fraction of differing entries and the threshold 0.
    """

    tensor: str
    shape: tuple[int, ...]
    max_abs: float
    rel_fro: float
    threshold: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.rel_fro) and math.isfinite(self.max_abs) and self.rel_fro <= self.threshold

    def summary(self) -> str:
        return (
            f"{self.tensor} {list(self.shape)}: rel Frobenius error {self.rel_fro:.3e} "
            f"(threshold {self.threshold:.0e}), max abs error {self.max_abs:.3e}"
        )


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """The comparisons of one configuration."""

    config: ParityConfig
    comparisons: tuple[Comparison, ...]

    @property
    def failures(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if not c.passed)

    @property
    def passed(self) -> bool:
        return not self.failures

    def __add__(self, other: "ParityReport") -> "ParityReport":
        if other.config != self.config:
            raise ValueError("only reports of one configuration can be joined")
        return ParityReport(self.config, self.comparisons + other.comparisons)

    def to_json(self) -> dict:
        return {
            "config": dataclasses.asdict(self.config),
            "passed": self.passed,
            "comparisons": [
                {**dataclasses.asdict(c), "shape": list(c.shape), "passed": c.passed}
                for c in self.comparisons
            ],
        }


def _as_torch(a, device: torch.device) -> torch.Tensor:
    """A jax array or torch tensor as a torch tensor on `device` (dlpack: no host copy on GPU)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to(device)
    if len(a.sharding.device_set) > 1:  # dlpack takes single-device arrays only (EP results)
        a = jax.device_put(a, next(iter(a.sharding.device_set)))
    return torch.from_dlpack(a).to(device)


def compare_tensor(name: str, ours, reference: torch.Tensor, threshold: float) -> Comparison:
    """One `Comparison`; shapes must agree (a mismatch raises ValueError naming the tensor)."""
    reference = reference.detach()
    theirs = _as_torch(ours, reference.device)
    if tuple(theirs.shape) != tuple(reference.shape):
        raise ValueError(
            f"{name}: our shape {tuple(theirs.shape)} differs from the reference's {tuple(reference.shape)}"
        )
    shape = tuple(reference.shape)
    if reference.numel() == 0:
        return Comparison(name, shape, 0.0, 0.0, threshold)
    if not reference.dtype.is_floating_point:
        differ = theirs.long() != reference.long()
        max_abs = float((theirs.long() - reference.long()).abs().max())
        return Comparison(name, shape, max_abs, float(differ.double().mean()), 0.0)
    a, b = theirs.double(), reference.double()
    diff = a - b
    norm = float(torch.linalg.vector_norm(b))
    err = float(torch.linalg.vector_norm(diff))
    return Comparison(name, shape, float(diff.abs().max()), err / norm if norm > 0 else err, threshold)


def compare_sides(config: ParityConfig, ours: dict, reference: dict[str, torch.Tensor]) -> ParityReport:
    """Compare every `layer_tensor_names(config)` entry of the two sides."""
    threshold = THRESHOLDS[config.dtype]
    comparisons = []
    for name in layer_tensor_names(config):
        for side, values in (("our", ours), ("reference", reference)):
            if name not in values:
                raise ValueError(f"{name} is missing from the {side} side's results ({config.describe()})")
        comparisons.append(compare_tensor(name, ours[name], reference[name], threshold))
    return ParityReport(config, tuple(comparisons))


def compare_layer(config: ParityConfig, problem: ParityProblem | None = None) -> ParityReport:
    """Run both layers on the (injected-routing) problem and compare outputs and gradients."""
    problem = problem if problem is not None else build_problem(config)
    return compare_sides(config, run_ours(config, problem), run_reference(config, problem))


# ---------------------------------------------------------------------------------------------
# Routers on the same logits


def run_router_ours(config: ParityConfig, problem: ParityProblem) -> dict[str, jax.Array]:
    """`moe_jax.routing` on `problem.logits_TE`: choice, weights, probs, losses, gradients.

    The gradients are those of `sum(weights * d_weights_TK) + sum(probs * d_probs_TE)`.
    """
    router = jax_router(config)
    d_weights_TK = jnp.asarray(problem.d_weights_TK)
    d_probs_TE = jnp.asarray(problem.d_probs_TE)

    def route(logits_TE):
        r = router.route(logits_TE)
        return jnp.sum(r.weights_TK * d_weights_TK) + jnp.sum(r.probs_TE * d_probs_TE), r

    logits_TE = jnp.asarray(problem.logits_TE)
    (_, r), d_logits_TE = jax.value_and_grad(route, has_aux=True)(logits_TE)
    x_TD = jnp.asarray(problem.x_TD, jnp.float32)
    return {
        "router.expert_idx": r.expert_idx_TK,
        "router.weights": r.weights_TK,
        "router.probs": r.probs_TE,
        "router.aux_loss": jrouting.aux_loss(r.probs_TE, r.expert_idx_TK),
        "router.z_loss": jrouting.z_loss(logits_TE),
        "router.d_logits": d_logits_TE,
        # logits = x W_router^T, so dL/dW_router = d_logits^T x.
        "router.d_w_router": jnp.matmul(d_logits_TE.T, x_TD, precision=jax.lax.Precision.HIGHEST),
    }


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


def run_parity(config: ParityConfig) -> ParityReport:
    """The full comparison of `config`: layer (injected routing) then router (same logits)."""
    problem = build_problem(config)
    return compare_layer(config, problem) + compare_routers(config, problem)


# ---------------------------------------------------------------------------------------------
# Reporting


def format_table(report: ParityReport) -> str:
    """A fixed-width table of the report, headed by the configuration."""
    rows = [("tensor", "shape", "max abs err", "rel Frobenius", "threshold", "status")]
    for c in report.comparisons:
        rows.append((
            c.tensor, "x".join(map(str, c.shape)) or "scalar", f"{c.max_abs:.3e}", f"{c.rel_fro:.3e}",
            f"{c.threshold:.0e}", "ok" if c.passed else "FAIL",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"parity: {report.config.describe()}"]
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    verdict = "PASS" if report.passed else f"FAIL ({len(report.failures)} of {len(report.comparisons)})"
    lines.append(verdict)
    return "\n".join(lines)


def check(report: ParityReport) -> None:
    """Raise AssertionError naming each failing tensor, the configuration and its error figures."""
    if report.passed:
        return
    lines = [f"parity failed for {report.config.describe()}:"]
    lines += [f"  {c.summary()}" for c in report.failures]
    raise AssertionError("\n".join(lines))
