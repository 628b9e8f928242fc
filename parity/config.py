"""The parity problem's configuration: `ParityConfig` (frozen, validated) and the router settings
both sides derive from it.

Legend (shape suffixes): T tokens, D model width, F routed-expert hidden width, E experts,
K experts per token (top-k), L latent width (LatentMoE), Fs shared-expert hidden width
(= F * shared_experts), Din routed-expert input width (L with a latent width, else D).

Bad values raise ValueError/TypeError naming the field and the fix. `router_groups` and
`ROUTED_SCALING_FACTOR` fix the sigmoid router's grouping and scale so that `parity.ours` and
`parity.theirs` build the same router.
"""

from __future__ import annotations

import dataclasses

DTYPES = ("float32", "bfloat16")
SKEWS = ("balanced", "zipf", "one_hot", "empty")
ROUTERS = ("selected_softmax", "softmax_topk", "sigmoid_grouped")
BACKENDS = ("auto", "pallas_triton", "xla")
EP_STRATEGIES = ("padded", "ragged")

ROUTED_SCALING_FACTOR = 2.5  # DeepSeek-V3-like scaling for the sigmoid router


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
    fp8: the routed experts' three projections in DeepSeek-V3's blockwise FP8 on both sides (ours:
      `GemmOptions(quantization=Fp8Blockwise())`; the reference: `parity.reference.fp8`); needs
      `fused_gate_up=False`. Compared at `parity.compare.layer_threshold`.
    backend: `moe_jax` GEMM backend of our side ("auto": Pallas/Triton on GPU, XLA elsewhere).
    ep_size: expert-parallel size of our side: >1 runs the layer on a `("data", "ep")` mesh of
      ep_size devices (data=1; host CPUs when the GPUs are too few, see `parity.ours.ep_mesh`),
      exchanging rows with `ep_strategy` ("padded" everywhere, "ragged" on GPUs only). The
      reference side stays on one device: the torch EP reference is checked against it by
      parity/tests/test_reference_ep.py, so one-device parity carries over.
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
    fp8: bool = False
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
        for name in ("fused_gate_up", "fp8"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}: must be a bool.")
        if self.fp8 and self.fused_gate_up:
            raise ValueError(
                "fp8=True needs fused_gate_up=False: the FP8 recipe quantizes the gate and up weights in "
                "their own 128 x 128 blocks (moe_jax's Fp8Blockwise takes separate weights only)."
            )
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
        if self.fp8:
            parts.append("fp8")
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
