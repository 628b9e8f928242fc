"""Per-kernel cost model of the expert GEMMs on one GPU.

Legend: P executed rows (each group's rows rounded up to the tile height), N output width, K
reduction width, G groups with rows (active experts or slots).

A grouped GEMM with tiles `(block_m, block_n, block_k)` on a rank takes

    seconds = launch + max(2 * P * pad(N, block_n) * pad(K, block_k) / rate,
                           (G_active * N * K + P * (N + K)) * bytes / copy bandwidth)

i.e. the executed FLOPs (row, column and reduction padding of the tiles included) at an achieved
rate for its kernel class, or, when that is faster, the bytes it must read and write (the active
experts' weights once, the rows in and out) at the copy bandwidth: a roofline with measured
ceilings. The layer runs three per pass: gate and up (`gate_up` class: N = F, K = D; separate,
`fused_gate_up=False`, the layer's default) and down (`down` class: N = D, K = F).

Defaults (`KernelCosts()`), our kernels on one H200, from
`benchmarks/results/2026-12-01-h200-gmm.md` (raw: `2026-12-01-h200-gmm.json`), the balanced
Qwen3-30B-A3B rows (M = 32768, E = 128, 256 rows per expert, so no tile padding: the rate there is
the rate on executed rows):

- forward: gate/up 471 TFLOP/s, down 362 TFLOP/s (rows `ours`);
- forward + backward: gate/up 413, down 348 TFLOP/s counting 3x the forward FLOPs (`ours_fb`);
- copy bandwidth 4.28 TB/s (the run's `copy_tbps`);
- launch 10 us per GEMM: the decode T=1 row took 22.0 us to read 50.3 MB of weights that take
  11.7 us at the copy bandwidth.

FP8 experts (`gate_up_fp8`, `down_fp8`; one byte per operand element, the scales' 3% left out),
our FP8 kernel on one H200 at the same rows: forward 667 / 425 TFLOP/s
(`benchmarks/results/2026-12-04-h200-fp8-kernel-2.md`, through jax_triton), forward + backward of
`fp8_grouped_linear` 259 / 224 (`2026-12-04-h200-fp8-layer-peers.md`; it quantizes the master
weights in each call, whose cost these rates carry at that row count only).

`KernelCosts.from_gmm_json` reads the same figures from any `python -m benchmarks.gmm run --json`
output. Assumed, not measured: that one rate per class holds at every shape (narrow N or K, as
ETP makes, runs slower than the measured wide shapes; only its tile padding is charged), and that
the backward pass is the forward's FLOPs times three at the `_train` rates.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from moe_jax.scaleout.tiles import Tiles, padded
from moe_jax.validation import check_number

__all__ = ["KernelCosts", "DEFAULT_GMM_RESULTS"]

DEFAULT_GMM_RESULTS = "benchmarks/results/2026-12-01-h200-gmm.json"
_CLASSES = ("gate_up", "down", "gate_up_fp8", "down_fp8")


@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """Achieved TFLOP/s per kernel class (forward, and forward + backward per forward-FLOP x3),
    the copy bandwidth in TB/s and the fixed launch cost per GEMM in microseconds. The `*_fp8`
    classes are the FP8 recipe's (module docstring); `from_gmm_json` reads the 16-bit ones and
    keeps the FP8 defaults."""

    gate_up_tflops: float = 471.0
    down_tflops: float = 362.0
    gate_up_train_tflops: float = 413.0
    down_train_tflops: float = 348.0
    copy_TBps: float = 4.28
    launch_us: float = 10.0
    source: str = "H200 defaults from benchmarks/results/2026-12-01-h200-gmm.md"
    gate_up_fp8_tflops: float = 667.0
    down_fp8_tflops: float = 425.0
    gate_up_fp8_train_tflops: float = 259.0
    down_fp8_train_tflops: float = 224.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name in ("source", "launch_us"):
                continue
            object.__setattr__(self, f.name, check_number(f.name, getattr(self, f.name)))
        launch = check_number("launch_us", self.launch_us, positive=False)
        if launch < 0:
            raise ValueError(f"launch_us must be >= 0; got {launch}.")
        object.__setattr__(self, "launch_us", launch)

    @classmethod
    def from_gmm_json(cls, path, *, gate_up_shape: str = "qwen3-30b-a3b gate+up",
                      down_shape: str = "qwen3-30b-a3b down", skew: str = "balanced",
                      launch_us: float = 10.0) -> "KernelCosts":
        """The rates of `impl` `ours` / `ours_fb` rows of a `benchmarks.gmm run --json` file for the
        named shapes and skew, and its copy bandwidth. ValueError naming what is missing."""
        path = Path(path)
        data = json.loads(path.read_text())
        rows = data.get("rows")
        if not isinstance(rows, list):
            raise ValueError(f"{path}: no 'rows' list; expected the output of `python -m benchmarks.gmm run --json`.")

        def rate(shape: str, impl: str) -> float:
            hits = [r for r in rows if r.get("shape") == shape and r.get("skew") == skew and r.get("impl") == impl]
            if not hits:
                have = sorted({r.get("shape") for r in rows if "shape" in r})
                raise ValueError(f"{path}: no row with shape={shape!r}, skew={skew!r}, impl={impl!r}; shapes: {have}.")
            return float(hits[0]["tflops"])

        copy = data.get("meta", {}).get("copy_tbps")
        if copy is None:
            raise ValueError(f"{path}: meta.copy_tbps (the measured copy bandwidth) is missing.")
        return cls(rate(gate_up_shape, "ours"), rate(down_shape, "ours"), rate(gate_up_shape, "ours_fb"),
                   rate(down_shape, "ours_fb"), float(copy), launch_us,
                   f"{path.name}: {gate_up_shape!r} / {down_shape!r}, {skew}")

    def rate_tflops(self, kernel_class: str, train: bool) -> float:
        if kernel_class not in _CLASSES:
            raise ValueError(f"kernel_class must be one of {_CLASSES}; got {kernel_class!r}.")
        return getattr(self, f"{kernel_class}{'_train' if train else ''}_tflops")

    def gemm_seconds(self, kernel_class: str, group_sizes_RG, n: int, k: int, tiles: Tiles, dtype_bytes: int,
                     train: bool = False) -> np.ndarray:
        """`[R]` seconds of one grouped GEMM per rank: `group_sizes_RG[r]` rows per group, output
        width n, reduction width k, run with `tiles` (module docstring). With `train`, the
        forward and its two backward GEMMs (3x the FLOPs and bytes, at the `_train` rate)."""
        sizes = np.asarray(group_sizes_RG, dtype=np.int64)
        if sizes.ndim != 2 or np.any(sizes < 0):
            raise ValueError(f"group_sizes_RG must be a non-negative [R, G] array; got shape {sizes.shape}.")
        executed_R = padded(sizes, tiles.block_m).sum(axis=1)
        flops_R = 2.0 * executed_R * padded(n, tiles.block_n) * padded(k, tiles.block_k)
        active_R = (sizes > 0).sum(axis=1)
        bytes_R = (active_R * n * k + executed_R * (n + k)) * float(dtype_bytes)
        passes = 3.0 if train else 1.0
        compute = passes * flops_R / (self.rate_tflops(kernel_class, train) * 1e12)
        memory = passes * bytes_R / (self.copy_TBps * 1e12)
        launches = (3 if train else 1) * self.launch_us * 1e-6  # launched on every rank, rows or not
        return launches + np.maximum(compute, memory)
