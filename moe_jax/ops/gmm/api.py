"""Public grouped-GEMM ops: `gmm`, `tgmm` and the differentiable `grouped_linear`. Each call checks
its arguments, takes a `Plan` (`moe_jax.ops.gmm.plan`, or one passed in) and runs it on the plan's
backend (`moe_jax.ops.gmm.registry`).

Legend: M packed rows, K input width, N output width, E groups (experts), T source rows.

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
`jit` they cannot be checked without a host round trip, so every backend clamps them the same
way, whatever their integer dtype (signed or unsigned, 32 or 64 bits): negative sizes count as
zero and rows past M are dropped from the last groups. No memory outside the operands is ever
touched, but such a result is not meaningful; validate routing upstream.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.ops.gather import sum_of_readers
from moe_jax.ops.gmm.plan import LinearPlan, plan, plan_linear
from moe_jax.ops.gmm.problem import Plan, resolved_problem
from moe_jax.ops.gmm.registry import GEMM_BACKENDS
from moe_jax.ops.platform import BackendName, BackendTable
from moe_jax.ops.sharding import replicate_explicit

__all__ = ["RowGather", "SUPPORTED_DTYPES", "as_primitive", "check_group_sizes", "check_row_ids", "check_rows", "gmm",
           "grouped_linear", "tgmm"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _check_array(name: str, x, ndim: int, what: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax array {what}; got {type(x).__name__}.")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {what}; got shape {tuple(x.shape)}.")


def _check_float(name: str, x):
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}.dtype={x.dtype} is not supported; use bfloat16, float16 or float32.")


def check_group_sizes(group_sizes, num_groups: int, num_rows: int, expert_arg: str):
    _check_array("group_sizes", group_sizes, 1, "[E] of integer row counts")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array; got dtype {group_sizes.dtype}.")
    if group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes has {group_sizes.shape[0]} entries but {expert_arg} has {num_groups} groups; "
            "pass one row count per group."
        )
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes).astype(np.int64)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes must be >= 0; got negative entries at {np.flatnonzero(sizes < 0).tolist()}.")
    if sizes.sum() > num_rows:
        raise ValueError(
            f"group_sizes sum to {int(sizes.sum())} but lhs has only {num_rows} rows; "
            "the groups must fit in the packed rows."
        )


def check_row_ids(name: str, ids) -> None:
    _check_array(name, ids, 1, "[M] of int source-row ids")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array [M] of source-row ids; got dtype {ids.dtype}.")


def _checked_plan(given: Plan | None, problem, backend, config) -> Plan:
    """`given` where it plans exactly `problem` (ValueError otherwise), else `plan(...)`."""
    if given is None:
        return plan(problem, backend, config)
    if not isinstance(given, Plan):
        raise TypeError(f"plan must be a moe_jax.ops.Plan (from moe_jax.ops.plan or plan_linear) or None; got "
                        f"{type(given).__name__}.")
    if given.problem != problem:
        raise ValueError(f"plan is for {given.problem.describe()} but the call is {problem.describe()}; make the plan "
                         "from this call's shapes and dtypes.")
    return given


def as_primitive(name: str, impl, *arrays, differentiable: str = "grouped_linear"):
    """`impl(*arrays)` as an op that `jax.vmap` maps element by element (`lax.map`: neither
    `ragged_dot` nor the kernels batch over a leading axis) and that autodiff refuses with the fix
    (the differentiable form, `moe_jax.ops.<differentiable>`; the backends have no derivative
    rules)."""

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
            f"moe_jax.ops.{name} is not differentiable; use moe_jax.ops.{differentiable} (x @ w^T per group, with "
            "a custom VJP) for gradients."
        )

    return op(*arrays)


def _run(name: str, gemm_plan: Plan, lhs, other, group_sizes, row_ids):
    """`gemm_plan` on its backend, as a primitive (`as_primitive`), on replicated Explicit operands."""
    backend = GEMM_BACKENDS[gemm_plan.backend]
    if row_ids is None:
        return as_primitive(name, lambda a, b, s: backend.run(gemm_plan, a, b, s, None),
                          *replicate_explicit(lhs, other, group_sizes))
    return as_primitive(name, lambda a, b, s, ids: backend.run(gemm_plan, a, b, s, ids),
                      *replicate_explicit(lhs, other, group_sizes, row_ids.astype(jnp.int32)))


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = True,
    config=None,
    backend: BackendName | BackendTable = "auto",
    preferred_element_type=None,
    precision: jax.lax.Precision | None = None,
    row_ids: jax.Array | None = None,
    plan: Plan | None = None,
) -> jax.Array:
    """Grouped GEMM: `out[M,N]`, rows of group e are `lhs_e @ rhs[e]^T`.

    Args:
      lhs: `[M, K]` rows grouped contiguously by group; with `row_ids`, `[T, K]` source rows.
      rhs: `[E, N, K]` (default, the linear-layer "NT" layout) or, with `transpose_rhs=False`,
        `[E, K, N]` (rows of group e are `lhs_e @ rhs[e]`).
      group_sizes: `[E]` integer rows per group.
      config: the kernel: None (the backend's static choice), `"auto"` (its on-device choice:
        `pallas_triton`'s selector picks a candidate from `group_sizes` inside the program), or a
        backend's configuration: `GmmConfig`, `TileConfig` or `SelectorTable` (`pallas_triton`),
        `TileConfig` (`triton`), `MosaicConfig` (`mosaic_gpu`). A configuration the backend does not
        take is a TypeError; one that does not fit the device's shared memory a ValueError.
      backend: `auto` (on GPU the per-kernel table of `moe_jax.ops.gmm.plan`; XLA elsewhere),
        `pallas_triton`, `triton` (GPU only), `mosaic_gpu`, `xla`, or a `BackendTable`.
      preferred_element_type: output dtype (default: `lhs.dtype`).
      precision: dot precision for fp32 inputs (default HIGHEST).
      row_ids: optional int `[M]`: packed row i is `lhs[row_ids[i]]` (zeros for ids outside
        `[0, T)`), i.e. `gmm(gather_rows(lhs, row_ids), ...)` with the gather fused into the
        GEMM's operand loads where the backend's kernel can.
      plan: a `Plan` made for this call's problem (`moe_jax.ops.plan`), instead of `backend` and
        `config`.
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
        check_row_ids("row_ids", row_ids)
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
    check_group_sizes(group_sizes, num_groups, m, "rhs")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    problem = resolved_problem("gmm_nt" if transpose_rhs else "gmm_nn", m, n, k, num_groups, lhs.dtype, out_dtype,
                               precision, gather=row_ids is not None)
    gemm_plan = _checked_plan(plan, problem, backend, config)
    if m == 0 or n == 0 or k == 0 or lhs.shape[0] == 0:  # no rows, or no source rows to read
        return jnp.zeros((m, n), out_dtype)
    return _run("gmm", gemm_plan, lhs, rhs, group_sizes, row_ids)


def tgmm(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    config=None,
    backend: BackendName | BackendTable = "auto",
    preferred_element_type=None,
    precision: jax.lax.Precision | None = None,
    row_ids: jax.Array | None = None,
    plan: Plan | None = None,
) -> jax.Array:
    """Grouped transposed GEMM (weight gradient): `out[E,N,K]`, `out[e] = dout_e^T @ lhs_e`.

    Args:
      lhs: `[M, K]` the forward input rows, grouped by group; with `row_ids`, `[T, K]` source rows.
      dout: `[M, N]` the gradient of the forward output, same row grouping.
      group_sizes: `[E]` integer rows per group. An empty group's slice is exactly zero.
      config: None or `"auto"` (the backend's rule) or a `TileConfig` (`pallas_triton`, `triton`).
      backend, preferred_element_type, precision, plan: as for `gmm`.
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
        check_row_ids("row_ids", row_ids)
        if row_ids.shape[0] != dout.shape[0]:
            raise ValueError(f"row_ids has {row_ids.shape[0]} rows but dout has {dout.shape[0]}; they must match.")
    elif lhs.shape[0] != dout.shape[0]:
        raise ValueError(f"lhs has {lhs.shape[0]} rows but dout has {dout.shape[0]}; they must match.")
    if group_sizes is None or not hasattr(group_sizes, "shape"):
        raise TypeError("group_sizes must be a jax integer array [E].")
    m, k = dout.shape[0], lhs.shape[1]
    n = dout.shape[1]
    num_groups = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
    check_group_sizes(group_sizes, num_groups, m, "group_sizes")
    if num_groups == 0:
        raise ValueError("group_sizes is empty (E=0); a grouped GEMM needs at least one group.")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    problem = resolved_problem("tgmm", m, n, k, num_groups, lhs.dtype, out_dtype, precision,
                               gather=row_ids is not None)
    gemm_plan = _checked_plan(plan, problem, backend, config)
    if m == 0 or n == 0 or k == 0 or lhs.shape[0] == 0:  # no rows, or no source rows to read
        return jnp.zeros((num_groups, n, k), out_dtype)
    return _run("tgmm", gemm_plan, lhs, dout, group_sizes, row_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_linear(plans: LinearPlan, x, w, group_sizes):
    return gmm(x, w, group_sizes, plan=plans.fwd)


def _grouped_linear_fwd(plans, x, w, group_sizes):
    return _grouped_linear(plans, x, w, group_sizes), (x, w, group_sizes)


def _grouped_linear_bwd(plans, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    # dX = dY W: the same [E, N, K] weights read as [E, K=N', N=K'], no transposed copy.
    dx = gmm(dy, w, group_sizes, transpose_rhs=False, plan=plans.dgrad)
    dw = tgmm(x, dy, group_sizes, preferred_element_type=w.dtype, plan=plans.wgrad)
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


def check_rows(rows, num_source_rows: int) -> None:
    """TypeError unless `rows` is a `RowGather`; ValueError for ids that are not an int vector or
    readers that are not `[T, K]` over the `num_source_rows` rows of `x` (the ids' values and the
    readers' agreement with them are not checked)."""
    if not isinstance(rows, RowGather):
        raise TypeError(f"rows must be a moe_jax.ops.RowGather(ids_M, readers_TK) or None; got {type(rows).__name__}.")
    check_row_ids("rows.ids_M", rows.ids_M)
    if rows.readers_TK.ndim != 2 or rows.readers_TK.shape[0] != num_source_rows:
        raise ValueError(f"rows.readers_TK must be [T, K] with T = x.shape[0] = {num_source_rows}; got shape "
                         f"{tuple(rows.readers_TK.shape)}.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered_linear(plans: LinearPlan, x, w, group_sizes, rows):
    return gmm(x, w, group_sizes, row_ids=rows.ids_M, plan=plans.fwd)


def _gathered_linear_fwd(plans, x, w, group_sizes, rows):
    return _gathered_linear(plans, x, w, group_sizes, rows), (x, w, group_sizes, rows)


def _gathered_linear_bwd(plans, res, dy):
    x, w, group_sizes, rows = res
    dy = dy.astype(x.dtype)
    dx_M = gmm(dy, w, group_sizes, transpose_rhs=False, plan=plans.dgrad)
    # The weight gradient reads the rows through the ids too: no packed copy exists at any point.
    dw = tgmm(x, dy, group_sizes, preferred_element_type=w.dtype, row_ids=rows.ids_M, plan=plans.wgrad)
    return sum_of_readers(dx_M, rows.readers_TK), dw, None, None


_gathered_linear.defvjp(_gathered_linear_fwd, _gathered_linear_bwd)


def grouped_linear(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: BackendName | BackendTable = "auto",
    precision: jax.lax.Precision | None = None,
    fwd_config=None,
    dgrad_config=None,
    wgrad_config=None,
    rows: RowGather | None = None,
    plans: LinearPlan | None = None,
) -> jax.Array:
    """Differentiable grouped linear layer: `y[M,N]`, rows of group e are `x_e @ w[e]^T`.

    `x`: `[M, K]` grouped rows; `w`: `[E, N, K]` (one linear weight per group); `group_sizes`:
    `[E]` integers (not differentiated). Backward: `dx = gmm(dy, w)` with `w` read as `[E, K, N]`,
    `dw = tgmm(x, dy)`; the gradient of an empty group's weight is exactly zero. Rows past
    `sum(group_sizes)` get zero output and zero gradient.

    The three GEMMs run `plans` (a `LinearPlan` from `moe_jax.ops.plan_linear` for these shapes),
    or the plans of `backend`, `precision` and the three configs (`gmm`'s `config`).

    `rows` (a `RowGather`): `x` is `[T, K]` and the grouped rows are `x[rows.ids_M]`, read through
    the ids by the forward `gmm` and the weight-gradient `tgmm` (`row_ids=`), so no packed copy is
    ever written; the input gradient sums each source row's readers in fp32 in a fixed order
    (`moe_jax.ops.gather.sum_of_readers`). Equal to `grouped_linear` on
    `gather_rows(x, rows.ids_M, inverse_N=rows.readers_TK)`.
    """
    _check_array("x", x, 2, "[T, K]" if rows is not None else "[M, K]")
    _check_array("w", w, 3, "[E, N, K]")
    if rows is not None:
        check_rows(rows, x.shape[0])
    num_rows = x.shape[0] if rows is None else rows.ids_M.shape[0]
    if plans is None:
        _check_float("x", x)
        plans = plan_linear(num_rows, tuple(w.shape), x.dtype, backend=backend, precision=precision,
                            fwd_config=fwd_config, dgrad_config=dgrad_config, wgrad_config=wgrad_config,
                            gather=rows is not None)
    elif not isinstance(plans, LinearPlan):
        raise TypeError(f"plans must be a moe_jax.ops.LinearPlan (from plan_linear) or None; got {type(plans).__name__}.")
    if rows is None:
        return _grouped_linear(plans, *replicate_explicit(x, w, group_sizes))
    return _gathered_linear(plans, *replicate_explicit(x, w, group_sizes), RowGather(*replicate_explicit(*rows)))
