"""The whole routed stage on an ep mesh: `moe_jax.parallel.ep_moe` (dispatch, SwiGLU experts
`moe_jax.experts.swiglu_experts`, combine) against `moe_jax.dense_reference.moe_reference` of the
whole batch on one device, with the weights of dropped routes zeroed.

fp32 at Precision.HIGHEST; ep = 2 and 4 (data 1); "zipf" routing (hot experts scattered over
the ranks) and "one_rank" routing (every route to ep rank 0's experts, so every other rank
receives nothing), both from the benchmark's `benchmarks.ep.routing.make_routing`; dropless and
with a capacity of half the balanced load, which drops routes in every case. Exchanges: the
padded strategy over the all_to_all transport and, at ep = 2, the pair swap, and the ragged
strategy. The output and the gradients w.r.t. x, the routing weights and the three expert weights
must be within `moe_jax.testing.tolerance(float32)`, and the routes each exchange drops (those
whose routing-weight gradient is exactly zero, and the ep-group drop count of `EPStats`) must be
those of the numpy capacity model below: every strategy drops the same routes.

Meshes come from `tests.helpers.mesh_devices`: GPUs where the host has P of them, else forced host
CPU devices. XLA:CPU has no ragged_all_to_all: on host devices the ragged cases run through
`tests.helpers.poisoned_ragged()` (the all_gather emulation, NaN in every row no sender writes),
on GPUs through the real collective (benchmarks/gpu_run.sh's ep-check phase runs them once more
under XLA's ragged_all_to_all decomposer flag).

Linear experts, masks, NaN padding, degenerate routings at data > 1 and the layout are
tests/test_dispatch.py's; the MoE layer on a mesh is tests/test_layers_parallel.py's.

Legend: P ep size, T tokens per rank, N = P*T tokens, D width, F expert hidden width, E experts,
K top-k, C capacity.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec

from benchmarks.ep.routing import make_routing
from moe_jax.dense_reference import moe_reference
from moe_jax.experts import swiglu_experts
from moe_jax.parallel import EP_AXIS, activation_spec, capacity_for, ep_moe, expert_spec, make_mesh
from moe_jax.routing import Routing
from moe_jax.testing import assert_close
from tests.helpers import mesh_devices, poisoned_ragged

# E/P >= K local experts on ep rank 0 at P = 4, as "one_rank" routing needs.
T, D, F, E, K = 8, 16, 32, 16, 2
HIGHEST = lax.Precision.HIGHEST
SEED = 3

# (strategy, transport, ep sizes it runs at); ids name the strategy, so `-k ragged` selects the ragged ones.
EXCHANGES = [("padded", "all_to_all", (2, 4)), ("padded", "pair_swap", (2,)), ("ragged", "ragged_all_to_all", (2, 4))]
# One test per compiled program; both routings run through it.
CASES = [
    pytest.param(p, dropping, strategy, transport,
                 id=f"ep{p}-{'capacity' if dropping else 'dropless'}-{strategy}-{transport}")
    for p in (2, 4)
    for dropping in (False, True)
    for strategy, transport, sizes in EXCHANGES
    if p in sizes
]
ROUTINGS = ("zipf", "one_rank")


@functools.cache
def _mesh(p):
    return make_mesh(ep=p, data=1, devices=mesh_devices(p))


def _capacity(p):
    """Half the balanced load, floored at one row per local expert (C = 8 at P = 2, 4 at P = 4)."""
    return capacity_for(T, K, p, 0.5, local_experts=E // p)


def _kept_routes(idx, p, capacity):
    """numpy model of the capacity rule: per source rank and destination rank, the first C routes
    in (token, slot) order are kept (all of them when dropless)."""
    dest = (idx // (E // p)).reshape(p, T * K)
    keep = np.zeros(dest.shape, bool)
    for src in range(p):
        for q in range(p):
            keep[src, np.flatnonzero(dest[src] == q)[:capacity]] = True
    return keep.reshape(idx.shape)


def _inputs(p):
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    x = jax.random.normal(keys[0], (p * T, D), jnp.float32)
    cot = jax.random.normal(keys[1], (p * T, D), jnp.float32)
    w_gate = jax.random.normal(keys[2], (E, F, D), jnp.float32) / np.sqrt(D)
    w_up = jax.random.normal(keys[3], (E, F, D), jnp.float32) / np.sqrt(D)
    w_down = jax.random.normal(keys[4], (E, D, F), jnp.float32) / np.sqrt(F)
    return x, cot, (w_gate, w_up, w_down)


# Whether each traced `ep_moe(fuse_regroup=True)` handed its expert function a `RowGather`.
FUSED_CALLS: dict[tuple, bool] = {}


@functools.cache
def _ep_value_and_grad(p, strategy, transport, capacity, fuse=False):
    """Jitted `((loss, (y, dropped_P)), grads)` of sum(y * cot) through `ep_moe` on the P mesh,
    grads w.r.t. (x, weights, w_gate, w_up, w_down). `fuse`: `fuse_regroup=True`, the expert
    function reading the receive buffer through the regroup's ids where it is given them."""
    act = activation_spec()

    def body(x, idx, w, cot, wg, wu, wd):
        # Expert matmuls through XLA at HIGHEST, as the reference; the row moves take "auto".
        def expert_fn(px, gs, rows=None):
            FUSED_CALLS[(p, strategy, transport, capacity, fuse)] = rows is not None
            return swiglu_experts(px, gs, wg, wu, wd, backend="xla", precision=HIGHEST, rows=rows)

        y, stats = ep_moe(x, idx, w, expert_fn, num_experts=E, strategy=strategy, capacity=capacity,
                          transport=transport, fuse_regroup=fuse)
        return lax.psum(jnp.sum(y * cot), EP_AXIS), y, stats.dropped[None]

    fn = jax.shard_map(body, mesh=_mesh(p), in_specs=(act,) * 4 + (expert_spec(),) * 3,
                       out_specs=(PartitionSpec(), act, act), check_vma=False)

    def loss(x, w, wg, wu, wd, idx, cot):
        value, y, dropped = fn(x, idx, w, cot, wg, wu, wd)
        return value, (y, dropped)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@jax.jit
def _reference_value_and_grad(x, w, wg, wu, wd, idx, cot, keep):
    """The same on one device over the whole batch, dropped routes' weights zeroed (so their
    weight gradient is zero too)."""

    def loss(x, w, wg, wu, wd):
        y = moe_reference(x, Routing(idx, jnp.where(keep, w, 0.0), None), wg, wu, wd)
        return jnp.sum(y * cot), y

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, w, wg, wu, wd)


@pytest.mark.parametrize("p, dropping, strategy, transport", CASES)
def test_ep_moe_swiglu_matches_single_device(p, dropping, strategy, transport):
    _check_against_reference(p, dropping, strategy, transport, fuse=False)


@pytest.mark.parametrize("p, dropping, strategy, transport, fused", [
    (2, True, "padded", "all_to_all", True),
    (4, False, "ragged", "ragged_all_to_all", True),
    (2, False, "padded", "pair_swap", False),  # two sources (tokens, peer block): regrouped first
], ids=["ep2-capacity-padded-all_to_all", "ep4-dropless-ragged", "ep2-dropless-padded-pair_swap"])
def test_ep_moe_fused_regroup_matches_single_device(p, dropping, strategy, transport, fused):
    """`fuse_regroup=True`: the first grouped GEMM reads the receive buffer through the regroup's
    ids (padding rows and, on the ragged exchange, unwritten NaN rows never read), with the same
    outputs, gradients and drops; the pairwise transport falls back to the regroup gather."""
    capacity = _capacity(p) if dropping else None
    _check_against_reference(p, dropping, strategy, transport, fuse=True)
    assert FUSED_CALLS[(p, strategy, transport, capacity, True)] is fused


def _check_against_reference(p, dropping, strategy, transport, *, fuse):
    mesh = _mesh(p)
    on_gpu = mesh.devices.flat[0].platform == "gpu"
    capacity = _capacity(p) if dropping else None
    fn = _ep_value_and_grad(p, strategy, transport, capacity, fuse)
    x, cot, experts = _inputs(p)
    for routing in ROUTINGS:
        idx_np, w_np = make_routing(routing, p, T, E, K, seed=SEED)
        keep = _kept_routes(idx_np, p, T * K if capacity is None else capacity)
        if dropping:
            assert (~keep).any(), f"{routing}: the capacity case must drop routes"
        else:
            assert keep.all()
        idx, w = jnp.asarray(idx_np), jnp.asarray(w_np)

        # XLA:CPU lacks ragged_all_to_all: host-device meshes run the emulation (NaN where unwritten).
        collective = poisoned_ragged() if strategy == "ragged" and not on_gpu else contextlib.nullcontext()
        with collective:
            (_, (y, dropped)), grads = fn(x, w, *experts, idx, cot)
        (_, y_ref), grads_ref = _reference_value_and_grad(x, w, *experts, idx, cot, jnp.asarray(keep))

        # rel_err is inf on a non-finite value, so NaN from unwritten receive rows fails here too.
        names = ("y", "dx", "dweights", "dw_gate", "dw_up", "dw_down")
        for name, got, want in zip(names, (y, *grads), (y_ref, *grads_ref)):
            assert_close(got, want, jnp.float32, f"{name} ({routing}, {strategy}/{transport})")
        # A dropped route never reaches its expert, so its weight gradient is exactly zero; a kept
        # route's is <expert output, cot>, nonzero for these random inputs: the zeros are the drops.
        np.testing.assert_array_equal(np.asarray(grads[1]) == 0.0, ~keep, err_msg=routing)
        # EPStats.dropped is the ep-group total, reported by every rank.
        np.testing.assert_array_equal(np.asarray(dropped), np.full(p, (~keep).sum()), err_msg=routing)
