"""Tests of the expert-parallel reference (`parity.reference.ep`) on spawned `torch.distributed` ranks.

Each world size is spawned once (module fixture): the ranks build every process-group layout of
that world (world 2: EP 2 x expert-DP 1; world 4: EP 2 x expert-DP 2, then EP 4 x 1), run every
case, and return CPU tensors. The checks run here, against the single-process reference on the
whole batch (the concatenation of all ranks' tokens) with the same weights and routing.

Losses are sums, `sum(out * G)` with a fixed upstream gradient `G[W*T, D]`, so per-rank losses
add up to the full-batch loss and the SUM all-reduce needs no division; `average=True` is checked
against the SUM divided by the group size.

Legend: W world size, T tokens per rank, D model, F expert hidden, E experts, K top-k.
CPU runs use gloo and Triton's interpreter; with >= W GPUs `run_ranks` picks NCCL.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from moe_jax import testing
from parity.reference import (
    moe_experts_autograd,
    route_selected_softmax,
    router_logits,
    selected_expert_path_forward,
)
from parity.reference.ep import (
    META_LOCAL_EXPERT,
    META_SLOT,
    META_SOURCE,
    META_TOKEN,
    all_to_all_rows,
    ep_combine,
    ep_dispatch,
    ep_moe_forward,
    make_parallel_groups,
    reduce_gradients,
)
from parity.reference.launch import RankFailed, pick_backend, rank_device, run_ranks

# Spawned torch.distributed ranks, Triton interpreted on CPU; torch only, so one pin suffices: the slow lane.
pytestmark = pytest.mark.slow

T, D, F, E, K = 6, 16, 32, 8, 2
BIG = 100.0  # a selection bias that dominates O(1) router logits


class Case(NamedTuple):
    """One check: `kind` "moe" (forward + backward), "roundtrip" (identity experts) or "errors"."""

    kind: str
    dtype: torch.dtype = torch.float32
    routing: str = "random"  # "random", "one_owner" (all routes to the last EP rank), "empty_expert"
    seed: int = 0


CASES = {
    "moe_fp32": Case("moe"),
    "moe_bf16": Case("moe", torch.bfloat16, seed=1),
    "moe_one_owner": Case("moe", routing="one_owner", seed=2),
    "moe_empty_expert": Case("moe", routing="empty_expert", seed=3),
    "roundtrip": Case("roundtrip", seed=4),
    "roundtrip_one_owner": Case("roundtrip", routing="one_owner", seed=5),
    "errors": Case("errors"),
}

# world size -> [(ep_size, case names)], in the order every rank runs them.
PLANS = {
    2: [(2, ["moe_fp32", "moe_bf16", "moe_one_owner", "moe_empty_expert", "roundtrip",
             "roundtrip_one_owner", "errors"])],
    4: [
        (2, ["moe_fp32", "moe_one_owner", "roundtrip", "errors"]),
        (4, ["moe_fp32", "moe_empty_expert", "moe_one_owner", "roundtrip_one_owner"]),
    ],
}
LAYOUTS = [(w, ep) for w, plan in PLANS.items() for ep, _ in plan]
MOE_RUNS = [(w, ep, n) for w, plan in PLANS.items() for ep, names in plan for n in names
            if CASES[n].kind == "moe"]
ROUNDTRIP_RUNS = [(w, ep, n) for w, plan in PLANS.items() for ep, names in plan for n in names
                  if CASES[n].kind == "roundtrip"]
ERROR_RUNS = [(w, ep) for w, plan in PLANS.items() for ep, names in plan if "errors" in names]


# ------------------------------------------------------------------------------------------
# Problems (built identically in every rank and in the test process)
# ------------------------------------------------------------------------------------------


class Problem(NamedTuple):
    """Full-batch data: x[W*T, D], w_router[E, D] fp32, expert weights [E, ...], upstream[W*T, D]."""

    x: torch.Tensor
    w_router: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    upstream: torch.Tensor
    bias: torch.Tensor | None


def selection_bias(routing: str, ep_size: int, device) -> torch.Tensor | None:
    """Bias that forces the routing pattern `routing` on an EP group of `ep_size` ranks."""
    per_rank = E // ep_size
    expert = torch.arange(E, device=device)
    if routing == "random":
        return None
    if routing == "one_owner":  # every route to the last rank's experts (needs E / ep >= K)
        return torch.where(expert // per_rank == ep_size - 1, BIG, 0.0)
    if routing == "empty_expert":  # local expert 1 of every rank is never chosen
        return torch.where(expert % per_rank == 1, -BIG, 0.0)
    raise ValueError(routing)


def make_problem(world: int, ep_size: int, case: Case, device) -> Problem:
    gen = torch.Generator().manual_seed(1000 * case.seed + 10 * world + ep_size)

    def randn(*shape, scale=1.0, dtype=case.dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return Problem(
        x=randn(world * T, D),
        w_router=randn(E, D, scale=D ** -0.5, dtype=torch.float32),
        w_gate=randn(E, F, D, scale=D ** -0.5),
        w_up=randn(E, F, D, scale=D ** -0.5),
        w_down=randn(E, D, F, scale=F ** -0.5),
        upstream=randn(world * T, D, dtype=torch.float32),
        bias=selection_bias(case.routing, ep_size, device),
    )


def route(x: torch.Tensor, w_router: torch.Tensor, bias):
    """The selected-softmax router (docs/reference-algorithm.md, Eq. 2): `(topk_idx[T, K], topk_weight[T, K] fp32)`."""
    idx, weight, _ = route_selected_softmax(router_logits(x, w_router), K, selection_bias=bias)
    return idx, weight


# ------------------------------------------------------------------------------------------
# What each rank runs
# ------------------------------------------------------------------------------------------


def _shard(w: torch.Tensor, ep_slot: int, ep_size: int) -> torch.Tensor:
    per_rank = E // ep_size
    return w[ep_slot * per_rank:(ep_slot + 1) * per_rank]


def _rank_moe(rank, world, ep_size, case, groups):
    """EP forward + backward of a sum loss, then the gradient reductions (SUM and average)."""
    ep_group, expert_dp_group, dense_dp_group = groups
    prob = make_problem(world, ep_size, case, rank_device())
    mine = slice(rank * T, (rank + 1) * T)
    slot = dist.get_rank(ep_group)
    x = prob.x[mine].clone().requires_grad_()
    w_router = prob.w_router.clone().requires_grad_()
    experts = [_shard(w, slot, ep_size).clone().requires_grad_() for w in (prob.w_gate, prob.w_up, prob.w_down)]

    idx, weight = route(x, w_router, prob.bias)
    weight.retain_grad()
    out = ep_moe_forward(x, idx, weight, *experts, E, ep_group)
    (out.float() * prob.upstream[mine]).sum().backward()

    # Same local gradients through average=True, on stand-in leaves.
    probes = [torch.zeros_like(p) for p in experts + [w_router]]
    for probe, p in zip(probes, experts + [w_router]):
        probe.grad = p.grad.clone()
    reduce_gradients(probes[:3], probes[3:], expert_dp_group, dense_dp_group, average=True)
    reduce_gradients(experts, [w_router], expert_dp_group, dense_dp_group, average=False)

    with torch.no_grad():  # routing statistics of the same step, for the edge-case checks
        _, _, offsets, ctx = ep_dispatch(x, idx, E, ep_group)
    return dict(
        out=out, topk_idx=idx, d_x=x.grad, d_weight=weight.grad,
        d_experts=[p.grad for p in experts], d_router=w_router.grad,
        avg_experts=[p.grad for p in probes[:3]], avg_router=probes[3].grad,
        offsets=offsets, send_splits=ctx.send_splits, recv_splits=ctx.recv_splits,
    )


def _rank_roundtrip(rank, world, ep_size, case, groups):
    """Dispatch, identity experts, combine; return the dispatch view for inspection."""
    ep_group = groups[0]
    prob = make_problem(world, ep_size, case, rank_device())
    x = prob.x[rank * T:(rank + 1) * T]
    idx, weight = route(x, prob.w_router, prob.bias)
    recv_x, recv_expert, offsets, ctx = ep_dispatch(x, idx, E, ep_group)
    out = ep_combine(recv_x, weight, ctx, T, ep_group)
    return dict(
        out=out, recv_x=recv_x, recv_expert=recv_expert, offsets=offsets, recv_meta=ctx.recv_meta,
        send_splits=ctx.send_splits, recv_splits=ctx.recv_splits,
    )


def _error_message(call) -> str:
    try:
        call()
    except ValueError as err:
        return str(err)
    return "no ValueError"


def _rank_errors(rank, world, ep_size, case, groups):
    """ValueErrors raised before any collective (so every rank raises, nothing desynchronises)."""
    ep_group = groups[0]
    device = rank_device()
    x = torch.zeros(T, D, device=device)
    idx = torch.zeros(T, K, dtype=torch.int64, device=device)
    per_rank = E // ep_size
    w = torch.zeros(per_rank, F, D, device=device)
    w_down = torch.zeros(per_rank, D, F, device=device)
    return {
        "indivisible": _error_message(lambda: ep_dispatch(x, idx, E + 1, ep_group)),
        "groups": _error_message(lambda: make_parallel_groups(3)),
        "out_of_range": _error_message(lambda: ep_dispatch(x, idx + E, E, ep_group)),
        "shard_size": _error_message(
            lambda: ep_moe_forward(x, idx, idx.float(), w[:-1], w[:-1], w_down[:-1], E, ep_group)),
        "splits": _error_message(lambda: all_to_all_rows(x, [1] * ep_size, [1] * ep_size, ep_group)),
    }


_RUNNERS = {"moe": _rank_moe, "roundtrip": _rank_roundtrip, "errors": _rank_errors}


def _rank_main(rank: int, world: int, plan):
    results = {}
    for ep_size, names in plan:
        groups = make_parallel_groups(ep_size)
        results[(ep_size, "groups")] = [dist.get_process_group_ranks(g) for g in groups]
        for name in names:
            case = CASES[name]
            results[(ep_size, name)] = _RUNNERS[case.kind](rank, world, ep_size, case, groups)
    return results


def _rank_raises(rank: int, world: int):
    if rank == 1:
        raise ValueError("boom from rank 1")
    # Never completes, so the launcher must stop this rank. Not a collective: a barrier fails here
    # too once rank 1's connection closes, and under load that failure could be reported first.
    time.sleep(120)


def _rank_sleeps(rank: int, world: int):
    time.sleep(120)


# ------------------------------------------------------------------------------------------
# Fixtures and helpers in the test process
# ------------------------------------------------------------------------------------------

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def world_results():
    """{world: per-rank result dicts}, one spawn per world size, made on first use."""
    cache = {}

    def get(world: int):
        if world not in cache:
            cache[world] = run_ranks(world, _rank_main, PLANS[world], timeout_s=240)
        return cache[world]

    return get


_REFERENCE_CACHE: dict = {}


def full_batch_reference(world: int, ep_size: int, name: str) -> dict:
    """Single-process MoE on all W*T tokens with autograd, on the test process's device."""
    key = (world, ep_size, name)
    if key in _REFERENCE_CACHE:
        return _REFERENCE_CACHE[key]
    prob = make_problem(world, ep_size, CASES[name], DEVICE)
    x = prob.x.clone().requires_grad_()
    w_router = prob.w_router.clone().requires_grad_()
    experts = [w.clone().requires_grad_() for w in (prob.w_gate, prob.w_up, prob.w_down)]
    idx, weight = route(x, w_router, prob.bias)
    weight.retain_grad()
    out = moe_experts_autograd(x, idx, weight, *experts)
    (out.float() * prob.upstream).sum().backward()
    explicit, _ = selected_expert_path_forward(x.detach(), idx, weight.detach(), *prob[2:5])
    ref = dict(
        prob=prob, out=out.detach().cpu(), explicit=explicit.cpu(), topk_idx=idx.cpu(),
        topk_weight=weight.detach().cpu(), d_x=x.grad.cpu(), d_weight=weight.grad.cpu(),
        d_experts=[p.grad.cpu() for p in experts], d_router=w_router.grad.cpu(),
    )
    _REFERENCE_CACHE[key] = ref
    return ref


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    """`moe_jax.testing.rel_err` <= tol, same dtype, and a zero reference matched exactly."""
    assert out.shape == ref.shape, (what, tuple(out.shape), tuple(ref.shape))
    assert out.dtype == ref.dtype, (what, out.dtype, ref.dtype)
    if not ref.any():
        assert not out.any(), f"{what}: expected exact zeros"
    err = testing.rel_err(out.detach().double().cpu().numpy(), ref.detach().double().cpu().numpy())
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:g}"


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------


def test_backend_choice():
    assert pick_backend(2) == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert pick_backend(10 ** 6) == "gloo"
    with pytest.raises(ValueError, match="backend"):
        run_ranks(2, _rank_sleeps, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(0, _rank_sleeps)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="CUDA devices"):
            run_ranks(2, _rank_sleeps, backend="nccl")


@pytest.mark.parametrize("world,ep_size", LAYOUTS)
def test_group_layout(world_results, world, ep_size):
    for rank, result in enumerate(world_results(world)):
        ep, expert_dp, dense = result[(ep_size, "groups")]
        first = rank - rank % ep_size
        assert ep == list(range(first, first + ep_size))
        assert expert_dp == list(range(rank % ep_size, world, ep_size))
        assert dense == list(range(world))


@pytest.mark.parametrize("world,ep_size,name", MOE_RUNS)
def test_ep_moe_matches_full_batch(world_results, world, ep_size, name):
    """Outputs, d x, d topk_weight per rank; reduced expert and router grads; average=True."""
    ref = full_batch_reference(world, ep_size, name)
    dtype = CASES[name].dtype
    tol = testing.tolerance(dtype)
    expert_dp_size = world // ep_size
    for rank, result in enumerate(world_results(world)):
        got = result[(ep_size, name)]
        mine = slice(rank * T, (rank + 1) * T)
        slot = rank % ep_size
        assert torch.equal(got["topk_idx"], ref["topk_idx"][mine]), f"rank {rank}: routing differs"
        assert_close(got["out"], ref["out"][mine], tol, f"rank {rank} out")
        assert_close(got["out"], ref["explicit"][mine], tol, f"rank {rank} out vs explicit path")
        assert_close(got["d_x"], ref["d_x"][mine], tol, f"rank {rank} d_x")
        assert_close(got["d_weight"], ref["d_weight"][mine], tol, f"rank {rank} d_topk_weight")
        for i, (g, r) in enumerate(zip(got["d_experts"], ref["d_experts"])):
            assert_close(g, _shard(r, slot, ep_size), tol, f"rank {rank} expert grad {i}")
            assert_close(got["avg_experts"][i], _shard(r, slot, ep_size) / expert_dp_size, tol,
                         f"rank {rank} averaged expert grad {i}")
        assert_close(got["d_router"], ref["d_router"], testing.tolerance(torch.float32), f"rank {rank} router grad")
        assert_close(got["avg_router"], ref["d_router"] / world, testing.tolerance(torch.float32),
                     f"rank {rank} averaged router grad")


def _routing_stats(world_results, world, ep_size, name):
    return [r[(ep_size, name)] for r in world_results(world)]


@pytest.mark.parametrize("world,ep_size", [(w, ep) for w, ep, n in MOE_RUNS if n == "moe_one_owner"])
def test_all_routes_to_one_rank(world_results, world, ep_size):
    """Every route goes to the last EP rank: the others receive nothing and send to no peer but it."""
    per_rank = E // ep_size
    for rank, got in enumerate(_routing_stats(world_results, world, ep_size, "moe_one_owner")):
        slot = rank % ep_size
        assert got["send_splits"] == [0] * (ep_size - 1) + [T * K]
        if slot == ep_size - 1:
            assert got["recv_splits"] == [T * K] * ep_size
        else:
            assert got["recv_splits"] == [0] * ep_size
            assert got["offsets"].tolist() == [0] * (per_rank + 1)
            assert all(bool((g == 0).all()) for g in got["d_experts"])


@pytest.mark.parametrize("world,ep_size", [(w, ep) for w, ep, n in MOE_RUNS if n == "moe_empty_expert"])
def test_local_expert_without_rows(world_results, world, ep_size):
    """Local expert 1 of every rank gets no row; its (reduced) gradients are exactly zero."""
    for got in _routing_stats(world_results, world, ep_size, "moe_empty_expert"):
        counts = got["offsets"][1:] - got["offsets"][:-1]
        assert counts[1] == 0 and counts.sum() > 0
        assert all(bool((g[1] == 0).all()) for g in got["d_experts"])


@pytest.mark.parametrize("world,ep_size,name", ROUNDTRIP_RUNS)
def test_roundtrip_identity_experts(world_results, world, ep_size, name):
    """Identity experts: combine gives sum_k w[t, k] x[t]; dispatch delivers the right rows."""
    prob = make_problem(world, ep_size, CASES[name], torch.device("cpu"))
    idx, weight = route(prob.x, prob.w_router, prob.bias)
    per_rank = E // ep_size
    for rank, got in enumerate(world_results(world)):
        got = got[(ep_size, name)]
        mine = slice(rank * T, (rank + 1) * T)
        expect = (weight[mine].sum(dim=1, keepdim=True) * prob.x[mine])
        assert_close(got["out"], expect, 1e-6, f"rank {rank} round trip")

        # Every received row is the source token's x, for this rank's expert of that route.
        meta = got["recv_meta"]
        group_first = rank - rank % ep_size
        src_token = (group_first + meta[:, META_SOURCE]) * T + meta[:, META_TOKEN]
        assert torch.equal(got["recv_x"], prob.x[src_token])
        owner_expert = idx[src_token, meta[:, META_SLOT]]
        assert torch.equal(owner_expert // per_rank, torch.full_like(owner_expert, rank % ep_size))
        assert torch.equal(owner_expert % per_rank, meta[:, META_LOCAL_EXPERT])
        assert torch.equal(got["recv_expert"], meta[:, META_LOCAL_EXPERT])
        # Grouped by local expert, each expert's rows in global token order, offsets consistent.
        key = meta[:, META_LOCAL_EXPERT] * (world * T) + src_token
        assert bool((key[1:] > key[:-1]).all())
        counts = torch.bincount(meta[:, META_LOCAL_EXPERT], minlength=per_rank)
        assert got["offsets"].tolist() == [0] + counts.cumsum(0).tolist()
        assert sum(got["recv_splits"]) == meta.shape[0] and sum(got["send_splits"]) == T * K


@pytest.mark.parametrize("world,ep_size", ERROR_RUNS)
def test_clear_errors(world_results, world, ep_size):
    for got in world_results(world):
        msgs = got[(ep_size, "errors")]
        assert "not divisible by the EP group size" in msgs["indivisible"]
        assert "must divide the world size" in msgs["groups"]
        assert "must lie in [0, 8)" in msgs["out_of_range"]
        assert "local weights hold" in msgs["shard_size"]
        assert "input_splits sum" in msgs["splits"]


def test_run_ranks_reports_failing_rank():
    with pytest.raises(RankFailed) as info:
        run_ranks(2, _rank_raises, timeout_s=120)
    assert info.value.rank == 1
    assert "boom from rank 1" in str(info.value) and "Traceback" in str(info.value)


def test_run_ranks_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        run_ranks(2, _rank_sleeps, timeout_s=8)
    assert time.monotonic() - start < 60
