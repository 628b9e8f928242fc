"""Comparison of the two sides: per-tensor error figures, the report, its table and its check.

`compare_tensor` measures the max abs error and the relative Frobenius error
`||ours - ref|| / ||ref||` of one tensor (integer tensors exactly); `compare_sides` does so for
every `layer_tensor_names(config)` entry against the dtype's threshold (`THRESHOLDS`).
`format_table(report)` prints a `ParityReport`; `check(report)` raises `AssertionError` naming
every failing tensor, the configuration and the error figures.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import torch

from moe_jax.testing import rel_err, tolerance
from parity.config import ParityConfig
from parity.problem import layer_tensor_names

# Relative Frobenius error allowed between the two sides: the repository's table (docs/numerics.md).
THRESHOLDS = {name: tolerance(name) for name in ("float32", "bfloat16")}
# Router math is fp32 on both sides whatever the layer's dtype.
ROUTER_THRESHOLD = THRESHOLDS["float32"]


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
