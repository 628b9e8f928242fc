"""moe_jax.experts: SwiGLU experts on packed rows against the fp32 per-expert reference, forward
and every gradient; fused == separate; rows past sum(group_sizes) are zero; both backends.

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
    fuse_gate_up,
    split_gate_up,
    swiglu_experts,
    swiglu_experts_fused,
    swiglu_experts_reference,
)
from moe_jax.testing import assert_close

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
