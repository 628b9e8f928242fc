"""Expert-parallel parity: our `moe_jax.layers.MoE` on a `("data", "ep")` mesh against the
`torch.distributed` EP reference (`parity.reference.ep`) on as many spawned ranks.

Both sides get the same full-batch problem (numpy, fixed seed): tokens `x[W*T, D]`, upstream
gradient `G[W*T, D]`, router and expert weights, and either an injected routing (expert ids with a
chosen pattern, fp32 weights) or the selected-softmax router (docs/reference-algorithm.md, Eq. 2) on both sides. Global
rank r holds tokens `[r*T, (r+1)*T)` on both sides: the torch EP groups are contiguous blocks of
ranks and the mesh's activation spec splits tokens over `("data", "ep")` with `"ep"` minor, so
torch rank r and mesh device (r // ep, r % ep) own the same tokens and the same expert shard.

The loss is `sum(y * G)` on both sides. Torch ranks back-propagate their share, then all-reduce
(SUM) expert gradients over the expert-DP group and router gradients over the dense-DP group
(`reduce_gradients`); each rank's reduced shard must equal the matching slice of our global
gradient, which `shard_map`'s transposes produce without hand-written reductions. Compared:
outputs, d x, d routing weights (injected), every expert-weight gradient, the router gradient
(router case): relative Frobenius error <= 1e-5 in fp32, per rank.

Devices: each world size W runs on NCCL with W GPUs and our layer on a mesh of W GPUs (compiled
kernels, larger sizes, padded and ragged exchanges) when both torch and jax see >= W GPUs;
otherwise on gloo with CPU tensors (Triton interpreted) against a mesh of W forced host devices
(the root conftest forces 8), padded exchange only: XLA:CPU has no ragged_all_to_all.
One spawn per world size: every rank runs all layouts and cases of that world in one go.

Legend: W world size (ranks = mesh devices), T tokens per rank, D model, F expert hidden,
E experts, El = E/ep local experts, K top-k.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.distributed as dist
from flax import nnx
from jax.sharding import NamedSharding

from moe_jax.layers import EPOptions, GemmOptions, MoE
from moe_jax.parallel import activation_spec, make_mesh
from moe_jax.routing import Routing, SelectedSoftmax
from parity.compare import THRESHOLDS, compare_tensor
from parity.ours import load_state
from parity.reference import route_selected_softmax, router_logits
from parity.reference.ep import ep_moe_forward, make_parallel_groups, reduce_gradients
from parity.reference.launch import rank_device, run_ranks
from parity.theirs import precise_matmuls

# Spawned torch.distributed ranks beside our layer on host meshes: the slow lane (our layer on the same
# meshes is tests/test_layers_parallel.py's, on both pins).
pytestmark = pytest.mark.slow

TOL = THRESHOLDS["float32"]
PARAMS = ("w_router", "w_gate", "w_up", "w_down")  # the layer's nnx.Params, as Problem fields


class Sizes(NamedTuple):
    tokens: int  # T per rank
    d_model: int
    d_ff: int
    experts: int
    top_k: int


CPU_SIZES = Sizes(tokens=6, d_model=16, d_ff=32, experts=8, top_k=2)
GPU_SIZES = Sizes(tokens=128, d_model=256, d_ff=512, experts=16, top_k=4)

# (ep, case) layouts per world size, in the order every rank runs them; data = W // ep.
PLANS = {
    2: [(2, "skewed"), (2, "one_owner"), (2, "router")],
    4: [(2, "skewed"), (2, "router"), (4, "skewed"), (4, "one_owner")],
    8: [(8, "skewed"), (8, "router"), (4, "one_owner"), (2, "skewed")],
}
CASES = ("skewed", "one_owner", "router")


def on_gpus(world: int) -> bool:
    """NCCL + a GPU mesh when torch and jax both see `world` GPUs; else gloo + host devices."""
    return (
        torch.cuda.device_count() >= world
        and jax.default_backend() == "gpu"
        and len(jax.devices()) >= world
    )


def sizes_for(world: int) -> Sizes:
    return GPU_SIZES if on_gpus(world) else CPU_SIZES


# ------------------------------------------------------------------------------------------
# The problem, built identically in every rank and in the test process
# ------------------------------------------------------------------------------------------


class Problem(NamedTuple):
    """Full batch, fp32 numpy: x/upstream [W*T, D], w_router [E, D], w_gate/w_up [E, F, D],
    w_down [E, D, F], injected expert_idx [W*T, K] int32, weights [W*T, K], probs [W*T, E]."""

    x: np.ndarray
    upstream: np.ndarray
    w_router: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    expert_idx: np.ndarray
    weights: np.ndarray
    probs: np.ndarray


def make_problem(world: int, ep: int, case: str, sz: Sizes) -> Problem:
    """Routing patterns: "skewed" (experts of ep rank 0 three times as popular, K distinct ids per
    token, so ranks receive uneven blocks), "one_owner" (every route to the last ep rank's
    experts: the other ranks receive nothing), "router" (ids come from the router; the injected
    ones are unused)."""
    rng = np.random.default_rng([world, ep, CASES.index(case)])
    n, e, k = world * sz.tokens, sz.experts, sz.top_k

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    local = e // ep
    if case == "one_owner":
        allowed, p = np.arange(e - local, e), None
    else:
        allowed = np.arange(e)
        p = np.where(allowed < local, 3.0, 1.0)
        p = p / p.sum()
    idx = np.stack([rng.choice(allowed, size=k, replace=False, p=p) for _ in range(n)]).astype(np.int32)
    logits = normal(n, e)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    weights = np.take_along_axis(probs, idx, axis=1)
    return Problem(
        x=normal(n, sz.d_model),
        upstream=normal(n, sz.d_model),
        w_router=normal(e, sz.d_model, scale=sz.d_model ** -0.5),
        w_gate=normal(e, sz.d_ff, sz.d_model, scale=sz.d_model ** -0.5),
        w_up=normal(e, sz.d_ff, sz.d_model, scale=sz.d_model ** -0.5),
        w_down=normal(e, sz.d_model, sz.d_ff, scale=sz.d_ff ** -0.5),
        expert_idx=idx,
        weights=(weights / weights.sum(axis=1, keepdims=True)).astype(np.float32),
        probs=probs.astype(np.float32),
    )


# ------------------------------------------------------------------------------------------
# Reference side: what each torch rank runs
# ------------------------------------------------------------------------------------------


def _rank_case(rank: int, world: int, ep: int, case: str, sz: Sizes, groups) -> dict:
    ep_group, expert_dp_group, dense_dp_group = groups
    prob = make_problem(world, ep, case, sz)
    device = rank_device()
    mine = slice(rank * sz.tokens, (rank + 1) * sz.tokens)
    local = sz.experts // ep
    shard = slice(dist.get_rank(ep_group) * local, (dist.get_rank(ep_group) + 1) * local)

    def tensor(a, grad=False):
        return torch.tensor(a, device=device).requires_grad_(grad)

    x = tensor(prob.x[mine], grad=True)
    experts = [tensor(w[shard], grad=True) for w in (prob.w_gate, prob.w_up, prob.w_down)]
    dense = []
    if case == "router":
        w_router = tensor(prob.w_router, grad=True)
        dense = [w_router]
        idx, weight, _ = route_selected_softmax(router_logits(x, w_router), sz.top_k)
    else:
        idx = tensor(prob.expert_idx[mine]).long()
        weight = tensor(prob.weights[mine], grad=True)
    out = ep_moe_forward(x, idx, weight, *experts, sz.experts, ep_group)
    (out * tensor(prob.upstream[mine])).sum().backward()
    reduce_gradients(experts, dense, expert_dp_group, dense_dp_group, average=False)
    result = dict(out=out, d_x=x.grad, d_experts=[w.grad for w in experts], topk_idx=idx)
    if case == "router":
        result["d_router"] = w_router.grad
    else:
        result["d_weights"] = weight.grad
    return result


def _rank_main(rank: int, world: int, plan, sz: Sizes) -> dict:
    # fp32 parity: no TF32 anywhere (the router's matmul is a plain torch matmul), as the
    # single-process reference runs (`parity.theirs`).
    results = {}
    with precise_matmuls():
        for ep, case in plan:
            groups = make_parallel_groups(ep)
            results[(ep, case)] = _rank_case(rank, world, ep, case, sz, groups)
    return results


@functools.cache
def reference_results(world: int) -> list[dict]:
    """Per-rank reference results of every layout of `world`, one spawn (NCCL or gloo)."""
    backend = "nccl" if on_gpus(world) else "gloo"
    return run_ranks(world, _rank_main, PLANS[world], sizes_for(world), backend=backend, timeout_s=300)


# ------------------------------------------------------------------------------------------
# Our side
# ------------------------------------------------------------------------------------------


def _mesh(world: int, ep: int):
    devices = jax.devices() if on_gpus(world) else jax.devices("cpu")
    if len(devices) < world:
        raise RuntimeError(
            f"{world} devices needed, jax sees {len(devices)}: the root conftest must force 8 host devices"
        )
    return make_mesh(ep=ep, data=world // ep, devices=devices[:world])


def our_results(world: int, ep: int, case: str, strategy: str) -> dict:
    """Our layer on the mesh: output, d x, d routing weights, every parameter gradient (global)."""
    sz = sizes_for(world)
    prob = make_problem(world, ep, case, sz)
    mesh = _mesh(world, ep)
    gpu = on_gpus(world)
    model = MoE(
        sz.d_model, sz.d_ff, sz.experts, sz.top_k,
        router=SelectedSoftmax(sz.top_k),
        # On host devices the grouped GEMM runs as lax.ragged_dot: the Pallas interpreter would
        # only add minutes (its parity is covered by the single-device suites).
        gemm=GemmOptions(backend="auto" if gpu else "xla", precision=jax.lax.Precision.HIGHEST),
        mesh=mesh,
        expert_parallel=EPOptions(strategy=strategy),
        rngs=nnx.Rngs(0),
    )
    load_state(model, {name: getattr(prob, name) for name in PARAMS})
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    act = NamedSharding(mesh, activation_spec())
    put = lambda a: jax.device_put(a, act)  # noqa: E731
    idx, probs, upstream = put(prob.expert_idx), put(prob.probs), put(prob.upstream)

    def loss(params, x, weights):
        layer = nnx.merge(graphdef, params, rest)
        routing = None if case == "router" else Routing(idx, weights, probs)
        y, stats = layer(x, routing=routing)
        return jnp.sum(y * upstream), (y, stats.dropped)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, (y, dropped)), (d_params, d_x, d_weights) = step(params, put(prob.x), put(prob.weights))
    grads = {path[0]: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(d_params)}
    return dict(out=np.asarray(y), d_x=np.asarray(d_x), d_weights=np.asarray(d_weights), grads=grads,
                dropped=int(dropped))


# ------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------


def compare(world: int, ep: int, case: str, strategy: str, ref_ranks: list[dict]) -> list[str]:
    """Every mismatch between our layer and the reference ranks, as readable lines."""
    sz = sizes_for(world)
    ours = our_results(world, ep, case, strategy)
    local = sz.experts // ep
    failures = []

    def check(what, got, want):
        if not np.isfinite(got).all():
            failures.append(f"W={world} ep={ep} {case}/{strategy}: {what} is not finite")
        elif not (c := compare_tensor(what, torch.tensor(got), want, TOL)).passed:
            failures.append(f"W={world} ep={ep} {case}/{strategy}: {c.summary()}")

    if ours["dropped"] != 0:
        failures.append(f"W={world} ep={ep} {case}/{strategy}: dropless layer reports {ours['dropped']} drops")
    for rank, ref in enumerate(ref_ranks):
        got = ref[(ep, case)]
        mine = slice(rank * sz.tokens, (rank + 1) * sz.tokens)
        shard = slice((rank % ep) * local, (rank % ep + 1) * local)
        if case != "router":
            assert np.array_equal(got["topk_idx"].numpy(), make_problem(world, ep, case, sz).expert_idx[mine])
        check(f"rank {rank} y", ours["out"][mine], got["out"])
        check(f"rank {rank} d x", ours["d_x"][mine], got["d_x"])
        if case == "router":
            check(f"rank {rank} d w_router (dense-DP reduced)", ours["grads"]["w_router"], got["d_router"])
        else:
            check(f"rank {rank} d routing weights", ours["d_weights"][mine], got["d_weights"])
        for name, g in zip(("w_gate", "w_up", "w_down"), got["d_experts"]):
            check(f"rank {rank} d {name} (expert-DP reduced)", ours["grads"][name][shard], g)
    if case != "router":
        # The router is skipped with an injected routing: its gradient is exactly zero.
        if np.any(ours["grads"]["w_router"] != 0):
            failures.append(f"W={world} ep={ep} {case}/{strategy}: w_router got a gradient without the router")
    return failures


def strategies(world: int) -> tuple[str, ...]:
    return ("padded", "ragged") if on_gpus(world) else ("padded",)


@pytest.mark.parametrize("world", sorted(PLANS))
def test_ep_layer_matches_torch_distributed_reference(world):
    """All layouts of one world size: (W=2: ep 2 x data 1; W=4: ep 2 x data 2 and ep 4 x data 1;
    W=8: ep 8 x data 1, ep 4 x data 2, ep 2 x data 4) x routing cases x exchange strategies,
    against one spawn of W reference ranks."""
    ref_ranks = reference_results(world)
    assert len(ref_ranks) == world
    failures = []
    for ep, case in PLANS[world]:
        for strategy in strategies(world):
            failures += compare(world, ep, case, strategy, ref_ranks)
    assert not failures, "\n".join(failures)


def test_problem_patterns_reach_the_edge_cases():
    """The routing patterns do what the parity cases rely on: "one_owner" leaves every ep rank
    but the last without rows, "skewed" gives every rank rows, unevenly, and K distinct ids."""
    for world, plan in PLANS.items():
        sz = sizes_for(world)
        for ep, case in plan:
            if case == "router":
                continue
            idx = make_problem(world, ep, case, sz).expert_idx
            owners = np.bincount(idx.reshape(-1) // (sz.experts // ep), minlength=ep)
            assert all(len(set(row)) == sz.top_k for row in idx.tolist())
            if case == "one_owner":
                assert owners[:-1].sum() == 0 and owners[-1] == idx.size
            else:
                assert owners.min() > 0 and owners[0] > owners[1:].max()
