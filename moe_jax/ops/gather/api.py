"""Row gather, the copy at the heart of packing and of expert-parallel dispatch and combine.

Legend: N source rows, M output rows, D width, K readers per source row.

`gather_rows(x_ND, rows_M)` is `out[i] = x[rows[i]]`, with zeros where `rows[i]` is outside
`[0, N)` (by convention -1 marks "no row"); `x_ND` may be a tuple of arrays read as their
concatenation. Backends (`backends`): `pallas_triton` (`kernel.gather_rows_pallas`, one vector
load and store per row, one launch per source) and `xla` (`jnp` indexing and a select); on an
H200 the kernel copied rows about 1.4x faster than XLA's gather (docs/decisions.md).

Differentiable in `x_ND`. Without more information the backward is a scatter-add of the output
cotangent into the source rows (rows used twice get both contributions), whose order of additions
XLA does not fix. A caller that knows who reads each source row passes `inverse_N`:

- `[N]`, for a gather that reads each source row at most once (`inverse_N[rows[i]] = i`, -1 for
  rows no output reads): the backward is the gather `gather_rows(g_MD, inverse_N)`.
- `[N, K]`, for a row read up to K times (a token's K routes): `inverse_N[n]` lists the output
  rows that read row n, -1 in unused entries. The backward gathers those K rows and sums them in
  float32: no atomics, the same result every run, one rounding per element.

With several sources the inverse can be given per source (a tuple with None for a source whose
backward should stay a scatter-add).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.gather import backends  # noqa: F401  (registers the two backends)
from moe_jax.ops.platform import BackendName, implementation
from moe_jax.ops.sharding import replicate_explicit, vary_to_union

__all__ = ["gather_rows", "sum_of_readers"]


def _sources(x_ND) -> tuple[jax.Array, ...]:
    xs = tuple(x_ND) if isinstance(x_ND, (tuple, list)) else (x_ND,)
    if not xs:
        raise ValueError("x_ND must be an [N, D] array or a non-empty tuple of them; got an empty tuple.")
    for x in xs:
        if x.ndim != 2:
            raise ValueError(f"x_ND must be [N, D] (or a tuple of [N_i, D]); got shape {tuple(x.shape)}.")
        if x.shape[1] != xs[0].shape[1] or x.dtype != xs[0].dtype:
            raise ValueError(
                "the sources in x_ND must share the width D and the dtype; got "
                + ", ".join(f"{tuple(y.shape)} {y.dtype}" for y in xs) + "."
            )
    return xs


def _inverses(inverse_N, sizes) -> tuple:
    """One inverse (or None) per source, int32, from `gather_rows`'s `inverse_N` argument."""
    if inverse_N is None:
        return (None,) * len(sizes)
    if not isinstance(inverse_N, (tuple, list)):
        _check_ids("inverse_N", inverse_N, sum(sizes), readers=True)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        inverse_N = tuple(inverse_N[start:start + size] for start, size in zip(starts, sizes))
    elif len(inverse_N) != len(sizes):
        raise ValueError(
            f"inverse_N as a tuple needs one entry (an array or None) per source: {len(sizes)} sources, "
            f"got {len(inverse_N)} entries."
        )
    for i, (inverse, size) in enumerate(zip(inverse_N, sizes)):
        if inverse is not None:
            _check_ids(f"inverse_N[{i}]", inverse, size, readers=True)
    return tuple(None if inverse is None else inverse.astype(jnp.int32) for inverse in inverse_N)


def sum_of_readers(g_MD: jax.Array, readers_NK: jax.Array) -> jax.Array:
    """`out[n] = sum_k g_MD[readers_NK[n, k]]` over the entries in `[0, M)`, summed in float32 in a
    fixed order; `[N, D]` in `g_MD.dtype`. The backward of `gather_rows` with an `[N, K]`
    `inverse_N`, for callers that read rows through ids without a `gather_rows` of their own
    (`moe_jax.ops.grouped_linear(rows=...)`)."""
    # Materialised once: fused into the sum, XLA would recompute the index arithmetic per element
    # (docs/decisions.md, "index arithmetic behind a barrier").
    readers_NK = jax.lax.optimization_barrier(readers_NK)
    ok_NK = (readers_NK >= 0) & (readers_NK < g_MD.shape[0])
    g_NKD = g_MD[jnp.where(ok_NK, readers_NK, 0)].astype(jnp.float32)
    return jnp.sum(jnp.where(ok_NK[:, :, None], g_NKD, 0.0), axis=1).astype(g_MD.dtype)


def _check_ids(name, a, size, *, readers: bool = False):
    if not (a.ndim == 1 or (readers and a.ndim == 2)) or (size is not None and a.shape[0] != size):
        want = "[M]" if size is None else f"[N] = ({size},)" + (f" or [N, K] = ({size}, K)" if readers else "")
        raise ValueError(f"{name} must be a{' 1-D' if not readers else 'n'} int array {want}; got shape "
                         f"{tuple(a.shape)}.")
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer row ids; got dtype {a.dtype}.")


def gather_rows(
    x_ND: jax.Array | tuple[jax.Array, ...], rows_M: jax.Array, *,
    inverse_N: jax.Array | tuple[jax.Array | None, ...] | None = None,
    backend: BackendName = "auto",
) -> jax.Array:
    """`out_MD[i] = x_ND[rows_M[i]]`, zero where `rows_M[i]` is outside `[0, N)`.

    Args:
      x_ND: `[N, D]` source rows, any float dtype; or a tuple of `[N_i, D]` arrays of one dtype
        standing for their concatenation (N = sum N_i), which the Pallas path never builds in
        memory (the XLA path concatenates).
      rows_M: int `[M]` source row of each output row; -1 (or any id outside `[0, N)`) gives a
        zero row.
      inverse_N: optional int `[N]`, for a gather that reads each source row at most once:
        `inverse_N[n]` is the output row that reads row n, -1 if none; or `[N, K]`: the output
        rows that read row n (-1 in unused entries), for rows read up to K times. Makes the
        backward a gather (summed over K in float32) instead of a scatter-add. Not checked: a wrong
        inverse gives wrong gradients. With a tuple of sources it may also be a tuple of per-source
        inverses, None for a source whose backward should stay a scatter-add.
      backend: `"auto"` (Pallas on GPU, XLA elsewhere), `"pallas_triton"` or `"xla"`.

    Returns `[M, D]` in the sources' dtype. Differentiable in the sources.
    """
    xs = _sources(x_ND)
    sizes = tuple(x.shape[0] for x in xs)
    _check_ids("rows_M", rows_M, None)
    inverses = _inverses(inverse_N, sizes)
    impl = implementation("gather_rows", backend)
    width, dtype = xs[0].shape[1], xs[0].dtype
    rows_M = rows_M.astype(jnp.int32)
    if rows_M.shape[0] == 0 or width == 0:
        return jnp.zeros((rows_M.shape[0], width), dtype)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    @jax.custom_vjp
    def gather(xs, rows, inverses):
        return impl(xs, rows)

    def forward(xs, rows, inverses):
        return gather(xs, rows, inverses), (rows, inverses)

    def backward(res, g_MD):
        rows, inverses = res
        grads = []
        for start, size, inverse in zip(starts, sizes, inverses):
            if size == 0:
                grads.append(jnp.zeros((0, width), g_MD.dtype))
            elif inverse is not None and inverse.ndim == 2:
                grads.append(sum_of_readers(g_MD, inverse))
            elif inverse is not None:
                grads.append(impl((g_MD,), inverse))
            else:
                local = rows - start
                dest = jnp.where((local >= 0) & (local < size), local, size)  # out of range: dropped
                grads.append(jnp.zeros((size, width), g_MD.dtype).at[dest].add(g_MD, mode="drop"))
        return tuple(grads), None, None

    gather.defvjp(forward, backward)
    # Under shard_map, a source replicated over an axis the row ids vary over (tokens replicated
    # over `ep`, routes sharded) must vary too: its gradient does, and the cast's transpose sums it.
    _, xs = vary_to_union(xs, (rows_M, *(i for i in inverses if i is not None)))
    # Explicit mesh axes: a row may be read from anywhere, so the operands are replicated first.
    xs, (rows_M,) = replicate_explicit(*xs), replicate_explicit(rows_M)
    inverses = tuple(None if i is None else replicate_explicit(i)[0] for i in inverses)
    return gather(xs, rows_M, inverses)
