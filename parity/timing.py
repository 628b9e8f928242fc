"""GPU timing of one MoE layer step (forward + backward), torch reference vs `moe_jax`, side by side.

Both sides run the parity harness's graph on the same problem: injected routing (from the
configuration's skew), the same weights, the same upstream gradient; each step is a forward and
the backward w.r.t. x, the routing weights and every expert/latent/shared parameter.

- torch reference (`parity.reference`, Triton grouped GEMMs, autograd): CUDA events around each
  step, after warm-up.
- ours (`moe_jax.layers.MoE`, jitted forward + vjp): wall clock around each step with
  `block_until_ready`, after warm-up (the first call compiles).

Medians over `iters` steps; `ratio` = torch median / ours median (> 1: ours is faster). The
useful-FLOP count is the three expert GEMMs (forward and the two backward products of each):
18 * T * K * Din * F, plus the latent and shared GEMMs when present.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import torch

from parity.config import ParityConfig
from parity.ours import make_our_step
from parity.problem import build_problem
from parity.theirs import reference_operands, reference_step


@dataclasses.dataclass(frozen=True)
class TimingResult:
    """Medians in milliseconds of one forward+backward step on each side."""

    config: ParityConfig
    torch_ms: float
    ours_ms: float
    iters: int
    warmup: int
    flops: float
    device: str

    @property
    def ratio(self) -> float:
        """torch / ours: how many times faster our step is."""
        return self.torch_ms / self.ours_ms

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12

    def to_json(self) -> dict:
        return {
            "config": dataclasses.asdict(self.config),
            "routing": f"injected ({self.config.skew})",
            "step": "forward+backward",
            "device": self.device,
            "iters": self.iters,
            "warmup": self.warmup,
            "torch_ms": self.torch_ms,
            "ours_ms": self.ours_ms,
            "ratio_torch_over_ours": self.ratio,
            "flops": self.flops,
            "torch_tflops": self.tflops(self.torch_ms),
            "ours_tflops": self.tflops(self.ours_ms),
        }


def step_flops(config: ParityConfig) -> float:
    """Useful FLOPs of one forward+backward step (each GEMM: 2mnk forward, 4mnk backward)."""
    t, d = config.tokens, config.d_model
    gemm_mnk = 3 * t * config.top_k * config.routed_width * config.d_ff
    if config.latent_dim is not None:
        gemm_mnk += 2 * t * d * config.latent_dim
    if config.shared_experts:
        gemm_mnk += 3 * t * d * config.shared_d_ff
    return 6.0 * gemm_mnk


def gpu_available() -> bool:
    """Whether both torch and jax see a GPU."""
    return torch.cuda.is_available() and jax.default_backend() == "gpu"


def _time_torch(config, problem, *, warmup: int, iters: int) -> float:
    ops = reference_operands(config, problem, torch.device("cuda"))
    for _ in range(warmup):
        reference_step(config, ops)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        reference_step(config, ops)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_ours(config, problem, *, warmup: int, iters: int) -> float:
    step, args = make_our_step(config, problem)
    for _ in range(max(warmup, 1)):  # the first call compiles
        jax.block_until_ready(step(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _check_ep_devices(config: ParityConfig) -> None:
    """Timing EP needs ep_size devices on the default backend: with fewer, `ep_mesh` falls back to
    the host's CPU devices, and our step would be timed on CPU against torch on the GPU."""
    available = len(jax.devices())
    if config.ep_size > 1 and available < config.ep_size:
        raise ValueError(
            f"timing with ep_size={config.ep_size} needs {config.ep_size} accelerators on jax's "
            f"default backend ({jax.default_backend()}), which has {available}; lower --ep-size or "
            "run on a host with enough GPUs."
        )


def time_layers(config: ParityConfig, *, warmup: int = 3, iters: int = 20) -> TimingResult:
    """Median forward+backward step time of the torch reference and of our layer on `config`.

    GPU only: raises RuntimeError unless both torch and jax see a CUDA GPU, and ValueError when
    `config.ep_size > 1` and jax's default backend has fewer than ep_size devices, or for
    `config.fp8` (the torch FP8 reference is an fp32 oracle, no peer to time against).
    """
    if config.fp8:
        raise ValueError(
            "config.fp8: the torch FP8 reference (parity.reference.fp8) is an fp32 oracle looping over experts "
            "and 128-wide steps, not a peer to time against; time the FP8 GEMMs and linear layer with python -m benchmarks.fp8."
        )
    if not gpu_available():
        raise RuntimeError(
            "timing needs a CUDA GPU visible to both torch and jax (torch.cuda.is_available()="
            f"{torch.cuda.is_available()}, jax.default_backend()={jax.default_backend()!r}); "
            "run it on the GPU runner."
        )
    _check_ep_devices(config)
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup={warmup} >= 0.")
    problem = build_problem(config)
    torch_ms = _time_torch(config, problem, warmup=warmup, iters=iters)
    ours_ms = _time_ours(config, problem, warmup=warmup, iters=iters)
    return TimingResult(
        config, torch_ms, ours_ms, iters, warmup, step_flops(config), torch.cuda.get_device_name(),
    )


def format_timing(result: TimingResult) -> str:
    """Two rows (torch reference, ours) with ms and TFLOP/s, and the ratio."""
    lines = [
        f"timing (forward+backward, median of {result.iters}, {result.device}): {result.config.describe()}",
        f"{'side':<18}{'ms':>10}{'TFLOP/s':>10}",
        f"{'torch reference':<18}{result.torch_ms:>10.3f}{result.tflops(result.torch_ms):>10.1f}",
        f"{'moe_jax':<18}{result.ours_ms:>10.3f}{result.tflops(result.ours_ms):>10.1f}",
        f"ratio torch/ours: {result.ratio:.2f}",
    ]
    return "\n".join(lines)
