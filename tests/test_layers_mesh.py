"""The MoE layer on the user's meshes: any axis names (AxisRules), Auto and Explicit axes, a mesh
passed in or the ambient one (`jax.set_mesh`), extra axes left alone, and calls inside the
user's own `shard_map`. Each case equals the same layer on one device over the full batch:
outputs and every gradient (forced CPU host devices, repo conftest: 8).

Legend: B batch, S sequence, D width, F expert hidden width, E experts, K top-k.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from moe_jax.layers import GemmOptions, MoE, SharedExperts
from moe_jax.parallel import AxisRules, EPOptions, make_mesh
from moe_jax.testing import assert_close

B, S, D, F, E, K = 8, 4, 8, 6, 8, 2
HOST = jax.devices("cpu")
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit


@pytest.fixture(autouse=True)
def _on_host():
    with jax.default_device(HOST[0]):
        yield


def _layer(row_gather="auto", **kw):
    return MoE(D, F, E, K, shared_experts=SharedExperts(1, d_ff=5), gemm=GemmOptions(backend="xla", row_gather=row_gather),
               rngs=nnx.Rngs(0), **kw)


def _inputs():
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(k1, (B, S, D), jnp.float32)
    mask = (jnp.arange(B * S).reshape(B, S) * 7) % 5 != 0
    cot = jnp.where(mask[..., None], jax.random.normal(k2, (B, S, D), jnp.float32), 0.0)
    return x, mask, cot


def _loss(m, x, mask, cot):
    y, stats = m(x, mask=mask)
    return jnp.sum(y * cot), (y, stats)


_grad = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1), has_aux=True))


def _run(m, x, mask, cot):
    (_, (y, stats)), (g, dx) = _grad(m, x, mask, cot)
    return y, stats, {p: v.get_value() for p, v in nnx.to_flat_state(g)}, dx


# Built where the meshes' devices are (initialisers draw differently on a GPU), outside any mesh context.
with jax.default_device(HOST[0]):
    REFERENCE = _layer()
    WANT = _run(REFERENCE, *_inputs())


def _assert_matches_single_device(m, x, mask, cot, what):
    """`m` (same weights as REFERENCE) equals the single-device layer: y, dx, every param gradient."""
    want = WANT
    got = _run(m, x, mask, cot)
    for name, a, b in (("y", got[0], want[0]), ("dx", got[3], want[3])):
        assert_close(a, b, jnp.float32, f"{what} {name}")
    assert got[2].keys() == want[2].keys()
    for path in want[2]:
        assert_close(got[2][path], want[2][path], jnp.float32, f"{what} d{'.'.join(map(str, path))}")
    np.testing.assert_array_equal(got[1].counts_E, want[1].counts_E)
    assert int(got[1].dropped) == 0
    return got


def _like_reference(**kw):
    """A layer with REFERENCE's weights (the same seed), laid out as `kw` lays them out."""
    m = _layer(**kw)
    np.testing.assert_array_equal(m.w_gate[...], REFERENCE.w_gate[...])
    return m


MESHES = {
    # name: (shape, axis names, rules); 8 devices each
    "make_mesh": ((4, 2), ("data", "ep"), AxisRules()),
    "data_fsdp_expert": ((2, 2, 2), ("data", "fsdp", "expert"), AxisRules(tokens=("data", "fsdp", "expert"),
                                                                           experts="expert")),
    "tensor_left_alone": ((2, 2, 2), ("data", "tensor", "expert"), AxisRules(tokens=("data", "expert"),
                                                                            experts="expert")),
    "data_parallel_only": ((8,), ("batch",), AxisRules(tokens=("batch",), experts=None)),
}


# Meshes whose siblings run on every pin (three axes: tensor_left_alone; data parallel: the fused
# row gather's test below) are in the slow lane.
SLOW_MESHES = ("data_fsdp_expert", "data_parallel_only")


@pytest.mark.parametrize("axis_type", [AUTO, EXPLICIT], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", [pytest.param(n, id=n, marks=[pytest.mark.slow] if n in SLOW_MESHES else [])
                                  for n in MESHES])
def test_user_mesh_matches_single_device(name, axis_type):
    shape, names, rules = MESHES[name]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=HOST[:8])
    m = _like_reference(mesh=mesh, axis_rules=rules)
    if rules.experts is not None:
        assert m.w_gate[...].sharding.spec == PartitionSpec(rules.experts, None, None)
    x, mask, cot = _inputs()
    with jax.set_mesh(mesh):
        _assert_matches_single_device(m, x, mask, cot, name)


@pytest.mark.parametrize("axis_type", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_fused_row_gather_on_a_data_parallel_mesh(axis_type):
    """`row_gather="fused"` inside the data-parallel shard_map, and on Explicit batch-sharded input
    without a mesh of the layer's own: the single-device layer's values and gradients."""
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(axis_type,), devices=HOST[:4])
    x, mask, cot = _inputs()
    m = _like_reference(mesh=mesh, axis_rules=AxisRules(tokens=("batch",), experts=None), row_gather="fused")
    with jax.set_mesh(mesh):
        _assert_matches_single_device(m, x, mask, cot, "fused, data parallel")
    if axis_type == EXPLICIT:
        m = _like_reference(row_gather="fused")
        with jax.set_mesh(mesh):
            sharded = NamedSharding(mesh, PartitionSpec("batch"))
            _assert_matches_single_device(m, *(jax.device_put(a, sharded) for a in (x, mask, cot)), "fused, explicit")


def test_explicit_make_mesh_with_capacity_and_pair_transport():
    """An Explicit ("data", "ep") mesh from make_mesh at ep = 2, with EP options as one value."""
    mesh = make_mesh(ep=2, data=4, devices=HOST[:8], axis_type=EXPLICIT)
    m = _like_reference(mesh=mesh, expert_parallel=EPOptions(transport="pair_swap"))
    x, mask, cot = _inputs()
    with jax.set_mesh(mesh):
        _assert_matches_single_device(m, x, mask, cot, "explicit ep=2 pair_swap")


@pytest.mark.parametrize("axis_type", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_ambient_mesh_and_rules(axis_type):
    """No mesh passed: the ambient mesh of jax.set_mesh with axis rules gives expert parallelism."""
    mesh = jax.make_mesh((2, 4), ("replica", "expert"), axis_types=(axis_type,) * 2, devices=HOST[:8])
    m = _like_reference(axis_rules=AxisRules(tokens=("replica", "expert"), experts="expert"))
    x, mask, cot = _inputs()
    with jax.set_mesh(mesh):
        _assert_matches_single_device(m, x, mask, cot, "ambient")


def test_no_mesh_layer_on_batch_sharded_explicit_input():
    """A layer built without a mesh, under nnx.jit on input sharded over an Explicit batch axis:
    data parallel over that axis (this failed in expert_counts' scatter and the packing)."""
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(EXPLICIT,), devices=HOST[:4])
    m = _like_reference()
    x, mask, cot = _inputs()
    with jax.set_mesh(mesh):
        sharded = NamedSharding(mesh, PartitionSpec("batch"))
        x, mask, cot = (jax.device_put(a, sharded) for a in (x, mask, cot))
        y, *_ = _assert_matches_single_device(m, x, mask, cot, "no-mesh explicit")
        assert jax.typeof(y).sharding.spec == PartitionSpec("batch", None, None)


def _single_device_run(x, mask, cot):
    """REFERENCE's `_run` on other inputs (one device, no mesh)."""
    with jax.default_device(HOST[0]):
        return _run(REFERENCE, x, mask, cot)


def _assert_same_run(got, want, what):
    for name, a, b in (("y", got[0], want[0]), ("dx", got[3], want[3])):
        assert_close(a, b, jnp.float32, f"{what} {name}")
    assert got[2].keys() == want[2].keys()
    for path in want[2]:
        assert_close(got[2][path], want[2][path], jnp.float32, f"{what} d{'.'.join(map(str, path))}")
    np.testing.assert_array_equal(got[1].counts_E, want[1].counts_E)
    for name in ("aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(getattr(got[1], name), getattr(want[1], name), rtol=1e-5, err_msg=name)


def _odd_inputs(b, s, seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(k1, (b, s, D), jnp.float32)
    mask = (jnp.arange(b * s).reshape(b, s) * 3) % 7 != 0
    cot = jnp.where(mask[..., None], jax.random.normal(k2, (b, s, D), jnp.float32), 0.0)
    return x, mask, cot


@pytest.mark.parametrize(
    "ep, data, b, s, spec",
    [
        pytest.param(2, 4, 2, 32, PartitionSpec(), id="ep2-B2"),
        pytest.param(2, 4, 6, 4, PartitionSpec(), id="ep2-B6", marks=pytest.mark.slow),
        pytest.param(1, 8, 4, 16, PartitionSpec(), id="data8-B4", marks=pytest.mark.slow),
        pytest.param(2, 4, 2, 32, PartitionSpec(None, ("data", "ep")), id="ep2-B2-sequence-sharded"),
        pytest.param(2, 4, 6, 4, PartitionSpec("ep"), id="ep2-B6-batch-over-ep"),
    ],
)
def test_explicit_make_mesh_with_batches_the_token_split_does_not_fit(ep, data, b, s, spec):
    """An Explicit make_mesh layer on batches whose B*S tokens split over the 8 devices but whose
    batch does not (B = 2, 6 at ep = 2; B = 4 data parallel over 8): outputs and every gradient of
    the single-device layer, and y laid out as x (these failed in the final reshape)."""
    mesh = make_mesh(ep=ep, data=data, devices=HOST[:8], axis_type=EXPLICIT)
    m = _like_reference(mesh=mesh)
    x, mask, cot = _odd_inputs(b, s, 10 * b + ep)
    want = _single_device_run(x, mask, cot)
    with jax.set_mesh(mesh):
        x, mask, cot = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, mask, cot))
        got = _run(m, x, mask, cot)
    _assert_same_run(got, want, f"B={b} ep={ep}")
    assert jax.typeof(got[0]).sharding.spec == jax.typeof(x).sharding.spec
    assert jax.typeof(got[3]).sharding.spec == jax.typeof(x).sharding.spec


@pytest.mark.parametrize(
    "spec",
    [pytest.param(PartitionSpec(None, "b"), id="sequence", marks=pytest.mark.slow),
     pytest.param(PartitionSpec("a", "b"), id="batch-and-sequence"),
     pytest.param(PartitionSpec(None, None, "b"), id="width", marks=pytest.mark.slow),
     pytest.param(PartitionSpec("a", None, "b"), id="batch-and-width")],
)
def test_no_mesh_layer_on_sequence_or_width_sharded_explicit_input(spec):
    """A layer without a mesh under an ambient Explicit mesh, on input sharded over the sequence or
    the width (it crashed in internal reshapes): data parallel over the token axes, the width
    gathered, y in x's sharding; values and gradients of the single-device layer."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(EXPLICIT,) * 2, devices=HOST[:8])
    m = _like_reference()
    x, mask, cot = _inputs()
    with jax.set_mesh(mesh):
        sharded = tuple(jax.device_put(a, NamedSharding(mesh, PartitionSpec(*spec[:a.ndim]))) for a in (x, mask, cot))
        y, *_ = _assert_matches_single_device(m, *sharded, f"no mesh, {spec}")
    assert jax.typeof(y).sharding.spec == PartitionSpec(*spec, *(None,) * (3 - len(spec)))


def test_explicit_mesh_layer_outside_set_mesh():
    """A layer holding an Explicit mesh enters it itself under jit (it had to be called under
    jax.set_mesh); under another ambient mesh it says which to use. Eagerly: the next test."""
    mesh = make_mesh(ep=2, data=4, devices=HOST[:8], axis_type=EXPLICIT)
    m = _like_reference(mesh=mesh)
    x, mask, cot = _inputs()
    _assert_matches_single_device(m, x, mask, cot, "explicit mesh, no set_mesh, jit")
    other = jax.make_mesh((8,), ("batch",), axis_types=(EXPLICIT,), devices=HOST[:8])
    with jax.set_mesh(other), pytest.raises(ValueError, match=r"built on the mesh .* called under jax.set_mesh of "
                                                              r"another one .* jax.set_mesh\(layer.mesh\)"):
        m(x, mask=mask)


@pytest.mark.slow  # eager shard_map compiles op by op (about 30 s on 2 cores); the jit case is above
def test_explicit_mesh_layer_outside_set_mesh_eagerly():
    """The same layer called eagerly, outside any jax.set_mesh, enters its own mesh."""
    m = _like_reference(mesh=make_mesh(ep=2, data=4, devices=HOST[:8], axis_type=EXPLICIT))
    x, mask, _ = _inputs()
    y, _ = m(x, mask=mask)
    assert_close(y, WANT[0], jnp.float32, "explicit mesh, no set_mesh, eager")


def test_inside_a_users_shard_map():
    """A no-mesh layer inside the user's shard_map runs per device on each shard's tokens (its
    replicated weights' gradients sum over the shards); a layer with a mesh is refused."""
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(AUTO,), devices=HOST[:4])
    m = _like_reference()
    graph, state = nnx.split(m)
    x, _, cot = _inputs()

    def per_shard(state, x, cot):
        y, _ = nnx.merge(graph, state)(x)
        return jax.lax.psum(jnp.sum(y * cot), "batch")

    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("batch"),
                                                            PartitionSpec("batch")), out_specs=PartitionSpec())
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(jax.value_and_grad(sharded))(state, x, cot)

    def shard_by_shard(state):  # the same per-shard computation, one shard at a time on one device
        layer = nnx.merge(graph, state)
        return sum(jnp.sum(layer(x[i:i + 2])[0] * cot[i:i + 2]) for i in range(0, B, 2))

    want_loss, want_grads = jax.value_and_grad(shard_by_shard)(state)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for (path, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
        assert_close(g.get_value(), w.get_value(), jnp.float32, str(path))

    with_mesh = _like_reference(mesh=make_mesh(ep=2, data=2, devices=HOST[:4]))
    graph, state = nnx.split(with_mesh)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="cannot be called inside another one"):
        jax.jit(sharded).trace(state, x, cot)


def test_mesh_errors():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=HOST[:8])
    with pytest.raises(ValueError, match=r"axis rules name \['ep'\], which the mesh .* does not have"):
        _layer(mesh=mesh)
    with pytest.raises(ValueError, match="AxisRules.experts='ep': must be one of the token axes"):
        AxisRules(tokens=("data",), experts="ep")
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the 'expert' axis size 4"):
        MoE(D, F, 6, K, mesh=mesh, axis_rules=AxisRules(("data", "expert"), "expert"), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="axis_rules must be a moe_jax.parallel.AxisRules"):
        _layer(axis_rules=("data", "ep"))
    m = _layer(mesh=mesh, axis_rules=AxisRules(("data", "expert"), "expert"))
    with pytest.raises(ValueError, match="12 tokens cannot be split over the 8 devices"):
        m(jnp.zeros((12, D)))
    with pytest.raises(ValueError, match="only 4 were given; lower data or ep"):
        make_mesh(ep=2, data=3, devices=HOST[:4])
