"""moe_jax.experts: SwiGLU experts on packed rows against the fp32 per-expert reference, forward
and every gradient; fused == separate; rows past sum(group_sizes) are zero; both backends; the
FP8 experts' rows (`exact_swiglu`, forward and backward) independent of the compiler's excess
precision.

Legend: M packed rows, D width, F hidden width, E experts.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_jax.experts import (
    exact_swiglu,
    fuse_gate_up,
    split_gate_up,
    swiglu_experts,
    swiglu_experts_fp8,
    swiglu_experts_fused,
    swiglu_experts_reference,
)
from moe_jax.ops import fp8_grouped_linear, fp8_weight_copies
from moe_jax.testing import assert_close
from tests.helpers import count_where_round_trips_removed

SETTINGS = settings(derandomize=True, max_examples=6, deadline=None)
D, F = 8, 6


def _case(sizes, extra_rows, seed, dtype=jnp.float32):
    """x with NaN poison in the rows past sum(sizes), weights scaled like the layer's init."""
    num_experts, used = len(sizes), int(sum(sizes))
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(k[0], (used + extra_rows, D), jnp.float32)
    x = x.at[used:].set(jnp.nan)
    w_gate = jax.random.normal(k[1], (num_experts, F, D)) / np.sqrt(D)
    w_up = jax.random.normal(k[2], (num_experts, F, D)) / np.sqrt(D)
    w_down = jax.random.normal(k[3], (num_experts, D, F)) / np.sqrt(F)
    cot = jax.random.normal(k[4], (used + extra_rows, D))
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return cast(x), jnp.asarray(sizes, jnp.int32), cast(w_gate), cast(w_up), cast(w_down), cot


@functools.cache
def _jitted(fn):
    """(forward, value_and_grad of sum(y * cot)) of `fn`, jitted once per function (group sizes
    are traced, so one compile serves every size pattern of one shape)."""

    def loss(x, sizes, w_gate, w_up, w_down, cot):
        return jnp.sum(fn(x, sizes, w_gate, w_up, w_down).astype(jnp.float32) * cot)

    return jax.jit(fn), jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4)))


def _check_against_reference(fn, x, sizes, w_gate, w_up, w_down, cot, dtype):
    used = int(np.sum(sizes))
    forward, grad = _jitted(fn)
    y = forward(x, sizes, w_gate, w_up, w_down)
    assert y.dtype == dtype
    ref_forward, ref_grad = _jitted(swiglu_experts_reference)
    ref = ref_forward(x, sizes, w_gate, w_up, w_down)
    assert_close(y[:used], ref[:used], dtype, "y")
    np.testing.assert_array_equal(np.asarray(y[used:], np.float32), 0.0)

    _, grads = grad(x, sizes, w_gate, w_up, w_down, cot)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    # The reference reads the poisoned rows; its x-gradient there is the selected-away branch (0).
    x_ref = jnp.where(jnp.arange(x.shape[0])[:, None] < used, f32(x), 0.0)
    _, ref_grads = ref_grad(x_ref, sizes, f32(w_gate), f32(w_up), f32(w_down), cot)
    for name, g, r in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, ref_grads):
        assert g.dtype == dtype, name
        assert_close(g, r, dtype, name)
    np.testing.assert_array_equal(np.asarray(grads[0][used:], np.float32), 0.0)
    empty = np.asarray(sizes) == 0  # an empty expert's weight gradient is exactly zero
    for name, g in zip(("dw_gate", "dw_up", "dw_down"), grads[1:]):
        np.testing.assert_array_equal(np.asarray(g, np.float32)[empty], 0.0, err_msg=name)


def _xla(x, sizes, w_gate, w_up, w_down):
    return swiglu_experts(x, sizes, w_gate, w_up, w_down, backend="xla")


def _pallas(x, sizes, w_gate, w_up, w_down):
    return swiglu_experts(x, sizes, w_gate, w_up, w_down, backend="pallas_triton")


def _fused_xla(x, sizes, w_gate, w_up, w_down):
    return swiglu_experts_fused(x, sizes, fuse_gate_up(w_gate, w_up), w_down, backend="xla")


def _fused_pallas(x, sizes, w_gate, w_up, w_down):
    return swiglu_experts_fused(x, sizes, fuse_gate_up(w_gate, w_up), w_down, backend="pallas_triton")


@SETTINGS
@given(sizes=st.lists(st.integers(0, 6), min_size=4, max_size=4).filter(lambda s: sum(s) > 0), seed=st.integers(0, 100))
def test_separate_matches_reference_fp32(sizes, seed):
    """Group sizes with empty experts; M = 24 rows fixed (so one compile), rows past the groups
    poisoned with NaN."""
    x, sz, wg, wu, wd, cot = _case(sizes, 24 - sum(sizes), seed)
    _check_against_reference(_xla, x, sz, wg, wu, wd, cot, jnp.float32)


@pytest.mark.parametrize("sizes", [(3, 0, 5, 1), (0, 0, 4, 0)])
def test_fused_matches_reference_fp32(sizes):
    x, sz, wg, wu, wd, cot = _case(sizes, 3, 1)
    _check_against_reference(_fused_xla, x, sz, wg, wu, wd, cot, jnp.float32)


def test_fused_equals_separate():
    x, sz, wg, wu, wd, cot = _case((4, 2, 0, 6), 2, 3)
    separate = _jitted(_xla)[0](x, sz, wg, wu, wd)
    fused = _jitted(_fused_xla)[0](x, sz, wg, wu, wd)
    assert_close(fused, separate, jnp.float32, "fused vs separate")
    _, g_sep = _jitted(_xla)[1](x, sz, wg, wu, wd, cot)
    _, g_fused = _jitted(_fused_xla)[1](x, sz, wg, wu, wd, cot)
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), g_fused, g_sep):
        assert_close(a, b, jnp.float32, name)


def test_bf16_matches_fp32_reference():
    x, sz, wg, wu, wd, cot = _case((5, 0, 9, 3), 3, 4, jnp.bfloat16)
    _check_against_reference(_xla, x, sz, wg, wu, wd, cot, jnp.bfloat16)


@pytest.mark.parametrize("fused", [False, True])
def test_pallas_triton_interpret_matches_reference(fused):
    """The Pallas kernels (interpreted on CPU, compiled on GPU) through the same expert path."""
    x, sz, wg, wu, wd, cot = _case((2, 0, 3), 2, 5)
    _check_against_reference(_fused_pallas if fused else _pallas, x, sz, wg, wu, wd, cot, jnp.float32)


def test_split_gate_up_inverts_fuse():
    _, _, wg, wu, _, _ = _case((1, 1), 0, 6)
    fused = fuse_gate_up(wg, wu)
    assert fused.shape == (2, 2 * F, D)
    g, u = split_gate_up(fused)
    np.testing.assert_array_equal(g, wg)
    np.testing.assert_array_equal(u, wu)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, s, g, u, d: swiglu_experts(x[:, :-1], s, g, u, d), "D = x_MD"),
        (lambda x, s, g, u, d: swiglu_experts(x, s, g, u[:, :-1], d), "w_up_EFD"),
        (lambda x, s, g, u, d: swiglu_experts(x, s, g, u, d[:, :, :-1]), "w_down_EDF"),
        (lambda x, s, g, u, d: swiglu_experts(x[0], s, g, u, d), "x_MD"),
        (lambda x, s, g, u, d: swiglu_experts_fused(x, s, g[:, :-1], d), "even"),
        (lambda x, s, g, u, d: swiglu_experts(x, s, g, u, d.astype(jnp.bfloat16)), "dtype"),
        (lambda x, s, g, u, d: fuse_gate_up(g, u[:, :-1]), "same shape"),
    ],
)
def test_bad_arguments_raise(call, match):
    x, sz, wg, wu, wd, _ = _case((2, 1), 1, 7)
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, sz, wg, wu, wd)


def fp8_staged_mismatches() -> int:
    """How many outputs of `swiglu_experts_fp8` (backend "xla", bf16) in one program differ from
    the same three products run as programs of their own, which hand the SwiGLU gate and up at
    their bf16 values."""
    rng = np.random.default_rng(0)
    e, d, f, m = 2, 256, 384, 96
    x_MD = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    w_gate_EFD, w_up_EFD = (jnp.asarray(rng.standard_normal((e, f, d)) / 16, jnp.bfloat16) for _ in range(2))
    w_down_EDF = jnp.asarray(rng.standard_normal((e, d, f)) / 16, jnp.bfloat16)
    group_sizes_E = jnp.asarray([40, 56], jnp.int32)
    linear = functools.partial(fp8_grouped_linear, group_sizes=group_sizes_E, backend="xla")

    together = jax.jit(lambda x: swiglu_experts_fp8(x, group_sizes_E, w_gate_EFD, w_up_EFD, w_down_EDF,
                                                    backend="xla"))(x_MD)
    gate_MF, up_MF = jax.jit(lambda x: linear(x, (w_gate_EFD, w_up_EFD)))(x_MD)
    h_MF = jax.jit(exact_swiglu)(gate_MF, up_MF)
    staged = jax.jit(lambda h: linear(h, w_down_EDF))(h_MF)
    return int(np.sum(np.asarray(together != staged)))


@pytest.mark.parametrize("input_gradient", ["fp8", "master"])
def test_fp8_experts_read_weight_copies_made_once_bit_for_bit(input_gradient):
    """`swiglu_experts_fp8(copies=fp8_weight_copies(weights))`: the output and the gradients of the
    rows and the three master weights equal those of the call that quantizes its weights itself."""
    backend = "auto" if jax.default_backend() == "gpu" else "xla"
    rng = np.random.default_rng(1)
    e, d, f, m = 3, 256, 384, 80
    x_MD = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    weights = tuple(jnp.asarray(rng.standard_normal(shape) / 16, jnp.bfloat16)
                    for shape in ((e, f, d), (e, f, d), (e, d, f)))
    group_sizes_E = jnp.asarray([40, 0, 36], jnp.int32)  # an empty expert; rows past the sum

    def loss(x, weights, copies):
        y = swiglu_experts_fp8(x, group_sizes_E, *weights, backend=backend, input_gradient=input_gradient,
                               copies=copies)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    copies = fp8_weight_copies(weights, backend=backend, input_gradient=input_gradient)
    for got, want in zip(jax.tree.leaves(grad(x_MD, weights, copies)), jax.tree.leaves(grad(x_MD, weights, None))):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(TypeError, match="copies must be the three Fp8Copies"):
        swiglu_experts_fp8(x_MD, group_sizes_E, *weights, backend=backend, input_gradient=input_gradient,
                           copies=copies[:2])


def test_fp8_experts_in_one_program_equal_their_products_staged():
    assert fp8_staged_mismatches() == 0


@pytest.mark.slow  # a child process (the flag is read when the backend starts)
def test_fp8_swiglu_reads_bf16_values_where_the_compiler_removes_the_rounding():
    """The down projection quantizes silu(gate) * up; gate and up come out of products accumulated
    in fp32 and rounded to bf16. Where the compiler would keep their fp32 values
    (`tests.helpers.ROUND_TRIPS_REMOVED`), the e4m3 rows, and so the output, must not change."""
    assert count_where_round_trips_removed("tests.test_experts:fp8_staged_mismatches") == 0


def exact_swiglu_gradient_mismatches() -> int:
    """How many of `exact_swiglu`'s gate and up gradients (bf16) differ when its cotangent is an
    fp32 value rounded to bf16 in the same program from when that cotangent comes in as an array."""
    rng = np.random.default_rng(0)
    gate_MF, up_MF = (jnp.asarray(rng.standard_normal((64, 384)), jnp.bfloat16) for _ in range(2))
    a_MF, b_MF = (jnp.asarray(rng.standard_normal((64, 384)), jnp.float32) for _ in range(2))

    def grads(gate, up, dh):
        return jax.vjp(exact_swiglu, gate, up)[1](dh)

    together = jax.jit(lambda g, u, a, b: grads(g, u, (a * b).astype(jnp.bfloat16)))(gate_MF, up_MF, a_MF, b_MF)
    staged = jax.jit(grads)(gate_MF, up_MF, jax.jit(lambda a, b: (a * b).astype(jnp.bfloat16))(a_MF, b_MF))
    return sum(int(np.sum(np.asarray(t != s))) for t, s in zip(together, staged))


def test_exact_swiglu_gradients_read_the_cotangent_at_its_bf16_values():
    assert exact_swiglu_gradient_mismatches() == 0


@pytest.mark.slow  # a child process (the flag is read when the backend starts)
def test_exact_swiglu_gradients_where_the_compiler_removes_the_rounding():
    """Where the compiler would keep the cotangent's fp32 value across its rounding to bf16
    (`tests.helpers.ROUND_TRIPS_REMOVED`; autodiff of the same SwiGLU then differs in about a
    quarter of the elements), the gradients, which the FP8 gate and up projections quantize, do not."""
    assert count_where_round_trips_removed("tests.test_experts:exact_swiglu_gradient_mismatches") == 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exact_swiglu_is_silu_gate_times_up_with_its_gradients(dtype):
    rng = np.random.default_rng(1)
    gate, up, dh = (jnp.asarray(rng.standard_normal((48, 160)) * 3, dtype) for _ in range(3))

    def reference(g, u):
        return jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)

    y, vjp = jax.vjp(exact_swiglu, gate, up)
    assert y.dtype == dtype
    want, ref_vjp = jax.vjp(reference, gate.astype(jnp.float32), up.astype(jnp.float32))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=8e-3, atol=1e-5)  # one bf16 rounding
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), **tol)
    for got, ref in zip(vjp(dh), ref_vjp(dh.astype(jnp.float32))):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), **tol)


def test_exact_swiglu_names_mismatched_inputs():
    with pytest.raises(ValueError, match="gate_MF .* and up_MF .* must share one shape and dtype"):
        exact_swiglu(jnp.zeros((4, 8)), jnp.zeros((4, 8), jnp.bfloat16))
