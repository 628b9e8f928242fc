"""Which backend `backend="auto"` runs for each grouped-GEMM kernel on a GPU.

Kernels: `gmm_nt` (the forward, `rhs [E, N, K]`), `gmm_nn` (the input gradient, `rhs` read as
`[E, K, N]`) and `tgmm` (the weight gradient). Shape classes: `decode` (at most 64 rows per group
on average, where the Pallas group-major and split-K kernels live) and `prefill`.

`H200_BACKENDS` comes from `python -m benchmarks.backends` on one H200 (docs/kernel-selection.md,
`benchmarks/results/2026-12-01-h200-backends.md`): on the prefill rows the official Triton kernels
(`triton`) beat the Pallas Triton ones on the input gradient (geomean 0.93x vs 0.91x
`torch._grouped_mm`) and the weight gradient (0.84x vs 0.81x); the forward stays on Pallas, where
the on-device selector chooses among its candidates (0.95x vs 0.90x). Each entry lists backends
in order of preference; `auto` runs the first that runs the call (`gemm_backend`). `mosaic_gpu`
is in no entry: its input gradient beats `triton` on the Qwen3-30B-A3B and Mixtral rows but loses
on DeepSeek-V3's, and the whole layer with it was no faster (the results file's "Mosaic in auto";
with the Mosaic rule, `2026-12-03-h200-backend-table-layer.md`: 3-7% faster at Qwen3-30B-A3B,
5-9% slower at DeepSeek-V3). A `BackendTable` passed as `backend` replaces this table per call.
It is applied on every GPU: it is the only one measured. Where jax_triton is not installed,
`triton` choices run on `pallas_triton`. Off GPU, `auto` is `xla` for every kernel.
"""

from __future__ import annotations

import functools
import logging

from moe_jax.ops.gmm.mosaic import mosaic_supports
from moe_jax.ops.gmm.triton_launch import import_jax_triton
from moe_jax.ops.platform import BackendTable, on_gpu, resolve_backend

__all__ = ["AUTO_FUSED_GATHER", "H200_BACKENDS", "KERNELS", "gemm_backend", "have_jax_triton", "shape_class"]

KERNELS = ("gmm_nt", "gmm_nn", "tgmm")
DECODE_ROWS_PER_GROUP = 64

H200_BACKENDS = BackendTable.of({
    ("gmm_nt", "decode"): ("pallas_triton",),
    ("gmm_nt", "prefill"): ("pallas_triton",),
    ("gmm_nn", "decode"): ("pallas_triton",),
    ("gmm_nn", "prefill"): ("triton", "pallas_triton"),
    ("tgmm", "decode"): ("pallas_triton",),
    ("tgmm", "prefill"): ("triton", "pallas_triton"),
})
# Backends on which `MoE(row_gather="auto")` fuses the row gather into the gate/up GEMM: where it
# measured faster than gathering first. None on the H200 (docs/backends.md, "Fused row gather").
AUTO_FUSED_GATHER: tuple[str, ...] = ()

_log = logging.getLogger("moe_jax")
_announced: set = set()


@functools.cache
def have_jax_triton() -> bool:
    """Whether jax_triton imports here (it needs a CUDA jaxlib)."""
    try:
        import_jax_triton()
    except ImportError:
        return False
    return True


def shape_class(num_rows: int, num_groups: int) -> str:
    """`decode` at <= 64 rows per group on average, else `prefill`."""
    return "decode" if num_rows <= DECODE_ROWS_PER_GROUP * max(num_groups, 1) else "prefill"


def gemm_backend(kernel: str, backend: str | BackendTable, num_rows: int, num_groups: int, *, operands=None,
                 table=H200_BACKENDS, triton_available: bool | None = None) -> str:
    """The backend that runs `kernel` (one of `KERNELS`) for `backend`: an explicit name as
    `platform.resolve_backend` checks it; `auto` off GPU is `xla`, on GPU the first of `table`'s
    choices for the shape class that runs here (a `BackendTable` passed as `backend` is `auto`
    with that table): `triton` only where jax_triton imports (or `triton_available` says so),
    `mosaic_gpu` only for `operands = (N, K, dtype, out_dtype)` that `mosaic.mosaic_supports`
    (never without them); `pallas_triton` runs everything. Logged once per choice on the
    `moe_jax` logger (INFO)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: use one of {KERNELS}.")
    if isinstance(backend, BackendTable):
        table, backend = backend, "auto"
    if backend != "auto" or not on_gpu():
        return resolve_backend(backend)
    cls = shape_class(num_rows, num_groups)
    if (kernel, cls) not in table:
        raise ValueError(f"the backend table has no entry for ({kernel!r}, {cls!r}); add one, e.g. start from "
                         f"H200_BACKENDS.replace({{...}}), which has every kernel and shape class.")
    triton_ok = have_jax_triton() if triton_available is None else triton_available
    mosaic_ok = operands is not None and mosaic_supports(num_rows, *operands[:3], out_dtype=operands[3])
    runs = {"triton": triton_ok, "mosaic_gpu": mosaic_ok}
    picked = next((b for b in table[(kernel, cls)] if runs.get(b, True)), "pallas_triton")
    if (kernel, cls, picked) not in _announced:
        _announced.add((kernel, cls, picked))
        _log.info("moe_jax: backend='auto' runs %s (%s) on %r", kernel, cls, picked)
    return picked
