"""Comparison of the two sides: per-tensor error figures, the report, its table and its check.

`compare_tensor` measures the max abs error and the relative Frobenius error
`||ours - ref|| / ||ref||` of one tensor (integer tensors exactly); `compare_sides` does so for
every `layer_tensor_names(config)` entry against the configuration's threshold
(`layer_threshold`: the dtype's, `THRESHOLDS`, no tighter than `fp8_products_threshold` for an FP8
layer: `FP8_THRESHOLD`, or `FP8_KERNEL_THRESHOLD` where our FP8 products run on the FP8 kernel).
`compare_quantized` measures what FP8 gives up: our FP8 layer against the unquantized layer.
`format_table(report)` prints a `ParityReport`; `check(report)` raises `AssertionError` naming
every failing tensor, the configuration and the error figures.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import torch

from moe_jax.ops.gmm.fp8_api import fp8_backend
from moe_jax.testing import rel_err, tolerance
from parity.config import ParityConfig
from parity.problem import layer_tensor_names

# Relative Frobenius error allowed between the two sides: the repository's table (docs/numerics.md).
THRESHOLDS = {name: tolerance(name) for name in ("float32", "bfloat16")}
# Router math is fp32 on both sides whatever the layer's dtype.
ROUTER_THRESHOLD = THRESHOLDS["float32"]
# FP8 layers (`ParityConfig.fp8`), either dtype. Both sides quantize the same values to the same
# e4m3 values and scales, bit for bit (parity/tests/test_parity_fp8.py); the products then differ
# only by fp32 summation order (and, in bf16, by the roundings of the outputs that order moves).
# Where such a difference moves a value that is quantized next (the SwiGLU output, the upstream
# gradient of a projection) across an e4m3 rounding boundary, that element moves by a whole e4m3
# step (2^-4 to 2^-3 relative), so the tensors downstream differ by more than fp32 noise: measured
# up to 9e-5 (CPU, dims 136-264; 2e-7 where nothing flips). 1e-3 leaves 10x for larger shapes and
# other fp32 summation orders (the FP8 kernel's products have their own threshold, below) and stays
# 10x below the smallest deviation from the recipe we measured (a scale differing in its last bit: 1.6e-2 in bf16) and 60x below the
# quantization error itself (`FP8_QUANTIZATION_BOUND`). A bf16 FP8 layer is held to bf16's 1e-2
# (`layer_threshold`): its unquantized parts (the latent projections) differ as any bf16 layer's do
# (measured 4e-3); its tensors without them stay within 1e-3 (test_parity_fp8.py).
FP8_THRESHOLD = 1e-3
# Where our side runs the FP8 products on the FP8 kernel (a GPU with e4m3 tensor cores, `auto` or
# `triton`), the tensor cores sum each 128-wide step with fewer bits than fp32 (about 14 on Hopper:
# DeepSeek-V3 report, section 3.3.2, the reason the recipe promotes every 128), so each step's sum
# differs from the reference's fp32 sum by about 1e-4 relative, and the next quantization flips
# the e4m3 rounding of a fraction of order 1e-3 of its elements, each by a whole e4m3 step: of
# order 3e-3 downstream. 1e-2 holds that with room and stays 5x below what FP8 gives up.
FP8_KERNEL_THRESHOLD = 1e-2
# Our FP8 layer against the unquantized layer of the same dtype (what FP8 gives up): measured
# 4.8e-2 to 6.9e-2 at dims 136-264 in fp32 and bf16 (e4m3's 3 mantissa bits on both operands of
# three chained products). Not a parity threshold but a sanity bound: one e4m3 step, 2^-3; a
# misplaced scale or block gives errors of order 1. `FP8_QUANTIZATION_FLOOR` is the other side:
# below it the layer did not quantize.
FP8_QUANTIZATION_BOUND = 2.0**-3
FP8_QUANTIZATION_FLOOR = 1e-2
# Prefix of the tensors of `compare_quantized`.
QUANTIZATION_PREFIX = "fp8_vs_unquantized."


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
            f"(threshold {self.threshold:.3g}), max abs error {self.max_abs:.3e}"
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
    ours_t = _as_torch(ours, reference.device)
    if tuple(ours_t.shape) != tuple(reference.shape):
        raise ValueError(
            f"{name}: our shape {tuple(ours_t.shape)} differs from the reference's {tuple(reference.shape)}"
        )
    shape = tuple(reference.shape)
    if reference.numel() == 0:
        return Comparison(name, shape, 0.0, 0.0, threshold)
    if not reference.dtype.is_floating_point:
        differ = ours_t.long() != reference.long()
        max_abs = float((ours_t.long() - reference.long()).abs().max())
        return Comparison(name, shape, max_abs, float(differ.double().mean()), 0.0)
    a, b = ours_t.double().cpu(), reference.double().cpu()
    return Comparison(name, shape, float((a - b).abs().max()), rel_err(a.numpy(), b.numpy()), threshold)


def fp8_products_threshold(config: ParityConfig) -> float:
    """The relative Frobenius error allowed for what the routed experts' FP8 products alone move:
    `FP8_KERNEL_THRESHOLD` where our side may run them on an FP8 kernel (`config.backend` a kernel
    or `auto`, on a device where `moe_jax.ops.gmm.fp8_api.fp8_backend` keeps `auto`: the kernels
    run), else `FP8_THRESHOLD` (the reference path: fp32 products, as the torch side's)."""
    kernel = config.backend in ("auto", "triton", "mosaic_gpu") and fp8_backend("auto") == "auto"
    return FP8_KERNEL_THRESHOLD if kernel else FP8_THRESHOLD


def layer_threshold(config: ParityConfig) -> float:
    """The relative Frobenius error allowed between the two layers of `config`: the dtype's
    (`THRESHOLDS`), no tighter than `fp8_products_threshold` for an FP8 layer."""
    return max(fp8_products_threshold(config), THRESHOLDS[config.dtype]) if config.fp8 else THRESHOLDS[config.dtype]


def compare_sides(config: ParityConfig, ours: dict, reference: dict[str, torch.Tensor]) -> ParityReport:
    """Compare every `layer_tensor_names(config)` entry of the two sides."""
    threshold = layer_threshold(config)
    comparisons = []
    for name in layer_tensor_names(config):
        for side, values in (("our", ours), ("reference", reference)):
            if name not in values:
                raise ValueError(f"{name} is missing from the {side} side's results ({config.describe()})")
        comparisons.append(compare_tensor(name, ours[name], reference[name], threshold))
    return ParityReport(config, tuple(comparisons))


def compare_quantized(config: ParityConfig, ours: dict, unquantized: dict) -> ParityReport:
    """What FP8 gives up: our FP8 layer's `layer_tensor_names(config)` against the unquantized
    layer's (same problem, same dtype; jax arrays or torch tensors), as
    `fp8_vs_unquantized.<tensor>`, each held to `FP8_QUANTIZATION_BOUND`. ValueError unless
    `config.fp8`."""
    if not config.fp8:
        raise ValueError(f"config: compare_quantized measures an FP8 layer; got fp8=False ({config.describe()}).")
    cpu = torch.device("cpu")
    return ParityReport(config, tuple(
        compare_tensor(QUANTIZATION_PREFIX + name, ours[name], _as_torch(unquantized[name], cpu),
                       FP8_QUANTIZATION_BOUND)
        for name in layer_tensor_names(config)
    ))


def format_table(report: ParityReport) -> str:
    """A fixed-width table of the report, headed by the configuration."""
    rows = [("tensor", "shape", "max abs err", "rel Frobenius", "threshold", "status")]
    for c in report.comparisons:
        rows.append((
            c.tensor, "x".join(map(str, c.shape)) or "scalar", f"{c.max_abs:.3e}", f"{c.rel_fro:.3e}",
            f"{c.threshold:.3g}", "ok" if c.passed else "FAIL",
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
