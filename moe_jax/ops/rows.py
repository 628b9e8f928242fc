"""Row gather, the copy at the heart of expert-parallel dispatch and combine.

Legend: N source rows, M output rows, D width.

`gather_rows(x_ND, rows_M)` is `out[i] = x[rows[i]]`, with zeros where `rows[i]` is outside
`[0, N)` (by convention -1 marks "no row"). Backends as for the grouped GEMM:

- `pallas_triton`: `kernels.gather_rows_pallas`, one vector load and store per row. On an H200
  (jax 0.11.2) it copied 40960 rows of 4096 bf16 in 172 us (3.5 TB/s), where XLA's gather of the
  same rows took 245 us, and 285 us inside the EP loop, where XLA fused the index arithmetic into
  every element of the gather (`scratch` probes summarised in
  benchmarks/results/2026-11-30-h200x2-ep-breakdown-2.md).
- `xla`: `jnp` indexing and a select; what `auto` picks off GPU.

Differentiable in `x_ND`. The backward is a scatter-add of the output cotangent into the source
rows (rows used twice get both contributions); when the caller knows the gather is injective it
passes `inverse_N` (`inverse_N[rows[i]] = i`, -1 for source rows no output reads) and the backward
is the gather `gather_rows(g_MD, inverse_N)`, with no atomics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops import kernels as _kernels
from moe_jax.ops.backends import BackendName, _on_gpu, resolve_backend

__all__ = ["gather_rows", "gather_rows_reference"]

_BLOCK_ROWS = 8  # rows per program; 4-16 were within 5% on an H200 at prefill sizes
_BLOCK_D = 512  # bf16: one 16-byte access per thread of 2 warps
_NUM_WARPS = 2
_INT32_LIMIT = 2**31


def _xla_gather(x_ND, rows_M):
    ok_M = (rows_M >= 0) & (rows_M < x_ND.shape[0])
    return jnp.where(ok_M[:, None], x_ND[jnp.where(ok_M, rows_M, 0)], jnp.zeros((), x_ND.dtype))


def _pallas_gather(x_ND, rows_M):
    n, d = x_ND.shape
    if max(n, rows_M.shape[0]) * d >= _INT32_LIMIT:  # the kernel's offsets are int32
        return _xla_gather(x_ND, rows_M)
    return _kernels.gather_rows_pallas(
        x_ND, rows_M, block_rows=_BLOCK_ROWS, block_d=min(_BLOCK_D, _kernels._pow2_at_least(d)),
        num_warps=_NUM_WARPS, interpret=not _on_gpu(),
    )


_IMPLS = {"pallas_triton": _pallas_gather, "xla": _xla_gather}


def _check(x_ND, rows_M, inverse_N):
    if x_ND.ndim != 2:
        raise ValueError(f"x_ND must be [N, D]; got shape {tuple(x_ND.shape)}.")
    for name, a, size in (("rows_M", rows_M, None), ("inverse_N", inverse_N, x_ND.shape[0])):
        if a is None:
            continue
        if a.ndim != 1 or (size is not None and a.shape[0] != size):
            want = "[M]" if size is None else f"[N] = ({size},)"
            raise ValueError(f"{name} must be a 1-D int array {want}; got shape {tuple(a.shape)}.")
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"{name} must hold integer row ids; got dtype {a.dtype}.")


def gather_rows(
    x_ND: jax.Array, rows_M: jax.Array, *, inverse_N: jax.Array | None = None,
    backend: BackendName = "auto",
) -> jax.Array:
    """`out_MD[i] = x_ND[rows_M[i]]`, zero where `rows_M[i]` is outside `[0, N)`.

    Args:
      x_ND: `[N, D]` source rows, any float dtype.
      rows_M: int `[M]` source row of each output row; -1 (or any id outside `[0, N)`) gives a
        zero row.
      inverse_N: optional int `[N]`, only for a gather that reads each source row at most once:
        `inverse_N[n]` is the output row that reads row n, -1 if none. Makes the backward a
        gather instead of a scatter-add. Not checked: a wrong inverse gives wrong gradients.
      backend: `"auto"` (Pallas on GPU, XLA elsewhere), `"pallas_triton"` or `"xla"`.

    Returns `[M, D]` in `x_ND.dtype`.
    """
    _check(x_ND, rows_M, inverse_N)
    impl = _IMPLS[resolve_backend(backend)]
    num_rows, width = x_ND.shape
    rows_M = rows_M.astype(jnp.int32)
    inverse_N = None if inverse_N is None else inverse_N.astype(jnp.int32)
    if rows_M.shape[0] == 0 or width == 0:
        return jnp.zeros((rows_M.shape[0], width), x_ND.dtype)

    @jax.custom_vjp
    def gather(x, rows, inverse):
        return impl(x, rows)

    def forward(x, rows, inverse):
        return gather(x, rows, inverse), (rows, inverse)

    def backward(res, g_MD):
        rows, inverse = res
        if inverse is not None:
            return impl(g_MD, inverse), None, None
        dest = jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)  # out of range: dropped
        return jnp.zeros((num_rows, width), g_MD.dtype).at[dest].add(g_MD, mode="drop"), None, None

    gather.defvjp(forward, backward)
    return gather(x_ND, rows_M, inverse_N)


def gather_rows_reference(
    x_ND: jax.Array, rows_M: jax.Array, *, inverse_N: jax.Array | None = None,
    backend: BackendName = "auto",
) -> jax.Array:
    """fp32 `gather_rows` by one-hot matmul (memory `M*N`: tests and small shapes only);
    `inverse_N` and `backend` are accepted for the signature and ignored."""
    del inverse_N, backend
    onehot_MN = (rows_M[:, None] == jnp.arange(x_ND.shape[0])[None, :]).astype(jnp.float32)
    return jnp.dot(onehot_MN, x_ND.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
