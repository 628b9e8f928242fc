"""EP dispatch's send plan (`moe_jax.parallel.send_plan`): both backends against the sort-based
reference, a worked example, edge cases, argument errors and the kernel's GPU lowering.

The Pallas kernel runs compiled on a GPU and interpreted on CPU, from the same test bodies.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_jax.parallel import SendPlanTiles, plan_sends, plan_sends_reference
from moe_jax.parallel.send_plan import PALLAS_MAX_RANKS, PALLAS_MAX_ROUTES
from tests.helpers import h200_mesh, lower_for_gpu, sharded_aval

BACKENDS = ["pallas_triton", "xla"]


def _assert_plans_equal(got, want, what=""):
    for name, g, w in zip(want._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what} {name}")


def _plan_all(expert_R, real_R=None, **kw):
    """The reference plan, after checking both backends give exactly the same one."""
    want = plan_sends_reference(expert_R, real_R, **kw)
    for backend in BACKENDS:
        _assert_plans_equal(plan_sends(expert_R, real_R, backend=backend, **kw), want, backend)
    return want


@functools.cache
def _jitted(backend, **kw):
    """`plan_sends` (the reference when `backend` is None) compiled for one layout's static arguments."""
    if backend is None:
        return jax.jit(functools.partial(plan_sends_reference, **kw))
    return jax.jit(functools.partial(plan_sends, backend=backend, **kw))


def test_worked_example():
    """T=4 tokens, top-2, 4 experts on 2 ranks, capacity 3. Rank 1 is offered routes 1, 2, 3, 5, 6
    (token order) and keeps the first three; each block is ordered by (expert, route)."""
    expert_R = jnp.asarray([0, 2, 2, 3, 1, 2, 2, 0], jnp.int32)
    kw = dict(num_experts=4, ep=2, capacity=3, top_k=2)
    padded = _plan_all(expert_R, padded=True, send_rows=6, **kw)
    np.testing.assert_array_equal(padded.route_row_R, [0, 3, 4, 5, 2, -1, -1, 1])
    np.testing.assert_array_equal(padded.send_ids_S, [0, 3, 2, 0, 1, 1])
    np.testing.assert_array_equal(padded.kept_PE, [[2, 1], [2, 1]])
    np.testing.assert_array_equal(padded.send_counts_P, [3, 5])
    np.testing.assert_array_equal(padded.send_sizes_P, [3, 3])
    # Masking token 1 (routes 2, 3) frees rank 1's capacity for routes 5 and 6.
    real_R = jnp.asarray([True, True, False, False, True, True, True, True])
    masked = _plan_all(expert_R, real_R, padded=True, send_rows=6, **kw)
    np.testing.assert_array_equal(masked.route_row_R, [0, 3, -1, -1, 2, 4, 5, 1])
    np.testing.assert_array_equal(masked.send_ids_S, [0, 3, 2, 0, 2, 3])
    np.testing.assert_array_equal(masked.send_counts_P, [3, 3])
    # The tight layout puts rank 1's block right after rank 0's kept routes; spare rows are -1.
    tight = _plan_all(expert_R, padded=False, send_rows=10, **dict(kw, capacity=2))
    np.testing.assert_array_equal(tight.route_row_R, [0, 2, 3, -1, 1, -1, -1, -1])
    np.testing.assert_array_equal(tight.send_ids_S, [0, 2, 0, 1, -1, -1, -1, -1, -1, -1])


def _random_routing(rng, tokens, top_k, experts, invalid, skew):
    """Expert ids `[T*K]` with hot experts (a Pareto popularity; `skew` is its shape, smaller is
    hotter) and about `invalid` of them out of range (-1, E, E + 5)."""
    routes = tokens * top_k
    popularity = rng.pareto(skew, experts) + 1e-3
    expert_R = rng.choice(experts, routes, p=popularity / popularity.sum())
    bad = rng.random(routes) < invalid
    expert_R[bad] = rng.choice([-1, experts, experts + 5], bad.sum())
    return expert_R


def _check_backends(layout, seed, invalid, skew, mask_rate):
    """Both backends against the sorting reference on one random routing of `layout`: the shapes
    and static arguments are the layout's, the routing, out-of-range ids and masked tokens are
    values, so each layout compiles once for any number of routings."""
    tokens, top_k, ep, local, capacity_frac, padded, masked, spare, small_tiles = layout
    rng = np.random.default_rng(seed)
    experts, routes = ep * local, tokens * top_k
    expert_R = _random_routing(rng, tokens, top_k, experts, invalid, skew)
    real_R = jnp.asarray(rng.random(tokens) >= mask_rate).repeat(top_k) if masked else None
    capacity = max(1, round(capacity_frac * routes))
    send_rows = (ep * capacity if padded else routes) + spare
    tiles = SendPlanTiles(block=4, chunk=16) if small_tiles else SendPlanTiles()
    kw = dict(num_experts=experts, ep=ep, capacity=capacity, top_k=top_k, padded=padded, send_rows=send_rows,
              tiles=tiles)
    expert_R = jnp.asarray(expert_R, jnp.int32)
    want = _jitted(None, **kw)(expert_R, real_R)
    for backend in BACKENDS:
        _assert_plans_equal(_jitted(backend, **kw)(expert_R, real_R), want, backend)


# (tokens, top_k, ep, local experts, capacity / routes, padded, masked, spare send rows, small tiles):
# one rank to four, heavy dropping to none, both layouts, with and without a mask and spare rows,
# R from 1 to 280 and never a power of two but once; small tiles make the kernel loop over many
# chunks (4 routes per program, 16 per step), as large R does.
LAYOUTS = {
    "one-route": (1, 1, 1, 1, 1.0, True, False, 0, False),
    "ep3-heavy-drop": (37, 2, 3, 3, 0.1, True, True, 3, True),
    "ep4-dropless-tight": (70, 4, 4, 9, 1.2, False, True, 5, True),
    "ep2-half-tight": (23, 3, 2, 5, 0.4, False, False, 0, False),
    "ep4-top1-padded": (50, 1, 4, 1, 0.3, True, True, 1, False),
    "ep1-small-tiles": (16, 4, 1, 7, 0.6, False, False, 2, True),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@settings(derandomize=True, max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), invalid=st.sampled_from([0.0, 0.15, 0.5]), skew=st.sampled_from([0.3, 1.0, 5.0]),
       mask_rate=st.sampled_from([0.0, 0.25, 0.9]))
def test_backends_match_the_sorting_reference(layout, seed, invalid, skew, mask_rate):
    """Any routing (ids out of range, masked tokens, hot experts via a skewed draw) of each layout
    equals the sorting reference on both backends."""
    _check_backends(layout, seed, invalid, skew, mask_rate)


@pytest.mark.slow
@settings(derandomize=True, max_examples=10, deadline=None)
@given(
    tokens=st.integers(1, 70),
    top_k=st.integers(1, 4),
    ep=st.sampled_from([1, 2, 3, 4]),
    local=st.integers(1, 9),
    capacity_frac=st.floats(0.05, 1.2),
    padded=st.booleans(),
    masked=st.booleans(),
    spare=st.integers(0, 5),
    small_tiles=st.booleans(),
    seed=st.integers(0, 2**16),
    invalid=st.sampled_from([0.0, 0.15]),
)
def test_backends_match_the_sorting_reference_on_random_layouts(tokens, top_k, ep, local, capacity_frac, padded,
                                                                masked, spare, small_tiles, seed, invalid):
    """The same on random layouts (each example compiles both backends anew)."""
    _check_backends((tokens, top_k, ep, local, capacity_frac, padded, masked, spare, small_tiles), seed, invalid,
                    1.0, 0.25)


@pytest.mark.parametrize("case", ["one_hot_expert", "nothing_dropped", "all_invalid", "single_route", "multi_chunk"])
def test_edge_cases(case):
    experts, ep, top_k = 8, 2, 2
    tokens = {"single_route": 1, "multi_chunk": 600}.get(case, 40)  # 1200 routes: two 1024-route steps
    routes = tokens * top_k
    expert_R = np.random.default_rng(3).integers(0, experts, routes)
    capacity = 7
    if case == "one_hot_expert":
        expert_R[:] = 5
    elif case == "nothing_dropped":
        capacity = routes
    elif case == "all_invalid":
        expert_R[:] = -1
    elif case == "single_route":
        top_k, routes, expert_R = 1, 1, expert_R[:1]
    plan = _plan_all(jnp.asarray(expert_R, jnp.int32), num_experts=experts, ep=ep, capacity=capacity, top_k=top_k,
                     padded=True, send_rows=ep * capacity)
    valid = int((expert_R >= 0).sum())
    expect_kept = {"one_hot_expert": capacity, "nothing_dropped": valid, "all_invalid": 0}
    if case in expect_kept:
        assert int(plan.send_sizes_P.sum()) == expect_kept[case]
    assert int(plan.keep_R.sum()) == int(plan.send_sizes_P.sum()) == int((np.asarray(plan.send_ids_S) >= 0).sum())


def test_zero_routes():
    plan = plan_sends(jnp.zeros((0,), jnp.int32), num_experts=4, ep=2, capacity=1, top_k=2, padded=True, send_rows=2)
    assert plan.route_row_R.shape == (0,)
    np.testing.assert_array_equal(plan.send_ids_S, [-1, -1])
    np.testing.assert_array_equal(plan.kept_PE, np.zeros((2, 2)))


def test_argument_errors():
    e = jnp.zeros((8,), jnp.int32)
    kw = dict(num_experts=4, ep=2, capacity=3, top_k=2, padded=True, send_rows=6)
    with pytest.raises(ValueError, match="send_rows=5 cannot hold"):
        plan_sends(e, **dict(kw, send_rows=5))
    with pytest.raises(ValueError, match="multiple of ep=3"):
        plan_sends(e, **dict(kw, ep=3))
    with pytest.raises(ValueError, match="not a multiple of top_k=3"):
        plan_sends(e, **dict(kw, top_k=3))
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        plan_sends(e, **dict(kw, capacity=0))
    with pytest.raises(ValueError, match="real_R must be bool"):
        plan_sends(e, jnp.ones((8,), jnp.int32), **kw)
    with pytest.raises(ValueError, match="expert_R must be a 1-D int array"):
        plan_sends(e.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match="backend="):
        plan_sends(e, backend="cuda", **kw)
    with pytest.raises(ValueError, match="SendPlanTiles.block must be a power of two|SendPlanTiles.block=12"):
        SendPlanTiles(block=12)
    with pytest.raises(TypeError, match="tiles must be a SendPlanTiles"):
        plan_sends(e, tiles=(16, 1024, 4), **kw)


@pytest.mark.parametrize("ep, routes, capacity, padded, masked", [
    (2, 1024, 640, True, False),  # decode: 128 tokens, top-8 of 256 experts, capacity factor 1.25
    (2, 1024, 640, False, True),
    (3, 999, 333, False, False),  # nothing a power of two
    (PALLAS_MAX_RANKS, PALLAS_MAX_ROUTES, PALLAS_MAX_ROUTES, True, True),  # the largest tiles: dropless
])
def test_kernel_lowers_for_h200_inside_shard_map(ep, routes, capacity, padded, masked):
    """The kernel compiles for an H200 inside shard_map, both layouts, with and without a token
    mask, up to its rank and route limits."""
    mesh = h200_mesh((ep,), ("ep",))
    spec = jax.sharding.PartitionSpec("ep")
    top_k = 8 if routes % 8 == 0 else 1

    def plan(expert_R, real_R):
        def body(expert_R, real_R):
            out = plan_sends(expert_R, real_R if masked else None, num_experts=32 * ep, ep=ep, capacity=capacity,
                             top_k=top_k, padded=padded, send_rows=ep * capacity if padded else routes)
            return out.route_row_R, out.send_ids_S
        return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))(expert_R, real_R)

    text = lower_for_gpu(plan, sharded_aval(mesh, (ep * routes,), jnp.int32, spec),
                         sharded_aval(mesh, (ep * routes,), jnp.bool_, spec), mesh=mesh)
    assert text.count('name = "moe_jax_send_plan"') == 1


def test_xla_plans_beyond_the_kernel_rank_limit():
    def plan(expert_R):
        return plan_sends(expert_R, num_experts=64, ep=2 * PALLAS_MAX_RANKS, capacity=16, top_k=2, padded=True,
                          send_rows=32 * PALLAS_MAX_RANKS).route_row_R

    assert 'name = "moe_jax_send_plan"' not in lower_for_gpu(plan, jax.ShapeDtypeStruct((64,), jnp.int32))


@pytest.mark.parametrize("backend", ["auto", "pallas_triton"])
@pytest.mark.parametrize("routes, kernel", [(PALLAS_MAX_ROUTES, True), (PALLAS_MAX_ROUTES + 2, False)])
def test_the_kernel_runs_only_up_to_its_route_limit(backend, routes, kernel):
    """On GPU, both the default and the explicit Pallas backend plan large R with XLA."""
    def plan(expert_R):
        return plan_sends(expert_R, num_experts=64, ep=2, capacity=routes, top_k=2, padded=True,
                          send_rows=2 * routes, backend=backend).route_row_R

    text = lower_for_gpu(plan, jax.ShapeDtypeStruct((routes,), jnp.int32))
    assert ('name = "moe_jax_send_plan"' in text) == kernel
