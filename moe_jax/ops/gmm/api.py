"""Public grouped-GEMM ops: `gmm`, `tgmm` and the differentiable `grouped_linear`.

Legend: M packed rows, K input width, N output width, E groups (experts).

Contract (all backends):
- Rows of `lhs` are grouped contiguously in group order; group e owns
  `[sum(group_sizes[:e]), sum(group_sizes[:e+1]))`. Empty groups are legal and skipped.
- Rows past `sum(group_sizes)` come out zero (`gmm`) and contribute nothing (`tgmm`).
- Accumulation is fp32; inputs bf16/fp16/fp32 of one dtype; the output has the input dtype unless
  `preferred_element_type` says otherwise. fp32 inputs use full fp32 products (`Precision.HIGHEST`)
  unless `precision` asks for TF32 (`Precision.DEFAULT`/`HIGH`).

Under a mesh with Explicit axes, sharded operands are gathered to replicated first (the groups
are global row ranges; see `moe_jax.ops.sharding`); inside `jax.shard_map` the ops run per device.

Checks: shapes, ranks and dtypes always raise `ValueError`/`TypeError` naming the argument. When
`group_sizes` is concrete (not traced), negative sizes or a total past M raise `ValueError`. Under
`jit` they cannot be checked without a host round trip, so the ops clamp instead: negative sizes
count as zero and rows past M are dropped from the last groups. No memory outside the operands is
ever touched, but such a result is not meaningful; validate routing upstream.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.ops.gather import sum_of_readers
from moe_jax.ops.gmm import backends  # noqa: F401  (registers the backends)
from moe_jax.ops.gmm.backend_table import gemm_backend
from moe_jax.ops.gmm.config import GmmConfig, TileConfig
from moe_jax.ops.gmm.mosaic import MosaicConfig, MosaicWgradConfig
from moe_jax.ops.gmm.selector import SelectorTable, selector_table
from moe_jax.ops.platform import BackendName, implementation, resolve_backend
from moe_jax.ops.sharding import replicate_explicit

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _check_array(name: str, x, ndim: int, what: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax array {what}; got {type(x).__name__}.")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {what}; got shape {tuple(x.shape)}.")


def _check_float(name: str, x):
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}.dtype={x.dtype} is not supported; use bfloat16, float16 or float32.")


def _check_group_sizes(group_sizes, num_groups: int, num_rows: int, expert_arg: str):
    _check_array("group_sizes", group_sizes, 1, "[E] of int32 row counts")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array; got dtype {group_sizes.dtype}.")
    if group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes has {group_sizes.shape[0]} entries but {expert_arg} has {num_groups} groups; "
            "pass one row count per group."
        )
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes must be >= 0; got negative entries at {np.flatnonzero(sizes < 0).tolist()}.")
    if sizes.sum() > num_rows:
        raise ValueError(
            f"group_sizes sum to {int(sizes.sum())} but lhs has only {num_rows} rows; "
            "the groups must fit in the packed rows."
        )


def _check_row_ids(name: str, ids) -> None:
    _check_array(name, ids, 1, "[M] of int source-row ids")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array [M] of source-row ids; got dtype {ids.dtype}.")


def _check_config(name: str, config, allowed: tuple) -> None:
    if config is not None and not isinstance(config, allowed):
        want = " or ".join(t.__name__ for t in allowed)
        auto = ", 'auto' (the on-device selector)" if SelectorTable in allowed else ""
        raise TypeError(f"{name} must be a {want}{auto} or None (the per-shape table); got {config!r}.")


def _gmm_choice(config, n: int, k: int, num_groups: int):
    """`config` of `gmm`, with `"auto"` resolved to the tuned selector table of this shape."""
    if isinstance(config, str) and config == "auto":
        return selector_table(n, k, num_groups)
    _check_config("config", config, (GmmConfig, TileConfig, SelectorTable, MosaicConfig))
    return config


def _default_precision(dtype, precision):
    if precision is not None:
        return precision
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _primitive(name: str, impl, *arrays):
    """`impl(*arrays)` as an op that `jax.vmap` maps element by element (`lax.map`: neither
    `ragged_dot` nor the kernels batch over a leading axis) and that autodiff refuses with the fix
    (the differentiable form is `grouped_linear`; the backends have no derivative rules)."""

    @jax.custom_jvp
    @jax.custom_batching.custom_vmap
    def op(*arrays):
        return impl(*arrays)

    @op.def_vmap
    def op_vmap(axis_size, in_batched, *arrays):
        del axis_size
        mapped = [a for a, batched in zip(arrays, in_batched) if batched]

        def one(elements):
            it = iter(elements)
            return impl(*(next(it) if batched else a for a, batched in zip(arrays, in_batched)))

        return jax.lax.map(one, mapped), True

    @op.defjvp
    def op_jvp(primals, tangents):
        raise TypeError(
            f"moe_jax.ops.{name} is not differentiable; use moe_jax.ops.grouped_linear (x @ w^T per group, with "
            "a custom VJP whose backward runs gmm and tgmm) for gradients."
        )

    return op(*arrays)


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = True,
    config: GmmConfig | TileConfig | SelectorTable | str | None = None,
    backend: BackendName = "auto",
    preferred_element_type=None,
    precision: jax.lax.Precision | None = None,
    row_ids: jax.Array | None = None,
) -> jax.Array:
    """Grouped GEMM: `out[M,N]`, rows of group e are `lhs_e @ rhs[e]^T`.

    Args:
      lhs: `[M, K]` rows grouped contiguously by group; with `row_ids`, `[T, K]` source rows.
      rhs: `[E, N, K]` (default, the linear-layer "NT" layout) or, with `transpose_rhs=False`,
        `[E, K, N]` (rows of group e are `lhs_e @ rhs[e]`).
      group_sizes: `[E]` integer rows per group.
      config: the Pallas backend's kernel: a `GmmConfig` (kernel family and tiles), a
        `TileConfig` (the row-tile family), a `SelectorTable` or `"auto"` (the on-device selector,
        `moe_jax.ops.gmm.selector`: a candidate picked from `group_sizes` inside the program);
        default None: the static `gmm_config` table.
      backend: `auto` (on GPU the per-kernel table of `backend_table`: Pallas for the forward,
        official Triton for the input gradient at prefill sizes; XLA elsewhere), `pallas_triton`,
        `triton` (GPU only) or `xla`.
      preferred_element_type: output dtype (default: `lhs.dtype`).
      precision: dot precision for fp32 inputs (default HIGHEST).
      row_ids: optional int `[M]`: packed row i is `lhs[row_ids[i]]` (zeros for ids outside
        `[0, T)`), i.e. `gmm(gather_rows(lhs, row_ids), ...)` with the gather fused into the
        GEMM's operand loads where the backend's kernel can (`backends`).
    """
    _check_array("lhs", lhs, 2, "[T, K]" if row_ids is not None else "[M, K]")
    _check_array("rhs", rhs, 3, "[E, N, K]" if transpose_rhs else "[E, K, N]")
    _check_float("lhs", lhs)
    _check_float("rhs", rhs)
    if lhs.dtype != rhs.dtype:
        raise TypeError(
            f"lhs.dtype={lhs.dtype} and rhs.dtype={rhs.dtype} differ; cast one, e.g. rhs.astype(lhs.dtype)."
        )
    m, k = lhs.shape
    if row_ids is not None:
        _check_row_ids("row_ids", row_ids)
        m = row_ids.shape[0]
    num_groups = rhs.shape[0]
    rhs_k, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
    if rhs_k != k:
        raise ValueError(
            f"lhs has K={k} columns but rhs {'[E, N, K]' if transpose_rhs else '[E, K, N]'} has K={rhs_k} "
            f"(rhs.shape={tuple(rhs.shape)}); check transpose_rhs."
        )
    if num_groups == 0:
        raise ValueError("rhs has zero groups (E=0); a grouped GEMM needs at least one group.")
    _check_group_sizes(group_sizes, num_groups, m, "rhs")
    config = _gmm_choice(config, n, k, num_groups)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if m == 0 or n == 0 or k == 0 or lhs.shape[0] == 0:  # no rows, or no source rows to read
        return jnp.zeros((m, n), out_dtype)
    backend = gemm_backend("gmm_nt" if transpose_rhs else "gmm_nn", backend, m, num_groups,
                           operands=(n, k, lhs.dtype, out_dtype))
    impl = functools.partial(implementation("gmm", backend), transpose_rhs=transpose_rhs, config=config,
                             out_dtype=out_dtype, precision=_default_precision(lhs.dtype, precision))
    if row_ids is None:
        return _primitive("gmm", impl, *replicate_explicit(lhs, rhs, group_sizes))
    return _primitive("gmm", lambda lhs, rhs, sizes, ids: impl(lhs, rhs, sizes, row_ids=ids),
                      *replicate_explicit(lhs, rhs, group_sizes, row_ids.astype(jnp.int32)))


def tgmm(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    config: TileConfig | None = None,
    backend: BackendName = "auto",
    preferred_element_type=None,
    precision: jax.lax.Precision | None = None,
    row_ids: jax.Array | None = None,
) -> jax.Array:
    """Grouped transposed GEMM (weight gradient): `out[E,N,K]`, `out[e] = dout_e^T @ lhs_e`.

    Args:
      lhs: `[M, K]` the forward input rows, grouped by group; with `row_ids`, `[T, K]` source rows.
      dout: `[M, N]` the gradient of the forward output, same row grouping.
      group_sizes: `[E]` integer rows per group. An empty group's slice is exactly zero.
      row_ids: optional int `[M]`: row i of the groups is `lhs[row_ids[i]]` (zeros for ids outside
        `[0, T)`), as in `gmm`: the rows the forward read through the same ids.
    """
    _check_array("lhs", lhs, 2, "[T, K]" if row_ids is not None else "[M, K]")
    _check_array("dout", dout, 2, "[M, N]")
    _check_float("lhs", lhs)
    _check_float("dout", dout)
    if lhs.dtype != dout.dtype:
        raise TypeError(f"lhs.dtype={lhs.dtype} and dout.dtype={dout.dtype} differ; cast one to the other.")
    if row_ids is not None:
        _check_row_ids("row_ids", row_ids)
        if row_ids.shape[0] != dout.shape[0]:
            raise ValueError(f"row_ids has {row_ids.shape[0]} rows but dout has {dout.shape[0]}; they must match.")
    elif lhs.shape[0] != dout.shape[0]:
        raise ValueError(f"lhs has {lhs.shape[0]} rows but dout has {dout.shape[0]}; they must match.")
    if group_sizes is None or not hasattr(group_sizes, "shape"):
        raise TypeError("group_sizes must be a jax integer array [E].")
    m, k = dout.shape[0], lhs.shape[1]
    n = dout.shape[1]
    num_groups = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
    _check_group_sizes(group_sizes, num_groups, m, "group_sizes")
    if num_groups == 0:
        raise ValueError("group_sizes is empty (E=0); a grouped GEMM needs at least one group.")
    _check_config("config", config, (TileConfig, MosaicWgradConfig))
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if m == 0 or n == 0 or k == 0 or lhs.shape[0] == 0:  # no rows, or no source rows to read
        return jnp.zeros((num_groups, n, k), out_dtype)
    impl = functools.partial(implementation("tgmm", gemm_backend("tgmm", backend, m, num_groups)), config=config,
                             out_dtype=out_dtype,
                             precision=_default_precision(lhs.dtype, precision))
    if row_ids is None:
        return _primitive("tgmm", impl, *replicate_explicit(lhs, dout, group_sizes))
    return _primitive("tgmm", lambda lhs, dout, sizes, ids: impl(lhs, dout, sizes, row_ids=ids),
                      *replicate_explicit(lhs, dout, group_sizes, row_ids.astype(jnp.int32)))


@dataclasses.dataclass(frozen=True)
class _LinearOptions:
    backend: str
    precision: jax.lax.Precision | None
    fwd_config: GmmConfig | TileConfig | SelectorTable | str | None
    dgrad_config: GmmConfig | TileConfig | SelectorTable | str | None
    wgrad_config: TileConfig | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_linear(opts: _LinearOptions, x, w, group_sizes):
    return gmm(x, w, group_sizes, config=opts.fwd_config, backend=opts.backend, precision=opts.precision)


def _grouped_linear_fwd(opts, x, w, group_sizes):
    return _grouped_linear(opts, x, w, group_sizes), (x, w, group_sizes)


def _grouped_linear_bwd(opts, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    # dX = dY W: the same [E, N, K] weights read as [E, K=N', N=K'], no transposed copy.
    dx = gmm(dy, w, group_sizes, transpose_rhs=False, config=opts.dgrad_config, backend=opts.backend,
             precision=opts.precision)
    dw = tgmm(x, dy, group_sizes, config=opts.wgrad_config, backend=opts.backend,
              preferred_element_type=w.dtype, precision=opts.precision)
    return dx, dw, None


_grouped_linear.defvjp(_grouped_linear_fwd, _grouped_linear_bwd)


class RowGather(NamedTuple):
    """Rows of `grouped_linear` read from a source `x` `[T, K]`: packed row i is `x[ids_M[i]]`
    (zeros for ids outside `[0, T)`). `readers_TK[t]` lists the packed rows that read source row
    t (-1 in unused entries), as `moe_jax.ops.gather_rows`'s `inverse_N`: the input gradient sums
    them in fp32, in a fixed order (no atomics). Not checked: a wrong inverse gives wrong
    gradients."""

    ids_M: jax.Array  # int [M]
    readers_TK: jax.Array  # int [T, K]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered_linear(opts: _LinearOptions, x, w, group_sizes, rows):
    return gmm(x, w, group_sizes, config=opts.fwd_config, backend=opts.backend, precision=opts.precision,
               row_ids=rows.ids_M)


def _gathered_linear_fwd(opts, x, w, group_sizes, rows):
    return _gathered_linear(opts, x, w, group_sizes, rows), (x, w, group_sizes, rows)


def _gathered_linear_bwd(opts, res, dy):
    x, w, group_sizes, rows = res
    dy = dy.astype(x.dtype)
    dx_M = gmm(dy, w, group_sizes, transpose_rhs=False, config=opts.dgrad_config, backend=opts.backend,
               precision=opts.precision)
    # The weight gradient reads the rows through the ids too: no packed copy exists at any point.
    dw = tgmm(x, dy, group_sizes, config=opts.wgrad_config, backend=opts.backend, preferred_element_type=w.dtype,
              precision=opts.precision, row_ids=rows.ids_M)
    return sum_of_readers(dx_M, rows.readers_TK), dw, None, None


_gathered_linear.defvjp(_gathered_linear_fwd, _gathered_linear_bwd)


def grouped_linear(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: BackendName = "auto",
    precision: jax.lax.Precision | None = None,
    fwd_config: GmmConfig | TileConfig | SelectorTable | str | None = None,
    dgrad_config: GmmConfig | TileConfig | SelectorTable | str | None = None,
    wgrad_config: TileConfig | None = None,
    rows: RowGather | None = None,
) -> jax.Array:
    """Differentiable grouped linear layer: `y[M,N]`, rows of group e are `x_e @ w[e]^T`.

    `x`: `[M, K]` grouped rows; `w`: `[E, N, K]` (one linear weight per group); `group_sizes`:
    `[E]` integers (not differentiated). Backward: `dx = gmm(dy, w)` with `w` read as `[E, K, N]`,
    `dw = tgmm(x, dy)`; the gradient of an empty group's weight is exactly zero. Rows past
    `sum(group_sizes)` get zero output and zero gradient.

    `rows` (a `RowGather`): `x` is `[T, K]` and the grouped rows are `x[rows.ids_M]`, read through
    the ids by the forward `gmm` and the weight-gradient `tgmm` (`row_ids=`), so no packed copy is
    ever written; the input gradient sums each source row's readers in fp32 in a fixed order
    (`moe_jax.ops.gather.sum_of_readers`). Equal to `grouped_linear` on
    `gather_rows(x, rows.ids_M, inverse_N=rows.readers_TK)`.
    """
    resolve_backend(backend)  # ValueError naming the choices; `auto` is resolved per kernel
    opts = _LinearOptions(backend, precision, fwd_config, dgrad_config, wgrad_config)
    if rows is None:
        return _grouped_linear(opts, *replicate_explicit(x, w, group_sizes))
    if not isinstance(rows, RowGather):
        raise TypeError(f"rows must be a moe_jax.ops.RowGather(ids_M, readers_TK) or None; got {type(rows).__name__}.")
    _check_row_ids("rows.ids_M", rows.ids_M)
    if rows.readers_TK.ndim != 2 or rows.readers_TK.shape[0] != x.shape[0]:
        raise ValueError(f"rows.readers_TK must be [T, K] with T = x.shape[0] = {x.shape[0]}; got shape "
                         f"{tuple(rows.readers_TK.shape)}.")
    return _gathered_linear(opts, *replicate_explicit(x, w, group_sizes), RowGather(*replicate_explicit(*rows)))
