"""`fp8_grouped_linear`: the differentiable grouped linear layer of the FP8 recipe; its products run
`moe_jax.ops.gmm.fp8_api.gmm_fp8` (the FP8 kernel on a GPU that has one, the reference path
elsewhere).

Legend: M packed rows, T source rows (read through row ids), K input width, N output width, E groups
(experts).

The recipe is DeepSeek-V3's blockwise FP8 (DeepSeek-AI, "DeepSeek-V3 Technical Report",
arXiv:2412.19437, section 3.3; the quantization itself is `moe_jax.ops.fp8`):

- Forward: `x` quantized per 1 x 128 tile of K (`quantize_rows`; on a GPU by the rows kernel of
  `moe_jax.ops.quantize.quantize_activations`, bit for bit), the weights per 128 x 128 block
  (`quantize_weights`, or given already quantized), `y = rows @ w^T` by the recipe. In a
  differentiated call the forward also writes the quantized master weights as `[E, K, N]`
  (`transpose_weights`), the layout the input gradient's product reads, in the quantization's own
  pass over the weights (no extra read), and the backward keeps it instead of the forward's
  layout (the same bytes), so it transposes nothing. Master weights are quantized by
  `moe_jax.ops.quantize.quantize_master_weights`: on a GPU its fused kernel (one read of the
  weights where XLA's quantization makes two), with `backend="pallas_triton"` that kernel
  interpreted off GPU, else XLA; every backend gives `quantize_weights`'s bits.
- Input gradient (`input_gradient="fp8"`, the recipe): `dy` quantized per 1 x 128 tile of N,
  `dx = dy @ w` by the recipe with the same 128 x 128 weight blocks read in the other orientation.
  With `input_gradient="master"` (master weights only), `dx = dy @ w` from the master weights in
  x's dtype on the 16-bit kernels instead: the backward keeps no e4m3 copy of the weights (the
  master weights are the step's inputs, alive anyway), so a step's peak memory holds no weight
  bytes the 16-bit layer does not, for a 16-bit input-gradient product (docs/fp8.md, "Memory").
- Weight gradient: `dw = dy^T @ rows` in x's dtype from the dequantized FP8 rows (the recipe keeps
  the FP8 rows, not `x`, for the backward: that is its activation-memory saving) and the
  unquantized `dy`: bf16 when `x` is (an FP8 weight gradient is for the kernels to measure).
- Read through row ids (`rows=RowGather(...)`, as `grouped_linear`'s): the source rows `[T, K]`
  are quantized once each, and their e4m3 bytes and scales gathered once into the packed layout
  that every weight's product reads: the packed bf16 rows are never written, a token routed to k
  experts is quantized once, not k times, and the backward keeps `T` FP8 rows instead of `M`.
- The weight quantization is passed through by a straight-through estimator: `dw` is the gradient
  of the master weights as if `quantize_weights` were the identity (as is the rows' quantization
  for `dx`).
- Quantized once for several calls (`copies=`, made by `fp8_weight_copies`): a step that
  accumulates micro-batches calls the op once per micro-batch on the same master weights, and
  each call would quantize them again; XLA's GPU compiler does not move that loop-invariant
  kernel out of the caller's loop (docs/fp8.md, "What the layer's step would need"). With the
  copies made before the loop, every call reads them instead (the same bits), and the weight
  gradient still reaches the master weights passed as `w`.
- Rows quantized already (`quantized=`, an `Fp8Rows` of x): an expert-parallel exchange that moved
  the rows in FP8 (`moe_jax.parallel.ep_moe(fp8_dispatch=True, fp8_rows=True)`) delivers the e4m3
  rows the sender quantized; the products read those instead of dequantizing and quantizing
  them again (passes over the rows that give 16-bit rows back their own e4m3 values), and the
  input gradient still goes to x.

Products: `gmm_fp8` on the caller's backend (`FP8_LINEAR_BACKENDS`): `triton` and `mosaic_gpu` are
the FP8 kernels (e4m3 tensor-core products promoted every 128 of the contraction:
`gmm_fp8_reference`'s value up to fp32 summation order within a step); `xla` and `pallas_triton`
dequantize the operands and run an fp32 `gmm` at `Precision.HIGHEST` (the reference path, slower
than bf16); `auto` is, per product, `gmm_fp8`'s choice of kernel where they run, else `xla`. The
weight gradient's `tgmm` runs in x's dtype on the backend `auto` picks for it (`triton`: its 16-bit
kernel).

Group sizes follow `grouped_linear`'s contract: empty groups are legal, rows past
`sum(group_sizes)` get zero output and zero input gradient and add nothing to the weight gradient.
Operands an Explicit mesh axis shards (outside `shard_map`) are gathered first, as the grouped
GEMM's are (`moe_jax.ops.sharding`); their gradients come back in their shardings.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.ops.fp8 import Fp8Rows, Fp8Weights, check_weights, dequantize_rows, transpose_weights
from moe_jax.ops.fp8 import check_rows as check_fp8_rows  # gmm.api's check_rows checks a RowGather
from moe_jax.ops.gather import gather_rows, sum_of_readers
from moe_jax.ops.gmm import SUPPORTED_DTYPES, RowGather, gmm, tgmm
from moe_jax.ops.gmm.api import check_rows
from moe_jax.ops.gmm.fp8_api import FP8_GEMM_BACKENDS, fp8_backend, gmm_fp8
from moe_jax.ops.quantize import quantize_activations, quantize_master_weights
from moe_jax.ops.sharding import replicate_explicit

__all__ = ["FP8_INPUT_GRADIENTS", "FP8_LINEAR_BACKENDS", "Fp8Copies", "fp8_grouped_linear", "fp8_weight_copies"]

FP8_LINEAR_BACKENDS = FP8_GEMM_BACKENDS
FP8_INPUT_GRADIENTS = ("fp8", "master")  # the recipe's FP8 product; the master weights' 16-bit one

_HI = jax.lax.Precision.HIGHEST


class Fp8Copies(NamedTuple):
    """Master weights `w` `[E, N, K]` quantized ahead of the calls that read them
    (`fp8_weight_copies`): `quantized` is `quantize_weights(w)`; `transposed` is its
    `transpose_weights` (`[E, K, N]`, what `input_gradient="fp8"` reads), or None for
    `input_gradient="master"` (whose input gradient reads `w` itself)."""

    quantized: Fp8Weights
    transposed: Fp8Weights | None


def _quantize_backend(backend):
    """The quantization kernels' backend for the products' `backend`: the Pallas kernels on a GPU
    (`auto`, and the FP8 kernel backends), interpreted off GPU only when `pallas_triton` is asked
    for; `xla` elsewhere."""
    return backend if backend in ("xla", "pallas_triton") else "auto"


def _quantize(backend, w, transposed: bool):
    """`quantize_master_weights` of `w` for the layer's `backend`. Returns `(wq, wq [E, K, N] or None)`."""
    out = quantize_master_weights(w, transposed=transposed, backend=_quantize_backend(backend))
    return out if transposed else (out, None)


def _quantize_rows(backend, x):
    """`quantize_activations` of `x` for the layer's `backend`."""
    return quantize_activations(x, backend=_quantize_backend(backend))


def _forward(backend, x, wqs, group_sizes, rows, quantized):
    """The outputs of every weight in `wqs` (quantized) and the FP8 rows they all read: `quantized`
    when given, else x quantized now."""
    # With `rows`, x's source rows: each quantized once, read by all its readers.
    fp8_rows = _quantize_rows(backend, x) if quantized is None else quantized
    packed = fp8_rows
    if rows is not None:
        # The e4m3 bytes and scales are gathered once for every weight (a quarter of the bf16 rows'
        # traffic with the scales), so each product reads packed rows on whichever kernel is fastest
        # for them (the Mosaic one reads no ids).
        packed = Fp8Rows(gather_rows(fp8_rows.values_MK, rows.ids_M), gather_rows(fp8_rows.scale_MKb, rows.ids_M))
    ys = tuple(gmm_fp8(packed, wq, group_sizes, backend=backend, out_dtype=x.dtype) for wq in wqs)
    return ys, fp8_rows


def _dgrad(backend, input_gradient, dys, kept, group_sizes, rows, x_dtype):
    """`dx`: each `dy` against its kept weight, the products added in x's dtype on the packed rows
    (as autodiff adds a reused input's cotangents), then with `rows` each source row's readers
    summed: `[T, K]`, else `[M, K]`. `"fp8"`, the recipe: `dy` quantized per 1 x 128 tile of N
    against the weights' blocks as `[E, K, N]` (`transpose_weights`); `"master"`: `dy @ w` from the
    master weights `[E, N, K]` in x's dtype on the 16-bit `gmm`."""
    dx = None
    for dy, w in zip(dys, kept):
        dy = dy.astype(x_dtype)
        if input_gradient == "fp8":
            part = gmm_fp8(_quantize_rows(backend, dy), w, group_sizes, backend=backend, out_dtype=x_dtype)
        else:
            part = gmm(dy, w.astype(x_dtype), group_sizes, transpose_rhs=False, backend=backend, precision=_HI)
        dx = part if dx is None else dx + part
    return dx if rows is None else sum_of_readers(dx, rows.readers_TK)


def _quantized(backend, ws, copies, transposed: bool):
    """`(wqs, [E, K, N] copies or Nones)`: `copies` as given, else each master weight quantized now
    (with its `[E, K, N]` copy when `transposed`)."""
    if copies is not None:
        return tuple(c.quantized for c in copies), tuple(c.transposed for c in copies)
    return tuple(zip(*(_quantize(backend, w, transposed) for w in ws)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _master_linear(backend, input_gradient, x, ws, copies, group_sizes, rows, quantized):
    return _forward(backend, x, _quantized(backend, ws, copies, False)[0], group_sizes, rows, quantized)[0]


def _master_linear_fwd(backend, input_gradient, x, ws, copies, group_sizes, rows, quantized):
    # "fp8": the backward keeps the e4m3 `[E, K, N]` copies (written by the quantization's own pass),
    # not the master weights (zero-size witnesses of their dtypes give the cotangents' dtypes);
    # "master": the master weights.
    fp8 = input_gradient == "fp8"
    wqs, copies = _quantized(backend, ws, copies, fp8)
    ys, fp8_rows = _forward(backend, x, wqs, group_sizes, rows, quantized)
    kept = copies if fp8 else ws
    witnesses = tuple(jnp.zeros((0,), w.dtype) for w in ws)
    return ys, (fp8_rows, kept, group_sizes, rows, witnesses, jnp.zeros((0,), x.dtype))


def _master_linear_bwd(backend, input_gradient, res, dys):
    fp8_rows, kept, group_sizes, rows, witnesses, x_dtype = res
    x_dtype = x_dtype.dtype
    dx = _dgrad(backend, input_gradient, dys, kept, group_sizes, rows, x_dtype)
    # dw from the dequantized FP8 rows; with `rows` the source rows are dequantized once and gathered
    # into the packed layout, so the weight gradient reads packed rows (read through ids, the bf16
    # layer's weight gradient measured 3-8% slower: docs/decisions.md, the row gather).
    rows_x = dequantize_rows(fp8_rows).astype(x_dtype)
    if rows is not None:
        rows_x = gather_rows(rows_x, rows.ids_M)
    dws = tuple(tgmm(rows_x, dy.astype(x_dtype), group_sizes, backend=backend, precision=_HI).astype(w.dtype)
                for dy, w in zip(dys, witnesses))
    # copies and quantized rows: values of w and x, no gradients of their own (they are dws and dx)
    return dx, dws, None, None, None, None


_master_linear.defvjp(_master_linear_fwd, _master_linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stored_linear(backend, x, wqs, group_sizes, rows, quantized):
    return _forward(backend, x, wqs, group_sizes, rows, quantized)[0]


def _stored_linear_fwd(backend, x, wqs, group_sizes, rows, quantized):
    # No weight gradient, so the FP8 rows are not kept.
    ys, _ = _forward(backend, x, wqs, group_sizes, rows, quantized)
    return ys, (wqs, group_sizes, rows, jnp.zeros((0,), x.dtype))


def _stored_linear_bwd(backend, res, dys):
    wqs, group_sizes, rows, x_dtype = res
    dx = _dgrad(backend, "fp8", dys, tuple(transpose_weights(wq) for wq in wqs), group_sizes, rows, x_dtype.dtype)
    # Stored FP8 weights are frozen (inference): their cotangents are zero, never an update.
    zeros = tuple(Fp8Weights(jnp.zeros_like(wq.values_ENK), jnp.zeros_like(wq.scale_ENbKb)) for wq in wqs)
    return dx, zeros, None, None, None


_stored_linear.defvjp(_stored_linear_fwd, _stored_linear_bwd)


def _check_weights(w, x) -> bool:
    """Validates one weight operand for `x`; True for stored `Fp8Weights`, False for master weights."""
    if isinstance(w, Fp8Weights):
        if check_weights(w, "w")[2] != x.shape[1]:
            raise ValueError(f"w.values_ENK: expected [E, N, K] with K = x.shape[1] = {x.shape[1]}, got "
                             f"{tuple(w.values_ENK.shape)}.")
        return True
    _check_master(w, x.shape[1])
    return False


def _check_master(w, k: int | None = None) -> jax.Array:
    """`w` as `[E, N, K]` bf16/fp16/fp32 master weights (K = `k` when given), else a ValueError or
    TypeError naming it."""
    w = jnp.asarray(w)
    if w.ndim != 3 or (k is not None and w.shape[2] != k):
        with_k = "" if k is None else f" with K = x.shape[1] = {k}"
        raise ValueError(f"w: expected [E, N, K] master weights{with_k}, got {w.shape}.")
    if jnp.dtype(w.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"w: expected bfloat16/float16/float32 master weights or an Fp8Weights, got {w.dtype}.")
    return w


def _check_copies(copies, ws, several: bool, input_gradient: str) -> tuple[Fp8Copies, ...]:
    """`copies` as a tuple with one `Fp8Copies` per master weight in `ws`, each checked against its
    weight's shape (TypeError / ValueError naming what to pass)."""
    listed = (copies,)
    if several and isinstance(copies, (tuple, list)) and not isinstance(copies, Fp8Copies):
        listed = tuple(copies)
    if len(listed) != len(ws) or not all(isinstance(c, Fp8Copies) for c in listed):
        expected = f"a tuple of {len(ws)} Fp8Copies" if several else "an Fp8Copies"
        raise TypeError(f"copies: expected {expected}, as fp8_weight_copies(w) returns for the same w; got "
                        f"{type(copies).__name__}.")
    for i, (c, w) in enumerate(zip(listed, ws)):
        e, n, k = w.shape
        if (c.transposed is None) != (input_gradient == "master"):
            made = "without" if c.transposed is None else "with"
            raise ValueError(f"copies[{i}] was made {made} the [E, K, N] copy, which input_gradient="
                             f"{input_gradient!r} {'reads' if input_gradient == 'fp8' else 'does not read'}; make "
                             f"them with fp8_weight_copies(w, input_gradient={input_gradient!r}).")
        for name, want in (("quantized", (e, n, k)), ("transposed", (e, k, n))):
            q = getattr(c, name)
            if name == "transposed" and q is None:
                continue
            got = check_weights(q, f"copies[{i}].{name}")  # its scales then fit its values
            if got != want:
                raise ValueError(f"copies[{i}].{name}: shapes {got} are not those of w {tuple(w.shape)} ({want}); "
                                 "make the copies from the same weights with fp8_weight_copies(w).")
    return listed


def _check_quantized(quantized, x_shape) -> Fp8Rows:
    """`quantized` as the `Fp8Rows` of rows of `x_shape`, else a TypeError / ValueError naming it."""
    quantized = Fp8Rows(*(jnp.asarray(a) for a in quantized)) if isinstance(quantized, Fp8Rows) else quantized
    if check_fp8_rows(quantized, "quantized") != tuple(x_shape):
        raise ValueError(f"quantized.values_MK: expected float8_e4m3fn {tuple(x_shape)} for x of shape "
                         f"{tuple(x_shape)}, got {tuple(quantized.values_MK.shape)}; pass the Fp8Rows of x's own rows.")
    return quantized


def fp8_weight_copies(
    w: jax.Array | tuple, *, backend: str = "xla", input_gradient: str = "fp8",
) -> Fp8Copies | tuple[Fp8Copies, ...]:
    """The quantization `fp8_grouped_linear` makes of master weights `w` in each call, made once:
    pass the result as its `copies=` to every call that reads the same `w` (the micro-batches of
    one step), so the weights are quantized once per step, not once per call.

    Args:
      w: `[E, N, K]` bf16/fp16/fp32 master weights, or a tuple of them (as for `fp8_grouped_linear`).
      backend, input_gradient: those the calls will pass (`backend` picks where the quantization
        runs, as in the call; `input_gradient="fp8"` also makes the `[E, K, N]` copy its product reads).

    Returns `Fp8Copies` (a tuple of them for a tuple `w`), equal bit for bit to what the calls would
    quantize. Not differentiated: the calls pass the weight gradient to the `w` they are given.
    The copies hold `w`'s values when they were made: make them again after every update of `w`
    (an optimizer step), since a call cannot tell stale copies from fresh ones.
    """
    fp8_backend(backend)
    if input_gradient not in FP8_INPUT_GRADIENTS:
        raise ValueError(f"input_gradient={input_gradient!r}: use one of {FP8_INPUT_GRADIENTS}.")
    several = isinstance(w, (tuple, list)) and not isinstance(w, Fp8Weights)
    ws = tuple(w) if several else (w,)
    if not ws or any(isinstance(one, Fp8Weights) for one in ws):
        raise TypeError("w: expected [E, N, K] master weights or a non-empty tuple of them; stored Fp8Weights are "
                        "quantized already (pass them to fp8_grouped_linear as they are).")
    # The quantization kernels have no derivative; the calls carry the gradient to their own `w`.
    out = tuple(Fp8Copies(*_quantize(backend, jax.lax.stop_gradient(_check_master(one)), input_gradient == "fp8"))
                for one in ws)
    return out if several else out[0]


def fp8_grouped_linear(
    x: jax.Array,
    w: jax.Array | Fp8Weights | tuple,
    group_sizes: jax.Array,
    *,
    backend: str = "xla",
    rows: RowGather | None = None,
    input_gradient: str = "fp8",
    copies: Fp8Copies | tuple | None = None,
    quantized: Fp8Rows | None = None,
):
    """Differentiable grouped linear layer of the FP8 recipe: `y[M, N]`, rows of group e are
    `x_e @ w[e]^T` with both operands blockwise FP8 (module docstring).

    Args:
      x: `[M, K]` bf16/fp16/fp32 rows grouped contiguously by group, or with `rows` the `[T, K]`
        source rows; the output has its dtype.
      w: either master weights `[E, N, K]` (bf16/fp16/fp32; quantized per 128 x 128 block in each
        call, gradient by the straight-through estimator, in w's dtype), or an `Fp8Weights`
        (`values_ENK` e4m3, `scale_ENbKb` fp32) used as they are, with zero gradient; or a tuple
        of several such weights of one kind (e.g. gate and up), all multiplying the same rows:
        then the result is the tuple of their outputs, `x` is quantized and kept once, and the
        input gradient adds theirs on the packed rows (as autodiff would for separate calls).
      group_sizes: `[E]` integer rows per group (not differentiated), as for `grouped_linear`.
      backend: where the recipe's products run (`gmm_fp8`'s `backend`): one of `FP8_LINEAR_BACKENDS`;
        master weights are quantized on `xla` or `pallas_triton` when it is one of those, else on
        `auto` (the fused kernel on a GPU).
      input_gradient: `"fp8"` (the recipe: `dy` and the weights' blocks in FP8; the backward keeps
        an e4m3 `[E, K, N]` copy of each weight) or, for master weights, `"master"` (`dy @ w` from
        the master weights in x's dtype on `backend`'s 16-bit kernels; nothing of the weights
        kept but the weights themselves). The forward and the weight gradient are the same.
      rows: a `RowGather`: the grouped rows are `x[rows.ids_M]` (zeros for ids outside `[0, T)`),
        as in `grouped_linear`. Each source row is quantized once (a 1 x 128 tile lies within one
        row, so this equals quantizing the gathered rows) and its e4m3 bytes and scales are
        gathered once for every weight's product; the backward keeps the `[T, K]` FP8 source rows,
        its weight gradient gathers their dequantized values into the packed layout and the input
        gradient sums each source row's readers in fp32
        (`moe_jax.ops.gather.sum_of_readers`). Equal to `fp8_grouped_linear` on
        `gather_rows(x, rows.ids_M, inverse_N=rows.readers_TK)`.
      copies: for master weights, their quantization made ahead (`fp8_weight_copies(w, backend=,
        input_gradient=)` of these weights, one `Fp8Copies` per weight): the call reads them instead
        of quantizing `w`, with the same result, and the weight gradient still goes to `w`. They
        must hold `w`'s current values; nothing here can check that.
      quantized: `x`'s rows in FP8 made already (`Fp8Rows`: e4m3 `[M, K]`, or `[T, K]` with
        `rows`, and fp32 scales `[., ceil(K/128)]`), read instead of quantizing `x`: the rows an FP8
        exchange delivered, whose dequantized values are `x`. `x` still gives the output dtype and
        receives the input gradient (straight through, as for the quantization), and the weight
        gradient reads these rows. Their agreement with `x` is not checked.
    """
    fp8_backend(backend)  # ValueError naming the choices, or why a kernel cannot run here
    if input_gradient not in FP8_INPUT_GRADIENTS:
        raise ValueError(f"input_gradient={input_gradient!r}: use one of {FP8_INPUT_GRADIENTS} ('fp8': the recipe's "
                         "FP8 product; 'master': the master weights' 16-bit product, no e4m3 copy kept).")
    x = jnp.asarray(x)
    if x.ndim != 2 or jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        layout = "[M, K]" if rows is None else "[T, K]"
        raise TypeError(f"x: expected {layout} rows of bfloat16/float16/float32, got shape {x.shape} dtype {x.dtype}.")
    if rows is not None:
        check_rows(rows, x.shape[0])
    several = isinstance(w, (tuple, list)) and not isinstance(w, Fp8Weights)
    ws = tuple(w) if several else (w,)
    if not ws:
        raise ValueError("w: an empty tuple of weights; pass one weight or a tuple of them.")
    stored = [_check_weights(one, x) for one in ws]
    if any(stored) and not all(stored):
        raise TypeError("w: a tuple of weights must be all master weights or all Fp8Weights; got "
                        f"{', '.join(type(one).__name__ for one in ws)}.")
    if stored[0] and input_gradient != "fp8":
        raise ValueError(f"input_gradient={input_gradient!r} needs master weights; stored Fp8Weights have none: "
                         "use input_gradient='fp8'.")
    if quantized is not None:
        quantized = _check_quantized(quantized, x.shape)
    if copies is not None:
        if stored[0]:
            raise ValueError("copies: stored Fp8Weights are quantized already; copies are for master weights.")
        copies = _check_copies(copies, tuple(jnp.asarray(one) for one in ws), several, input_gradient)
    # The products read rows and weights anywhere (groups are global row ranges) and the weights'
    # quantization reads whole weights: operands an Explicit mesh axis shards are gathered here
    # (`moe_jax.ops.sharding`), outside the custom VJPs, so autodiff returns each gradient in its
    # operand's sharding.
    x, group_sizes = replicate_explicit(x, jnp.asarray(group_sizes))
    rows = None if rows is None else RowGather(*replicate_explicit(*rows))
    quantized = None if quantized is None else Fp8Rows(*replicate_explicit(*quantized))
    if stored[0]:
        ys = _stored_linear(backend, x, tuple(Fp8Weights(*replicate_explicit(*one)) for one in ws), group_sizes, rows,
                            quantized)
    else:
        if copies is not None:
            copies = tuple(Fp8Copies(*(None if q is None else Fp8Weights(*replicate_explicit(*q)) for q in c))
                           for c in copies)
        ys = _master_linear(backend, input_gradient, x, replicate_explicit(*(jnp.asarray(one) for one in ws)),
                            copies, group_sizes, rows, quantized)
    return ys if several else ys[0]
