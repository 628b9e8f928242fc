"""moe_jax.layers.MoE on one device: output, every gradient and the statistics against the fp32
dense reference (`moe_jax.dense_reference`), for each router, shared experts, LatentMoE, fused
gate/up, masks, injected routing, bf16 compute, the Pallas backend, scanned layer stacks, the
loss-free bias, and configuration errors.

Legend: B batch, S sequence, T = B*S tokens, D model width, F expert hidden width, E experts,
K top-k, L latent width.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import routing as R
from moe_jax.dense_reference import LatentWeights, SwiGLUWeights, moe_reference, router_reference
from moe_jax.experts import split_gate_up
from moe_jax.layers import EPOptions, GemmOptions, MoE, MoEStats, SelectionBias, SharedExperts
from moe_jax.ops import CANDIDATES, candidate_index, gmm_config, select, selector_table
from moe_jax.parallel import make_mesh
from moe_jax.testing import assert_close, rel_err, tolerance

B, S, D, F, E, K, L = 2, 8, 8, 6, 8, 2, 4
HI = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- reference helpers


def flat_params(module) -> dict:
    """{path tuple: array} of the module's nnx.Params."""
    return {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def reference_apply(p: dict, x, router, *, mask=None, routing=None, bias=None):
    """fp32 reference output of an MoE with params `p` (`flat_params` layout); also returns the
    routing and logits it used."""
    x_T = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    logits = jnp.dot(x_T, p[("w_router",)].astype(jnp.float32).T, precision=HI)
    if routing is None:
        routing = router_reference(x, p[("w_router",)], router, selection_bias_E=bias)
    if ("w_gate_up",) in p:
        w_gate, w_up = split_gate_up(p[("w_gate_up",)])
    else:
        w_gate, w_up = p[("w_gate",)], p[("w_up",)]
    shared = None
    if ("shared", "w_gate") in p:
        shared = SwiGLUWeights(*(p[("shared", n)] for n in ("w_gate", "w_up", "w_down")), p.get(("w_shared_gate",)))
    latent = None
    if ("w_latent_down",) in p:
        latent = LatentWeights(p[("w_latent_down",)], p[("w_latent_up",)])
    y = moe_reference(x, routing, w_gate, w_up, p[("w_down",)], mask=mask, shared=shared, latent=latent)
    return y, routing, logits


def _module_loss(m, x, w_TK, cot, mask, routing):
    inj = None if routing is None else routing._replace(weights_TK=w_TK)
    y, stats = m(x, mask=mask, routing=inj)
    return jnp.sum(y.astype(jnp.float32) * cot), (y, stats)


# One jitted function for every test: a module config compiles once per input signature.
_module_grad = nnx.jit(nnx.value_and_grad(_module_loss, argnums=(0, 1, 2), has_aux=True))


def module_value_and_grads(module, x, cot, *, mask=None, routing=None):
    """(y, stats, param grads {path: array}, dx, d routing.weights_TK or None), jitted."""
    w_TK = jnp.zeros((1,)) if routing is None else routing.weights_TK
    (_, (y, stats)), (g_params, dx, dw) = _module_grad(module, x, w_TK, cot, mask, routing)
    grads = {path: v.get_value() for path, v in nnx.to_flat_state(g_params)}
    return y, stats, grads, dx, (None if routing is None else dw)


def reference_value_and_grads(module, x, cot, *, mask=None, routing=None):
    p = flat_params(module)
    bias = module.selection_bias[...]

    def loss(p, x, w_TK):
        inj = None if routing is None else routing._replace(weights_TK=w_TK)
        y, _, _ = reference_apply(p, x, module.router, mask=mask, routing=inj, bias=bias)
        return jnp.sum(y * cot), y

    w_TK = jnp.zeros((1,)) if routing is None else routing.weights_TK
    (_, y), (grads, dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(p, x, w_TK)
    return y, grads, dx, (None if routing is None else dw)


def assert_matches_reference(module, x, *, mask=None, routing=None, dtype=jnp.float32, seed=0, tol=None):
    """Output and every gradient (input, all params, injected weights) within `tol` relative
    Frobenius error (default: the `dtype` tolerance of tests.helpers)."""
    tol = tolerance(dtype) if tol is None else tol
    cot = jax.random.normal(jax.random.PRNGKey(100 + seed), x.shape)
    if mask is not None:
        cot = jnp.where(mask[..., None], cot, 0.0)
    y, stats, grads, dx, dw = module_value_and_grads(module, x, cot, mask=mask, routing=routing)
    ref_y, ref_grads, ref_dx, ref_dw = reference_value_and_grads(module, x, cot, mask=mask, routing=routing)
    assert y.shape == x.shape and y.dtype == jnp.dtype(dtype)
    assert grads.keys() == ref_grads.keys()
    pairs = {"y": (y, ref_y), "dx": (dx, ref_dx)}
    pairs.update({"d" + ".".join(map(str, p)): (grads[p], ref_grads[p]) for p in grads})
    if routing is not None:
        pairs["d weights_TK"] = (dw, ref_dw)
    errors = {name: rel_err(out, ref) for name, (out, ref) in pairs.items()}
    assert max(errors.values()) <= tol, f"relative Frobenius errors above {tol:.0e}: " + str(
        {k: f"{v:.2e}" for k, v in errors.items() if v > tol}
    )
    return y, stats


def inputs(seed=0, shape=(B, S, D)):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


XLA = GemmOptions(backend="xla")


def make(**kw):
    kw.setdefault("gemm", XLA)
    return MoE(D, F, E, K, rngs=nnx.Rngs(kw.pop("seed", 0)), **kw)


# ----------------------------------------------------------------------------- numerics


def test_full_layer_matches_reference_with_stats():
    """Default router, shared experts, LatentMoE, [B, S, D] input with a mask: output, every
    gradient, and every statistic."""
    m = make(shared_experts=SharedExperts(2, d_ff=5), latent_dim=L)
    x = inputs(1)
    mask = jnp.arange(B * S).reshape(B, S) % 5 != 3
    _, stats = assert_matches_reference(m, x, mask=mask)
    assert isinstance(stats, MoEStats)

    @jax.jit
    def expected_stats(p, x, mask):
        _, routing, logits = reference_apply(p, x, m.router)
        idx, probs, mask_T = routing.expert_idx_TK, routing.probs_TE, mask.reshape(-1)
        return (
            R.expert_counts(idx, E, mask_T=mask_T),
            R.aux_loss(probs, idx, mask_T=mask_T),
            R.seq_aux_loss(probs.reshape(B, S, E), idx.reshape(B, S, K), mask_BS=mask),
            R.z_loss(logits, mask_T=mask_T),
        )

    counts, aux, seq_aux, z = expected_stats(flat_params(m), x, mask)
    np.testing.assert_array_equal(stats.counts_E, counts)
    assert int(stats.tokens) == int(mask.sum())
    np.testing.assert_allclose(stats.aux_loss, aux, rtol=1e-6)
    np.testing.assert_allclose(stats.seq_aux_loss, seq_aux, rtol=1e-6)
    np.testing.assert_allclose(stats.z_loss, z, rtol=1e-6)
    # The xla backend: the useful rows, no tile padding claimed (XLA's tiling is its own).
    assert int(stats.executed_rows) == int(counts.sum()) and float(stats.padding_fraction) == 0.0
    assert int(stats.dropped) == 0 and stats.dropped_E.shape == (E,) and not np.any(stats.dropped_E)
    assert int(stats.useful_rows) == int(stats.useful_rows_max) == int(stats.executed_rows_max) == int(counts.sum())
    assert stats.kernel_counts_C.shape == (len(CANDIDATES),) and not np.any(stats.kernel_counts_C)
    dtypes = (jnp.float32,) * 3 + (jnp.int32,) * 7 + (jnp.float32, jnp.int32, jnp.int32)
    assert len(stats) == len(dtypes) and all(jnp.asarray(a).dtype == d for a, d in zip(stats, dtypes))


@pytest.mark.parametrize(
    "router, extra",
    [
        (R.SelectedSoftmax(K), {}),
        (R.SoftmaxTopK(K), {"gemm": GemmOptions(backend="xla", fused_gate_up=True)}),
        (R.SigmoidGroupedTopK(K, n_group=4, topk_group=2, routed_scaling_factor=2.5), {"shared_experts": SharedExperts(1)}),
    ],
    ids=["selected_softmax", "softmax_topk_fused", "sigmoid_grouped_shared"],
)
def test_each_router_matches_reference(router, extra):
    m = make(router=router, **extra)
    assert m.router is router
    assert_matches_reference(m, inputs(2, (B * S, D)), seed=2)


def test_injected_routing_reaches_weights():
    """A routing from outside (parity/) skips the router; gradients reach its weights_TK; z_loss
    is 0 and aux_loss reads the injected probabilities."""
    m = make(latent_dim=L)
    x = inputs(3)
    rng = np.random.default_rng(3)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(B * S)]).astype(np.int32)
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(4), (B * S, E)))
    weights = jax.random.uniform(jax.random.PRNGKey(5), (B * S, K), minval=0.1, maxval=1.0)
    routing = R.Routing(jnp.asarray(idx), weights, probs)
    _, stats = assert_matches_reference(m, x, routing=routing)
    assert float(stats.z_loss) == 0.0
    np.testing.assert_allclose(stats.aux_loss, R.aux_loss(probs, jnp.asarray(idx)), rtol=1e-6)
    np.testing.assert_array_equal(stats.counts_E, np.bincount(idx.reshape(-1), minlength=E))


@pytest.mark.parametrize("extra", [{}, {"shared_experts": SharedExperts(1)}, {"shared_experts": SharedExperts(1, gate=True)}],
                         ids=["routed", "shared", "gated_shared"])
def test_masked_tokens_change_nothing(extra):
    """Padding tokens holding NaN or other values: real tokens' outputs, every gradient (shared
    experts' included) and the statistics are bit-identical; padding outputs are 0."""
    m = make(latent_dim=L, router=R.SelectedSoftmax(K), **extra)
    mask = jnp.asarray(np.random.default_rng(6).random((B, S)) < 0.6)
    x = inputs(6)
    x_nan = jnp.where(mask[..., None], x, jnp.nan)
    x_other = jnp.where(mask[..., None], x, 100.0 * inputs(7))
    cot = jnp.where(mask[..., None], jax.random.normal(jax.random.PRNGKey(8), x.shape), 0.0)
    results = [module_value_and_grads(m, xi, cot, mask=mask) for xi in (x, x_nan, x_other)]
    y0, stats0, grads0, dx0, _ = results[0]
    np.testing.assert_array_equal(np.asarray(y0)[~np.asarray(mask)], 0.0)
    for y, stats, grads, dx, _ in results[1:]:
        np.testing.assert_array_equal(y, y0)
        np.testing.assert_array_equal(dx, dx0)
        for path in grads0:
            np.testing.assert_array_equal(grads[path], grads0[path], err_msg=str(path))
        for a, b in zip(stats, stats0):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "extra, tol",
    [
        ({"shared_experts": SharedExperts(1)}, 1e-2),
        # LatentMoE puts two more bf16 roundings in series with the experts' (the narrow
        # projection and its cotangent), which takes single gradients to ~1.0-1.4e-2 against
        # fp32 over seeds; the bound allows for that chain rather than a tuned seed.
        ({"shared_experts": SharedExperts(1), "latent_dim": L}, 2e-2),
    ],
    ids=["shared", "shared_latent"],
)
def test_bf16_compute_with_fp32_params(extra, tol):
    m = make(dtype=jnp.bfloat16, **extra)
    assert all(v.dtype == jnp.float32 for v in flat_params(m).values())
    assert_matches_reference(m, inputs(9), dtype=jnp.bfloat16, seed=9, tol=tol)


def test_gated_shared_expert_matches_reference():
    """Qwen2-MoE's shared expert: its output scaled per token by sigmoid(x W_sg^T)."""
    m = make(shared_experts=SharedExperts(1, d_ff=7, gate=True), seed=21)
    assert m.w_shared_gate[...].shape == (1, D)
    mask = jnp.asarray(np.random.default_rng(21).random((B, S)) < 0.7)
    assert_matches_reference(m, inputs(21), mask=mask, seed=21)


def test_return_routing():
    """`return_routing=True` hands back the routing the layer used: the router's on its logits."""
    m = make(router=R.SigmoidGroupedTopK(K, n_group=4, topk_group=2), seed=22)
    x = inputs(22)
    y, stats, routing = nnx.jit(lambda m, x: m(x, return_routing=True))(m, x)
    y2, _ = nnx.jit(lambda m, x: m(x))(m, x)
    np.testing.assert_array_equal(y, y2)
    want = router_reference(x, m.w_router[...], m.router)
    np.testing.assert_array_equal(routing.expert_idx_TK, want.expert_idx_TK)
    assert_close(routing.weights_TK, want.weights_TK, jnp.float32, "weights")
    np.testing.assert_array_equal(stats.counts_E, np.bincount(np.asarray(routing.expert_idx_TK).ravel(), minlength=E))


@pytest.mark.parametrize("gemm_kernel", ["static", "auto"])
def test_pallas_backend_matches_reference(gemm_kernel):
    """The layer on the Pallas kernels (interpreted on CPU), small shape; its executed rows are
    the running candidate's (the shape table's, or the selector's pick): every expert's rows
    rounded up to its tile height, and `kernel_counts_C` names it."""
    m = MoE(D, F, 4, K, gemm=GemmOptions(backend="pallas_triton", kernel=gemm_kernel, fused_gate_up=True),
            rngs=nnx.Rngs(10))
    _, stats = assert_matches_reference(m, inputs(10, (4, D)), seed=10)
    if gemm_kernel == "static":
        config = gmm_config(4 * K, 2 * F, D, 4)
    else:
        pick = select(jnp.asarray(stats.counts_E, jnp.int32), 4 * K, selector_table(2 * F, D, 4))
        config = list(CANDIDATES.values())[int(pick.candidate)]
    block_m = config.tiles.block_m
    executed = sum(math.ceil(c / block_m) * block_m for c in np.asarray(stats.counts_E))
    assert int(stats.executed_rows) == int(stats.executed_rows_max) == executed
    assert int(stats.useful_rows) == int(stats.useful_rows_max) == 4 * K
    np.testing.assert_array_equal(stats.kernel_counts_C, np.eye(len(CANDIDATES), dtype=np.int32)[candidate_index(config)])
    np.testing.assert_allclose(stats.padding_fraction, (executed - 4 * K) / executed, rtol=1e-6)


@pytest.mark.gpu_only
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="jax_triton needs a CUDA GPU; "
                    "tests/test_triton_kernels.py runs the same kernels interpreted on CPU and compiles them for sm_90")
@pytest.mark.parametrize("fused_gate_up", [True, False])
def test_triton_backend_matches_reference(fused_gate_up):
    """The layer on the official Triton kernels (jax_triton): output and every gradient; the
    telemetry counts the rows of its tiles and names no Pallas candidate."""
    from moe_jax.ops.gmm.triton import gmm_tiles

    m = MoE(D, F, 4, K, gemm=GemmOptions(backend="triton", fused_gate_up=fused_gate_up), rngs=nnx.Rngs(10))
    _, stats = assert_matches_reference(m, inputs(10, (4, D)), seed=10)
    block_m = gmm_tiles(4 * K, 2 * F if fused_gate_up else F, D, 4).block_m
    assert int(stats.executed_rows) == sum(math.ceil(c / block_m) * block_m for c in np.asarray(stats.counts_E))
    assert not np.any(stats.kernel_counts_C)


def test_fused_layer_holds_separate_weights():
    """Same seed: the fused layer's w_gate_up is [w_gate; w_up] of the separate layer, so the two
    compute the same function (fused == separate is checked in tests/test_experts.py)."""
    sep, fused = make(seed=11), make(seed=11, gemm=GemmOptions(backend="xla", fused_gate_up=True))
    np.testing.assert_array_equal(fused.w_gate_up[...], jnp.concatenate([sep.w_gate[...], sep.w_up[...]], axis=1))
    np.testing.assert_array_equal(fused.w_down[...], sep.w_down[...])


def test_token_major_and_batched_inputs_agree():
    m = make(seed=12)
    x = inputs(12)
    y3, stats3 = nnx.jit(lambda m, x: m(x))(m, x)
    y2, stats2 = nnx.jit(lambda m, x: m(x))(m, x.reshape(B * S, D))
    np.testing.assert_array_equal(y3.reshape(B * S, D), y2)
    np.testing.assert_array_equal(stats3.counts_E, stats2.counts_E)
    assert y3.shape == (B, S, D)


# ----------------------------------------------------------------------------- module behaviour


def test_params_layout_init_and_dtypes():
    m = make(shared_experts=SharedExperts(2), latent_dim=L, param_dtype=jnp.bfloat16)
    shapes = {path: v.shape for path, v in flat_params(m).items()}
    assert shapes == {
        ("w_router",): (E, D),
        ("w_gate",): (E, F, L),
        ("w_up",): (E, F, L),
        ("w_down",): (E, L, F),
        ("w_latent_down",): (L, D),
        ("w_latent_up",): (D, L),
        ("shared", "w_gate"): (2 * F, D),
        ("shared", "w_up"): (2 * F, D),
        ("shared", "w_down"): (D, 2 * F),
    }
    assert all(v.dtype == jnp.bfloat16 for v in flat_params(m).values())
    assert isinstance(m.selection_bias, SelectionBias) and not isinstance(m.selection_bias, nnx.Param)
    assert m.selection_bias[...].dtype == jnp.float32 and not np.any(m.selection_bias[...])
    # LeCun truncated normal on each weight's input axis (std ~ 1/sqrt(fan_in), bounded).
    big = MoE(64, 48, 16, 2, rngs=nnx.Rngs(0))
    for name, fan_in in (("w_router", 64), ("w_gate", 64), ("w_down", 48)):
        w = np.asarray(getattr(big, name)[...])
        assert abs(w.std() * math.sqrt(fan_in) - 1.0) < 0.05, name
        assert np.abs(w).max() * math.sqrt(fan_in) < 2.3, name


def test_dtype_defaults_to_input_dtype():
    m = make(seed=13)
    y, _ = nnx.jit(lambda m, x: m(x))(m, inputs(13).astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16


def test_zero_tokens():
    m = make(shared_experts=SharedExperts(1), seed=16)
    grad_fn = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0])))
    for shape in ((0, S, D), (B, 0, D)):
        y, stats = nnx.jit(lambda m, x: m(x))(m, jnp.ones(shape))
        assert y.shape == shape
        assert int(stats.tokens) == 0 and int(stats.executed_rows) == 0 and not np.any(stats.counts_E)
        assert float(stats.aux_loss) == float(stats.seq_aux_loss) == float(stats.z_loss) == 0.0
        grads = nnx.to_flat_state(grad_fn(m, jnp.ones(shape)))
        assert all(not np.any(v.get_value()) for _, v in grads)


def test_selection_bias_update_and_effect():
    """update_selection_bias applies the loss-free rule; the bias changes which experts are
    chosen (not the weights) and is not an optimizer-visible parameter."""
    m = make(router=R.SelectedSoftmax(K), seed=14)
    x = inputs(14)
    forward = nnx.jit(lambda m, x: m(x))
    _, stats = forward(m, x)
    m.update_selection_bias(stats.counts_E, 0.5)
    np.testing.assert_array_equal(
        m.selection_bias[...], R.update_selection_bias(jnp.zeros(E), stats.counts_E, 0.5)
    )
    assert ("selection_bias",) not in flat_params(m)
    m.selection_bias[...] = jnp.zeros(E).at[3].set(1e3)
    _, stats = forward(m, x)
    assert int(stats.counts_E[3]) == B * S  # every token now picks expert 3


def test_scanned_two_layer_stack():
    """nnx.vmap-created, nnx.scan-applied 2-layer stack equals applying the layers in turn."""

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
        return MoE(D, F, E, K, gemm=XLA, rngs=rngs)

    stack = create(nnx.Rngs(15))
    x = inputs(15)

    @nnx.jit
    def run(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(h, layer):
            y, stats = layer(h)
            return h + y, stats

        return step(x, stack)

    out, stats = run(stack, x)
    assert stats.counts_E.shape == (2, E) and stats.aux_loss.shape == (2,)
    graphdef, state = nnx.split(stack)
    layer_fn = nnx.jit(lambda m, h: m(h))
    h = x
    for i in range(2):
        y, st = layer_fn(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)), h)
        np.testing.assert_array_equal(st.counts_E, stats.counts_E[i])
        h = h + y
    assert_close(out, h, jnp.float32, "scanned stack")

    grads = nnx.jit(nnx.grad(lambda s, x: jnp.sum(run(s, x)[0] ** 2)))(stack, x)
    g = nnx.to_flat_state(grads)
    assert all(v.get_value().shape[0] == 2 and np.isfinite(v.get_value()).all() for _, v in g)
    assert np.any(g[0][1].get_value()[0] != 0) and np.any(g[0][1].get_value()[1] != 0)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(top_k=9), ValueError, "top_k=9 exceeds num_experts=8"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(d_model=0), ValueError, "d_model"),
        (dict(d_ff=-1), ValueError, "d_ff"),
        (dict(num_experts=0), ValueError, "num_experts"),
        (dict(latent_dim=0), ValueError, "latent_dim"),
        (dict(shared_experts=2), TypeError, r"shared_experts must be None or a moe_jax.layers.SharedExperts"),
        (dict(router=R.SoftmaxTopK(3)), ValueError, "router.top_k=3 differs from top_k=2"),
        (dict(router="softmax"), TypeError, "router"),
        (dict(router=R.SigmoidGroupedTopK(2, n_group=3, topk_group=1)), ValueError, "n_group=3 does not divide"),
        (dict(gemm="xla"), TypeError, r"gemm must be a moe_jax.layers.GemmOptions \(e.g. gemm=GemmOptions"),
        (dict(expert_parallel=dict(capacity_factor=1.25)), TypeError, "expert_parallel must be a moe_jax.parallel.EPOptions"),
        # The older spellings are gone: one option group each.
        (dict(backend="xla"), TypeError, "unexpected keyword argument 'backend'"),
        (dict(ep_strategy="padded"), TypeError, "unexpected keyword argument 'ep_strategy'"),
        (dict(capacity_factor=1.25), TypeError, "unexpected keyword argument 'capacity_factor'"),
        (dict(dtype=jnp.int32), TypeError, "dtype"),
        (dict(dtype=jnp.float8_e4m3fn), TypeError, "dtype=float8_e4m3fn is not supported; use bfloat16, float16"),
        (dict(top_k=2.0), TypeError, "top_k must be a positive int"),
        (dict(num_experts=6, mesh="ep4"), TypeError, "mesh"),
    ],
)
def test_bad_configs_raise(kwargs, error, match):
    args = dict(d_model=D, d_ff=F, num_experts=E, top_k=K)
    args.update(kwargs)
    d_model, d_ff, num_experts, top_k = (args.pop(n) for n in ("d_model", "d_ff", "num_experts", "top_k"))
    with pytest.raises(error, match=match):
        MoE(d_model, d_ff, num_experts, top_k, rngs=nnx.Rngs(0), **args)


def test_pallas_backend_on_cpu_mesh_raises():
    mesh = make_mesh(ep=2, data=1, devices=jax.devices("cpu")[:2])
    with pytest.raises(ValueError, match="interpret mode inside shard_map"):
        MoE(D, F, E, K, mesh=mesh, gemm=GemmOptions(backend="pallas_triton"), rngs=nnx.Rngs(0))


def test_ragged_strategy_on_a_cpu_mesh_raises_at_construction():
    mesh = make_mesh(ep=2, data=1, devices=jax.devices("cpu")[:2])
    with pytest.raises(ValueError, match=r"expert_parallel=EPOptions\(strategy='ragged'\) needs GPUs"):
        MoE(D, F, E, K, mesh=mesh, expert_parallel=EPOptions(strategy="ragged"), rngs=nnx.Rngs(0))


def test_numpy_scalars_configure_the_layer():
    mesh = make_mesh(ep=2, data=1, devices=jax.devices("cpu")[:2])
    m = MoE(np.int64(D), np.int32(F), np.int64(E), np.int64(K), shared_experts=SharedExperts(np.int64(1)),
            expert_parallel=EPOptions(capacity_factor=np.float32(1.25)), mesh=mesh, rngs=nnx.Rngs(0))
    assert (m.d_model, m.num_experts, m.expert_parallel.capacity_factor) == (D, E, 1.25) and type(m.top_k) is int
    assert type(m.shared_experts.count) is int


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: GemmOptions(backend="cuda"), ValueError, "backend='cuda' is not a moe_jax backend"),
        (lambda: GemmOptions(backend={("gmm_nn", "prefill"): ("xla",)}), TypeError,
         r"plain mapping; wrap a per-kernel table as moe_jax.ops.BackendTable.of"),
        (lambda: GemmOptions(backend=3), TypeError, "GemmOptions.backend must be a backend name or a"),
        (lambda: GemmOptions(kernel="fast"), ValueError, r"GemmOptions.kernel='fast': use one of \('auto', 'static'\)"),
        (lambda: GemmOptions(row_gather="packed"), ValueError, "GemmOptions.row_gather='packed'"),
        (lambda: GemmOptions(precision="highest"), TypeError, "GemmOptions.precision='highest': use None or a "
                                                              "jax.lax.Precision"),
        (lambda: GemmOptions(fused_gate_up=1), TypeError, "GemmOptions.fused_gate_up must be a bool"),
        (lambda: SharedExperts(0), ValueError, "takes shared_experts=None"),
        (lambda: SharedExperts(-1), ValueError, "SharedExperts.count must be a positive int"),
        (lambda: SharedExperts(1.0), TypeError, "SharedExperts.count must be a positive int"),
        (lambda: SharedExperts(1, d_ff=0), ValueError, "SharedExperts.d_ff must be a positive int"),
        (lambda: SharedExperts(1, gate=1), TypeError, "SharedExperts.gate must be a bool"),
        (lambda: EPOptions(strategy="dense"), ValueError, "strategy"),
        (lambda: EPOptions(capacity_factor=0.0), ValueError, "capacity_factor"),
        (lambda: EPOptions(capacity_factor="1.25"), TypeError, "capacity_factor must be a number"),
    ],
)
def test_bad_option_groups_name_the_field(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.slow  # eager, element by element; tests/test_gmm.py's vmap test runs on every pin
def test_layer_under_vmap_equals_per_element_calls():
    """jax.vmap over a leading axis (the default CPU backend's ragged_dot has no such batching
    rule: the grouped GEMMs map element by element), forward and gradients."""
    m = make(seed=23)
    x = inputs(23)  # [B, S, D]: vmap over B, each call a [S, D] sequence
    y = nnx.vmap(lambda m, x: m(x)[0], in_axes=(None, 0))(m, x)
    want = jnp.stack([m(x[b])[0] for b in range(B)])
    assert_close(y, want, jnp.float32, "vmap")
    grads = nnx.grad(lambda m, x: jnp.sum(nnx.vmap(lambda m, x: m(x)[0], in_axes=(None, 0))(m, x) ** 2))(m, x)
    want_grads = nnx.grad(lambda m, x: sum(jnp.sum(m(x[b])[0] ** 2) for b in range(B)))(m, x)
    for (path, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
        assert_close(g.get_value(), w.get_value(), jnp.float32, str(path))


def test_experts_not_divisible_by_ep_raises():
    mesh = make_mesh(ep=4, data=1, devices=jax.devices("cpu")[:4])
    with pytest.raises(ValueError, match="num_experts=6 is not divisible"):
        MoE(D, F, 6, K, mesh=mesh, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m(jnp.zeros((2, 3, D + 1))), "d_model"),
        (lambda m: m(jnp.zeros((D,))), "d_model"),
        (lambda m: m(jnp.zeros((2, 3, D)), mask=jnp.ones((3, 2), bool)), "mask"),
        (
            lambda m: m(
                jnp.zeros((4, D)),
                routing=R.Routing(jnp.zeros((4, 3), jnp.int32), jnp.zeros((4, 3)), jnp.zeros((4, E))),
            ),
            "expert_idx_TK",
        ),
        (
            lambda m: m(
                jnp.zeros((4, D)),
                routing=R.Routing(jnp.asarray([[0, 1], [2, E], [3, 4], [-1, 5]], jnp.int32), jnp.ones((4, K)),
                                  jnp.zeros((4, E))),
            ),
            r"routing.expert_idx_TK holds 2 expert id\(s\) outside \[0, num_experts=8\), first at \[1, 1\] = 8",
        ),
    ],
)
def test_bad_call_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call(make())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m(jnp.zeros((4, D), jnp.int32)), "x.dtype=int32: the layer's input must be a float array"),
        (lambda m: m(jnp.zeros((4, D), jnp.float8_e4m3fn)), r"x.dtype \(the compute dtype when dtype=None\)=float8_e4m3fn is not supported"),
        (lambda m: m(jnp.zeros((2, 3, D)), mask=jnp.ones((2, 3), jnp.int32)), "mask must be a bool array"),
        (lambda m: m(jnp.zeros((2, 3, D)), return_routing=1), "return_routing must be a bool"),
        (lambda m: m(np.zeros((2, 3, D)).tolist()), "x must be a JAX or NumPy array .* got list. Convert it first"),
        (lambda m: m(jnp.zeros((2, 3, D)), mask=[[True] * 3] * 2), "mask must be a bool JAX or NumPy array"),
        (lambda m: m(jnp.zeros((4, D)), routing=(jnp.zeros((4, K), jnp.int32), jnp.zeros((4, K)), jnp.zeros((4, E)))),
         r"routing must be a moe_jax.routing.Routing\(expert_idx_TK, weights_TK, probs_TE\); got tuple"),
        (lambda m: m(jnp.zeros((4, D)), routing=R.Routing(jnp.zeros((4, K)), jnp.zeros((4, K)), jnp.zeros((4, E)))),
         "routing.expert_idx_TK must hold integer expert ids"),
        (lambda m: m.update_selection_bias(jnp.ones(E, jnp.int32), None),
         "step_size must be a number >= 0 .* got NoneType None"),
        (lambda m: m.update_selection_bias(jnp.ones(E, jnp.int32), "0.1"), "step_size must be a number >= 0 .* got str"),
        (lambda m: m.update_selection_bias(jnp.ones(E, jnp.int32), jnp.ones(2)), "step_size must be a number >= 0 or a "
                                                                                 "float scalar array"),
    ],
)
def test_bad_call_types_raise(call, match):
    with pytest.raises(TypeError, match=match):
        call(make())


def test_selection_bias_step_size_values():
    """Numbers and float scalar arrays (a schedule's value, traced too) are step sizes; negatives
    and NaN are not."""
    m = make(seed=24)
    counts = jnp.arange(E, dtype=jnp.int32)
    want = R.update_selection_bias(jnp.zeros(E), counts, 0.5)
    m.update_selection_bias(counts, np.float32(0.5))
    np.testing.assert_array_equal(m.selection_bias[...], want)
    step = nnx.jit(lambda m, c, s: m.update_selection_bias(c, s))
    step(m, counts, jnp.float32(0.5))
    np.testing.assert_array_equal(m.selection_bias[...], 2 * want)
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="step_size=.* must be a finite number >= 0"):
            m.update_selection_bias(counts, bad)


def test_call_arguments_are_checked_before_any_compute():
    """A bad return_routing or routing is reported as such, not as whatever the forward would have
    hit first (here: 12 tokens that cannot be split over the mesh's 8 devices)."""
    m = make(mesh=make_mesh(ep=2, data=4, devices=jax.devices("cpu")[:8]))
    x = jnp.zeros((12, D))
    with pytest.raises(ValueError, match="12 tokens cannot be split"):
        m(x)
    with pytest.raises(TypeError, match="return_routing must be a bool"):
        m(x, return_routing="yes")
    with pytest.raises(TypeError, match="routing must be a moe_jax.routing.Routing"):
        m(x, routing=(jnp.zeros((12, K), jnp.int32), jnp.zeros((12, K)), jnp.zeros((12, E))))


def test_numpy_float64_input_is_read_as_jax_reads_it():
    """With x64 off JAX reads a NumPy float64 array as float32; so does the layer (it refused it)."""
    m = make(seed=25)
    x = np.asarray(inputs(25), np.float64)
    y, stats = m(x)
    y32, stats32 = m(jnp.asarray(x))
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, y32)
    np.testing.assert_array_equal(stats.counts_E, stats32.counts_E)


def test_capacity_factor_without_expert_parallelism_warns():
    """A capacity factor only caps the EP exchange: on a layer that cannot split experts it would be
    ignored, so the layer says so (and stays quiet where the mesh splits experts)."""
    capped = EPOptions(capacity_factor=1.25)
    with pytest.warns(UserWarning, match=r"EPOptions\(capacity_factor=1.25\) has no effect"):
        make(expert_parallel=capped)
    with pytest.warns(UserWarning, match="no expert axis of size > 1"):
        make(expert_parallel=capped, mesh=make_mesh(ep=1, data=2, devices=jax.devices("cpu")[:2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(expert_parallel=capped, mesh=make_mesh(ep=2, data=1, devices=jax.devices("cpu")[:2]))
        make(expert_parallel=EPOptions())

