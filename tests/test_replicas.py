"""Replicated experts on device (`moe_jax.parallel.replicas`, `EPOptions(placement=...)`): the
layer with a placement against the same layer on one device with the logical weights; replica
routing against the host reference `split_counts`; the replica gradient sum; replicas identical
after an optimizer step; lower per-rank rows under hot experts; moving slots to a new placement.
Forced CPU host devices (repo conftest: 8), fp32, padded exchange, backend "xla".

Legend: N global tokens, D width, E logical experts, R ep ranks, S slots per rank, F = R*S
physical slots, K top-k.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moe_jax import routing as R
from moe_jax.layers import GemmOptions, MoE
from moe_jax.parallel import AxisRules, EPOptions, make_mesh
from moe_jax.parallel.placement import Placement, placement_moves, plan_placement, split_counts
from moe_jax.parallel.replicas import (
    logical_counts,
    logical_weights,
    move_slots,
    physical_weights,
    rebalance,
    replica_sum_transfers,
    route_to_replicas,
    slot_move_transfers,
    sum_replica_grads,
)
from moe_jax.testing import assert_close
from tests.helpers import MESH_DEVICES, on_mesh_platform  # noqa: F401  (an autouse fixture)
from tests.test_layers import flat_params, module_value_and_grads

B, SEQ, D, F, E, K = 2, 16, 8, 6, 8, 2
N = B * SEQ
EXPERT_WEIGHTS = (("w_gate",), ("w_up",), ("w_down",))


# E = 8 on R = 4 ranks of S = 3 slots: the 4 redundant slots hold replicas of the hot experts 0
# (3 replicas) and 1 (2) and 2 (2), no rank holds an expert twice.
HOT = Placement(np.array([[0, 1, 3], [0, 2, 4], [0, 1, 5], [2, 6, 7]]), E)




def _mesh(ep, data=1):
    return make_mesh(ep=ep, data=data, devices=MESH_DEVICES[: ep * data])


def _layer(mesh=None, placement=None, capacity_factor=None):
    return MoE(D, F, E, K, gemm=GemmOptions(backend="xla"), mesh=mesh,
               expert_parallel=EPOptions(capacity_factor=capacity_factor, placement=placement), rngs=nnx.Rngs(0))


def _inputs(seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, (B, SEQ, D), jnp.float32), jax.random.normal(k2, (B, SEQ, D), jnp.float32)


def _hot_routing(seed):
    """Top-2 routing where expert 0 is in most tokens and expert 1 in many."""
    rng = np.random.default_rng(seed)
    p = np.array([0.45, 0.25, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])
    idx = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(N)]).astype(np.int32)
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(seed), (N, E)))
    weights = jax.random.uniform(jax.random.PRNGKey(seed + 1), (N, K), minval=0.1, maxval=1.0)
    return R.Routing(jnp.asarray(idx), weights, probs)


def _replica_groups(placement):
    return [slots[slots >= 0] for slots in placement.expert_slots_EM]


# ----------------------------------------------------------------------------- host-side pieces


def test_physical_and_logical_weights_round_trip():
    w_E = np.arange(E * 2, dtype=np.float32).reshape(E, 2)
    w_F = physical_weights(w_E, HOT)
    assert isinstance(w_F, np.ndarray) and w_F.shape == (12, 2)
    np.testing.assert_array_equal(w_F, w_E[HOT.slot_expert_RS.ravel()])
    np.testing.assert_array_equal(logical_weights(w_F, HOT), w_E)
    np.testing.assert_array_equal(logical_weights(physical_weights(jnp.asarray(w_E), HOT), HOT), w_E)
    np.testing.assert_array_equal(logical_counts(jnp.arange(12), HOT),
                                  np.bincount(HOT.slot_expert_RS.ravel(), weights=np.arange(12), minlength=E))
    with pytest.raises(ValueError, match="num_experts E = 8"):
        physical_weights(w_F, HOT)
    with pytest.raises(ValueError, match="R\\*S = 12"):
        logical_weights(w_E, HOT)
    with pytest.raises(TypeError, match="Placement"):
        physical_weights(w_E, HOT.slot_expert_RS)


_route = jax.jit(route_to_replicas, static_argnums=1)  # placements are hashable: static


@pytest.mark.parametrize("source_rank", [0, 1, 2, 3, 7])
def test_route_to_replicas_follows_split_counts(source_rank):
    """Per source rank, the rows each slot receives are the host reference's round-robin deal
    starting at replica `source_rank`; masked routes and ids outside [0, E) go nowhere (-1)."""
    routing = _hot_routing(source_rank)
    idx = np.asarray(routing.expert_idx_TK).copy()
    idx[3, 0], idx[7, 1] = E, -2
    mask = np.ones(N, bool)
    mask[[5, 11]] = False
    slot_TK = np.asarray(_route(jnp.asarray(idx), HOT, source_rank, jnp.asarray(mask)))
    valid = (idx >= 0) & (idx < E) & mask[:, None]
    assert np.all(slot_TK[~valid] == -1) and np.all(slot_TK[valid] >= 0)
    np.testing.assert_array_equal(HOT.slot_expert_RS.ravel()[slot_TK[valid]], idx[valid])
    got_RS = np.bincount(slot_TK[valid], minlength=HOT.num_slots).reshape(HOT.slot_expert_RS.shape)
    want_RS = split_counts(HOT, np.bincount(idx[valid], minlength=E), offset=source_rank)
    np.testing.assert_array_equal(got_RS, want_RS)


def test_replica_sum_transfers_move_only_replicated_slots():
    """Gather rounds: one send per non-primary replica (2 + 1 + 1 = 4 slots for HOT), no round
    where a rank sends or receives twice; a placement without replicas has no rounds."""
    sync = replica_sum_transfers(HOT)
    assert sync.rows_sent == HOT.num_redundant
    for rnd in sync.rounds:
        sources, dests = zip(*rnd.perm)
        assert len(set(sources)) == len(sources) and len(set(dests)) == len(dests)
    assert replica_sum_transfers(Placement.uniform(E, 4)).rounds == ()


def _sum_grads(placement, mesh, w_FX, cot_FX):
    def loss(w):
        body = lambda w: sum_replica_grads(w, placement, "ep")  # noqa: E731
        y = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(w)
        return jnp.sum(y * cot_FX)
    return jax.jit(jax.grad(loss))(w_FX)


@pytest.mark.parametrize("placement", [HOT, Placement(np.array([[0, 0], [1, 2], [3, 1]]), 4)],
                         ids=["hot", "two-replicas-on-one-rank"])
def test_sum_replica_grads(placement):
    """Every replica's gradient is its expert's summed gradient, bit-identical across replicas;
    also for a hand-made placement holding an expert twice on one rank (a local round)."""
    r, s = placement.slot_expert_RS.shape
    mesh = jax.make_mesh((r,), ("ep",), devices=MESH_DEVICES[:r], axis_types=(AxisType.Auto,))
    cot = jax.random.normal(jax.random.PRNGKey(0), (r * s, 3))
    g = np.asarray(_sum_grads(placement, mesh, jnp.zeros((r * s, 3)), cot))
    want_E = jax.ops.segment_sum(cot, jnp.asarray(placement.slot_expert_RS.ravel()), placement.num_experts)
    assert_close(g, physical_weights(want_E, placement), jnp.float32, "replica sum")
    for slots in _replica_groups(placement):
        for f in slots[1:]:
            np.testing.assert_array_equal(g[f], g[slots[0]])


# ----------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("data", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_layer_with_replicas_matches_one_device(data):
    """EP over 4 ranks (x 2 data replicas, slow) with replicated hot experts equals the one-device
    layer with the logical weights: output and every statistic exactly (counts and drops per
    logical expert), input and router gradients to fp32 rounding, each replica's expert gradient
    the logical expert's gradient, the same bits on every replica."""
    mesh = _mesh(4, data)
    placed = _layer(mesh, HOT)
    single = _layer()
    assert placed.w_gate[...].shape == (HOT.num_slots, F, D)
    assert placed.w_gate[...].sharding.spec == P("ep", None, None)
    for w in EXPERT_WEIGHTS:  # same seed: every slot is a copy of the one-device layer's expert
        np.testing.assert_array_equal(flat_params(placed)[w], physical_weights(flat_params(single)[w], HOT))

    x, cot = _inputs(1)
    mask = (jnp.arange(N).reshape(B, SEQ) * 7) % 5 != 0
    cot = jnp.where(mask[..., None], cot, 0.0)
    got = module_value_and_grads(placed, x, cot, mask=mask)
    want = module_value_and_grads(single, x, cot, mask=mask)
    y, stats, grads, dx, _ = got
    y0, stats0, grads0, dx0, _ = want
    assert_close(y, y0, jnp.float32, "y")
    assert_close(dx, dx0, jnp.float32, "dx")
    assert_close(grads[("w_router",)], grads0[("w_router",)], jnp.float32, "d w_router")
    for w in EXPERT_WEIGHTS:
        assert_close(grads[w], physical_weights(grads0[w], HOT), jnp.float32, "d" + w[0])
        g = np.asarray(grads[w])
        for slots in _replica_groups(HOT):
            for f in slots[1:]:
                np.testing.assert_array_equal(g[f], g[slots[0]])
    for name in ("counts_E", "dropped_E", "tokens", "dropped", "useful_rows", "executed_rows"):
        np.testing.assert_array_equal(getattr(stats, name), getattr(stats0, name), err_msg=name)
    for name in ("aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(getattr(stats, name), getattr(stats0, name), rtol=1e-5, err_msg=name)


@pytest.mark.slow  # two more layer compilations
def test_replicas_on_explicit_axes_with_fused_gate_up():
    """Explicit mesh axes, `w_gate_up` and the fused row gather: the placed layer still equals the
    one-device layer (output, counts, the gate/up gradient per replica)."""
    gemm = GemmOptions(backend="xla", fused_gate_up=True, row_gather="fused")
    mesh = make_mesh(ep=4, data=2, devices=MESH_DEVICES[:8], axis_type=AxisType.Explicit)
    placed = MoE(D, F, E, K, gemm=gemm, mesh=mesh, expert_parallel=EPOptions(placement=HOT), rngs=nnx.Rngs(0))
    single = MoE(D, F, E, K, gemm=gemm, rngs=nnx.Rngs(0))
    x, cot = _inputs(2)
    y, stats, grads, dx, _ = module_value_and_grads(placed, x, cot)
    y0, stats0, grads0, dx0, _ = module_value_and_grads(single, x, cot)
    assert_close(y, y0, jnp.float32, "y")
    assert_close(dx, dx0, jnp.float32, "dx")
    assert_close(grads[("w_gate_up",)], physical_weights(grads0[("w_gate_up",)], HOT), jnp.float32, "d w_gate_up")
    np.testing.assert_array_equal(stats.counts_E, stats0.counts_E)


@pytest.mark.slow  # one more mesh program; each option has a fast case of its own
def test_replicas_with_expert_tensor_parallelism_and_a_chunked_exchange():
    """Placement x ETP x chunks: 4 ep ranks of the HOT placement, each expert's hidden width over 2
    "etp" ranks, the exchange in 3 token chunks (4 tokens per device: a remainder); the same
    one-device result, each replica's gradient slices the logical expert's."""
    mesh = make_mesh(ep=4, etp=2, data=1, devices=MESH_DEVICES[:8])
    placed = MoE(D, F, E, K, gemm=GemmOptions(backend="xla"), mesh=mesh, axis_rules=AxisRules(expert_tensor="etp"),
                 expert_parallel=EPOptions(placement=HOT, chunks=3), rngs=nnx.Rngs(0))
    assert placed.w_down[...].sharding.spec == P("ep", None, "etp")
    x, cot = _inputs(3)
    y, stats, grads, dx, _ = module_value_and_grads(placed, x, cot)
    y0, stats0, grads0, dx0, _ = module_value_and_grads(_layer(), x, cot)
    assert_close(y, y0, jnp.float32, "y")
    assert_close(dx, dx0, jnp.float32, "dx")
    for w in EXPERT_WEIGHTS:
        assert_close(grads[w], physical_weights(grads0[w], HOT), jnp.float32, "d" + w[0])
    for name in ("counts_E", "dropped_E", "tokens", "dropped"):
        np.testing.assert_array_equal(getattr(stats, name), getattr(stats0, name), err_msg=name)


def _rank_rows(idx, placement, ep):
    """Host reference of each rank's received rows with data = 1 (device r is source rank r,
    tokens split evenly): the sum over source ranks of `split_counts(offset=source)`."""
    rows_RS = np.zeros(placement.slot_expert_RS.shape, np.int64)
    for src, part in enumerate(np.split(idx, ep)):
        rows_RS += split_counts(placement, np.bincount(part.ravel(), minlength=E), offset=src)
    return rows_RS.sum(axis=1)


def test_replicas_lower_the_busiest_rank():
    """Under a hot-expert routing, the busiest rank's rows (`useful_rows_max`) equal the host
    reference and fall below the contiguous layout's (whose per-rank rows the EP tests of
    tests/test_layers_parallel.py cover); counts stay per logical expert."""
    mesh = _mesh(4)
    routing = _hot_routing(3)
    idx = np.asarray(routing.expert_idx_TK)
    counts = np.bincount(idx.ravel(), minlength=E)
    plan = plan_placement(counts, 4, 3)
    assert plan.replicas_E.max() > 1
    x, cot = _inputs(3)
    placed = module_value_and_grads(_layer(mesh, plan), x, cot, routing=routing)[1]
    np.testing.assert_array_equal(placed.counts_E, counts)
    uniform_max = counts.reshape(4, E // 4).sum(axis=1).max()  # rank r holds experts 2r, 2r+1
    assert int(placed.useful_rows_max) == _rank_rows(idx, plan, 4).max() < uniform_max


@pytest.mark.slow
def test_capacity_drops_counted_per_logical_expert():
    """With a capacity factor, drops happen per (source, destination rank) as without a placement;
    `dropped_E` sums them over each expert's replicas and `counts_E - dropped_E` is what ran."""
    mesh = _mesh(4)
    routing = _hot_routing(4)
    x, cot = _inputs(4)
    stats = module_value_and_grads(_layer(mesh, HOT, capacity_factor=0.5), x, cot, routing=routing)[1]
    assert int(stats.dropped) > 0 and int(stats.dropped_E.sum()) == int(stats.dropped)
    assert int(stats.useful_rows) == int((stats.counts_E - stats.dropped_E).sum())


def test_placement_errors():
    with pytest.raises(TypeError, match="EPOptions\\(placement=...\\) must be a .*Placement"):
        EPOptions(placement=HOT.slot_expert_RS)
    with pytest.raises(ValueError, match="needs expert parallelism"):
        _layer(None, HOT)
    with pytest.raises(ValueError, match="needs expert parallelism"):
        _layer(_mesh(1, 4), Placement(np.arange(E).reshape(1, E), E))
    with pytest.raises(ValueError, match="has 4 ranks but the mesh's 'ep' axis has size 2.*num_ranks=2"):
        _layer(_mesh(2), HOT)
    with pytest.raises(ValueError, match="places 6 experts but num_experts=8"):
        _layer(_mesh(2), Placement(np.arange(6).reshape(2, 3), 6))
    with pytest.raises(ValueError, match="offset must be a non-negative integer"):
        split_counts(HOT, np.ones(E), offset=-1)


# ----------------------------------------------------------------------------- rebalance


def test_move_slots_follows_placement_moves():
    """Each slot of the new placement holds its expert's row after the move; only changed slots
    travel (remote ones over the permute rounds, same-rank ones in a local round)."""
    new = Placement(np.array([[0, 1, 2], [0, 4, 3], [1, 5, 6], [0, 2, 7]]), E)
    moves = placement_moves(HOT, new)
    assert moves.num_changed > 0
    mesh = jax.make_mesh((4,), ("ep",), devices=MESH_DEVICES[:4], axis_types=(AxisType.Auto,))
    w_E = jnp.arange(E * 2, dtype=jnp.float32).reshape(E, 2)
    fn = jax.jit(jax.shard_map(lambda w: move_slots(w, HOT, new, "ep"), mesh=mesh, in_specs=P("ep"),
                               out_specs=P("ep")))
    np.testing.assert_array_equal(fn(physical_weights(w_E, HOT)), physical_weights(w_E, new))
    assert slot_move_transfers(HOT, new).rows_sent >= moves.num_changed
    assert slot_move_transfers(HOT, HOT).rounds == ()


def test_adam_keeps_replicas_identical_and_rebalance_moves_its_state():
    """An optax adam step on the placed layer leaves every replica bit-identical (weights and
    moments). Then `rebalance` moves the expert weights and adam moments to a new placement on
    device: every slot, replicas included, holds exactly its new expert's weights and moments (the
    logical model unchanged bit for bit), and the layer with the new placement computes what it did before (to fp32
    rounding: see below)."""
    mesh = _mesh(4)
    model = _layer(mesh, HOT)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x, cot = _inputs(6)

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.sum(m(x)[0] * cot))(model)
        optimizer.update(model, grads)

    before_step = flat_params(model)
    step(model, optimizer, x)
    for path, v in nnx.to_flat_state(nnx.state((model, optimizer))):
        if path[-1] in ("w_gate", "w_up", "w_down"):  # the layer's weights and adam's mu, nu
            a = np.asarray(v.get_value())
            for slots in _replica_groups(HOT):
                for f in slots[1:]:
                    np.testing.assert_array_equal(a[f], a[slots[0]], err_msg=str(path))
    for w in EXPERT_WEIGHTS:
        assert not np.array_equal(flat_params(model)[w], before_step[w])

    y_before = nnx.jit(lambda m, x: m(x)[0])(model, x)
    new = plan_placement(np.array([1, 9, 8, 1, 1, 1, 1, 1]), 4, 3, previous=HOT)
    assert placement_moves(HOT, new).num_remote > 0
    flat_before = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state((model, optimizer)))}
    nnx.update((model, optimizer), rebalance(nnx.state((model, optimizer)), HOT, new, mesh))
    model.expert_parallel = dataclasses.replace(model.expert_parallel, placement=new)
    moved = 0
    for path, v in nnx.to_flat_state(nnx.state((model, optimizer))):
        if path[-1] in ("w_gate", "w_up", "w_down"):  # the layer's weights and adam's mu, nu
            # Every slot, replicas included, is exactly its new expert's array: the state is the
            # state of the new placement with the same logical model, bit for bit.
            np.testing.assert_array_equal(v.get_value(), physical_weights(logical_weights(flat_before[path], HOT), new))
            moved += 1
        else:
            np.testing.assert_array_equal(v.get_value(), flat_before[path])
    assert moved == 9
    # Against the old placement each route meets the same weights in another group of rows on
    # another rank, and XLA's grouped GEMM rounds a row differently with other rows around it
    # (1 ulp seen): equal to fp32 rounding.
    assert_close(nnx.jit(lambda m, x: m(x)[0])(model, x), y_before, jnp.float32, "y after rebalance")
    with pytest.raises(ValueError, match="'ep' of the placements' 4 ranks"):
        rebalance({}, HOT, new, _mesh(2))
