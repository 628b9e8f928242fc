"""The chunked EP exchange (`EPOptions(chunks=n)`, `ep_moe(chunks=n)`) on forced CPU host devices
(repo conftest: 8).

Equal results: the MoE layer with n = 2, 3 (a remainder), 4 on ep = 2, 4 meshes (data 1, 2)
gives the unchunked layer's outputs and every `MoEStats` field exactly, its gradients to fp32
rounding (weight gradients sum the chunks' rows in another order), and the one-device layer's
results; the ragged strategy through tests/helpers.py's emulated collective. With a capacity
factor each chunk has its own C: the drops equal a numpy model of the per-chunk rule.
Overlap is possible: in the jaxpr, the n chunks' exchanges form n mutually independent groups
(a dispatch with no expert GEMM or other exchange upstream, a combine fed by that dispatch only),
XLA:CPU's compiled module keeps all 2n all-to-alls, and nothing but the latent up-projection of
the layer waits for the exchange (the shared experts can run beside it). The chunked ragged path,
forward and backward, lowers for H200s (4n ragged_all_to_all).

Legend: N global tokens, T tokens per device, D width, E experts, El = E/P local experts,
P ep size, K top-k, C capacity, n chunks.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec

from moe_jax import routing as R
from moe_jax.layers import GemmOptions, MoE, SharedExperts
from moe_jax.ops import grouped_linear
from moe_jax.parallel import (
    DATA_AXIS,
    EP_AXIS,
    EPOptions,
    activation_spec,
    capacity_for,
    ep_moe,
    expert_spec,
    make_mesh,
    token_chunks,
)
from moe_jax.testing import assert_close
from tests.helpers import (  # noqa: F401  (on_mesh_platform: an autouse fixture)
    MESH_DEVICES,
    h200_mesh,
    lower_for_gpu,
    masked_inputs,
    on_mesh_platform,
    poisoned_ragged,
    sharded_aval,
)
from tests.test_layers import module_value_and_grads

B, S, D, F, E, K, L = 2, 8, 8, 6, 8, 2, 4
N = B * S


def _mesh(ep, data):
    return make_mesh(ep=ep, data=data, devices=MESH_DEVICES[: ep * data])


def _layer(mesh=None, **options):
    return MoE(D, F, E, K, shared_experts=SharedExperts(1, d_ff=5), latent_dim=L, gemm=GemmOptions(backend="xla"),
               mesh=mesh, expert_parallel=EPOptions(**options), rngs=nnx.Rngs(0))


def _inputs(seed):
    return masked_inputs(seed, (B, S, D))


@functools.cache
def _single_device(seed):
    x, mask, cot = _inputs(seed)
    return module_value_and_grads(_layer(), x, cot, mask=mask)


def _assert_close_results(got, want, what):
    """Outputs and every gradient to fp32 rounding."""
    y, _, grads, dx, _ = got
    y0, _, grads0, dx0, _ = want
    assert_close(y, y0, jnp.float32, what + " y")
    assert_close(dx, dx0, jnp.float32, what + " dx")
    assert grads.keys() == grads0.keys()
    for path in grads:
        assert_close(grads[path], grads0[path], jnp.float32, what + " d" + ".".join(map(str, path)))


def _assert_equal_stats(stats, stats0):
    for name, value in stats._asdict().items():
        np.testing.assert_array_equal(value, getattr(stats0, name), err_msg=name)


# ----------------------------------------------------------------------------- options


def test_chunks_option_is_checked():
    assert EPOptions().chunks == 1 and EPOptions(chunks=3).chunks == 3
    with pytest.raises(ValueError, match=r"chunks must be a positive int; got 0\. Pass chunks=1"):
        EPOptions(chunks=0)
    for bad in (2.0, "2", True, None):
        with pytest.raises(TypeError, match="chunks must be a positive int"):
            EPOptions(chunks=bad)
    x = jnp.zeros((4, D))
    idx = jnp.zeros((4, K), jnp.int32)
    with pytest.raises(ValueError, match="chunks must be a positive int; got -1"):
        ep_moe(x, idx, jnp.ones((4, K)), lambda x, sizes: x, num_experts=E, chunks=-1)
    with pytest.raises(ValueError, match=r"weights_TK must be \[T, K\] = \(4, 2\)"):
        ep_moe(x, idx, jnp.ones((3, K)), lambda x, sizes: x, num_experts=E, chunks=2)


def test_token_chunks_and_capacity_per_chunk():
    """Contiguous chunks differing by at most one token, larger ones first; at most one chunk per
    token; the capacity factor scales the largest chunk's balanced load."""
    assert token_chunks(8, 3) == ((0, 3), (3, 6), (6, 8))
    assert token_chunks(8, 4) == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert token_chunks(2, 4) == ((0, 1), (1, 2))  # decode: one token per chunk
    assert token_chunks(0, 3) == ((0, 0),)
    assert token_chunks(5, 1) == ((0, 5),)
    options = EPOptions(capacity_factor=1.0, chunks=3)
    assert options.capacity(8, K, 2, 1) == capacity_for(3, K, 2, 1.0) == 3
    assert EPOptions(capacity_factor=1.0).capacity(8, K, 2, 1) == capacity_for(8, K, 2, 1.0) == 8
    assert EPOptions(chunks=3).capacity(8, K, 2, 1) is None


def test_chunks_without_expert_parallelism_warn():
    with pytest.warns(UserWarning, match=r"EPOptions\(chunks=2\) has no effect"):
        _layer(chunks=2)


# ----------------------------------------------------------------------------- equal results


# (ep, data, chunks, transport): T = N / (ep*data) tokens per device, so (2, 1, 3) cuts 8 tokens
# 3+3+2, (4, 1, 3) cuts 4 tokens 2+1+1 and (4, 2, 4) has T = 2 < n: two one-token chunks.
CASES = [(2, 1, 2, "auto"), (2, 1, 3, "auto"), (4, 1, 4, "auto"), (2, 2, 4, "auto"), (4, 1, 3, "auto"),
         (4, 2, 4, "auto"), (2, 2, 3, "pair_swap")]
FAST = {(2, 1, 3, "auto")}


@pytest.mark.parametrize("ep, data, chunks, transport", [
    pytest.param(*case, marks=() if case in FAST else pytest.mark.slow) for case in CASES])
def test_layer_with_chunks_equals_unchunked_and_one_device(ep, data, chunks, transport):
    """Router in the layer, padding mask, the all_to_all or (ep = 2) pair-swap exchange: every
    statistic equals the unchunked layer's exactly, outputs and gradients to fp32 rounding (a
    chunk's expert groups hold other rows, and XLA's grouped GEMM may round a row differently with
    other rows around it: bit for bit on jax 0.11.2, 1 ulp apart on 0.12); the slow cases also
    against the one-device layer (the fast one leaves that to tests/test_layers_parallel.py's
    unchunked meshes)."""
    mesh = _mesh(ep, data)
    x, mask, cot = _inputs(0)
    got = module_value_and_grads(_layer(mesh, chunks=chunks, transport=transport), x, cot, mask=mask)
    want = module_value_and_grads(_layer(mesh, transport=transport), x, cot, mask=mask)
    _assert_equal_stats(got[1], want[1])
    _assert_close_results(got, want, f"chunks={chunks} vs 1:")
    if (ep, data, chunks, transport) not in FAST:
        _assert_close_results(got, _single_device(0), f"chunks={chunks} vs one device:")
    assert int(got[1].dropped) == 0


@pytest.mark.slow
def test_ragged_strategy_with_chunks():
    """The ragged exchange in chunks (emulated collective, NaN in every row no sender writes)
    equals the padded one in chunks (outputs bit for bit: the same groups) and the unchunked ragged
    one (to fp32 rounding)."""
    mesh = _mesh(2, 2)
    x, mask, cot = _inputs(1)
    padded = module_value_and_grads(_layer(mesh, chunks=3), x, cot, mask=mask)
    results = []
    for chunks in (3, 1):
        # The layer refuses ragged on CPU devices at construction; with the collective emulated,
        # its options switch to it.
        layer = _layer(mesh)
        layer.expert_parallel = EPOptions(strategy="ragged", chunks=chunks)
        with poisoned_ragged():
            results.append(module_value_and_grads(layer, x, cot, mask=mask))
    ragged, unchunked = results
    np.testing.assert_array_equal(ragged[0], padded[0])
    _assert_equal_stats(ragged[1], padded[1])
    _assert_close_results(ragged, padded, "ragged vs padded, 3 chunks:")
    _assert_equal_stats(ragged[1], unchunked[1])
    _assert_close_results(ragged, unchunked, "ragged, 3 chunks vs 1:")


# ----------------------------------------------------------------------------- capacity


def _kept_routes_per_chunk(idx, mask, ep, data, chunks, capacity_of):
    """numpy model of the per-chunk capacity rule: per source device and chunk, per destination
    rank, the first C real routes in (token, slot) order are kept (`capacity_of(chunk tokens)`)."""
    tokens = N // (ep * data)
    keep = np.zeros(idx.shape, bool)
    for dev in range(ep * data):
        for a, b in token_chunks(tokens, chunks):
            used, cap = np.zeros(ep, int), capacity_of(b - a)
            for t in range(dev * tokens + a, dev * tokens + b):
                for k in range(K):
                    dest = idx[t, k] // (E // ep)
                    if mask[t] and used[dest] < cap:
                        keep[t, k] = True
                        used[dest] += 1
    return keep


@pytest.mark.slow
def test_capacity_per_chunk_drops_counted_exactly():
    """Every route goes to rank 0's experts; capacity factor 1 and 3 chunks of 3, 3 and 2 tokens
    per device, C = 4 (one row per local expert; the 2-token chunk's 4 routes all fit): each
    chunk's routes past its own C drop, even where another chunk of the device has room. The
    count, the per-expert drops and the outputs and gradients (the one-device layer without the
    dropped routes) follow the numpy model, whose drops differ from the unchunked rule's."""
    ep, data, chunks, factor = 2, 1, 3, 1.0
    idx = np.stack([np.arange(N) % 4, (np.arange(N) + 1) % 4], axis=1).astype(np.int32)
    routing = R.Routing(jnp.asarray(idx), jax.random.uniform(jax.random.PRNGKey(3), (N, K), minval=0.1, maxval=1.0),
                        jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(4), (N, E))))
    x, mask, cot = _inputs(3)
    mask_N = np.asarray(mask).reshape(N)
    options = EPOptions(capacity_factor=factor, chunks=chunks)
    capacity = options.capacity(N // (ep * data), K, ep, E // ep)  # the largest chunk's, for every chunk
    assert capacity == capacity_for(3, K, ep, factor, local_experts=E // ep)
    keep = _kept_routes_per_chunk(idx, mask_N, ep, data, chunks, lambda tokens: min(capacity, tokens * K))
    expected = int(mask_N.sum()) * K - int(keep.sum())
    assert expected > 0  # the case must overflow
    unchunked_C = EPOptions(capacity_factor=factor).capacity(N // (ep * data), K, ep, E // ep)
    unchunked = _kept_routes_per_chunk(idx, mask_N, ep, data, 1, lambda tokens: unchunked_C)
    assert int(unchunked.sum()) != int(keep.sum())  # per-chunk capacity moves which routes drop

    mesh = _mesh(ep, data)
    got = module_value_and_grads(_layer(mesh, capacity_factor=factor, chunks=chunks), x, cot, mask=mask,
                                 routing=routing)
    stats = got[1]
    assert int(stats.dropped) == expected
    real = mask_N[:, None] & np.ones_like(keep)
    np.testing.assert_array_equal(stats.dropped_E, np.bincount(idx[real & ~keep], minlength=E))
    np.testing.assert_array_equal(stats.counts_E - stats.dropped_E, np.bincount(idx[keep], minlength=E))
    assert int(stats.useful_rows) == int(keep.sum())

    kept_routing = routing._replace(weights_TK=jnp.where(keep, routing.weights_TK, 0.0))
    want = module_value_and_grads(_layer(), x, cot, mask=mask, routing=kept_routing)
    _assert_close_results(got, want, "capacity per chunk:")
    assert np.all(np.asarray(got[4])[~keep] == 0.0)  # a dropped route's weight gets no gradient
    assert_close(jnp.where(keep, got[4], 0.0), jnp.where(keep, want[4], 0.0), jnp.float32, "d weights_TK")


# ----------------------------------------------------------------------------- overlap


def _sub_jaxprs(eqn):
    """The jaxprs an equation runs its operands through one to one (pjit, custom_vjp_call,
    shard_map, remat, ...): (jaxpr, consts)."""
    for value in eqn.params.values():
        jaxpr = getattr(value, "jaxpr", value)
        if isinstance(jaxpr, jex_core.Jaxpr) and len(jaxpr.invars) == len(eqn.invars) \
                and len(jaxpr.outvars) == len(eqn.outvars):
            return jaxpr
    return None


def _dependencies(jaxpr, marks):
    """Walk `jaxpr` (into its one-to-one sub-jaxprs; anything else is opaque: its outputs depend on
    all its inputs). `marks(eqn)` names the equations to track (e.g. "a2a", "gemm"), None others.
    Returns [(kind, node id, frozenset of the tracked node ids upstream of it)] in trace order."""
    found, counter = [], iter(range(1 << 30))

    def walk(jaxpr, deps_in):
        deps = dict(zip(jaxpr.invars, deps_in))
        read = lambda v: deps.get(v, frozenset()) if isinstance(v, jex_core.Var) else frozenset()  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            kind, inner = marks(eqn), _sub_jaxprs(eqn)
            if kind is None and inner is not None:
                outs = walk(inner, ins)
            else:
                upstream = frozenset().union(*ins)
                if kind is not None:
                    node = next(counter)
                    found.append((kind, node, upstream))
                    upstream = upstream | {node}
                outs = [upstream] * len(eqn.outvars)
            deps.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    walk(jaxpr, [frozenset()] * len(jaxpr.invars))
    return found


def _exchange_marks(eqn):
    name = eqn.primitive.name
    return "a2a" if name == "all_to_all" else "gemm" if name in ("ragged_dot_general", "ragged_dot") else None


def _ep_linear(chunks, mesh, *, grad=False):
    """A linear EP layer (grouped_linear experts) over `mesh`, all_to_all transport, `chunks`:
    `(fn, args)`, `fn` its forward, or with `grad` the gradient of `<y, cot>`."""
    tokens = 12

    def body(x, idx, w, W):
        W = lax.pcast(W, (DATA_AXIS,), to="varying")  # per-device weight gradients, summed over data
        y, _ = ep_moe(x, idx, w, lambda px, sizes: grouped_linear(px, W, sizes, backend="xla"), num_experts=E,
                      transport="all_to_all", backend="xla", chunks=chunks)
        return y

    forward = jax.shard_map(body, mesh=mesh, in_specs=(activation_spec(),) * 3 + (expert_spec(),),
                            out_specs=activation_spec())
    ranks = mesh.devices.size
    args = (jnp.ones((ranks * tokens, D)), jnp.zeros((ranks * tokens, K), jnp.int32), jnp.ones((ranks * tokens, K)),
            jnp.ones((E, D, D)))
    if not grad:
        return forward, args
    # A cotangent that is an input, as the layer's is (the next layer's backward): the backward of
    # chunk i starts from its slice of it, not from the other chunks' outputs.
    loss = lambda x, idx, w, W, cot: jnp.sum(forward(x, idx, w, W) * cot)  # noqa: E731
    return jax.grad(loss, argnums=(0, 2, 3)), args + (jnp.ones((ranks * tokens, D)),)


@pytest.mark.parametrize("chunks, grad", [(1, False), (3, False), (4, True)])
def test_chunk_exchanges_are_independent_in_the_jaxpr(chunks, grad):
    """n chunks run 2n all_to_alls forward (4n with the backward's reverse exchanges) that fall
    into n groups with no data dependency between groups, one per chunk, each with its own expert
    GEMMs; every dispatch has no expert GEMM and no exchange upstream (nor does the backward's
    first exchange, the reverse of combine), so chunk i+1's dispatch never waits for chunk i's
    GEMMs and chunk i-1's combine never waits for chunk i's dispatch."""
    fn, args = _ep_linear(chunks, _mesh(2, 1), grad=grad)
    found = _dependencies(jax.make_jaxpr(fn)(*args).jaxpr, _exchange_marks)
    upstream_of = {node: upstream for _, node, upstream in found}
    exchanges = [node for kind, node, _ in found if kind == "a2a"]
    assert len(exchanges) == (4 if grad else 2) * chunks
    assert sum(not upstream_of[node] for node in exchanges) == (2 if grad else 1) * chunks

    group = {node: node for node in upstream_of}  # union-find over "upstream of"

    def root(node):
        while group[node] != node:
            node = group[node]
        return node

    for node, upstream in upstream_of.items():
        for other in upstream:
            group[root(other)] = root(node)
    groups = {}
    for kind, node, _ in found:
        groups.setdefault(root(node), []).append(kind)
    assert len(groups) == chunks, groups
    for kinds in groups.values():
        assert kinds.count("a2a") == (4 if grad else 2) and "gemm" in kinds, kinds


def _hlo_instructions(text):
    """{name: (opcode, operand names)} of an HLO module's ENTRY computation."""
    entry = text[text.index("\nENTRY"):]
    entry = entry[: entry.index("\n}")]
    found = {}
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = .*? ([\w-]+)\((.*?)\)(?:, |$)", line)
        if m:
            found[m.group(1)] = (m.group(2), re.findall(r"%([\w.-]+)", m.group(3)))
    return found


def test_compiled_module_keeps_the_chunk_exchanges_apart():
    """XLA:CPU's optimised module has all 2n all-to-alls (none combined), and in its dataflow n of
    them (the dispatches) have no all-to-all upstream and the other n (the combines) one each."""
    chunks = 3
    fn, args = _ep_linear(chunks, _mesh(2, 1))
    text = jax.jit(fn).lower(*args).compile().as_text()
    hlo = _hlo_instructions(text)
    exchanges = [name for name, (op, _) in hlo.items() if op == "all-to-all"]
    assert len(exchanges) == 2 * chunks, text.count("all-to-all")

    @functools.cache
    def upstream(name):
        found = set()
        for operand in hlo.get(name, ("", ()))[1]:
            found |= upstream(operand) | ({operand} if operand in exchanges else set())
        return frozenset(found)

    counts = sorted(len(upstream(name)) for name in exchanges)
    assert counts == [0] * chunks + [1] * chunks


def test_only_the_latent_up_projection_waits_for_the_exchange():
    """In the layer's jaxpr every GEMM outside the routed stage but the latent up-projection (the
    router, the latent down-projection, the shared experts and their gate) has no data dependency
    on the routed stage's `shard_map`, where the exchanges run: XLA may run the shared experts
    beside the exchange."""
    layer = _layer(_mesh(2, 1), chunks=2)
    graph, state = nnx.split(layer)
    x, mask, _ = _inputs(0)

    def forward(state, x):
        return nnx.merge(graph, state)(x, mask=mask)[0]

    def marks(eqn):
        return {"shard_map": "routed", "dot_general": "dot"}.get(eqn.primitive.name)

    found = _dependencies(jax.make_jaxpr(forward)(state, x).jaxpr, marks)
    routed = {node for kind, node, _ in found if kind == "routed"}
    dots = [upstream for kind, _, upstream in found if kind == "dot"]
    assert len(routed) == 1
    assert len(dots) >= 5  # router, latent down, shared gate/up/down: at least
    assert sum(bool(upstream & routed) for upstream in dots) == 1  # the latent up-projection


def test_chunked_ragged_exchange_lowers_for_gpu():
    """Forward and backward of the chunked ragged path lower for two H200s from this host, under
    shard_map's varying-axes checks as the layer runs it: 4n ragged_all_to_all (each chunk's
    dispatch and combine, and their reverse exchanges) and n count all_gathers."""
    chunks, tokens = 3, 8
    mesh = h200_mesh((1, 2), (DATA_AXIS, EP_AXIS))

    def body(x, idx, w, W, cot):
        W = lax.pcast(W, (DATA_AXIS,), to="varying")
        y, _ = ep_moe(x, idx, w, lambda px, sizes: grouped_linear(px, W, sizes, backend="xla"), num_experts=E,
                      strategy="ragged", backend="xla", chunks=chunks)
        return lax.psum(jnp.sum(y * cot), (DATA_AXIS, EP_AXIS))

    act = activation_spec()
    fn = jax.shard_map(body, mesh=mesh, in_specs=(act, act, act, expert_spec(), act), out_specs=PartitionSpec())
    n = 2 * tokens
    avals = (sharded_aval(mesh, (n, D), jnp.float32, act), sharded_aval(mesh, (n, K), jnp.int32, act),
             sharded_aval(mesh, (n, K), jnp.float32, act), sharded_aval(mesh, (E, D, D), jnp.float32, expert_spec()),
             sharded_aval(mesh, (n, D), jnp.float32, act))
    text = lower_for_gpu(jax.grad(fn, argnums=(0, 2, 3)), *avals, mesh=mesh)
    assert text.count("stablehlo.custom_call @ragged_all_to_all") == 4 * chunks
    assert text.count("stablehlo.all_gather") == chunks
