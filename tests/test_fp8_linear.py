"""`fp8_grouped_linear` (`moe_jax.ops.fp8_linear`): the forward and the input gradient against
`gmm_fp8_reference` (the recipe in fp32), the straight-through weight gradient against
`tgmm_reference` on the dequantized FP8 rows, stored `Fp8Weights`, group-size edges (empty
experts, one hot expert, zero rows, rows past the sum), K and N not multiples of 128, bf16 and fp32
x, several weights in one call against one call each, rows read through ids (`rows=RowGather`)
against the same op on the gathered rows, argument
errors, one small case on `pallas_triton` (interpret mode on CPU), and weights quantized once
(`fp8_weight_copies`, `copies=`) against each call quantizing its own, with a micro-batch loop
lowered for an H200 to show where the quantization runs, and rows quantized already
(`quantized=`) against the call quantizing them.

Legend: M rows, T source rows, K contraction, N outputs, E experts."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from moe_jax.ops import (Fp8Copies, RowGather, fp8_grouped_linear, fp8_weight_copies, gather_rows, gmm_fp8_reference,
                         grouped_linear, tgmm_reference)
from moe_jax.ops.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows, quantize_weights
from tests.helpers import lower_for_gpu, mesh_devices

# The op scales each product term, the reference each 128-wide partial sum: fp32 rounding only.
FP32_TOL = dict(rtol=2e-5, atol=2e-5)


def _case(m, k, n, e, dtype=jnp.float32, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x_MK = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w_ENK = jax.random.normal(kw, (e, n, k), jnp.float32) / np.sqrt(k)
    return x_MK, w_ENK


def _expected(x_MK, w_ENK, group_sizes, dy_MN):
    """The recipe by the references: output, input gradient and the STE weight gradient."""
    rows, wq = quantize_rows(x_MK), quantize_weights(w_ENK)
    y = gmm_fp8_reference(rows, wq, group_sizes)
    dy = dy_MN.astype(x_MK.dtype)
    dx = gmm_fp8_reference(quantize_rows(dy), wq, group_sizes, transpose_rhs=False)
    dw = tgmm_reference(dequantize_rows(rows).astype(x_MK.dtype), dy, group_sizes)
    return y, dx, dw


def _check(x_MK, w_ENK, group_sizes, *, backend="xla", tol=FP32_TOL):
    dy_MN = jax.random.normal(jax.random.key(7), (x_MK.shape[0], w_ENK.shape[1]), jnp.float32).astype(x_MK.dtype)
    y, vjp = jax.vjp(lambda x, w: fp8_grouped_linear(x, w, group_sizes, backend=backend), x_MK, w_ENK)
    dx, dw = vjp(dy_MN)
    assert y.dtype == x_MK.dtype and dx.dtype == x_MK.dtype and dw.dtype == w_ENK.dtype
    want_y, want_dx, want_dw = _expected(x_MK, w_ENK, group_sizes, dy_MN)
    # Outputs are rounded to x's dtype; compare against the fp32 reference rounded the same way.
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y.astype(x_MK.dtype), np.float32), **tol)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(want_dx.astype(x_MK.dtype), np.float32), **tol)
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(want_dw, np.float32), **tol)
    return y, dx, dw


@pytest.mark.parametrize("m, k, n, sizes", [
    (12, 256, 128, [5, 0, 7]),  # an empty expert, block-aligned
    (9, 200, 130, [0, 9, 0]),  # one hot expert, K and N not multiples of 128
    (10, 70, 40, [3, 2, 1]),  # rows past the sum: zero output, gradient, no weight update
])
def test_fp32_matches_recipe(m, k, n, sizes):
    x, w = _case(m, k, n, len(sizes))
    gs = jnp.array(sizes, jnp.int32)
    y, dx, dw = _check(x, w, gs)
    total = sum(sizes)
    assert np.all(np.asarray(y)[total:] == 0) and np.all(np.asarray(dx)[total:] == 0)
    for e, size in enumerate(sizes):
        if size == 0:
            assert np.all(np.asarray(dw[e]) == 0)


def test_bf16_matches_recipe():
    x, w = _case(16, 300, 140, 2, dtype=jnp.bfloat16)
    # bf16 outputs: one bf16 rounding apart where the fp32 sums differ in their last bits.
    _check(x, w.astype(jnp.bfloat16), jnp.array([10, 6], jnp.int32), tol=dict(rtol=1e-2, atol=1e-2))


def test_zero_rows():
    x, w = _case(0, 130, 64, 2)
    y, dx, dw = _check(x, w, jnp.array([0, 0], jnp.int32))
    assert y.shape == (0, 64) and dx.shape == (0, 130) and np.all(np.asarray(dw) == 0)


def test_jit_and_close_to_fp32():
    x, w = _case(64, 256, 256, 4)
    gs = jnp.array([20, 4, 0, 40], jnp.int32)
    y = jax.jit(lambda x, w: fp8_grouped_linear(x, w, gs))(x, w)
    exact = jax.vmap(lambda e: x @ w[e].T)(jnp.arange(4))
    g = np.repeat(np.arange(4), np.asarray(gs))
    exact = np.asarray(exact)[g, np.arange(64)]
    rel = float(np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact))
    # e4m3 keeps 3 mantissa bits: a few percent on unit-scale products, never more.
    assert rel < 0.06, f"FP8 vs fp32 relative error {rel:.4f}"


def test_stored_weights_equal_master_and_are_frozen():
    x, w = _case(11, 200, 150, 3)
    gs = jnp.array([4, 0, 7], jnp.int32)
    wq = quantize_weights(w)
    assert wq.values_ENK.dtype == FP8_DTYPE
    y_master = fp8_grouped_linear(x, w, gs)
    y_stored, vjp = jax.vjp(lambda x, wq: fp8_grouped_linear(x, wq, gs), x, wq)
    np.testing.assert_array_equal(np.asarray(y_stored), np.asarray(y_master))
    dy = jnp.ones_like(y_stored)
    dx, dwq = vjp(dy)
    dx_master = jax.vjp(lambda x: fp8_grouped_linear(x, w, gs), x)[1](dy)[0]
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_master))
    assert not np.any(np.asarray(dwq.values_ENK, np.float32)) and not np.any(np.asarray(dwq.scale_ENbKb))


def _route(num_tokens, top_k, num_experts, seed=0):
    """Token rows routed top-k: the packed rows' source ids (grouped by expert, -1 in the slack past
    the sum), each token's readers and the group sizes."""
    rng = np.random.default_rng(seed)
    idx_TK = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)])
    order = np.argsort(idx_TK.ravel(), kind="stable")
    slack = 3
    ids_M = np.concatenate([order // top_k, np.full(slack, -1)]).astype(np.int32)
    readers_TK = np.empty((num_tokens, top_k), np.int32)
    readers_TK.reshape(-1)[order] = np.arange(order.size)
    sizes = np.bincount(idx_TK.ravel(), minlength=num_experts).astype(np.int32)
    return RowGather(jnp.asarray(ids_M), jnp.asarray(readers_TK)), jnp.asarray(sizes)


@pytest.mark.parametrize("dtype, stored", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True)])
def test_rows_read_through_ids_equal_the_gathered_rows(dtype, stored):
    num_tokens, top_k, e, k, n = 7, 2, 4, 200, 130
    x_TK, w_ENK = _case(num_tokens, k, n, e, dtype=dtype, seed=3)
    w_ENK = w_ENK.astype(dtype)
    rows, gs = _route(num_tokens, top_k, e)
    gs = gs.at[1].set(0).at[0].add(int(gs[1]))  # an empty expert (regroup its rows into expert 0)
    w = quantize_weights(w_ENK) if stored else w_ENK
    dy = jax.random.normal(jax.random.key(5), (rows.ids_M.shape[0], n), jnp.float32).astype(dtype)

    def through_ids(x, w):
        return fp8_grouped_linear(x, w, gs, backend="auto", rows=rows)

    def gathered(x, w):
        x_MK = gather_rows(x, rows.ids_M, inverse_N=rows.readers_TK, backend="xla")
        return fp8_grouped_linear(x_MK, w, gs, backend="auto")

    (y, vjp), (want_y, want_vjp) = jax.vjp(through_ids, x_TK, w), jax.vjp(gathered, x_TK, w)
    (dx, dw), (want_dx, want_dw) = vjp(dy), want_vjp(dy)
    assert y.shape == (rows.ids_M.shape[0], n) and dx.shape == x_TK.shape
    tol = FP32_TOL if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, want in ((y, want_y), (dx, want_dx)) + (() if stored else ((dw, want_dw),)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    assert not np.any(np.asarray(y, np.float32)[int(gs.sum()):])  # the slack rows past the sum
    if stored:
        assert not np.any(np.asarray(dw.values_ENK, np.float32)) and not np.any(np.asarray(dw.scale_ENbKb))
    else:
        assert not np.any(np.asarray(dw[1], np.float32))  # the empty expert


@pytest.mark.parametrize("stored, gather", [(False, False), (False, True), (True, True)])
def test_quantized_rows_are_read_instead_of_quantizing_x(stored, gather):
    """`quantized=` (the FP8 rows an exchange delivered): the products and the weight gradient read
    them, not x's values (here x is shifted by one, so quantizing it would differ), and the call
    equals the one that quantizes the rows itself, bit for bit, for gate and up in one call and
    through row ids; the input gradient still reaches x."""
    num_tokens, top_k, e, k, n = 7, 2, 4, 200, 130
    x_TK, w_ENK = _case(num_tokens, k, n, e, dtype=jnp.bfloat16, seed=4)
    ws = tuple(quantize_weights(w) if stored else w.astype(jnp.bfloat16) for w in (w_ENK, w_ENK[:, ::-1]))
    rows, gs = _route(num_tokens, top_k, e)
    if not gather:
        x_TK, rows = gather_rows(x_TK, rows.ids_M), None
    q = quantize_rows(x_TK)

    def loss(x, ws, quantized):
        ys = fp8_grouped_linear(x, ws, gs, backend="xla", rows=rows, quantized=quantized)
        return sum(jnp.sum(y.astype(jnp.float32) ** 2) for y in ys), ys

    (_, ys), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x_TK, ws, None)
    (_, got_ys), got_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x_TK + 1, ws, q)
    for got, want in zip(jax.tree.leaves((got_ys, got_grads)), jax.tree.leaves((ys, grads))):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert got_grads[0].shape == x_TK.shape and np.any(np.asarray(got_grads[0], np.float32))


def test_quantized_errors():
    x, w = _case(6, 200, 64, 2)
    gs = jnp.array([2, 4], jnp.int32)
    q = quantize_rows(x)
    with pytest.raises(TypeError, match="quantized: expected moe_jax.ops.fp8.Fp8Rows"):
        fp8_grouped_linear(x, w, gs, quantized=tuple(q))
    with pytest.raises(ValueError, match=r"quantized.values_MK: expected float8_e4m3fn \(6, 200\)"):
        fp8_grouped_linear(x, w, gs, quantized=type(q)(q.values_MK[:5], q.scale_MKb[:5]))
    with pytest.raises(TypeError, match=r"quantized.scale_MKb: expected float32 scales, got bfloat16"):
        fp8_grouped_linear(x, w, gs, quantized=type(q)(q.values_MK, q.scale_MKb.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"quantized.scale_MKb: expected \(6, 2\)"):
        fp8_grouped_linear(x, w, gs, quantized=type(q)(q.values_MK, q.scale_MKb[:, :1]))


@pytest.mark.parametrize("stored", [False, True])
def test_several_weights_equal_separate_calls(stored):
    """A tuple of weights (gate and up): the rows quantized once, the outputs and every gradient
    those of one call per weight, the input gradients added as autodiff adds them."""
    x, w1 = _case(10, 200, 130, 3, dtype=jnp.bfloat16, seed=1)
    _, w2 = _case(10, 200, 130, 3, seed=2)
    ws = tuple(quantize_weights(w) if stored else w.astype(jnp.bfloat16) for w in (w1, w2))
    gs = jnp.array([4, 0, 5], jnp.int32)

    def together(x, ws):
        a, b = fp8_grouped_linear(x, ws, gs, backend="auto")
        return jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))

    def apart(x, ws):
        a, b = (fp8_grouped_linear(x, w, gs, backend="auto") for w in ws)
        return jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))

    ys = fp8_grouped_linear(x, ws, gs, backend="auto")
    assert isinstance(ys, tuple) and len(ys) == 2
    for y, w in zip(ys, ws):
        np.testing.assert_array_equal(np.asarray(y, np.float32),
                                      np.asarray(fp8_grouped_linear(x, w, gs, backend="auto"), np.float32))
    got, want = jax.grad(together, argnums=(0, 1))(x, ws), jax.grad(apart, argnums=(0, 1))(x, ws)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("gather", [False, True], ids=["packed", "row-ids"])
def test_input_gradient_from_the_master_weights(gather):
    """`input_gradient="master"`: the output and weight gradients are the recipe's; `dx` is the
    16-bit linear layer's (`grouped_linear` on the same `dy`, summed over each row's readers with
    `rows`); and the backward keeps the weights themselves, not an e4m3 copy."""
    x, w1 = _case(10, 200, 130, 3, seed=3)
    _, w2 = _case(10, 200, 130, 3, seed=4)
    rows, gs = _route(6, 2, 3) if gather else (None, jnp.array([4, 0, 5], jnp.int32))
    x = x[:6] if gather else x

    def run(input_gradient, x, w1, w2):
        ys = fp8_grouped_linear(x, (w1, w2), gs, rows=rows, input_gradient=input_gradient)
        return jnp.sum(ys[0] * jnp.cos(ys[1]))

    (loss, grads), (loss_fp8, grads_fp8) = (jax.value_and_grad(lambda *a, g=g: run(g, *a), argnums=(0, 1, 2))(x, w1, w2)
                                            for g in ("master", "fp8"))
    assert loss == loss_fp8
    for got, want in zip(grads[1:], grads_fp8[1:]):
        np.testing.assert_array_equal(got, want)
    ys = fp8_grouped_linear(x, (w1, w2), gs, rows=rows)
    dys = (jnp.cos(ys[1]), -ys[0] * jnp.sin(ys[1]))
    _, vjp = jax.vjp(lambda x: tuple(grouped_linear(x, w, gs, rows=rows, precision=jax.lax.Precision.HIGHEST)
                                     for w in (w1, w2)), x)
    np.testing.assert_allclose(grads[0], vjp(dys)[0], **FP32_TOL)
    assert not np.allclose(grads[0], grads_fp8[0], rtol=1e-4, atol=1e-4)  # not the recipe's FP8 product

    def saved(input_gradient):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(lambda w1, w2: run(input_gradient, x, w1, w2), w1, w2)
        return out.getvalue()

    assert "f8_e4m3fn[3,200,130]" in saved("fp8") and "f8_e4m3fn[3,200,130]" not in saved("master")
    assert "from the argument w1" in saved("master")


def test_rows_errors():
    x, w = _case(4, 128, 64, 2)
    rows, gs = _route(4, 1, 2)
    with pytest.raises(TypeError, match="RowGather"):
        fp8_grouped_linear(x, w, gs, rows=(rows.ids_M, rows.readers_TK))
    with pytest.raises(ValueError, match="readers_TK"):
        fp8_grouped_linear(x[:3], w, gs, rows=rows)


@pytest.mark.slow
def test_pallas_triton_interpret():
    x, w = _case(8, 128, 64, 2)
    _check(x, w, jnp.array([3, 5], jnp.int32), backend="pallas_triton")


def test_errors():
    x, w = _case(4, 128, 64, 2)
    gs = jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="backend='cutlass'.*one of"):
        fp8_grouped_linear(x, w, gs, backend="cutlass")
    with pytest.raises(ValueError, match="K = x.shape"):
        fp8_grouped_linear(x, w[:, :, :64], gs)
    with pytest.raises(TypeError, match="quantize_weights"):
        fp8_grouped_linear(x, quantize_weights(w)._replace(scale_ENbKb=jnp.ones((2, 1, 1), jnp.bfloat16)), gs)
    with pytest.raises(ValueError, match="scale_ENbKb"):
        fp8_grouped_linear(x, quantize_weights(w)._replace(scale_ENbKb=jnp.ones((2, 2, 1))), gs)
    with pytest.raises(TypeError, match="x:"):
        fp8_grouped_linear(x.astype(FP8_DTYPE), w, gs)
    with pytest.raises(TypeError, match="all master weights or all Fp8Weights"):
        fp8_grouped_linear(x, (w, quantize_weights(w)), gs)
    with pytest.raises(ValueError, match="empty tuple"):
        fp8_grouped_linear(x, (), gs)
    with pytest.raises(ValueError, match="input_gradient='bf16'.*'fp8'"):
        fp8_grouped_linear(x, w, gs, input_gradient="bf16")
    with pytest.raises(ValueError, match="needs master weights"):
        fp8_grouped_linear(x, quantize_weights(w), gs, input_gradient="master")


@pytest.mark.parametrize("input_gradient", ["fp8", "master"])
def test_explicitly_sharded_rows_and_master_weights(input_gradient):
    """Rows and master weights an Explicit mesh axis shards (outside `shard_map`) are gathered for
    the products and the quantization, which read whole operands: the linear's output and gradients
    equal those of unsharded operands, and each gradient comes back in its operand's sharding."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    devices = mesh_devices(2)  # two GPUs where the host has them, else host devices (on the XLA path)
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(AxisType.Explicit,), devices=devices)
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (96, 256), jnp.float32), devices[0])
    w = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (4, 200, 256), jnp.float32), devices[0])
    gs = jax.device_put(jnp.array([30, 0, 40, 26], jnp.int32), devices[0])
    backend = "auto" if devices[0].platform == "gpu" else "xla"

    def loss(x, w):
        y = fp8_grouped_linear(x, w, gs, backend=backend, input_gradient=input_gradient)
        return jnp.sum(jnp.square(y))

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    with jax.set_mesh(mesh):
        w_sharded = jax.device_put(w, NamedSharding(mesh, PartitionSpec("ep")))
        x_sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("ep")))
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x_sharded, w_sharded)
    assert got[1][0].sharding.spec == PartitionSpec("ep", None)
    assert got[1][1].sharding.spec == PartitionSpec("ep", None, None)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


def _flat(tree):
    return [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize("input_gradient", ["fp8", "master"])
@pytest.mark.parametrize("several, gather", [(False, False), (True, True)], ids=["one-packed", "pair-row-ids"])
def test_copies_give_the_call_quantizing_its_own_weights_bit_for_bit(input_gradient, several, gather):
    """`fp8_weight_copies` made once and passed as `copies=`: output, input gradient and the master
    weights' gradient equal those of calls that quantize their weights themselves, exactly, also
    inside a jitted micro-batch loop that closes over the copies; the copies get no gradient."""
    backend = "auto" if jax.default_backend() == "gpu" else "xla"
    x, w = _case(20, 256, 200, 3, jnp.bfloat16)
    w = w.astype(jnp.bfloat16)
    ws = (w, (w * 0.5).astype(jnp.bfloat16)) if several else w
    rows, gs = _route(20, 2, 3) if gather else (None, jnp.array([8, 0, 10], jnp.int32))  # rows past the sum
    gs = gs.at[1].set(0).at[0].add(int(gs[1]))  # an empty expert

    def loss(x, ws, copies):
        ys = fp8_grouped_linear(x, ws, gs, backend=backend, rows=rows, input_gradient=input_gradient, copies=copies)
        return sum(jnp.sum(jnp.square(y.astype(jnp.float32))) for y in (ys if several else (ys,)))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    want = grad(x, ws, None)
    copies = fp8_weight_copies(ws, backend=backend, input_gradient=input_gradient)
    got = grad(x, ws, copies)
    for g, r in zip(_flat(got), _flat(want)):
        np.testing.assert_array_equal(g, r)
    _, copies_grad = jax.grad(loss, argnums=(0, 2), allow_int=True)(x, ws, copies)
    assert all(not np.any(np.asarray(leaf, np.float32)) for leaf in jax.tree.leaves(copies_grad))

    @jax.jit
    def accumulated(ws, xs):  # a step of micro-batches reading the copies made once before the loop
        once = fp8_weight_copies(ws, backend=backend, input_gradient=input_gradient)
        body = lambda acc, x: (jax.tree.map(jnp.add, acc, jax.grad(loss, argnums=1)(x, ws, once)), None)
        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, ws), xs)[0]

    xs = jnp.stack([x, (x * 2).astype(x.dtype)])
    per_call = jax.tree.map(jnp.add, *(jax.grad(loss, argnums=1)(xi, ws, None) for xi in xs))
    for g, r in zip(_flat(accumulated(ws, xs)), _flat(per_call)):
        np.testing.assert_array_equal(g, r)


def _loop_body(stablehlo: str) -> str:
    """The lines of the one `stablehlo.while` loop's body in `stablehlo` (the printer puts each op
    on a line of its own, the body between `} do {` and `}` at the loop's indentation)."""
    lines = stablehlo.splitlines()
    at = next(i for i, line in enumerate(lines) if "stablehlo.while" in line)
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    start = lines.index(indent + "} do {", at)
    return "\n".join(lines[start + 1: lines.index(indent + "}", start)])


@pytest.mark.filterwarnings("ignore:gmm_fp8.*reference path")  # the products, off GPU without jax_triton
@pytest.mark.parametrize("input_gradient", ["fp8", "master"])
def test_copies_take_the_weights_quantization_out_of_a_micro_batch_loop(input_gradient):
    """Lowered for an H200 (from any host): a step accumulating micro-batches in `lax.scan` quantizes
    the master weights in the loop's body when each call quantizes them (the GPU compiler leaves
    that kernel there: 3 launches per micro-batch at Qwen3-30B-A3B), and once before the loop with
    `fp8_weight_copies` made outside it."""
    gs = jnp.array([64, 0, 64], jnp.int32)

    def step(w, xs, once: bool):
        copies = fp8_weight_copies(w, backend="auto", input_gradient=input_gradient) if once else None

        def body(acc, x):
            def loss(x, w):  # y's values reach the gradients, so no part of the forward is dead code
                y = fp8_grouped_linear(x, w, gs, backend="auto", input_gradient=input_gradient, copies=copies)
                return jnp.sum(jnp.square(y.astype(jnp.float32)))

            dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
            return acc + dw, dx

        return jax.lax.scan(body, jnp.zeros_like(w), xs)

    w = jax.ShapeDtypeStruct((3, 256, 256), jnp.bfloat16)
    xs = jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16)
    calls = {}
    for once in (False, True):
        text = lower_for_gpu(lambda w, xs: step(w, xs, once), w, xs)
        body = _loop_body(text)
        calls[once] = (text.count('name = "moe_jax_quantize_weights"'), body.count('name = "moe_jax_quantize_weights"'))
    assert calls[False][1] == calls[False][0] >= 1  # every quantization in the body
    assert calls[True] == (1, 0)  # one, before the loop


def test_copies_errors():
    x, w = _case(4, 128, 64, 2)
    gs = jnp.array([2, 2], jnp.int32)
    copies = fp8_weight_copies(w)
    with pytest.raises(TypeError, match="copies: expected an Fp8Copies"):
        fp8_grouped_linear(x, w, gs, copies=(copies,))
    with pytest.raises(TypeError, match="copies: expected a tuple of 2 Fp8Copies"):
        fp8_grouped_linear(x, (w, w), gs, copies=copies)
    with pytest.raises(ValueError, match=r"copies\[0\] was made with the \[E, K, N\] copy.*input_gradient='master'"):
        fp8_grouped_linear(x, w, gs, input_gradient="master", copies=copies)
    with pytest.raises(ValueError, match=r"made without .*input_gradient='fp8'"):
        fp8_grouped_linear(x, w, gs, copies=fp8_weight_copies(w, input_gradient="master"))
    with pytest.raises(ValueError, match=r"copies\[0\].quantized: shapes .* are not those of w"):
        fp8_grouped_linear(x, w[:1], gs[:1], copies=copies)
    with pytest.raises(TypeError, match=r"copies\[0\].transposed: expected Fp8Weights"):
        fp8_grouped_linear(x, w, gs, copies=Fp8Copies(copies.quantized, w))
    with pytest.raises(ValueError, match="stored Fp8Weights are quantized already"):
        fp8_grouped_linear(x, quantize_weights(w), gs, copies=copies)
    with pytest.raises(TypeError, match="stored Fp8Weights are quantized already"):
        fp8_weight_copies(quantize_weights(w))
    with pytest.raises(ValueError, match=r"w: expected \[E, N, K\]"):
        fp8_weight_copies(w[0])
    with pytest.raises(ValueError, match="input_gradient='bf16'"):
        fp8_weight_copies(w, input_gradient="bf16")
