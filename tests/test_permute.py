"""moe_jax.permute: pack by expert, gather, combine (exact layout checks against numpy, round
trips, masks, empty experts, zero tokens, gradients).

Legend: T tokens, K top-k, E experts, D width, R = T*K routes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_jax.permute import Packing, combine, gather_rows, pack, pack_rows, stable_rank
from tests.helpers import count_where_round_trips_removed, scatter_lines

SETTINGS = settings(derandomize=True, max_examples=12, deadline=None)


# (tokens, top_k, experts) of the routings: one expert; top-3 of 7 (some experts empty); top-2 of
# 4; a single token. Shapes come from this short list so each test compiles a few programs, and the
# routings themselves (experts, masks) are values drawn per example; zero tokens is
# test_zero_tokens.
ROUTING_SHAPES = [(9, 1, 1), (9, 3, 7), (6, 2, 4), (1, 2, 2)]


@st.composite
def routings(draw):
    """(expert_idx_TK, mask_T, E): distinct experts per token, E up to 7 (so some are empty)."""
    num_tokens, top_k, num_experts = draw(st.sampled_from(ROUTING_SHAPES))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    rows = [rng.choice(num_experts, size=top_k, replace=False) for _ in range(num_tokens)]
    idx = np.asarray(rows, np.int32).reshape(num_tokens, top_k)
    mask = rng.random(num_tokens) < draw(st.sampled_from([1.0, 0.7, 0.0]))
    return idx, mask, num_experts


# Compiled once per routing shape (the property tests' examples share them).
_pack = jax.jit(pack, static_argnums=1)
_pack_rows = jax.jit(pack_rows)
_combine = jax.jit(combine)


def _numpy_packing(idx, mask, num_experts):
    top_k = idx.shape[1]
    key = np.where(np.repeat(mask, top_k), idx.reshape(-1), num_experts)
    order = np.argsort(key, kind="stable")
    return order, np.bincount(key, minlength=num_experts + 1)[:num_experts]


@SETTINGS
@given(routings())
def test_pack_matches_numpy_stable_sort(case):
    idx, mask, num_experts = case
    p = _pack(jnp.asarray(idx), num_experts, mask_T=jnp.asarray(mask))
    order, sizes = _numpy_packing(idx, mask, num_experts)
    np.testing.assert_array_equal(p.order_R, order)
    np.testing.assert_array_equal(p.group_sizes_E, sizes)
    np.testing.assert_array_equal(p.token_R, order // idx.shape[1])
    np.testing.assert_array_equal(np.asarray(p.order_R)[np.asarray(p.inverse_R)], np.arange(idx.size))
    # Packed rows really are grouped: row i of the first sum(sizes) has expert of its group.
    groups = np.repeat(np.arange(num_experts), sizes)
    np.testing.assert_array_equal(idx.reshape(-1)[order[: sizes.sum()]], groups)
    assert all(a.dtype == jnp.int32 for a in p)


@SETTINGS
@given(routings(), st.sampled_from([1, 5]))
def test_gather_rows_zero_past_groups_even_for_nan_tokens(case, width):
    idx, mask, num_experts = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal((idx.shape[0], width)).astype(np.float32)
    x[~mask] = np.nan  # masked tokens may hold anything
    p = _pack(jnp.asarray(idx), num_experts, mask_T=jnp.asarray(mask))
    rows = np.asarray(_pack_rows(jnp.asarray(x), p))
    used = int(np.sum(p.group_sizes_E))
    np.testing.assert_array_equal(rows[:used], x[np.asarray(p.token_R)[:used]])
    np.testing.assert_array_equal(rows[used:], 0.0)
    assert np.isfinite(rows).all()  # assert_array_equal counts NaN == NaN: no masked token got in


@SETTINGS
@given(routings())
def test_round_trip_with_identity_experts_is_identity(case):
    """Identity experts and weights summing to 1 (dyadic, so exact): combine(gather(x)) == x on
    real tokens and 0 on masked ones."""
    idx, mask, num_experts = case
    num_tokens, top_k = idx.shape
    rng = np.random.default_rng(1)
    x = rng.integers(-50, 50, size=(num_tokens, 4)).astype(np.float32)
    w = np.full((num_tokens, top_k), 1.0 / top_k if top_k != 3 else 0.25, np.float32)
    if top_k == 3:
        w[:, 0] = 0.5
    p = _pack(jnp.asarray(idx), num_experts, mask_T=jnp.asarray(mask))
    y = _combine(_pack_rows(jnp.asarray(x), p), jnp.asarray(w), p, mask_T=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(y), np.where(mask[:, None], x, 0.0))


def test_combine_matches_direct_sum_and_gradients():
    """y_t = sum_k w_tk y[inverse[t*K+k]], against a direct formula; gradients reach y_RD and
    weights_TK; rows past sum(group_sizes) hold NaN and are never read."""
    num_tokens, top_k, num_experts, width = 7, 2, 5, 3
    rng = np.random.default_rng(2)
    idx = np.stack([rng.choice(num_experts, 2, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    mask = np.array([1, 1, 0, 1, 1, 0, 1], bool)
    p = pack(jnp.asarray(idx), num_experts, mask_T=jnp.asarray(mask))
    used = int(np.sum(p.group_sizes_E))
    y_rows = rng.standard_normal((num_tokens * top_k, width)).astype(np.float32)
    y_rows[used:] = np.nan
    w = rng.uniform(0.1, 1.0, (num_tokens, top_k)).astype(np.float32)
    cot = rng.standard_normal((num_tokens, width)).astype(np.float32)

    def loss(y_rows, w):
        return jnp.sum(combine(y_rows, w, p) * cot)

    (dy, dw) = jax.grad(loss, argnums=(0, 1))(jnp.asarray(y_rows), jnp.asarray(w))
    inv = np.asarray(p.inverse_R).reshape(num_tokens, top_k)
    per_route = np.where(mask[:, None, None], y_rows[inv], 0.0)  # [T, K, D]
    expected = np.einsum("tk,tkd->td", w, np.nan_to_num(per_route))
    np.testing.assert_allclose(np.asarray(combine(jnp.asarray(y_rows), jnp.asarray(w), p)), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), np.einsum("tkd,td->tk", np.nan_to_num(per_route), cot), rtol=1e-5)
    expected_dy = np.zeros_like(y_rows)
    for t in range(num_tokens):
        for k in range(top_k):
            if mask[t]:
                expected_dy[inv[t, k]] = w[t, k] * cot[t]
    np.testing.assert_allclose(np.asarray(dy), expected_dy, rtol=1e-6)
    assert np.all(np.asarray(dw)[~mask] == 0.0)


def test_combine_backward_gathers_without_scatter():
    """The combine's backward reads each packed row's token cotangent through `order_R` (gathers
    only: no scatter, whose transpose-of-gather form needs atomics or a sort on a GPU); `pack`'s
    inverse permutation is a scatter declared with unique indices."""
    num_tokens, top_k, num_experts, width = 16, 2, 4, 8
    idx = jnp.asarray(np.random.default_rng(3).integers(0, num_experts, (num_tokens, top_k)), jnp.int32)
    packing = pack(idx, num_experts)

    def loss(y_rows, w):
        return jnp.sum(combine(y_rows, w, packing))

    backward = scatter_lines(jax.grad(loss, argnums=(0, 1)), jnp.zeros((num_tokens * top_k, width)),
                             jnp.ones((num_tokens, top_k)))
    inverse = scatter_lines(lambda idx: pack(idx, num_experts).order_R, idx)
    assert backward == [] and len(inverse) == 1, (backward, inverse)
    assert "unique_indices = true" in inverse[0], inverse


def test_combine_mask_argument_masks_tokens_packed_without_mask():
    idx = jnp.asarray([[0, 1], [1, 2], [2, 0]], jnp.int32)
    p = pack(idx, 3)
    y_rows = jnp.arange(12, dtype=jnp.float32).reshape(6, 2) + 1.0
    mask = jnp.asarray([True, False, True])
    y = combine(y_rows, jnp.ones((3, 2)), p, mask_T=mask)
    assert np.all(np.asarray(y)[1] == 0.0) and np.all(np.asarray(y)[[0, 2]] > 0)


def test_combine_accumulates_in_fp32_and_keeps_dtype():
    """bf16 rows whose sum would lose bits in a bf16 accumulator come out as the fp32 sum rounded
    once."""
    idx = jnp.asarray([[0, 1, 2]], jnp.int32)
    p = pack(idx, 3)
    y_rows = jnp.asarray([[256.0], [1.0], [1.0]], jnp.bfloat16)[p.inverse_R]
    y = combine(y_rows, jnp.ones((1, 3), jnp.float32), p)
    assert y.dtype == jnp.bfloat16
    assert float(y[0, 0]) == 258.0  # bf16 sequential sum would give 256 + 1 -> 256, + 1 -> 256


def bf16_cotangent_mismatches() -> int:
    """How many of the combine's row gradients differ from `w * g`, rounded to bf16, where `g` is
    the bf16 cotangent of its output: an fp32-accumulated bf16 product rounded to bf16, as
    LatentMoE's up-projection hands it back."""
    rng = np.random.default_rng(0)
    t, k, e, d, n = 64, 2, 4, 128, 96
    packing = pack(jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32), e)
    y_RD = jnp.asarray(rng.standard_normal((t * k, d)), jnp.bfloat16)
    w_TK = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    # Small integers: every precision a device's f32 dot may use (TF32 included) gives `g` exactly,
    # and |g| needs more bits than bf16 keeps, so its rounding to bf16 shows.
    w_ND = jnp.asarray(rng.integers(-8, 9, (n, d)), jnp.bfloat16)
    c_TN = jnp.asarray(rng.integers(-64, 65, (t, n)), jnp.float32)

    def loss(y_RD, w_TK, w_ND, c_TN):  # operands as arguments: no constant folding of the product
        y_TD = combine(y_RD, w_TK, packing)
        return jnp.sum(c_TN * jnp.dot(y_TD, w_ND.T, preferred_element_type=jnp.float32))

    dy_RD, _ = jax.jit(jax.grad(loss, argnums=(0, 1)))(y_RD, w_TK, w_ND, c_TN)
    g_TD = np.asarray(jnp.asarray(np.asarray(c_TN) @ np.asarray(w_ND, np.float32), jnp.bfloat16), np.float32)
    order_R = np.asarray(packing.order_R)
    want = w_TK.reshape(-1)[order_R][:, None] * g_TD[order_R // k]
    return int(np.sum(np.asarray(dy_RD, np.float32) != np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32)))


def test_combine_backward_reads_a_bf16_cotangent_at_its_bf16_values():
    """The rows' gradient is `w * g` from the bf16 cotangent `g`, rounded once to bf16."""
    assert bf16_cotangent_mismatches() == 0


@pytest.mark.slow  # a child process (the flag is read when the backend starts)
def test_combine_backward_keeps_the_bf16_rounding_the_compiler_would_remove():
    """The same where the compiler keeps an fp32 product's precision across its rounding to bf16
    (`tests.helpers.ROUND_TRIPS_REMOVED`). The FP8 experts quantize these rows, and one bf16 step
    across an e4m3 boundary moves a whole e4m3 step (a bf16 FP8 LatentMoE differed from the torch
    recipe by 1-2.5e-2 on a GPU where this rounding was not pinned)."""
    assert count_where_round_trips_removed("tests.test_permute:bf16_cotangent_mismatches") == 0


def test_empty_experts_and_invalid_ids_are_not_packed():
    idx = jnp.asarray([[5, 0], [0, -1], [9, 5]], jnp.int32)  # E = 6: experts 1-4 empty; -1, 9 invalid
    p = pack(idx, 6)
    np.testing.assert_array_equal(p.group_sizes_E, [2, 0, 0, 0, 0, 2])
    order = np.asarray(p.order_R)
    np.testing.assert_array_equal(order[:4], [1, 2, 0, 5])  # expert 0 then expert 5, token order
    y = combine(jnp.ones((6, 1)), jnp.ones((3, 2)), p)
    np.testing.assert_array_equal(np.asarray(y)[:, 0], [2.0, 1.0, 1.0])


def test_zero_tokens():
    p = pack(jnp.zeros((0, 2), jnp.int32), 4, mask_T=jnp.zeros((0,), bool))
    assert isinstance(p, Packing)
    assert p.order_R.shape == (0,) and np.all(np.asarray(p.group_sizes_E) == 0)
    rows = pack_rows(jnp.zeros((0, 3)), p)
    assert rows.shape == (0, 3)
    y = combine(rows, jnp.zeros((0, 2)), p)
    assert y.shape == (0, 3)
    dw = jax.grad(lambda w: jnp.sum(combine(rows, w, p)))(jnp.zeros((0, 2)))
    assert dw.shape == (0, 2)


def test_gather_rows_gradient_scatters_back_to_tokens():
    idx = jnp.asarray([[1, 0], [1, 2]], jnp.int32)
    mask = jnp.asarray([True, False])
    p = pack(idx, 3, mask_T=mask)
    x = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
    dx = jax.grad(lambda x: jnp.sum(pack_rows(x, p) * 2.0))(x)
    np.testing.assert_array_equal(np.asarray(dx), [[4.0, 4.0], [0.0, 0.0]])  # 2 routes x 2; masked 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: pack(jnp.zeros((2, 1), jnp.int32), 0), "num_experts"),
        (lambda: pack(jnp.zeros((2,), jnp.int32), 3), "2-D"),
        (lambda: pack(jnp.zeros((2, 1), jnp.float32), 3), "integer"),
        (lambda: pack(jnp.zeros((2, 1), jnp.int32), 3, mask_T=jnp.ones((3,), bool)), "mask_T"),
        (lambda: pack_rows(jnp.zeros((3, 2)), pack(jnp.zeros((2, 2), jnp.int32), 3)), "routes"),
        (lambda: combine(jnp.zeros((4, 2)), jnp.ones((3, 2)), pack(jnp.zeros((2, 2), jnp.int32), 3)), "routes"),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("routes,num_keys", [(1, 3), (255, 2), (256, 7), (1000, 64), (1030, 300)])
def test_stable_rank_matches_a_stable_sort(routes, num_keys):
    """The sort-free rank: earlier equal keys, for blocks that do not divide the routes, more keys
    than a block holds, and keys outside [0, num_keys) (whose ranks are unspecified) mixed in."""
    rng = np.random.default_rng(routes)
    keys = rng.integers(-2, num_keys + 2, routes).astype(np.int32)
    keys[: routes // 3] = rng.integers(0, 2, routes // 3)  # long runs of a few hot keys
    got, counts = map(np.asarray, stable_rank(jnp.asarray(keys), num_keys))
    order = np.argsort(keys, kind="stable")
    want = np.empty(routes, np.int64)
    want[order] = np.arange(routes) - np.searchsorted(keys[order], keys[order])
    valid = (keys >= 0) & (keys < num_keys)
    np.testing.assert_array_equal(got[valid], want[valid])
    np.testing.assert_array_equal(counts, np.bincount(keys[valid], minlength=num_keys))


def test_gather_rows_is_the_old_name_of_pack_rows():
    """`moe_jax.permute.gather_rows` (the name before `moe_jax.ops.gather_rows` existed) still works."""
    assert gather_rows is pack_rows
