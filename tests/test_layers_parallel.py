"""moe_jax.layers.MoE on a device mesh (forced CPU host devices, repo conftest: 8) against the
same layer on one device over the full batch: outputs, statistics and every gradient (input,
router, routed experts, shared experts, latent projections), for ep = 1 (data parallel) and
ep = 2, 4 with data = 1, 2; hot experts, a rank without real tokens, and capacity drops counted
exactly. fp32, padded exchange, backend "xla" (speed).

Legend: N global tokens, T tokens per device, D width, E experts, El = E/P local experts,
P ep size, K top-k, C capacity.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from moe_jax import routing as R
from moe_jax.layers import GemmOptions, MoE, SharedExperts
from moe_jax.parallel import EPOptions, capacity_for, make_mesh
from moe_jax.testing import assert_close
from tests.helpers import MESH_DEVICES, on_mesh_platform, poisoned_ragged  # noqa: F401  (an autouse fixture)
from tests.test_layers import flat_params, module_value_and_grads

B, S, D, F, E, K, L = 2, 8, 8, 6, 8, 2, 4
N = B * S


# Up to ep * data = 8 devices: the accelerators when there are that many, else the forced CPU host
# devices (a 1- or 2-GPU runner runs these on CPU; the real GPU meshes are covered by
# tests/test_ep_moe.py and parity/tests/test_parity_ep.py).




def _mesh(ep, data):
    return make_mesh(ep=ep, data=data, devices=MESH_DEVICES[: ep * data])


def _layer(mesh=None, *, row_gather="auto", capacity_factor=None):
    return MoE(
        D, F, E, K, shared_experts=SharedExperts(1, d_ff=5), latent_dim=L,
        gemm=GemmOptions(backend="xla", row_gather=row_gather), mesh=mesh,
        expert_parallel=EPOptions(capacity_factor=capacity_factor), rngs=nnx.Rngs(0),
    )


def _inputs(seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(k1, (B, S, D), jnp.float32)
    cot = jax.random.normal(k2, (B, S, D), jnp.float32)
    return x, cot


def _assert_same(got, want, what=""):
    """Mesh result vs single device: outputs and gradients to fp32 tolerance (the reductions run
    in another order), integer statistics exactly."""
    y, stats, grads, dx, dw = got
    y0, stats0, grads0, dx0, dw0 = want
    assert_close(y, y0, jnp.float32, what + "y")
    assert_close(dx, dx0, jnp.float32, what + "dx")
    assert grads.keys() == grads0.keys()
    for path in grads:
        assert_close(grads[path], grads0[path], jnp.float32, what + "d" + ".".join(map(str, path)))
    if dw0 is not None:
        assert_close(dw, dw0, jnp.float32, what + "d weights_TK")
    np.testing.assert_array_equal(stats.counts_E, stats0.counts_E)
    assert int(stats.tokens) == int(stats0.tokens)
    for name in ("aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(getattr(stats, name), getattr(stats0, name), rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("ep, data", [(1, 4), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_router_path_matches_single_device(ep, data):
    """Router inside the layer, padding mask: everything equals the single-device layer."""
    mesh = _mesh(ep, data)
    m = _layer(mesh)
    assert m.w_gate[...].sharding.spec == PartitionSpec("ep", None, None)
    for w in (m.w_router, m.w_latent_down, m.shared.w_gate):
        assert w[...].sharding.spec == PartitionSpec(None, None)
    assert m.w_gate.out_sharding == ("ep", None, None)
    x, cot = _inputs(ep * 10 + data)
    mask = (jnp.arange(N).reshape(B, S) * 7) % 5 != 0
    cot = jnp.where(mask[..., None], cot, 0.0)
    got = module_value_and_grads(m, x, cot, mask=mask)
    want = module_value_and_grads(_layer(), x, cot, mask=mask)
    _assert_same(got, want)
    stats = got[1]
    assert int(stats.dropped) == 0

    # The xla backend executes the useful rows as far as moe_jax can tell (no tile padding claimed),
    # summed over every device's grouped GEMM.
    assert int(stats.executed_rows) == int(mask.sum()) * K and float(stats.padding_fraction) == 0.0
    # Sums over devices beside the largest device's figure: the slowest device sets the latency.
    devices = ep * data
    assert int(stats.useful_rows) == int(mask.sum()) * K
    assert int(mask.sum()) * K / devices <= int(stats.useful_rows_max) <= int(stats.useful_rows)
    assert int(stats.executed_rows_max) == int(stats.useful_rows_max) and not np.any(stats.kernel_counts_C)


@pytest.mark.parametrize("ep, data, capacity_factor", [(2, 2, 1.0), (4, 1, None)])
def test_fused_row_gather_on_an_ep_mesh(ep, data, capacity_factor):
    """`row_gather="fused"` under expert parallelism (the gate/up GEMM reads the receive buffer
    through the regroup's ids): outputs, gradients and drops of the separate-gather layer on the
    same mesh, and with no drops the single-device layer's."""
    mesh = _mesh(ep, data)
    x, cot = _inputs(40 + ep)
    mask = (jnp.arange(N).reshape(B, S) * 3) % 7 != 0
    cot = jnp.where(mask[..., None], cot, 0.0)
    got = module_value_and_grads(_layer(mesh, row_gather="fused", capacity_factor=capacity_factor), x, cot, mask=mask)
    want = module_value_and_grads(_layer(mesh, row_gather="separate", capacity_factor=capacity_factor), x, cot,
                                  mask=mask)
    _assert_same(got, want)
    assert int(got[1].dropped) == int(want[1].dropped)
    if capacity_factor is None:
        _assert_same(got, module_value_and_grads(_layer(), x, cot, mask=mask))


def _injected(seed, experts_of_token):
    rng = np.random.default_rng(seed)
    idx = np.stack([experts_of_token(t, rng) for t in range(N)]).astype(np.int32)
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(seed), (N, E)))
    weights = jax.random.uniform(jax.random.PRNGKey(seed + 1), (N, K), minval=0.1, maxval=1.0)
    return R.Routing(jnp.asarray(idx), weights, probs)


def test_hot_experts_and_a_rank_without_real_tokens():
    """Every token picks the same two experts, both on ep rank 0 (rank 1 computes nothing), and
    the first device's tokens are all padding."""
    mesh = _mesh(2, 2)
    routing = _injected(1, lambda t, rng: [3, 1])
    x, cot = _inputs(1)
    mask = (jnp.arange(N) >= N // 4).reshape(B, S)  # device 0 holds tokens [0, N/4)
    cot = jnp.where(mask[..., None], cot, 0.0)
    got = module_value_and_grads(_layer(mesh), x, cot, mask=mask, routing=routing)
    want = module_value_and_grads(_layer(), x, cot, mask=mask, routing=routing)
    _assert_same(got, want)
    assert int(got[1].dropped) == 0
    np.testing.assert_array_equal(got[1].counts_E, np.eye(E, dtype=np.int32)[[3, 1]].sum(0) * int(mask.sum()))


def test_out_of_range_injected_ids_count_alike_on_one_device_and_on_meshes():
    """Traced expert ids outside [0, E) (concrete ones are refused, tests/test_layers.py): their
    routes reach no expert and count in `dropped`, in no `counts_E` or `dropped_E` slot, the same
    on one device, data parallel and under dropless EP (one device counted none, EP counted them
    in `dropped` only); a masked token's invalid id counts nowhere."""
    idx = np.array(_injected(7, lambda t, rng: rng.choice(E, K, replace=False)).expert_idx_TK)
    idx[0, 1], idx[5, 0], idx[9, 1] = E, -1, E + 3
    routing = _injected(7, lambda t, rng: [0, 1])._replace(expert_idx_TK=jnp.asarray(idx))
    mask = jnp.ones(N, bool).at[9].set(False).reshape(B, S)
    x, cot = _inputs(7)
    cot = jnp.where(mask[..., None], cot, 0.0)
    want = module_value_and_grads(_layer(), x, cot, mask=mask, routing=routing)
    valid = (idx >= 0) & (idx < E) & np.asarray(mask).reshape(N, 1)
    for mesh in (None, _mesh(1, 4), _mesh(2, 2)):
        got = want if mesh is None else module_value_and_grads(_layer(mesh), x, cot, mask=mask, routing=routing)
        stats = got[1]
        assert int(stats.dropped) == 2, mesh
        np.testing.assert_array_equal(stats.counts_E, np.bincount(idx[valid], minlength=E))
        assert int(stats.counts_E.sum()) == N * K - 4 and not np.any(stats.dropped_E)
        assert np.all(np.asarray(got[4])[~valid] == 0.0)  # no expert: no weight gradient
        _assert_same(got, want)


def _kept_routes(idx, mask, ep, data, capacity):
    """numpy model of the capacity rule: per source device, per destination rank, the first C
    real routes in (token, slot) order are kept."""
    tokens = N // (ep * data)
    keep = np.zeros(idx.shape, bool)
    for dev in range(ep * data):
        used = np.zeros(ep, int)
        for t in range(dev * tokens, (dev + 1) * tokens):
            for k in range(K):
                dest = idx[t, k] // (E // ep)
                if mask[t] and used[dest] < capacity:
                    keep[t, k] = True
                    used[dest] += 1
    return keep


@pytest.mark.parametrize("ep, data, factor", [(2, 2, 1.0), (4, 1, 1.0), (4, 1, 0.25)])
def test_capacity_overflow_dropped_exactly(ep, data, factor):
    """Skewed routing over a capacity-factor buffer: the drop count equals the numpy model, and
    the output and gradients equal the single-device layer with the dropped routes removed. At
    factor 0.25 the balanced share is less than one row per local expert; `capacity_for` keeps
    that floor (C = E/ep) rather than failing."""
    mesh = _mesh(ep, data)
    hot = np.arange(E // ep)  # rank 0's experts

    def skewed(t, rng):
        first = rng.choice(hot)
        return [first, rng.choice(np.setdiff1d(np.arange(E), [first]))]

    routing = _injected(2 + ep, skewed)
    x, cot = _inputs(2 + ep)
    mask = np.ones(N, bool)
    mask[[1, 6]] = False
    tokens = N // (ep * data)
    capacity = capacity_for(tokens, K, ep, factor, local_experts=E // ep)
    keep = _kept_routes(np.asarray(routing.expert_idx_TK), mask, ep, data, capacity)
    expected_dropped = int(mask.sum()) * K - int(keep.sum())
    assert expected_dropped > 0  # the case must overflow

    mask_BS = jnp.asarray(mask).reshape(B, S)
    cot = jnp.where(mask_BS[..., None], cot, 0.0)
    got = module_value_and_grads(_layer(mesh, capacity_factor=factor), x, cot, mask=mask_BS, routing=routing)
    assert int(got[1].dropped) == expected_dropped
    # Per expert too: the drops of each expert's real routes (the routing and its drops are out).
    idx = np.asarray(routing.expert_idx_TK)
    real = mask[:, None] & np.ones_like(keep)
    want_dropped_E = np.bincount(idx[real & ~keep], minlength=E)
    np.testing.assert_array_equal(got[1].dropped_E, want_dropped_E)
    np.testing.assert_array_equal(got[1].counts_E - got[1].dropped_E, np.bincount(idx[keep], minlength=E))

    kept_routing = routing._replace(weights_TK=jnp.where(keep, routing.weights_TK, 0.0))
    want = list(module_value_and_grads(_layer(), x, cot, mask=mask_BS, routing=kept_routing))
    # A dropped route never reaches its expert: its weight gradient is exactly zero, where the
    # zero-weight reference still sees <expert output, dy>.
    assert np.all(np.asarray(got[4])[~keep] == 0.0)
    want[4] = jnp.where(keep, want[4], 0.0)
    _assert_same(got, tuple(want))


def test_ragged_strategy_matches_padded():
    """The ragged exchange (XLA:CPU lacks ragged_all_to_all: run through the all_gather emulation
    of tests/helpers.py, NaN in rows no sender writes) gives the padded results."""
    mesh = _mesh(2, 2)
    x, cot = _inputs(5)
    mask = jnp.ones((B, S), bool).at[0, :3].set(False)
    cot = jnp.where(mask[..., None], cot, 0.0)
    padded = module_value_and_grads(_layer(mesh, capacity_factor=1.0), x, cot, mask=mask)
    # The layer refuses ragged on CPU devices at construction (XLA:CPU has no ragged_all_to_all);
    # with the collective emulated, the same layer's options switch to it.
    ragged_layer = _layer(mesh, capacity_factor=1.0)
    ragged_layer.expert_parallel = EPOptions(strategy="ragged", capacity_factor=1.0)
    with poisoned_ragged():
        ragged = module_value_and_grads(ragged_layer, x, cot, mask=mask)
    _assert_same(ragged, padded)
    assert int(ragged[1].dropped) == int(padded[1].dropped)


def _stack(mesh):
    """Two `_layer` configs stacked on a leading layer axis (nnx.vmap over split keys, as in
    tests/test_layers.py::test_scanned_two_layer_stack); equal keys give equal params with or
    without a mesh."""

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
        return MoE(
            D, F, E, K, shared_experts=SharedExperts(1, d_ff=5), latent_dim=L, gemm=GemmOptions(backend="xla"),
            mesh=mesh, rngs=rngs
        )

    return create(nnx.Rngs(21))


def _scanned_loss(stack, x, cot):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def step(h, layer):
        y, stats = layer(h)
        return h + y, stats

    out, stats = step(x, stack)
    return jnp.sum(out * cot), (out, stats)


_scanned_grad = nnx.jit(nnx.value_and_grad(_scanned_loss, argnums=(0, 1), has_aux=True))


@pytest.mark.slow  # test_layers.py's scanned stack and the mesh cases above run on every pin
def test_scanned_stack_on_mesh_matches_single_device():
    """An nnx.scan over a vmap-built 2-layer stack of ep = 2, data = 2 layers: the stacked expert
    weights stay split over "ep" behind the layer axis, and the output, per-layer counts and every
    gradient (input, each stacked param) equal the same stack without a mesh."""
    mesh = _mesh(2, 2)
    stack, stack0 = _stack(mesh), _stack(None)
    params, params0 = flat_params(stack), flat_params(stack0)
    assert params.keys() == params0.keys()
    for path in params0:
        np.testing.assert_array_equal(params[path], params0[path])
    assert stack.w_gate[...].sharding.spec == PartitionSpec(None, "ep")
    assert not np.array_equal(params0[("w_gate",)][0], params0[("w_gate",)][1])  # two distinct layers

    x, cot = _inputs(21)
    (_, (y, stats)), (grads, dx) = _scanned_grad(stack, x, cot)
    (_, (y0, stats0)), (grads0, dx0) = _scanned_grad(stack0, x, cot)
    assert_close(y, y0, jnp.float32, "y")
    assert_close(dx, dx0, jnp.float32, "dx")
    assert stats.counts_E.shape == (2, E)
    np.testing.assert_array_equal(stats.counts_E, stats0.counts_E)
    grads, grads0 = dict(nnx.to_flat_state(grads)), dict(nnx.to_flat_state(grads0))
    assert grads.keys() == params0.keys() == grads0.keys()
    for path in grads0:
        g, g0 = grads[path].get_value(), grads0[path].get_value()
        assert g.shape == params0[path].shape
        assert_close(g, g0, jnp.float32, "d" + ".".join(map(str, path)))


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_zero_tokens_on_a_mesh(capacity_factor):
    """An empty batch runs expert-parallel too (nothing is exchanged): zero output, zero stats,
    zero gradients, dropless and with a capacity factor."""
    layer = _layer(_mesh(2, 2), capacity_factor=capacity_factor)
    grad_fn = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0])))
    for shape in ((0, 4, D), (4, 0, D)):
        y, stats = nnx.jit(lambda m, x: m(x))(layer, jnp.ones(shape))
        assert y.shape == shape
        assert int(stats.tokens) == 0 and int(stats.dropped) == 0 and not np.any(stats.counts_E)
        grads = nnx.to_flat_state(grad_fn(layer, jnp.ones(shape)))
        assert all(not np.any(v.get_value()) for _, v in grads)
