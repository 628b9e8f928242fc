"""The repository's one tolerance table and relative-error helper (tests, parity, benchmarks).

Results are compared with fp32 references by the relative Frobenius error
`||out - ref||_F / ||ref||_F` (`||out - ref||_F` when the reference is all zeros). The allowed
error depends on the dtype the computation ran in: inputs rounded to bf16 carry a relative error
of about 2^-9 per element, and sums of many such products stay near 1e-3, so 1e-2 leaves room
for reordered accumulations; fp32 at `Precision.HIGHEST` differs from a float64 reference only by
reassociation. See docs/numerics.md.

Arrays may be JAX or NumPy arrays, or anything `np.asarray` accepts (callers holding torch
tensors pass `t.detach().float().cpu().numpy()`); the helpers compute in float64 on the host.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TOLERANCES", "assert_close", "rel_err", "tolerance"]

# Relative Frobenius error allowed against an fp32 (or float64) reference, by compute dtype.
TOLERANCES = {"float64": 1e-12, "float32": 1e-5, "float16": 3e-3, "bfloat16": 1e-2}


def _dtype_name(dtype) -> str:
    """'float32' for jnp/np dtypes, their names and type objects, and torch dtypes alike."""
    name = str(dtype).removeprefix("torch.")
    if name not in TOLERANCES:
        name = getattr(dtype, "name", None) or getattr(dtype, "__name__", name)
    if name not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}.")
    return name


def tolerance(dtype) -> float:
    """The allowed relative Frobenius error for results computed in `dtype`."""
    return TOLERANCES[_dtype_name(dtype)]


def rel_err(out, ref) -> float:
    """`||out - ref||_F / ||ref||_F` in float64 (the absolute error for an all-zero `ref`); `inf`
    when `out` holds a non-finite value, so a comparison with any tolerance fails. Shapes must match."""
    out, ref = np.asarray(out).astype(np.float64), np.asarray(ref).astype(np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ, {out.shape} vs {ref.shape}.")
    if not np.isfinite(out).all():
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def assert_close(out, ref, dtype, what: str = "") -> None:
    """AssertionError unless `rel_err(out, ref) <= tolerance(dtype)`, naming `what` and the figures."""
    err, tol = rel_err(out, ref), tolerance(dtype)
    assert err <= tol, f"{what}: rel Frobenius error {err:.3e} > {tol:.0e} ({_dtype_name(dtype)})"
