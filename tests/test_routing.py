"""Tests of moe_jax.routing: routers against hand-computed cases, router gradients, balancing losses,
masking, the loss-free bias update, configuration errors and jit; the router logits' products."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from moe_jax.routing import (
    Routing,
    SelectedSoftmax,
    SigmoidGroupedTopK,
    SoftmaxTopK,
    aux_loss,
    expert_counts,
    router_logits,
    seq_aux_loss,
    update_selection_bias,
    z_loss,
)
from tests.helpers import lower_for_gpu, scatter_lines

# T=2 tokens, E=4 experts, all logits distinct so the top-k order is unambiguous.
LOGITS_24 = np.array([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 2.0, 4.0]], np.float32)


def np_softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def logit(p):
    p = np.asarray(p, np.float64)
    return np.log(p / (1.0 - p)).astype(np.float32)


def check_routing(r, idx, weights, probs):
    assert isinstance(r, Routing)
    assert r.expert_idx_TK.dtype == jnp.int32
    assert r.weights_TK.dtype == jnp.float32 and r.probs_TE.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(r.expert_idx_TK), np.asarray(idx))
    np.testing.assert_allclose(np.asarray(r.weights_TK), weights, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(r.probs_TE), probs, rtol=1e-6, atol=1e-7)


def random_logits(seed, t, e, scale=2.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((t, e)) * scale, jnp.float32)


# ------------------------------------------------------------------------------------------------
# Routers: hand-computed cases.


def test_selected_softmax_hand_case():
    r = SelectedSoftmax(top_k=2).route(jnp.asarray(LOGITS_24))
    idx = [[1, 2], [3, 2]]
    w = np.array([np_softmax([3.0, 2.0]), np_softmax([4.0, 2.0])])
    check_routing(r, idx, w, np_softmax(LOGITS_24))


def test_selected_softmax_bias_changes_choice_not_weights():
    bias = np.array([0.0, 0.0, 0.0, 5.0], np.float32)
    r = SelectedSoftmax(top_k=2).route(jnp.asarray(LOGITS_24), selection_bias_E=jnp.asarray(bias))
    # Row 0: biased scores [1, 3, 2, 5] -> experts 3, 1; weights from the *unbiased* logits 0, 3.
    idx = [[3, 1], [3, 2]]
    w = np.array([np_softmax([0.0, 3.0]), np_softmax([4.0, 2.0])])
    check_routing(r, idx, w, np_softmax(LOGITS_24))


def test_selected_softmax_equals_renormalised_full_softmax():
    logits = random_logits(0, 16, 8)
    r = SelectedSoftmax(top_k=3).route(logits, selection_bias_E=jnp.linspace(-1.0, 1.0, 8))
    full = np_softmax(np.asarray(logits))
    chosen = np.take_along_axis(full, np.asarray(r.expert_idx_TK), axis=-1)
    np.testing.assert_allclose(np.asarray(r.weights_TK), chosen / chosen.sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(r.weights_TK).sum(-1), 1.0, rtol=1e-6)


def test_softmax_topk_hand_case():
    p = np_softmax(LOGITS_24)
    idx = [[1, 2], [3, 2]]
    sel = np.take_along_axis(p, np.array(idx), axis=-1)
    check_routing(SoftmaxTopK(top_k=2).route(jnp.asarray(LOGITS_24)), idx, sel, p)
    check_routing(
        SoftmaxTopK(top_k=2, renormalize=True).route(jnp.asarray(LOGITS_24)),
        idx,
        sel / sel.sum(-1, keepdims=True),
        p,
    )


def test_softmax_topk_bias_added_to_probabilities():
    p = np_softmax(LOGITS_24)
    # Row 0: p = [.090, .665, .245, .033]; +0.9 on expert 0 -> [.990, .665, ...] picks 0 then 1.
    # Row 1: p = [.020, .004, .117, .859]; +0.9 on expert 0 -> [.920, ...] picks 0 then 3.
    # A bias of 0.9 on the *logit* scale would not move row 1 at all, so this also checks that the
    # bias is added after the softmax.
    bias = jnp.asarray([0.9, 0.0, 0.0, 0.0])
    idx = np.array([[0, 1], [0, 3]])
    sel = np.take_along_axis(p, idx, axis=-1)  # unbiased probabilities
    check_routing(SoftmaxTopK(top_k=2).route(jnp.asarray(LOGITS_24), selection_bias_E=bias), idx, sel, p)
    check_routing(
        SoftmaxTopK(top_k=2, renormalize=True).route(jnp.asarray(LOGITS_24), selection_bias_E=bias),
        idx,
        sel / sel.sum(-1, keepdims=True),
        p,
    )


def test_sigmoid_hand_case_normalize_and_scaling():
    s = np_sigmoid(LOGITS_24)
    idx = np.array([[1, 2], [3, 2]])
    sel = np.take_along_axis(s, idx, axis=-1)
    probs = s / s.sum(-1, keepdims=True)
    logits = jnp.asarray(LOGITS_24)
    check_routing(SigmoidGroupedTopK(top_k=2).route(logits), idx, sel / sel.sum(-1, keepdims=True), probs)
    unnormalised = SigmoidGroupedTopK(top_k=2, normalize=False, routed_scaling_factor=2.5)
    check_routing(unnormalised.route(logits), idx, 2.5 * sel, probs)


def test_sigmoid_bias_changes_choice_not_weights():
    s = np_sigmoid(LOGITS_24)
    # Row 0: s = [.731, .953, .881, .5]; +0.5 on expert 3 -> 1.0 beats all; row 1 keeps 3 and 2.
    bias = jnp.asarray([0.0, 0.0, 0.0, 0.5])
    idx = np.array([[3, 1], [3, 2]])
    sel = np.take_along_axis(s, idx, axis=-1)
    router = SigmoidGroupedTopK(top_k=2, routed_scaling_factor=1.5)
    r = router.route(jnp.asarray(LOGITS_24), selection_bias_E=bias)
    check_routing(r, idx, 1.5 * sel / sel.sum(-1, keepdims=True), s / s.sum(-1, keepdims=True))


def test_group_limited_selection_excludes_best_expert_in_losing_group():
    # E=6 in two groups of three; one group kept; two experts per token.
    s = np.array(
        [
            # Group A top-2 sum 1.55 beats B's 1.40 (B would win on the full sum, 1.9).
            [0.95, 0.05, 0.60, 0.70, 0.70, 0.50],
            # Group A holds the best expert (0.95) but its top-2 sum is 1.00 < B's 1.22: A loses,
            # so expert 0 is excluded although it scores highest (it would win on the max).
            [0.95, 0.05, 0.05, 0.60, 0.62, 0.10],
        ]
    )
    router = SigmoidGroupedTopK(top_k=2, n_group=2, topk_group=1)
    r = router.route(jnp.asarray(logit(s)))
    idx = np.array([[0, 2], [4, 3]])
    sel = np.take_along_axis(s, idx, axis=-1)
    check_routing(r, idx, sel / sel.sum(-1, keepdims=True), s / s.sum(-1, keepdims=True))
    # Without grouping, row 1 takes the best single expert.
    ungrouped = SigmoidGroupedTopK(top_k=2).route(jnp.asarray(logit(s)))
    np.testing.assert_array_equal(np.asarray(ungrouped.expert_idx_TK)[1], [0, 4])


def test_group_scores_use_biased_scores():
    s = np.array([[0.9, 0.8, 0.7, 0.6]])  # groups {0,1} (1.7) and {2,3} (1.3)
    router = SigmoidGroupedTopK(top_k=1, n_group=2, topk_group=1)
    np.testing.assert_array_equal(np.asarray(router.route(jnp.asarray(logit(s))).expert_idx_TK), [[0]])
    # +0.25 on experts 2 and 3 lifts group {2,3} to 1.8; expert 2 then wins with biased 0.95.
    r = router.route(jnp.asarray(logit(s)), selection_bias_E=jnp.asarray([0.0, 0.0, 0.25, 0.25]))
    np.testing.assert_array_equal(np.asarray(r.expert_idx_TK), [[2]])
    np.testing.assert_allclose(np.asarray(r.weights_TK), [[1.0]], rtol=1e-6)  # normalised unbiased 0.7


def test_single_expert_groups_and_negative_bias_with_masking():
    logits = random_logits(1, 32, 8)
    # Groups of one expert: a group scores its only expert, so keeping the best `topk_group`
    # groups and taking top-k inside them is plain top-k when top_k == topk_group.
    grouped = SigmoidGroupedTopK(top_k=3, n_group=8, topk_group=3).route(logits)
    plain = SigmoidGroupedTopK(top_k=3).route(logits)
    np.testing.assert_array_equal(np.asarray(grouped.expert_idx_TK), np.asarray(plain.expert_idx_TK))
    # Strongly negative biases (all biased scores < 0): a dropped group's experts must still never
    # be chosen, which a 0-fill (rather than -inf) mask would get wrong.
    router = SigmoidGroupedTopK(top_k=2, n_group=4, topk_group=1)
    r = router.route(logits, selection_bias_E=jnp.full((8,), -5.0))
    s_TGP = np_sigmoid(logits).reshape(-1, 4, 2)
    kept_T = s_TGP.sum(-1).argmax(-1)  # pairs: a group scores both its experts
    pair_T2 = s_TGP[np.arange(len(kept_T)), kept_T]
    expected = 2 * kept_T[:, None] + np.argsort(-pair_T2, axis=-1)
    np.testing.assert_array_equal(np.asarray(r.expert_idx_TK), expected)


# ------------------------------------------------------------------------------------------------
# Router gradients.


def test_selected_softmax_grad_matches_seed_backward():
    logits = random_logits(2, 8, 6)
    c = jnp.asarray(np.random.default_rng(3).standard_normal((8, 3)), jnp.float32)
    router = SelectedSoftmax(top_k=3)
    grad = jax.grad(lambda l: jnp.sum(router.route(l).weights_TK * c))(logits)

    r = router.route(logits)
    p, dp, idx = np.asarray(r.weights_TK), np.asarray(c), np.asarray(r.expert_idx_TK)
    d_selected = p * (dp - (p * dp).sum(-1, keepdims=True))
    expected = np.zeros((8, 6), np.float32)
    np.put_along_axis(expected, idx, d_selected, axis=-1)  # distinct indices per row: a scatter-add
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)
    # Unselected experts receive exactly zero.
    unselected = np.ones((8, 6), bool)
    np.put_along_axis(unselected, idx, False, axis=-1)
    assert (np.asarray(grad)[unselected] == 0).all()


@pytest.mark.parametrize(
    "router",
    [
        SoftmaxTopK(top_k=2),
        SoftmaxTopK(top_k=2, renormalize=True),
        SigmoidGroupedTopK(top_k=2),
        SigmoidGroupedTopK(top_k=3, n_group=3, topk_group=2, routed_scaling_factor=2.5),
        SigmoidGroupedTopK(top_k=2, normalize=False, routed_scaling_factor=1.5),
    ],
    ids=repr,
)
def test_router_grads_match_finite_differences(router):
    # Logits spaced 0.5 apart (shuffled per row) keep the selection, and the groups' scores,
    # clear of ties under the eps probe. The bias forces expert 0 in and expert 5 out whatever
    # their logits, and is far from any tie too.
    rng = np.random.default_rng(4)
    logits = jnp.asarray(np.stack([rng.permutation(6) * 0.5 - 1.5 for _ in range(4)]), jnp.float32)
    bias = jnp.asarray([1.0, 0.0, 0.0, 0.0, 0.0, -1.0])
    check_grads(
        lambda l: router.route(l, selection_bias_E=bias).weights_TK,
        (logits,),
        order=1,
        modes=["rev"],
        eps=1e-2,
        atol=2e-3,
        rtol=2e-3,
    )


@pytest.mark.parametrize(
    "router",
    [SelectedSoftmax(top_k=2), SoftmaxTopK(top_k=2), SoftmaxTopK(top_k=2, renormalize=True),
     SigmoidGroupedTopK(top_k=3, n_group=3, topk_group=2)],
    ids=repr,
)
def test_router_backward_scatters_unique_entries(router):
    """A row's K experts are distinct, and the backward says so: the scatter that returns the
    routing weights' gradient to the logits is declared with unique indices (no atomics, no sort
    for repeated indices on a GPU)."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(8, 6)), jnp.float32)
    scatters = scatter_lines(jax.grad(lambda l: jnp.sum(router.route(l).weights_TK ** 2)), logits)
    assert scatters and all("unique_indices = true" in line for line in scatters), scatters


@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid_router_gradients_stay_finite_for_very_negative_logits(normalize):
    """Every logit of a token below -45: the scores underflow and autodiff of s / (S + 1e-20)
    squared the denominator to 0, giving NaN through probs_TE and the normalised weights."""
    router = SigmoidGroupedTopK(top_k=2, n_group=2, topk_group=1, normalize=normalize)
    ordinary = jax.random.normal(jax.random.PRNGKey(0), (2, 8))
    logits = jnp.concatenate([jnp.full((1, 8), -60.0), ordinary[:1]])

    def loss(z):
        r = router.route(z)
        return jnp.sum(r.weights_TK * jnp.arange(1.0, 3.0)) + jnp.sum(r.probs_TE * jnp.arange(8.0))

    value, grad = jax.value_and_grad(loss)(logits)
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
    # Ordinary logits keep the plain quotient's gradient.
    plain = lambda z: jnp.sum((s := jax.nn.sigmoid(z)) / (s.sum(-1, keepdims=True) + 1e-20) * jnp.arange(8.0))
    np.testing.assert_allclose(jax.grad(lambda z: jnp.sum(router.route(z).probs_TE * jnp.arange(8.0)))(ordinary),
                               jax.grad(plain)(ordinary), rtol=1e-5, atol=1e-7)


def test_bias_receives_no_gradient():
    logits = random_logits(5, 8, 4)
    for router in (SelectedSoftmax(2), SoftmaxTopK(2, renormalize=True), SigmoidGroupedTopK(2, n_group=2)):
        f = lambda b: jnp.sum(router.route(logits, selection_bias_E=b).weights_TK ** 2)
        np.testing.assert_array_equal(np.asarray(jax.grad(f)(jnp.zeros(4))), 0.0)


# ------------------------------------------------------------------------------------------------
# Statistics and losses.


def test_expert_counts_with_mask():
    idx = jnp.asarray([[0, 1], [1, 2], [3, 1], [0, 2]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(expert_counts(idx, 5)), [2, 3, 2, 1, 0])
    mask = jnp.asarray([True, False, True, False])
    counts = expert_counts(idx, 5, mask_T=mask)
    assert counts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(counts), [1, 2, 0, 1, 0])
    # Ids outside [0, E) are dropped, negative ones too (a scatter would wrap -1 to E - 1).
    bad = jnp.asarray([[-1, 0], [4, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(expert_counts(bad, 4)), [1, 0, 0, 0])
    # Leading axes may be [B, S].
    np.testing.assert_array_equal(
        np.asarray(expert_counts(idx.reshape(2, 2, 2), 5, mask_T=mask.reshape(2, 2))), [1, 2, 0, 1, 0]
    )


def test_aux_loss_uniform_is_one():
    probs = jnp.full((8, 4), 0.25)
    idx = (jnp.arange(8, dtype=jnp.int32) % 4)[:, None]  # round robin, K=1
    np.testing.assert_allclose(float(aux_loss(probs, idx)), 1.0, rtol=1e-6)
    # K=2, every expert twice per 4 tokens.
    idx2 = jnp.stack([jnp.arange(8) % 4, (jnp.arange(8) + 1) % 4], axis=-1).astype(jnp.int32)
    np.testing.assert_allclose(float(aux_loss(probs, idx2)), 1.0, rtol=1e-6)


def test_aux_loss_skewed_hand_value():
    probs = np.array([[0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1], [0.6, 0.2, 0.1, 0.1]], np.float32)
    idx = np.array([[0], [0], [1]], np.int32)
    # f = [2/3, 1/3, 0, 0]; Pbar = [1.7/3, 0.7/3, 0.1, 0.1]; 4 * (2/3*1.7/3 + 1/3*0.7/3) = 4.1*4/9.
    np.testing.assert_allclose(float(aux_loss(jnp.asarray(probs), jnp.asarray(idx))), 4 * 4.1 / 9, rtol=1e-6)


def test_aux_loss_gradient_only_through_probs():
    rng = np.random.default_rng(6)
    probs = jnp.asarray(np_softmax(rng.standard_normal((6, 4))), jnp.float32)
    idx = jnp.asarray([[0, 1], [0, 2], [0, 1], [3, 0], [1, 2], [0, 3]], jnp.int32)
    mask = jnp.asarray([True, True, False, True, True, True])
    grad = jax.grad(lambda p: aux_loss(p, idx, mask_T=mask))(probs)
    counts = np.asarray(expert_counts(idx, 4, mask_T=mask), np.float64)
    t_real, k, e = 5, 2, 4
    expected_row = e * (counts / (t_real * k)) / t_real  # E * f_e / T_real
    expected = np.where(np.asarray(mask)[:, None], expected_row[None, :], 0.0)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6)


def test_seq_aux_loss_hand_value():
    # B=2, S=2, E=2, K=1.
    probs = np.array([[[0.8, 0.2], [0.6, 0.4]], [[0.5, 0.5], [0.3, 0.7]]], np.float32)
    idx = np.array([[[0], [0]], [[0], [1]]], np.int32)
    # b=0: f = 2/2 * [2, 0] = [2, 0], P = [0.7, 0.3] -> 1.4.  b=1: f = [1, 1], P = [0.4, 0.6] -> 1.0.
    loss = seq_aux_loss(jnp.asarray(probs), jnp.asarray(idx))
    np.testing.assert_allclose(float(loss), 1.2, rtol=1e-6)
    # Masking the second token of b=0: f = 2/1 * [1, 0], P = [0.8, 0.2] -> 1.6; mean (1.6 + 1.0) / 2.
    mask = jnp.asarray([[True, False], [True, True]])
    loss = seq_aux_loss(jnp.asarray(probs), jnp.asarray(idx), mask_BS=mask)
    np.testing.assert_allclose(float(loss), 1.3, rtol=1e-6)
    # A fully padded sequence is left out of the mean, not counted as zero.
    mask = jnp.asarray([[False, False], [True, True]])
    loss = seq_aux_loss(jnp.asarray(probs), jnp.asarray(idx), mask_BS=mask)
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)


def test_seq_aux_loss_uniform_is_one_and_grad_is_constant_f():
    probs = jnp.full((2, 4, 4), 0.25)
    idx = jnp.broadcast_to((jnp.arange(4, dtype=jnp.int32) % 4)[None, :, None], (2, 4, 1))
    np.testing.assert_allclose(float(seq_aux_loss(probs, idx)), 1.0, rtol=1e-6)
    grad = jax.grad(lambda p: seq_aux_loss(p, idx))(probs)
    # dL/dP[b,s,e] = f_be / (S_b * B_real) = 1 / (4 * 2) everywhere.
    np.testing.assert_allclose(np.asarray(grad), 1.0 / 8, rtol=1e-6)


def test_z_loss_hand_value():
    logits = np.array([[0.0, 0.0], [1.0, 2.0], [3.0, -1.0]], np.float32)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(z_loss(jnp.asarray(logits))), np.mean(lse**2), rtol=1e-6)
    by_hand = (np.log(2.0) ** 2 + (2.0 + np.log1p(np.exp(-1.0))) ** 2) / 2
    np.testing.assert_allclose(float(z_loss(jnp.asarray(logits[:2]))), by_hand, rtol=1e-6)


def test_masked_tokens_change_nothing():
    rng = np.random.default_rng(7)
    b, s, e, k = 3, 5, 8, 2
    logits_BSE = jnp.asarray(rng.standard_normal((b, s, e)) * 2, jnp.float32)
    mask_BS = jnp.asarray(rng.random((b, s)) < 0.6).at[0, 0].set(True)
    # Garbage in padding rows must not leak into any statistic or gradient.
    logits_BSE = jnp.where(mask_BS[..., None], logits_BSE, jnp.nan)
    router = SoftmaxTopK(top_k=k)
    r = router.route(logits_BSE.reshape(-1, e))
    probs_BSE = r.probs_TE.reshape(b, s, e)
    idx_BSK = r.expert_idx_TK.reshape(b, s, k)
    mask_T = mask_BS.reshape(-1)

    real = np.asarray(mask_T)
    r_real = router.route(logits_BSE.reshape(-1, e)[real])
    np.testing.assert_array_equal(
        np.asarray(expert_counts(r.expert_idx_TK, e, mask_T=mask_T)),
        np.asarray(expert_counts(r_real.expert_idx_TK, e)),
    )
    np.testing.assert_allclose(
        float(aux_loss(r.probs_TE, r.expert_idx_TK, mask_T=mask_T)),
        float(aux_loss(r_real.probs_TE, r_real.expert_idx_TK)),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        float(z_loss(logits_BSE.reshape(-1, e), mask_T=mask_T)),
        float(z_loss(logits_BSE.reshape(-1, e)[real])),
        rtol=1e-6,
    )
    # seq_aux_loss: each sequence against its own real tokens alone.
    per_seq = []
    for bi in range(b):
        keep = np.asarray(mask_BS[bi])
        if keep.any():
            per_seq.append(float(seq_aux_loss(probs_BSE[bi : bi + 1, keep], idx_BSK[bi : bi + 1, keep])))
    loss = seq_aux_loss(probs_BSE, idx_BSK, mask_BS=mask_BS)
    np.testing.assert_allclose(float(loss), np.mean(per_seq), rtol=1e-6)
    # Gradients of the losses w.r.t. probs / logits are finite and zero on padding rows.
    g_aux = jax.grad(lambda p: aux_loss(p, r.expert_idx_TK, mask_T=mask_T))(r.probs_TE)
    g_z = jax.grad(lambda l: z_loss(l, mask_T=mask_T))(logits_BSE.reshape(-1, e))
    for g in (g_aux, g_z):
        assert np.isfinite(np.asarray(g)).all()
        assert (np.asarray(g)[~real] == 0).all()


def test_all_masked_losses_are_zero_not_nan():
    probs = jnp.full((4, 4), 0.25)
    idx = jnp.zeros((4, 2), jnp.int32)
    none_T = jnp.zeros((4,), bool)
    values = [
        aux_loss(probs, idx, mask_T=none_T),
        z_loss(jnp.ones((4, 4)), mask_T=none_T),
        seq_aux_loss(probs.reshape(2, 2, 4), idx.reshape(2, 2, 2), mask_BS=none_T.reshape(2, 2)),
    ]
    for v in values:
        assert float(v) == 0.0
    def both(p):
        seq = seq_aux_loss(p.reshape(2, 2, 4), idx.reshape(2, 2, 2), mask_BS=none_T.reshape(2, 2))
        return aux_loss(p, idx, mask_T=none_T) + seq

    g = jax.grad(both)(probs)
    np.testing.assert_array_equal(np.asarray(g), 0.0)
    np.testing.assert_array_equal(np.asarray(expert_counts(idx, 4, mask_T=none_T)), 0)


# ------------------------------------------------------------------------------------------------
# Loss-free balancing.


def test_update_selection_bias_rule():
    bias = jnp.asarray([0.0, 0.5, -0.5, 0.0])
    counts = jnp.asarray([10, 2, 4, 4], jnp.int32)  # mean 5
    out = update_selection_bias(bias, counts, 0.1)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), [-0.1, 0.6, -0.4, 0.1], rtol=1e-6)
    # Balanced loads leave the bias alone; no gradient flows through the update.
    balanced = update_selection_bias(bias, jnp.full((4,), 3), 0.1)
    np.testing.assert_array_equal(np.asarray(balanced), np.asarray(bias))
    g = jax.grad(lambda b, c: update_selection_bias(b, c, 0.1).sum(), argnums=(0, 1))(
        bias, counts.astype(jnp.float32)
    )
    np.testing.assert_array_equal(np.asarray(g[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(g[1]), 0.0)


@pytest.mark.parametrize(
    "router,step_size",
    [
        (SelectedSoftmax(top_k=2), 0.05),  # bias on the logit scale
        (SoftmaxTopK(top_k=2), 0.01),  # bias on the probability scale
        (SigmoidGroupedTopK(top_k=2, n_group=4, topk_group=2), 0.01),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, float) else str(v),
)
def test_loss_free_bias_balances_skewed_router(router, step_size):
    rng = np.random.default_rng(8)
    t, d, e = 512, 16, 8
    x_TD = rng.standard_normal((t, d)).astype(np.float32)
    w_ED = (rng.standard_normal((e, d)) * 0.3).astype(np.float32)
    skew_E = np.zeros(e, np.float32)
    skew_E[0] = 3.0  # the router strongly favours expert 0
    logits_TE = jnp.asarray(x_TD @ w_ED.T + skew_E)

    def step(bias_E, _):
        counts_E = expert_counts(router.route(logits_TE, selection_bias_E=bias_E).expert_idx_TK, e)
        return update_selection_bias(bias_E, counts_E, step_size), counts_E

    _, counts_NE = jax.jit(lambda b: jax.lax.scan(step, b, None, length=51))(jnp.zeros(e))
    counts_NE = np.asarray(counts_NE, np.float64)
    cv = counts_NE.std(-1) / counts_NE.mean(-1)
    assert cv[0] > 0.8, cv[0]  # really skewed at step 0
    # The sign rule settles into a small oscillation around balance, so judge the last steps.
    assert cv[-10:].max() < 0.25 * cv[0], (cv[0], cv[-10:])
    assert counts_NE[-1].min() > 0
    assert counts_NE[-1].max() / counts_NE[-1].min() < 2.5, counts_NE[-1]


# ------------------------------------------------------------------------------------------------
# Configuration errors.


@pytest.mark.parametrize(
    "make,error,arg",
    [
        (lambda: SelectedSoftmax(top_k=0), ValueError, "top_k"),
        (lambda: SoftmaxTopK(top_k=-1), ValueError, "top_k"),
        (lambda: SoftmaxTopK(top_k=2.0), TypeError, "top_k"),
        (lambda: SoftmaxTopK(top_k=2, renormalize=1), TypeError, "renormalize"),
        (lambda: SigmoidGroupedTopK(top_k=0), ValueError, "top_k"),
        (lambda: SigmoidGroupedTopK(top_k=2, n_group=0), ValueError, "n_group"),
        (lambda: SigmoidGroupedTopK(top_k=2, n_group=2, topk_group=3), ValueError, "topk_group"),
        (lambda: SigmoidGroupedTopK(top_k=2, n_group=2, topk_group=0), ValueError, "topk_group"),
        (lambda: SigmoidGroupedTopK(top_k=2, routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
    ],
)
def test_bad_config_raises_at_construction(make, error, arg):
    with pytest.raises(error, match=arg):
        make()


def test_numpy_scalars_configure_routers():
    """NumPy integers and floats are numbers: the routers store them as Python values."""
    router = SigmoidGroupedTopK(np.int64(2), n_group=np.int32(2), topk_group=np.int64(1),
                                routed_scaling_factor=np.float32(2.5))
    assert (router.top_k, router.n_group, router.routed_scaling_factor) == (2, 2, 2.5)
    assert type(router.top_k) is int and type(router.routed_scaling_factor) is float
    assert SoftmaxTopK(np.int64(3), renormalize=np.bool_(True)).renormalize is True


@pytest.mark.parametrize(
    "router,bias,match",
    [
        (SelectedSoftmax(top_k=5), None, "num_experts"),
        (SoftmaxTopK(top_k=5), None, "num_experts"),
        (SigmoidGroupedTopK(top_k=5), None, "num_experts"),
        (SigmoidGroupedTopK(top_k=2, n_group=3, topk_group=1), None, "n_group"),
        (SigmoidGroupedTopK(top_k=3, n_group=2, topk_group=1), None, "topk_group"),
        (SelectedSoftmax(top_k=2), jnp.zeros(3), "selection_bias_E"),
        (SoftmaxTopK(top_k=2), jnp.zeros((1, 4)), "selection_bias_E"),
        (SigmoidGroupedTopK(top_k=2), jnp.zeros(5), "selection_bias_E"),
    ],
)
def test_bad_config_raises_at_route(router, bias, match):
    with pytest.raises(ValueError, match=match):
        router.route(jnp.asarray(LOGITS_24), selection_bias_E=bias)


def test_bad_arguments_to_statistics():
    with pytest.raises(ValueError, match="mask_T"):
        aux_loss(jnp.full((4, 4), 0.25), jnp.zeros((4, 1), jnp.int32), mask_T=jnp.ones((3,), bool))
    with pytest.raises(ValueError, match="logits_TE"):
        SelectedSoftmax(top_k=1).route(jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="bias_E"):
        update_selection_bias(jnp.zeros(4), jnp.zeros(5), 0.1)


@pytest.mark.parametrize(
    "step_size, error, match",
    [
        (None, TypeError, r"step_size must be a number >= 0 \(e.g. 1e-3\) or a float scalar array; got NoneType None"),
        ("0.1", TypeError, "step_size must be a number >= 0 .* got str '0.1'"),  # was read as 0.1
        (True, TypeError, "got bool True"),
        (jnp.ones(4), TypeError, r"got an array of shape \(4,\) and dtype float32"),
        (jnp.int32(1), TypeError, "dtype int32"),
        (-0.1, ValueError, "step_size=-0.1 must be a finite number >= 0"),
        (float("inf"), ValueError, "must be a finite number >= 0"),
    ],
)
def test_update_selection_bias_names_a_bad_step_size(step_size, error, match):
    with pytest.raises(error, match=match):
        update_selection_bias(jnp.zeros(4), jnp.arange(4), step_size)


# ------------------------------------------------------------------------------------------------
# jit.


@pytest.mark.parametrize(
    "router",
    [
        SelectedSoftmax(top_k=2),
        SoftmaxTopK(top_k=2, renormalize=True),
        SigmoidGroupedTopK(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.0),
    ],
    ids=lambda r: type(r).__name__,
)
def test_everything_under_jit(router):
    logits_BSE = random_logits(9, 2 * 6, 4).reshape(2, 6, 4).astype(jnp.bfloat16)
    mask_BS = jnp.asarray([[True] * 6, [True] * 3 + [False] * 3])
    bias_E = jnp.asarray([0.1, -0.1, 0.0, 0.05])

    def everything(logits_BSE, mask_BS, bias_E):
        logits_TE = logits_BSE.reshape(-1, 4)
        r = router.route(logits_TE, selection_bias_E=bias_E)
        mask_T = mask_BS.reshape(-1)
        counts_E = expert_counts(r.expert_idx_TK, 4, mask_T=mask_T)
        losses = (
            aux_loss(r.probs_TE, r.expert_idx_TK, mask_T=mask_T),
            seq_aux_loss(r.probs_TE.reshape(2, 6, 4), r.expert_idx_TK.reshape(2, 6, 2), mask_BS=mask_BS),
            z_loss(logits_TE, mask_T=mask_T),
        )
        return r, counts_E, losses, update_selection_bias(bias_E, counts_E, 0.01)

    eager = everything(logits_BSE, mask_BS, bias_E)
    jitted = jax.jit(everything)(logits_BSE, mask_BS, bias_E)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # Router configs are hashable, so they can be static jit arguments too.
    routed = jax.jit(lambda rt, l: rt.route(l), static_argnums=0)(router, logits_BSE.reshape(-1, 4))
    assert routed.weights_TK.dtype == jnp.float32 and routed.expert_idx_TK.dtype == jnp.int32
    # And the router gradient traces under jit.
    grad_fn = jax.jit(jax.grad(lambda l: jnp.sum(router.route(l).weights_TK ** 2)))
    g = grad_fn(logits_BSE.reshape(-1, 4).astype(jnp.float32))
    assert np.isfinite(np.asarray(g)).all()


def _logits_reference(x_TD, w_ED):
    return jnp.dot(x_TD.astype(jnp.float32), w_ED.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("dtypes", [(jnp.float32, jnp.float32), (jnp.float16, jnp.float16), (jnp.float32, jnp.bfloat16),
                                    (jnp.bfloat16, jnp.float16)])
def test_router_logits_other_dtypes_are_the_float32_product(dtypes):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(7), 3)
    x = jax.random.normal(kx, (48, 96)).astype(dtypes[0])
    w = (0.1 * jax.random.normal(kw, (12, 96))).astype(dtypes[1])
    g = jax.random.normal(kg, (48, 12))
    y, vjp = jax.vjp(router_logits, x, w)
    want, vjp_want = jax.vjp(_logits_reference, x, w)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    for got, ref in zip(vjp(g), vjp_want(g)):
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))


@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float32])
def test_router_logits_bf16_products_are_exact_and_gradients_within_rounding(w_dtype):
    """bf16 `x` with bf16 or fp32 weights: float32 logits equal to the float32 product up to the
    order of summation (within 2 (n + 3) 2^-24 of the terms' magnitudes, n the contraction); `dx`
    (bf16) within one bf16 ulp of the float32 reference's plus the hi + lo split's error (2^-16 of
    each term, so bounded by the terms' magnitudes, which decide where a sum cancels); an fp32 `dw`
    equal to the float32 product up to the order of summation, a bf16 one within one ulp plus the
    split's error; NaN-free on empty rows."""
    t, d = 40, 384
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(8), 3)
    x = jax.random.normal(kx, (t, d)).astype(jnp.bfloat16).at[3].set(0)
    w = (0.05 * jax.random.normal(kw, (16, d))).astype(w_dtype)
    g = 1e-3 * jax.random.normal(kg, (t, 16))
    y, vjp = jax.vjp(router_logits, x, w)
    want, vjp_want = jax.vjp(_logits_reference, x, w)
    x32, w32, g32 = (np.abs(np.asarray(a, np.float32)) for a in (x, w, g))
    eps = 2.0 ** -24
    assert y.dtype == jnp.float32
    np.testing.assert_array_less(np.abs(np.asarray(y) - np.asarray(want)), 2 * (d + 3) * eps * (x32 @ w32.T) + 1e-30)
    (dx, dw), (dx_ref, dw_ref) = vjp(g), vjp_want(g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == w_dtype
    for got, ref, terms, exact in ((dx, dx_ref, g32 @ w32, False), (dw, dw_ref, g32.T @ x32, w_dtype == jnp.float32)):
        got32, ref32 = np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        assert np.all(np.isfinite(got32))
        if exact:  # the summation order's error alone
            bound = 2 * (t + 3) * eps * terms
        else:  # one bf16 ulp of each result, and the split's error on each side of a rounding boundary
            bound = 2 ** -7 * np.abs(ref32) + 2 ** -15 * terms
        np.testing.assert_array_less(np.abs(got32 - ref32), bound + 1e-30)


@pytest.mark.parametrize("w_dtype, dots", [(jnp.bfloat16, 4), (jnp.float32, 7)])
def test_router_logits_bf16_runs_every_product_on_bf16_operands(w_dtype, dots):
    """Lowered for a GPU: the forward and both gradient products take bf16 operands and return
    float32 (tensor-core GEMMs), where the float32 path converts the operands first. bf16 weights:
    the forward, dx, dw from hi and from lo; fp32 weights: the forward per weight part (3), dx, dw per
    cotangent part (3)."""
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((16, 256), w_dtype)

    def step(x, w):
        return jax.grad(lambda x, w: jnp.sum(router_logits(x, w) ** 2), argnums=(0, 1))(x, w)

    found = [line for line in lower_for_gpu(step, x, w).splitlines() if "stablehlo.dot_general" in line]
    assert len(found) == dots, found
    assert all(re.search(r"\(tensor<[0-9x]+xbf16>, tensor<[0-9x]+xbf16>\) -> tensor<[0-9x]+xf32>", d) for d in found), found
