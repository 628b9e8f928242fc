"""`MoE.fp8_weight_copies()` and `MoE(..., fp8_copies=)`: an FP8 layer's master weights quantized
once, ahead of its calls, give the calls' output and every gradient bit for bit: on one device
(on `auto`: on a GPU its FP8 kernels, compiled) and on every mesh case on `MESH_DEVICES` (data
parallel on Explicit axes, expert parallel with shared experts, expert tensor parallelism with
shards no multiple of 128, a placement with replicas, inside a user's `shard_map`, and without
rules under an ambient mesh); in a jitted micro-batch loop the weights are quantized once before
the loop instead of once per micro-batch (lowered for an H200); argument errors.

Legend: T tokens, D model width, F expert hidden width, E experts, K experts per token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moe_jax.layers import EPOptions, Fp8Blockwise, Fp8LayerCopies, GemmOptions, MoE, SharedExperts, stored_fp8
from moe_jax.parallel import ETP_AXIS, AxisRules, make_mesh
from moe_jax.parallel.placement import Placement
from tests.helpers import MESH_DEVICES, lower_for_gpu

D, F, E, K = 160, 256, 4, 2

# The warning of the products' reference path off GPU (the layers here run on `xla` anyway).
pytestmark = pytest.mark.filterwarnings("ignore:gmm_fp8.*reference path")


def _layer(input_gradient="fp8", shared=True, d_ff=F, backend="xla", **kwargs):
    """The FP8 layer; built on the mesh's kind of device when given one (initializers draw
    differently on a GPU; the layer's arrays then live where its mesh is)."""
    device = kwargs["mesh"].devices.flat[0] if kwargs.get("mesh") is not None else jax.devices()[0]
    with jax.default_device(device):
        return _build(input_gradient, shared, d_ff, backend, **kwargs)


def _build(input_gradient, shared, d_ff, backend, **kwargs):
    gemm = GemmOptions(backend=backend, quantization=Fp8Blockwise(input_gradient=input_gradient))
    shared_experts = SharedExperts(count=1, gate=True) if shared else None
    return MoE(D, d_ff, E, K, gemm=gemm, shared_experts=shared_experts, rngs=nnx.Rngs(0), **kwargs)


def _x(t=32, seed=1):
    return jax.random.normal(jax.random.key(seed), (2, t // 2, D), jnp.float32)


def _mask(t=32):
    return (jnp.arange(t).reshape(2, t // 2) * 7) % 5 != 0


def _loss(m, x, mask, copies):
    y, stats = m(x, mask=mask, fp8_copies=copies)
    return jnp.sum(jnp.square(y.astype(jnp.float32))) + stats.aux_loss, y


def _value_and_grads(m, x, mask, copies):
    (_, y), (g_m, g_x) = nnx.value_and_grad(_loss, argnums=(0, 1), has_aux=True)(m, x, mask, copies)
    return y, g_x, nnx.state(g_m, nnx.Param)


def _assert_bit_equal(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) > 0
    for a, b in zip(got_leaves, want_leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _doubled(copies: Fp8LayerCopies) -> Fp8LayerCopies:
    """The copies with the routed gate weight's forward block scales doubled (its values twice as large)."""
    gate = copies.routed[0]
    gate = gate._replace(quantized=gate.quantized._replace(scale_ENbKb=2 * gate.quantized.scale_ENbKb))
    return copies._replace(routed=(gate, *copies.routed[1:]))


def _with_and_without(m, x, mask=None):
    """The layer's value and gradients under `jit` with copies made in the same program, without
    copies, and with copies whose gate weight was altered (which must change the output: the
    calls read the copies)."""
    graph, state = nnx.split(m)

    def run(state, x, mode: str):
        m = nnx.merge(graph, state)
        copies = None if mode == "none" else m.fp8_weight_copies()
        return _value_and_grads(m, x, mask, _doubled(copies) if mode == "doubled" else copies)

    with_copies, without, doubled = (jax.jit(run, static_argnums=2)(state, x, mode)
                                     for mode in ("copies", "none", "doubled"))
    assert not np.array_equal(np.asarray(doubled[0]), np.asarray(without[0]))
    return with_copies, without


@pytest.mark.parametrize("input_gradient", ["fp8", "master"])
def test_one_device_bit_equal(input_gradient):
    m = _layer(input_gradient, backend="auto")
    copies = m.fp8_weight_copies()
    assert isinstance(copies, Fp8LayerCopies) and len(copies.routed) == 3 and len(copies.shared) == 3
    assert all((c.transposed is None) == (input_gradient == "master") for c in copies.routed + copies.shared)
    x, mask = _x(), _mask()
    _assert_bit_equal(_value_and_grads(m, x, mask, copies), _value_and_grads(m, x, mask, None))


def _placement():
    # Two ep ranks of three slots: experts 0 and 1 have two replicas each.
    return Placement(np.array([[0, 1, 2], [0, 3, 1]]), E)


MESH_CASES = {
    "data-explicit": lambda: dict(mesh=make_mesh(ep=1, data=2, devices=MESH_DEVICES[:2],
                                                 axis_type=AxisType.Explicit)),
    "ep-data": lambda: dict(mesh=make_mesh(ep=2, data=2, devices=MESH_DEVICES[:4])),
    # 384 / 2 = 192 hidden units per shard: each shard's blocks are laid from its own first row.
    "etp-unaligned": lambda: dict(mesh=make_mesh(ep=2, etp=2, devices=MESH_DEVICES[:4]), d_ff=384, shared=False,
                                  axis_rules=AxisRules(expert_tensor=ETP_AXIS)),
    "placement": lambda: dict(mesh=make_mesh(ep=2, data=1, devices=MESH_DEVICES[:2]), shared=False,
                              expert_parallel=EPOptions(placement=_placement())),
}


@pytest.mark.parametrize("case", list(MESH_CASES))
def test_mesh_cases_bit_equal(case):
    """On each mesh case the copies (made per device shard, with the weights' own specs) give the
    calls' output and every gradient bit for bit."""
    kwargs = MESH_CASES[case]()
    m = _layer(**kwargs)
    with jax.default_device(MESH_DEVICES[0]):  # the mesh's kind of device
        with_copies, without = _with_and_without(m, _x(), _mask())
        _assert_bit_equal(with_copies, without)
        # Made outside the program too: under ETP the scales of each 192-row shard, 2 blocks each, side by side.
        copies = m.fp8_weight_copies()
    if case == "etp-unaligned":
        assert copies.routed[0].quantized.scale_ENbKb.shape == (E, 4, 2)
        assert copies.routed[2].quantized.scale_ENbKb.shape == (E, 2, 4)


def test_inside_a_users_shard_map_bit_equal():
    """A no-mesh layer in the user's `shard_map`: copies made there too, per device."""
    mesh = jax.make_mesh((2,), ("batch",), axis_types=(AxisType.Auto,), devices=MESH_DEVICES[:2])
    with jax.default_device(MESH_DEVICES[0]):  # the mesh's kind of device
        graph, state = nnx.split(_layer())
        x = _x().reshape(-1, D)

    def per_shard(state, x, once):
        m = nnx.merge(graph, state)
        loss, _ = _loss(m, x, None, m.fp8_weight_copies() if once else None)
        return jax.lax.psum(loss, "batch")

    grads = {}
    for once in (True, False):
        sharded = jax.shard_map(lambda s, x: per_shard(s, x, once), mesh=mesh, in_specs=(P(), P("batch")),
                                out_specs=P())
        with jax.set_mesh(mesh):
            grads[once] = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))(state, x)
    _assert_bit_equal(grads[True], grads[False])


def test_ambient_mesh_without_rules_bit_equal():
    """No rules of the layer's own: the routed stage follows the tokens' Explicit sharding (data
    parallel, replicated weights); copies made on the replicated weights are the same."""
    mesh = make_mesh(ep=1, data=2, devices=MESH_DEVICES[:2], axis_type=AxisType.Explicit)
    with jax.default_device(MESH_DEVICES[0]):  # the mesh's kind of device
        m = _layer()
    with jax.set_mesh(mesh):
        x = jax.device_put(_x(), jax.sharding.NamedSharding(mesh, P("data")))
        with_copies, without = _with_and_without(m, x)
    _assert_bit_equal(with_copies, without)


def _micro_batch_step(graph, input_gradient):
    """A step that accumulates the gradients of 4 micro-batches in `lax.scan`, with the layer's
    copies made once before the loop (`once`) or not."""
    def step(state, xs, once: bool):
        m = nnx.merge(graph, state)
        copies = m.fp8_weight_copies() if once else None

        def body(acc, x):
            def loss(state, x):
                y, _ = nnx.merge(graph, state)(x, fp8_copies=copies)
                return jnp.sum(jnp.square(y.astype(jnp.float32)))

            g_state, dx = jax.grad(loss, argnums=(0, 1))(state, x)
            return jax.tree.map(jnp.add, acc, g_state), dx

        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, state), xs)

    return step


@pytest.mark.parametrize("input_gradient", ["fp8", "master"])
def test_micro_batch_loop_bit_equal(input_gradient):
    graph, state = nnx.split(_layer(input_gradient, shared=False, backend="auto"))
    xs = jax.random.normal(jax.random.key(2), (4, 16, D), jnp.float32)
    step = _micro_batch_step(graph, input_gradient)
    run = jax.jit(step, static_argnums=2)
    _assert_bit_equal(run(state, xs, True), run(state, xs, False))


def _loop_body(stablehlo: str) -> str:
    """The text of the (one) `stablehlo.while` loop's body."""
    lines = stablehlo.splitlines()
    at = next(i for i, line in enumerate(lines) if "stablehlo.while" in line)
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    start = lines.index(indent + "} do {", at)
    return "\n".join(lines[start + 1: lines.index(indent + "}", start)])


def test_micro_batch_loop_quantizes_once_for_a_gpu():
    """Lowered for an H200: without copies each micro-batch quantizes the three expert weights in
    the loop's body; with the copies made before the loop, the loop quantizes none."""
    m = _layer(shared=True, backend="auto")
    graph, state = nnx.split(m)
    state_avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    xs = jax.ShapeDtypeStruct((4, 128, D), jnp.bfloat16)
    step = _micro_batch_step(graph, "fp8")
    counts = {}
    for once in (False, True):
        text = lower_for_gpu(lambda s, xs: step(s, xs, once), state_avals, xs)
        kernel = 'name = "moe_jax_quantize_weights"'
        counts[once] = (text.count(kernel), _loop_body(text).count(kernel))
    assert counts[False][1] == counts[False][0] >= 6  # routed and shared, all in the body
    assert counts[True] == (6, 0), counts  # three routed and three shared, before the loop


def test_errors():
    m = _layer()
    copies = m.fp8_weight_copies()
    x = _x()
    with pytest.raises(TypeError, match="fp8_copies: expected the Fp8LayerCopies"):
        m(x, fp8_copies=copies.routed)
    with pytest.raises(ValueError, match="not made for input_gradient='master'"):
        _layer("master")(x, fp8_copies=copies)
    with pytest.raises(ValueError, match="fp8_copies.shared is given, but this layer has no shared experts"):
        _layer(shared=False)(x, fp8_copies=copies)
    other = MoE(D, F, 2 * E, K, gemm=m.gemm, shared_experts=m.shared_experts, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"fp8_copies\.routed\[0\]\.quantized\.values_ENK: float8_e4m3fn\[4, 256, 160\]"
                                         r", but this layer's is float8_e4m3fn\[8, 256, 160\]"):
        other(x, fp8_copies=copies)
    with pytest.raises(ValueError, match="fp8_copies: this layer has no FP8 master weights"):
        MoE(D, F, E, K, gemm=GemmOptions(backend="xla"), rngs=nnx.Rngs(0))(x, fp8_copies=copies)
    with pytest.raises(ValueError, match=r"fp8_weight_copies\(\): this layer has no FP8 master weights"):
        stored_fp8(m).fp8_weight_copies()
