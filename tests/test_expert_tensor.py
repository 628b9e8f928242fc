"""Expert tensor parallelism (ETP): moe_jax.layers.MoE with the routed experts' hidden width F
split over an `AxisRules.expert_tensor` mesh axis, alone (ETP = 2, 4) and with expert parallelism
(EP = 2 x ETP = 2 x data = 2), on forced CPU host devices (repo conftest: 8), against the same
layer on one device over the full batch: outputs, statistics and every gradient (input, router,
routed experts, shared experts, latent projections). fp32, backend "xla" (speed). Also the fused
gate/up layout per shard, an Explicit mesh, capacity drops under EP x ETP, and the errors.

Legend: B batch, S sequence, N = B*S tokens, D width, L latent width, F expert hidden width,
E experts, K top-k.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from moe_jax import routing as R
from moe_jax.experts import fuse_gate_up, split_gate_up
from moe_jax.layers import GemmOptions, MoE, SharedExperts
from moe_jax.parallel import ETP_AXIS, AxisRules, EPOptions, make_mesh
from moe_jax.testing import assert_close
from tests.helpers import MESH_DEVICES, masked_inputs, on_mesh_platform  # noqa: F401  (an autouse fixture)
from tests.test_layers import module_value_and_grads

B, S, D, F, E, K, L = 2, 8, 8, 8, 8, 2, 4
N = B * S
ETP_RULES = AxisRules(expert_tensor=ETP_AXIS)



def _mesh(ep, etp, data, axis_type=AxisType.Auto):
    return make_mesh(ep=ep, etp=etp, data=data, devices=MESH_DEVICES[: ep * etp * data], axis_type=axis_type)


def _layer(mesh=None, *, fused=False, capacity_factor=None, chunks=1, rules=ETP_RULES):
    return MoE(
        D, F, E, K, shared_experts=SharedExperts(1, d_ff=5), latent_dim=L,
        gemm=GemmOptions(backend="xla", fused_gate_up=fused), mesh=mesh, axis_rules=None if mesh is None else rules,
        expert_parallel=EPOptions(capacity_factor=capacity_factor, chunks=chunks),
        rngs=nnx.Rngs(0),
    )


def _inputs(seed):
    return masked_inputs(seed, (B, S, D))


def _assert_same(got, want):
    """Mesh result vs the reference layer: outputs and every gradient to fp32 tolerance (the sums
    run in another order), integer statistics exactly, the losses to fp32 rounding."""
    y, stats, grads, dx, dw = got
    y0, stats0, grads0, dx0, dw0 = want
    assert_close(y, y0, jnp.float32, "y")
    assert_close(dx, dx0, jnp.float32, "dx")
    assert grads.keys() == grads0.keys()
    for path in grads0:
        assert_close(grads[path], grads0[path], jnp.float32, "d" + ".".join(map(str, path)))
    if dw0 is not None:
        assert_close(dw, dw0, jnp.float32, "d weights_TK")
    for name in ("counts_E", "dropped_E", "tokens", "dropped"):
        np.testing.assert_array_equal(getattr(stats, name), getattr(stats0, name), err_msg=name)
    for name in ("aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(getattr(stats, name), getattr(stats0, name), rtol=1e-5, err_msg=name)


def _assert_rows_once(stats, mask):
    """GEMM telemetry counts each ETP group's rows once (its ranks run the same rows, F/ETP wide)."""
    assert int(stats.useful_rows) == int(stats.executed_rows) == int(mask.sum()) * K
    assert int(stats.dropped) == 0


@pytest.mark.parametrize("ep, etp, data", [(1, 2, 4), (1, 4, 2), (2, 2, 2)])
def test_matches_single_device(ep, etp, data):
    """ETP alone and EP x ETP x data: the weights' F dims split over "etp" (gate/up rows, down
    columns), everything else as without ETP; output, stats and every gradient equal the
    single-device layer."""
    mesh = _mesh(ep, etp, data)
    m = _layer(mesh)
    assert (m.ep, m.etp) == (ep, etp)
    assert m.w_gate[...].sharding.spec == PartitionSpec("ep", "etp", None)
    assert m.w_down[...].sharding.spec == PartitionSpec("ep", None, "etp")
    assert m.w_gate[...].addressable_shards[0].data.shape == (E // ep, F // etp, L)
    for w in (m.w_router, m.w_latent_down, m.shared.w_gate):
        assert w[...].sharding.spec == PartitionSpec(None, None)  # replicated over "etp" too
    x, mask, cot = _inputs(ep * 10 + etp)
    got = module_value_and_grads(m, x, cot, mask=mask)
    _assert_same(got, module_value_and_grads(_layer(), x, cot, mask=mask))
    _assert_rows_once(got[1], mask)


@pytest.mark.slow  # one more mesh program; each option has a fast case of its own
def test_ep_x_etp_with_a_chunked_exchange():
    """EP x ETP with the exchange in 3 token chunks (a remainder: 4 tokens per device): the ETP sum
    of each chunk's partial outputs, the same single-device result."""
    mesh = _mesh(2, 2, 2)
    x, mask, cot = _inputs(7)
    got = module_value_and_grads(_layer(mesh, chunks=3), x, cot, mask=mask)
    _assert_same(got, module_value_and_grads(_layer(), x, cot, mask=mask))
    _assert_rows_once(got[1], mask)


@pytest.mark.slow  # two more layer programs (fused, on the mesh and on one device)
def test_fused_gate_up_in_per_shard_blocks():
    """A fused `w_gate_up` under ETP holds [gate slice j; up slice j] in row block j, so each
    rank's even share of its rows is its own fused slice: same results as the single-device fused
    layer (its gradient compared in the gate-rows-first layout)."""
    w_gate, w_up = (jax.random.normal(jax.random.PRNGKey(i), (E, F, D)) for i in (1, 2))
    fused = fuse_gate_up(np.asarray(w_gate), np.asarray(w_up), shards=2)
    assert isinstance(fused, np.ndarray)
    np.testing.assert_array_equal(fused[:, : F // 2], w_gate[:, : F // 2])
    np.testing.assert_array_equal(fused[:, F // 2: F], w_up[:, : F // 2])
    for got, want in zip(split_gate_up(fused, shards=2), (w_gate, w_up)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(fuse_gate_up(w_gate, w_up, shards=1), jnp.concatenate([w_gate, w_up], 1))

    mesh = _mesh(2, 2, 2)
    m, m0 = _layer(mesh, fused=True), _layer(fused=True)
    assert m.w_gate_up[...].sharding.spec == PartitionSpec("ep", "etp", None)
    for got, want in zip(split_gate_up(m.w_gate_up[...], shards=2), split_gate_up(m0.w_gate_up[...])):
        np.testing.assert_array_equal(got, want)
    x, mask, cot = _inputs(3)
    y, stats, grads, dx, dw = module_value_and_grads(m, x, cot, mask=mask)
    grads[("w_gate_up",)] = jnp.concatenate(split_gate_up(grads[("w_gate_up",)], shards=2), axis=1)
    _assert_same((y, stats, grads, dx, dw), module_value_and_grads(m0, x, cot, mask=mask))


@pytest.mark.slow  # tests/test_layers_mesh.py covers Explicit meshes without ETP
def test_explicit_mesh_and_own_axis_names():
    """An Explicit mesh of the user's with its own axis names ("tp" for ETP)."""
    mesh = jax.make_mesh((2, 2, 2), ("dp", "expert", "tp"), axis_types=(AxisType.Explicit,) * 3,
                         devices=MESH_DEVICES[:8])
    rules = AxisRules(tokens=("dp", "expert"), experts="expert", expert_tensor="tp")
    m = _layer(mesh, rules=rules)
    assert m.w_up[...].sharding.spec == PartitionSpec("expert", "tp", None)
    x, mask, cot = _inputs(5)
    with jax.set_mesh(mesh):
        got = module_value_and_grads(m, x, cot, mask=mask)
    _assert_same(got, module_value_and_grads(_layer(), x, cot, mask=mask))


@pytest.mark.slow  # test_matches_single_device[2-2-2] covers EP x ETP; this adds the capacity path
def test_capacity_drops_under_ep_x_etp_match_ep():
    """A capacity factor under EP x ETP drops exactly what EP alone drops on the same token split
    (the dispatch runs unchanged within each ETP slice), with the same output and gradients. All
    routes go to ep rank 0's experts, which overflows its capacity."""
    rng = np.random.default_rng(0)
    idx = np.stack([rng.choice(E // 2, K, replace=False) for _ in range(N)]).astype(np.int32)
    routing = R.Routing(jnp.asarray(idx), jax.random.uniform(jax.random.PRNGKey(1), (N, K), minval=0.1),
                        jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(2), (N, E))))
    x, mask, cot = _inputs(9)
    got = module_value_and_grads(_layer(_mesh(2, 2, 2), capacity_factor=1.0), x, cot, mask=mask, routing=routing)
    ep_only = _layer(make_mesh(ep=2, data=2, devices=MESH_DEVICES[:4]), capacity_factor=1.0, rules=AxisRules())
    want = module_value_and_grads(ep_only, x, cot, mask=mask, routing=routing)
    assert int(got[1].dropped) == int(want[1].dropped) > 0
    np.testing.assert_array_equal(got[1].dropped_E, want[1].dropped_E)
    _assert_same(got, want)


def test_axis_sets():
    """Tokens are replicated over the ETP axis: no gradient is summed over it."""
    rules = AxisRules(expert_tensor="etp")
    assert rules.expert_replicas == ("data",) and rules.dense_replicas == ("data", "ep")
    assert rules.gate_up_spec() == PartitionSpec("ep", "etp", None)
    assert rules.down_spec() == PartitionSpec("ep", None, "etp")
    assert AxisRules().gate_up_spec() == PartitionSpec("ep", None, None)
    assert AxisRules(experts=None, expert_tensor="etp").down_spec() == PartitionSpec(None, None, "etp")
    mesh = make_mesh(ep=2, etp=2, devices=MESH_DEVICES[:8])
    assert mesh.axis_names == ("data", "ep", "etp") and tuple(mesh.shape.values()) == (2, 2, 2)
    assert make_mesh(ep=2, devices=MESH_DEVICES[:8]).axis_names == ("data", "ep")


def test_errors():
    with pytest.raises(ValueError, match=r"expert_tensor='ep' is the expert axis"):
        AxisRules(expert_tensor="ep")
    with pytest.raises(ValueError, match=r"expert_tensor='data' is a token axis"):
        AxisRules(expert_tensor="data")
    with pytest.raises(ValueError, match=r"expert_tensor=3: must be a mesh axis name"):
        AxisRules(expert_tensor=3)
    with pytest.raises(ValueError, match=r"axis rules name \['etp'\], which the mesh"):
        _layer(make_mesh(ep=2, data=2, devices=MESH_DEVICES[:4]))
    with pytest.raises(ValueError, match="d_ff=8 is not divisible by the 'etp' axis size 3"):
        _layer(make_mesh(ep=1, etp=3, data=2, devices=MESH_DEVICES[:6]))
    with pytest.raises(ValueError, match=r"ep \* etp = 3 \* 2 = 6 does not divide the 8 devices"):
        make_mesh(ep=3, etp=2, devices=MESH_DEVICES[:8])
    with pytest.raises(ValueError, match=r"data \* ep \* etp = 1 \* 2 \* 2 = 4 but 8 devices"):
        make_mesh(ep=2, etp=2, data=1, devices=MESH_DEVICES[:8])
    with pytest.raises(ValueError, match="etp must be a positive int"):
        make_mesh(ep=2, etp=0)
    with pytest.raises(ValueError, match="shards=3 does not divide F = 8"):
        fuse_gate_up(jnp.zeros((E, F, D)), jnp.zeros((E, F, D)), shards=3)
    # A fused layer built without a mesh is laid out for ETP = 1: an ambient ETP mesh cannot run it.
    mesh = _mesh(1, 2, 4)
    m = MoE(D, F, E, K, gemm=GemmOptions(backend="xla", fused_gate_up=True), axis_rules=ETP_RULES, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="laid out at construction for an expert-tensor size of 1"):
        m(jnp.ones((B, S, D)))
