"""Expert-parallel dispatch + combine: benchmark and correctness check on P GPUs (`--ranks`, default 2).

    python -m benchmarks.ep [--ranks P] [--skip-ragged] [--json PATH]  # the table (P GPUs)
    python -m benchmarks.ep [--ranks P] --check         # forward/gradient checks on the GPU mesh
    python -m benchmarks.ep [--ranks P] --cpu-smoke [--check]  # the same code paths at tiny sizes on P host devices

Benchmark. For each shape (prefill: T = 4096 and 16384 tokens per rank, D = 4096, top-2 of 64;
decode: T = 128, D = 7168, top-8 of 256; bf16) and routing (balanced: every expert gets exactly
T*K/E routes of each rank; zipf: expert popularity ~ rank^-1.2, hot experts scattered over the
ranks) it times one dispatch + combine (identity experts) of:

* ours, `moe_jax.parallel.ep_dispatch`/`ep_combine` on a `make_mesh(ep=P)` mesh, per strategy:
  `padded` dropless (C = T*K), `padded cf=1.25` (capacity 1.25x the balanced load; drops are
  reported), `padded cf=1.25 no-a2a` (the same with the row collective replaced by the identity:
  what our planning, gathers and combine cost around the collective), `padded cf=1.25 xla-ops`
  (the row gathers and the send plan through XLA instead of our Pallas kernels), `ragged`
  (`ragged_all_to_all`), and `ragged+decomp` (the same with
  `--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true`, in its own process since XLA
  reads flags once);
* xla, the bare collectives there and back and nothing else: `all_to_all` of the dropless padded
  buffers (P blocks of R rows), `all_to_all cf=1.25` of the capacity buffers (P blocks of C rows),
  `ppermute cf=1.25` (P = 2 only: the peer's C-row block, what our padded strategy moves at P = 2
  for blocks of `_PAIR_MIN_BLOCK_BYTES` and more, i.e. at prefill here),
  `ragged_all_to_all` with this routing's exact block sizes, and `ragged_all_to_all+decomp` (the
  same under the decomposer flag);
* NCCL: two `torch.distributed.all_to_all_single` calls (P processes) with this routing's split
  sizes, i.e. the bytes a dropless exchange must move, and nothing else;
* torch-ref, the torch EP reference, `parity.reference.ep.ep_dispatch`/`ep_combine` (counts
  exchange, host sync, metadata and rows, regroup), on the same routing.

`--skip-ragged` times only the padded rows, `all_to_all` and `ppermute` (plus NCCL and
torch-ref): the ragged rows and the decomposer process take minutes.

Payload = rows delivered * D * bytes/elt, both directions (dispatch sends them, combine brings
them back), per GPU; GB/s = payload / time. Padding rows a strategy moves are not payload. The
"x NCCL" column is time / NCCL time for the same shape and routing (lower is better).

Rank tail (the seed's point that the slowest rank sets the layer's pace): every torch process
times itself, the table reports the slowest rank's median and, under `slow/mean`, its ratio to
the mean over ranks; below the table, each routing's received rows per rank, max / mean (the load
the hottest rank must take). Our JAX rows are one SPMD program whose wall time is already the
slowest device's.

Timing: ours runs `reps` dispatch+combine iterations inside one jitted `fori_loop` (the output of
one iteration is the input of the next, and the routing passes an optimization barrier each
iteration, so the planning cannot be hoisted out of the loop; the identity experts sit behind a
barrier, so XLA cannot fuse dispatch's regroup into combine's un-regroup, which no real expert
stage allows; tables before 2026-11-30's breakdown-2 lacked that barrier); torch runs `reps` eager calls.
Both: median over trials of wall time / reps, after a warm-up, synchronised on the device.

Check (`--check`). On the P-GPU mesh (`--ranks`), both strategies (and ragged once more under the decomposer
flag) run dispatch, SwiGLU experts and combine in fp32, HIGHEST, dropless and with a capacity that
drops, on zipf routing and on "all routes to one rank"; the output and the gradients w.r.t. x, the
routing weights and the three expert weights must match `moe_jax.dense_reference.moe_reference`
of the whole batch on one device (weights of dropped routes zeroed) within the fp32 relative
Frobenius tolerance of `moe_jax.testing` (1e-5; a non-finite value fails), and both strategies
must drop the same routes. It also reports, as a finding, whether `jax.grad` through a raw
`jax.lax.ragged_all_to_all` (JAX's own transpose, which our exchanges never use: they carry a
custom_vjp whose backward is the reverse exchange) matches the exact gradient, for operand rows
greater than, equal to and smaller than output rows.

`--cpu-smoke` runs everything at tiny sizes on P forced host devices and gloo: padded only
(XLA:CPU has no ragged_all_to_all), to exercise the code paths without a GPU.

Legend: P ranks (ep size), T tokens per rank, D width, K top-k, E experts, El = E/P, F expert
hidden width, R = T*K routes per rank, C capacity.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from typing import NamedTuple
import time

import numpy as np

from parity.problem import ZIPF_EXPONENT

DEFAULT_RANKS = 2
DECOMPOSER_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"
CAPACITY_FACTOR = 1.25
ROUTINGS = ("balanced", "zipf")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    tokens: int  # T per rank
    d_model: int
    top_k: int
    experts: int

    def describe(self) -> str:
        return f"{self.name} T={self.tokens} D={self.d_model} top-{self.top_k}/{self.experts}"

    @property
    def payload_bytes(self) -> int:
        """Bytes a dropless dispatch + combine delivers per rank: R rows of D bf16, both ways."""
        return 2 * self.tokens * self.top_k * self.d_model * 2


GPU_SHAPES = (
    Shape("prefill", 4096, 4096, 2, 64),
    Shape("prefill", 16384, 4096, 2, 64),
    Shape("decode", 128, 7168, 8, 256),
)
SMOKE_SHAPES = (Shape("prefill", 64, 32, 2, 8), Shape("decode", 8, 64, 4, 16))


@dataclasses.dataclass(frozen=True)
class CheckSize:
    tokens: int
    d_model: int
    d_ff: int
    experts: int
    top_k: int


# Enough experts for "one_rank" routing (every route to rank 0's E/P experts, K distinct) at P = 8.
GPU_CHECK = CheckSize(tokens=256, d_model=256, d_ff=512, experts=32, top_k=4)
SMOKE_CHECK = CheckSize(tokens=8, d_model=16, d_ff=32, experts=16, top_k=2)


# ----------------------------------------------------------------------------- routing (shared)


def make_routing(kind: str, ranks: int, tokens: int, experts: int, top_k: int, seed: int = 0):
    """`(expert_idx [ranks*T, K] int32, weights [ranks*T, K] f32)`, K distinct experts per token,
    weights summing to 1 per token. Identical in every process for the same arguments.

    balanced: each rank's T*K routes cover every expert exactly T*K/E times (when E divides T*K).
    zipf: expert popularity ~ (popularity rank)^-1.2 over a random expert order, K distinct
      experts per token drawn without replacement (Gumbel top-k).
    one_rank: every route to the experts of ep rank 0 (needs E/ranks >= K).
    """
    rng = np.random.default_rng(seed)
    n = ranks * tokens
    if kind == "balanced":
        perm = rng.permutation(experts)
        rows = []
        for _ in range(ranks):
            flat = perm[np.arange(tokens * top_k) % experts].reshape(tokens, top_k)
            rows.append(flat[rng.permutation(tokens)])
        idx = np.concatenate(rows)
    elif kind in ("zipf", "one_rank"):
        if kind == "zipf":
            logp = -ZIPF_EXPONENT * np.log1p(rng.permutation(experts).astype(np.float64))
        else:
            if experts // ranks < top_k:
                raise ValueError(f"one_rank routing needs E/ranks >= K distinct experts on rank 0; got "
                                 f"E={experts}, ranks={ranks}, K={top_k}.")
            logp = np.where(np.arange(experts) < experts // ranks, 0.0, -np.inf)
        keys = logp[None, :] + rng.gumbel(size=(n, experts))
        idx = np.argsort(-keys, axis=1)[:, :top_k]
    else:
        raise ValueError(f"unknown routing {kind!r}")
    weights = rng.uniform(0.1, 1.0, size=(n, top_k))
    weights /= weights.sum(axis=1, keepdims=True)
    return idx.astype(np.int32), weights.astype(np.float32)


def send_counts(idx_NK: np.ndarray, experts: int, ranks: int) -> np.ndarray:
    """`[src, dst]` routes ep rank src sends to ep rank dst (dropless), from `make_routing`'s
    rank-major `[ranks*T, K]` expert ids."""
    dest_PR = idx_NK.reshape(ranks, -1) // (experts // ranks)
    return np.stack([np.bincount(d, minlength=ranks) for d in dest_PR])


def _reps(shape: Shape, smoke: bool) -> int:
    if smoke:
        return 3
    return int(max(5, min(100, 4e9 // max(shape.payload_bytes, 1))))


class Variant(NamedTuple):
    """One kind of row; `label` is its name in the tables and JSON records.

    side: "ours" (`ep_dispatch` + `ep_combine`, `_jax_loop`) or "xla" (a bare collective there and
      back, `_collective_loop`).
    exchange: ours: the strategy, "padded" or "ragged"; xla: "all_to_all", "ppermute" or
      "ragged_all_to_all".
    capacity: capacity buffers, C = `capacity_for(..., CAPACITY_FACTOR)`, instead of dropless.
    no_a2a: ours, with the row collective replaced by the identity (the cost around it).
    xla_ops: ours, with the row gathers and the send plan through XLA instead of our Pallas kernels.
    decomposer: run in the process started with XLA's ragged_all_to_all decomposer flag.
    """

    side: str
    exchange: str
    capacity: bool = False
    no_a2a: bool = False
    xla_ops: bool = False
    decomposer: bool = False

    @property
    def label(self) -> str:
        return (self.exchange + ("+decomp" if self.decomposer else "")
                + (f" cf={CAPACITY_FACTOR}" if self.capacity else "")
                + (" no-a2a" if self.no_a2a else "") + (" xla-ops" if self.xla_ops else ""))


# The padded rows (every backend; the ppermute row at P = 2 only) and the ragged ones (GPU only).
PADDED_VARIANTS = (
    Variant("ours", "padded"),
    Variant("ours", "padded", capacity=True),
    Variant("ours", "padded", capacity=True, no_a2a=True),
    Variant("ours", "padded", capacity=True, xla_ops=True),
    Variant("xla", "all_to_all"),
    Variant("xla", "all_to_all", capacity=True),
    Variant("xla", "ppermute", capacity=True),
)
RAGGED_VARIANTS = (Variant("ours", "ragged"), Variant("xla", "ragged_all_to_all"))
DECOMPOSER_VARIANTS = tuple(v._replace(decomposer=True) for v in RAGGED_VARIANTS)


# ----------------------------------------------------------------------------- JAX worker


def _ep_mesh(ranks: int):
    """`make_mesh(ep=ranks)` over this process's first `ranks` devices."""
    import jax

    from moe_jax.parallel import make_mesh

    devices = jax.devices()
    if len(devices) < ranks:
        raise ValueError(f"--ranks {ranks} needs {ranks} devices; this process sees {len(devices)} "
                         f"({devices[0].platform}): run on a machine with {ranks} GPUs, or add --cpu-smoke "
                         "for host devices.")
    return make_mesh(ep=ranks, data=1, devices=devices[:ranks])


def _jax_bench(shapes, variants, smoke: bool, ranks: int) -> list[dict]:
    """Time every `Variant` on every shape and routing; one record per (shape, routing, variant).
    NCCL and torch-ref rows come from `_torch_bench`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import time_compiled
    from moe_jax.parallel import activation_spec

    mesh = _ep_mesh(ranks)
    put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, activation_spec()))  # noqa: E731
    records = []
    for shape in shapes:
        routes = shape.tokens * shape.top_k
        compiled = {}
        x = put(jax.random.normal(jax.random.PRNGKey(0), (ranks * shape.tokens, shape.d_model), jnp.bfloat16))
        for routing in ROUTINGS:
            idx, weights = make_routing(routing, ranks, shape.tokens, shape.experts, shape.top_k)
            counts_PP = send_counts(idx, shape.experts, ranks)
            inputs = dict(ours=(x, put(idx), put(weights)), xla=(x, put(counts_PP)))
            for variant in variants:
                record = dict(side=variant.side, strategy=variant.label, shape=shape.describe(),
                              d_model=shape.d_model, routing=routing)
                try:
                    if variant not in compiled:  # same shapes for every routing: compile once
                        build = _jax_loop if variant.side == "ours" else _collective_loop
                        compiled[variant] = build(mesh, shape, variant, smoke)
                    run, reps, delivered = compiled[variant]
                    args = inputs[variant.side]
                    kept = delivered(*args)  # outside the timed executable
                    seconds = time_compiled(lambda: run(*args), reps, trials=2 if smoke else 5)
                    record.update(seconds=seconds, rows_per_rank=kept / ranks, dropped=routes * ranks - kept,
                                  reps=reps)
                except Exception as err:  # a variant that cannot run is reported, not fatal
                    record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                records.append(record)
                _progress(record)
    return records


def _jax_loop(mesh, shape: Shape, variant: Variant, smoke: bool):
    """`(run, reps, delivered)`: `run(x, idx, weights)` is `reps` dispatch+combine iterations
    (identity experts) of our `variant` in one jitted fori_loop, returning x after the round trips;
    `delivered(x, idx, weights)` is the routes one iteration delivers (a separate executable, so
    the timed one runs nothing else)."""
    import jax
    from jax import lax

    from moe_jax.parallel import EP_AXIS, activation_spec, capacity_for, ep_combine, ep_dispatch, select_transport

    strategy = variant.exchange
    backend = "xla" if variant.xla_ops else "auto"
    ranks = mesh.shape[EP_AXIS]
    capacity = capacity_for(shape.tokens, shape.top_k, ranks, CAPACITY_FACTOR) if variant.capacity else None
    act = activation_spec()
    reps = _reps(shape, smoke)
    # "no-a2a": the transport "auto" picks, with its collective replaced by the identity (same
    # buffer shape under "padded"): what our code costs around the collective.
    transport = "auto"
    if variant.no_a2a:
        block_bytes = (capacity or shape.tokens * shape.top_k) * shape.d_model * 2  # bf16 rows
        chosen = select_transport(strategy, "auto", ep=ranks, block_bytes=block_bytes)
        transport = dataclasses.replace(chosen, name=chosen.name + " (identity)",
                                        move=lambda rows, ex, out_rows, axis_name: rows)

    def body(x, idx, w):
        def one(_, carry):
            x, idx, w = lax.optimization_barrier(carry)  # keep the planning inside the loop
            packed, _, plan = ep_dispatch(x, idx, num_experts=shape.experts, strategy=strategy, capacity=capacity,
                                          backend=backend, transport=transport)
            # The identity experts sit behind a barrier, as a real expert stage would: otherwise
            # XLA fuses the regroup gather into combine's un-regroup and one row pass disappears.
            return ep_combine(lax.optimization_barrier(packed), w, plan, backend=backend), idx, w

        y, _, _ = lax.fori_loop(0, reps, one, (x, idx, w))
        return y

    def kept(x, idx, w):
        _, _, plan = ep_dispatch(x, idx, num_experts=shape.experts, strategy=strategy, capacity=capacity,
                                 backend=backend)
        return lax.psum(plan.keep_TK.sum(dtype="int32"), EP_AXIS)

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(act,) * 3, out_specs=act, check_vma=False))
    count = jax.jit(jax.shard_map(kept, mesh=mesh, in_specs=(act,) * 3, out_specs=jax.sharding.PartitionSpec(),
                                  check_vma=False))
    return run, reps, lambda *args: int(count(*args))


def _collective_loop(mesh, shape: Shape, variant: Variant, smoke: bool):
    """The bare exchanges, there and back, `reps` times: `all_to_all` of the dropless padded
    buffer ([P*R, D] per rank, as our padded strategy moves; [P*C, D] with `variant.capacity`) or
    `ragged_all_to_all` with this routing's exact block sizes (counts_PP[src, dst], offsets from
    it), or `ppermute`, the swap of the peer's [C, D] block that our padded strategy does at P = 2
    (for blocks of `exchange._PAIR_MIN_BLOCK_BYTES` and more). Nothing else runs.
    `(run, reps, delivered)` as for `_jax_loop`, with `run(x, counts_PP)`."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec

    from moe_jax.parallel import EP_AXIS, PAIR_SWAP, activation_spec, capacity_for

    routes = shape.tokens * shape.top_k
    reps = _reps(shape, smoke)
    ranks = mesh.shape[EP_AXIS]
    ragged = variant.exchange == "ragged_all_to_all"
    pair = variant.exchange == "ppermute"
    # Capacity: blocks of our capacity C instead of the dropless R rows.
    block = capacity_for(shape.tokens, shape.top_k, ranks, CAPACITY_FACTOR) if variant.capacity else routes

    def body(x, counts):
        counts = counts.reshape(ranks, ranks)  # every rank sees the whole [src, dst] matrix
        me = lax.axis_index(EP_AXIS)
        send = jnp.repeat(x, shape.top_k, axis=0)  # R rows, one per route
        start_src = jnp.cumsum(counts, axis=1) - counts  # [src, dst]: dst's block in src's send buffer
        start_dst = jnp.cumsum(counts, axis=0) - counts  # [src, dst]: src's block in dst's receive buffer
        there = (start_src[me], counts[me], start_dst[me], counts[:, me])
        back = (start_dst[:, me], counts[:, me], start_src[:, me], counts[me])

        def one(_, buf):
            buf = lax.optimization_barrier(buf)
            if ragged:
                recv = lax.ragged_all_to_all(buf, jnp.zeros((ranks * routes,) + buf.shape[1:], buf.dtype), *there,
                                             axis_name=EP_AXIS)
                return lax.ragged_all_to_all(recv, jnp.zeros_like(buf), *back, axis_name=EP_AXIS)
            if pair:  # the library's own two-rank swap, there and back
                return PAIR_SWAP.move(PAIR_SWAP.move(buf, None, block, EP_AXIS), None, block, EP_AXIS)
            return lax.all_to_all(lax.all_to_all(buf, EP_AXIS, 0, 0, tiled=True), EP_AXIS, 0, 0, tiled=True)

        if pair:  # the peer's block only
            send = send[:block]
        elif not ragged:  # padded layout: P blocks of R rows (dropless) or C rows
            send = jnp.tile(send[:block], (ranks, 1))
        return lax.fori_loop(0, reps, one, send)[:1]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(activation_spec(), PartitionSpec()), out_specs=activation_spec(),
                       check_vma=False)
    return jax.jit(fn), reps, lambda *args: ranks * routes


# ----------------------------------------------------------------------------- torch worker


def _torch_rank(rank: int, world: int, shapes, smoke: bool) -> list[dict]:
    """One rank: NCCL/gloo all_to_all_single pair and the torch EP reference, per shape/routing."""
    import torch
    import torch.distributed as dist

    from parity.reference.ep import ep_combine, ep_dispatch
    from parity.reference.launch import rank_device

    device = rank_device()
    records = []
    for shape in shapes:
        for routing in ROUTINGS:
            idx_all, w_all = make_routing(routing, world, shape.tokens, shape.experts, shape.top_k)
            mine = slice(rank * shape.tokens, (rank + 1) * shape.tokens)
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(shape.tokens, shape.d_model, generator=gen).to(device, torch.bfloat16)
            idx = torch.as_tensor(idx_all[mine], device=device).long()
            w = torch.as_tensor(w_all[mine], device=device)
            counts_PP = send_counts(idx_all, shape.experts, world)
            sends, recvs = counts_PP[rank].tolist(), counts_PP[:, rank].tolist()
            routes = shape.tokens * shape.top_k
            send_buf = x.repeat_interleave(shape.top_k, dim=0)  # one row per route; contents do not matter
            recv_buf = send_buf.new_empty(sum(recvs), shape.d_model)
            back_buf = torch.empty_like(send_buf)

            def nccl():
                dist.all_to_all_single(recv_buf, send_buf, recvs, sends)
                dist.all_to_all_single(back_buf, recv_buf, sends, recvs)

            def reference():
                recv_x, _, _, ctx = ep_dispatch(x, idx, shape.experts, dist.group.WORLD)
                ep_combine(recv_x, w, ctx, shape.tokens, dist.group.WORLD)

            reps = _reps(shape, smoke)
            base = dict(shape=shape.describe(), d_model=shape.d_model, routing=routing, rows_per_rank=float(routes),
                        dropped=0, reps=reps)
            # The NCCL row carries the dropless load of every receiving rank (once per routing).
            loads = dict(recv_rows_P=counts_PP.sum(axis=0).tolist())
            with torch.no_grad():
                for side, fn, extra in (("nccl", nccl, loads), ("torch-ref", reference, {})):
                    rank_seconds = _time_torch(fn, reps, smoke)
                    records.append(dict(base, side=side, strategy=side, seconds=max(rank_seconds),
                                        rank_seconds=rank_seconds, **extra))
    return records


def _time_torch(fn, reps: int, smoke: bool) -> list[float]:
    """Every rank's median seconds per call (the same list on every rank)."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(2 if smoke else 5):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / reps)
    # Every rank measured the same collectives; the table reports the slowest beside the mean.
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [float(t.item()) for t in every]


def _torch_bench(shapes, smoke: bool, ranks: int) -> list[dict]:
    from parity.reference.launch import run_ranks

    per_rank = run_ranks(ranks, _torch_rank, shapes, smoke, backend="gloo" if smoke else "nccl", timeout_s=900)
    for record in per_rank[0]:
        _progress(record)
    return per_rank[0]


# ----------------------------------------------------------------------------- check (JAX worker)


def _jax_check(strategies, size: CheckSize, raw_ragged: bool, ranks: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec

    from moe_jax.dense_reference import moe_reference
    from moe_jax.experts import swiglu_experts
    from moe_jax.parallel import (
        EP_AXIS,
        activation_spec,
        capacity_for,
        ep_combine,
        ep_dispatch,
        expert_spec,
    )
    from moe_jax.routing import Routing
    from moe_jax.testing import rel_err, tolerance

    tol = tolerance(jnp.float32)
    hi = lax.Precision.HIGHEST
    mesh = _ep_mesh(ranks)
    act, rep = activation_spec(), PartitionSpec()
    n, e, k = ranks * size.tokens, size.experts, size.top_k
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    x = jax.random.normal(keys[0], (n, size.d_model), jnp.float32)
    cot = jax.random.normal(keys[1], (n, size.d_model), jnp.float32)
    w_gate = jax.random.normal(keys[2], (e, size.d_ff, size.d_model), jnp.float32) / math.sqrt(size.d_model)
    w_up = jax.random.normal(keys[3], (e, size.d_ff, size.d_model), jnp.float32) / math.sqrt(size.d_model)
    w_down = jax.random.normal(keys[4], (e, size.d_model, size.d_ff), jnp.float32) / math.sqrt(size.d_ff)
    experts = (w_gate, w_up, w_down)
    # Half the balanced load (floored at a row per local expert): zipf and one-rank routing overflow it.
    small_cap = capacity_for(size.tokens, k, ranks, 0.5, local_experts=e // ranks)

    @functools.cache
    def ep_loss(strategy, capacity):
        # ep_dispatch/ep_combine rather than ep_moe: the check needs the plan's keep_TK.
        def body(x, idx, w, cot, wg, wu, wd):
            packed, sizes, plan = ep_dispatch(x, idx, num_experts=e, strategy=strategy, capacity=capacity)
            y_rows = swiglu_experts(packed, sizes, wg, wu, wd, backend="xla", precision=hi)
            y = ep_combine(y_rows, w, plan)
            return lax.psum(jnp.sum(y * cot), EP_AXIS), y, plan.keep_TK

        fn = jax.shard_map(body, mesh=mesh, in_specs=(act, act, act, act) + (expert_spec(),) * 3,
                           out_specs=(rep, act, act), check_vma=False)

        def loss(x, w, wg, wu, wd, idx, cot):
            value, y, keep = fn(x, idx, w, cot, wg, wu, wd)
            return value, (y, keep)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))

    @jax.jit
    def single_device(x, w, wg, wu, wd, idx, cot, keep):
        def loss(x, w, wg, wu, wd):
            y = moe_reference(x, Routing(idx, w * keep, None), wg, wu, wd)
            return jnp.sum(y * cot), y

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, w, wg, wu, wd)

    rows, failures = [], []
    ref_device = jax.devices()[0]
    for routing in ("zipf", "one_rank"):
        idx_np, w_np = make_routing(routing, ranks, size.tokens, e, k, seed=3)
        idx, w = jnp.asarray(idx_np), jnp.asarray(w_np)
        keeps = {}
        for capacity in (None, small_cap):
            for strategy in strategies:
                label = f"{routing} {strategy} C={'dropless' if capacity is None else capacity}"
                try:
                    (_, (y, keep)), grads = ep_loss(strategy, capacity)(x, w, *experts, idx, cot)
                    keep = np.asarray(keep)
                    args = jax.device_put((x, w, *experts, idx, cot, jnp.asarray(keep, jnp.float32)), ref_device)
                    (_, y_ref), grads_ref = single_device(*args)
                    # rel_err is inf on a non-finite output: the row fails.
                    errs = {name: rel_err(a, b) for name, a, b in zip(
                        ("y", "dx", "dweights", "dw_gate", "dw_up", "dw_down"), (y, *grads), (y_ref, *grads_ref))}
                    dropped = int((~keep).sum())
                    ok = all(v <= tol for v in errs.values()) and (capacity is not None or dropped == 0)
                    if capacity is not None:
                        keeps.setdefault(capacity, keep)
                        ok = ok and np.array_equal(keeps[capacity], keep)
                    rows.append(dict(case=label, dropped=dropped, ok=ok, **errs))
                except Exception as err:
                    rows.append(dict(case=label, ok=False, error=f"{type(err).__name__}: {str(err)[:300]}"))
                if not rows[-1]["ok"]:
                    failures.append(label)
                print(_format_check_row(rows[-1]), flush=True)
    result = dict(checks=rows, failures=failures)
    if raw_ragged:
        result["raw_ragged_all_to_all_grad"] = _raw_ragged_grad_finding(mesh)
    return result


def _raw_ragged_grad_finding(mesh) -> list[dict]:
    """Does `jax.grad` through a bare `jax.lax.ragged_all_to_all` give the exact gradient?

    Rank s sends `sizes[s][d]` rows, from operand offset 1 + (earlier blocks), into rank d's
    output packed in source order from row 0. For loss = sum(out * cot) the exact gradients are:
    d operand[s][row sent to d at j] = cot[d][its landing row], 0 for unsent rows; d output (the
    buffer the collective writes into) = cot on rows nobody writes, 0 on written rows.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec

    from moe_jax.parallel import EP_AXIS

    ranks = mesh.shape[EP_AXIS]
    sizes = 1 + (np.arange(ranks)[:, None] + np.arange(ranks)[None, :]) % 2  # [src, dst], 1 or 2 rows
    longest = int(sizes.sum(axis=1).max())
    spec = PartitionSpec(EP_AXIS)
    findings = []
    for label, in_rows, out_rows in (("operand > output", 2 * longest + 2, longest), ("operand == output", longest + 1, longest + 1),
                                     ("operand < output", longest + 1, 2 * longest)):
        in_off = 1 + np.cumsum(sizes, axis=1) - sizes  # [src, dst]
        out_off = np.cumsum(sizes, axis=0) - sizes  # [src, dst]: src's block in dst's output
        rng = np.random.default_rng(0)
        operand = rng.standard_normal((ranks, in_rows, 3)).astype(np.float32)
        output = rng.standard_normal((ranks, out_rows, 3)).astype(np.float32)
        cot = rng.standard_normal((ranks, out_rows, 3)).astype(np.float32)
        want_op, want_out = np.zeros_like(operand), cot.copy()
        for s in range(ranks):
            for d in range(ranks):
                for j in range(sizes[s, d]):
                    want_op[s, in_off[s, d] + j] = cot[d, out_off[s, d] + j]
                    want_out[d, out_off[s, d] + j] = 0.0
        send_sizes, recv_sizes = sizes, sizes.T  # recv_sizes[d][s] = sizes[s][d]

        def body(op, out, c, i_off, s_sz, o_off, r_sz):
            y = lax.ragged_all_to_all(op[0], out[0], i_off[0], s_sz[0], o_off[0], r_sz[0], axis_name=EP_AXIS)
            return lax.psum(jnp.sum(y * c[0]), EP_AXIS)

        fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 7, out_specs=PartitionSpec(), check_vma=False)
        ints = [jnp.asarray(a, jnp.int32) for a in (in_off, send_sizes, out_off, recv_sizes)]
        record = dict(case=label, operand_rows=in_rows, output_rows=out_rows)
        try:
            g_op, g_out = jax.jit(jax.grad(fn, argnums=(0, 1)))(jnp.asarray(operand), jnp.asarray(output),
                                                               jnp.asarray(cot), *ints)
            record.update(
                d_operand_max_err=float(np.max(np.abs(np.asarray(g_op) - want_op))),
                d_output_max_err=float(np.max(np.abs(np.asarray(g_out) - want_out))),
            )
            record["matches"] = record["d_operand_max_err"] < 1e-6 and record["d_output_max_err"] < 1e-6
        except Exception as err:
            record.update(matches=False, error=f"{type(err).__name__}: {str(err)[:300]}")
        findings.append(record)
        print(f"  raw ragged_all_to_all grad, {label}: " + (
            f"d operand max err {record['d_operand_max_err']:.2e}, d output max err {record['d_output_max_err']:.2e}"
            if "error" not in record else record["error"]) + (" (matches)" if record["matches"] else " (MISMATCH)"),
            flush=True)
    return findings


def _format_check_row(row: dict) -> str:
    if "error" in row:
        return f"  {row['case']:<36} ERROR {row['error']}"
    errs = " ".join(f"{k}={row[k]:.1e}" for k in ("y", "dx", "dweights", "dw_gate", "dw_up", "dw_down"))
    return f"  {row['case']:<36} dropped={row['dropped']:<4} {errs} {'ok' if row['ok'] else 'FAIL'}"


# ----------------------------------------------------------------------------- orchestration


def _progress(record: dict) -> None:
    if "error" in record:
        print(f"  {record['side']:<9} {record['strategy']:<16} {record['shape']} {record['routing']}: "
              f"{record['error']}", flush=True)
    else:
        print(f"  {record['side']:<9} {record['strategy']:<16} {record['shape']} {record['routing']}: "
              f"{record['seconds'] * 1e6:.1f} us", flush=True)


def _worker_env(variant: str, smoke: bool, ranks: int) -> dict:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        flags += f" --xla_force_host_platform_device_count={ranks}"
    if variant == "decomposer":
        flags += " " + DECOMPOSER_FLAG
    env["XLA_FLAGS"] = flags.strip()
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def _run_worker(kind: str, variant: str, smoke: bool, ranks: int, timeout_s: float = 900) -> dict:
    """Run `--worker kind` in a fresh interpreter (XLA flags are read once per process)."""
    with tempfile.TemporaryDirectory(prefix="ep_bench_") as folder:
        out = os.path.join(folder, "out.json")
        cmd = [sys.executable, "-m", "benchmarks.ep", "--worker", kind, "--variant", variant, "--out", out,
               "--ranks", str(ranks)]
        if smoke:
            cmd.append("--cpu-smoke")
        print(f"--- {kind} worker ({variant}, {ranks} ranks{', cpu smoke' if smoke else ''})", flush=True)
        proc = subprocess.run(cmd, env=_worker_env(variant, smoke, ranks), timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out):
            return dict(error=f"{kind}/{variant} worker exited with code {proc.returncode}")
        with open(out) as f:
            return json.load(f)


def _worker(kind: str, variant: str, smoke: bool, out: str, ranks: int) -> None:
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    if kind == "jax-bench":
        padded = tuple(v for v in PADDED_VARIANTS if ranks == 2 or v.exchange != "ppermute")
        if variant == "decomposer":
            variants = DECOMPOSER_VARIANTS
        elif smoke or variant == "padded":  # XLA:CPU has no ragged_all_to_all
            variants = padded
        else:
            variants = padded + RAGGED_VARIANTS
        result = dict(records=_jax_bench(shapes, variants, smoke, ranks))
    elif kind == "torch-bench":
        result = dict(records=_torch_bench(shapes, smoke, ranks))
    elif kind == "jax-check":
        strategies = ["ragged"] if variant == "decomposer" else (["padded"] if smoke else ["padded", "ragged"])
        result = _jax_check(strategies, SMOKE_CHECK if smoke else GPU_CHECK, raw_ragged=not smoke, ranks=ranks)
    else:
        raise ValueError(f"unknown worker {kind!r}")
    result["env"] = _environment(kind, ranks)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def _environment(kind: str, ranks: int) -> dict:
    env = dict(xla_flags=os.environ.get("XLA_FLAGS", ""))
    if kind.startswith("jax"):
        import jax

        env.update(jax=jax.__version__, devices=[str(d) for d in jax.devices()[:ranks]])
    else:
        import torch

        env.update(torch=torch.__version__, cuda=torch.version.cuda)
    return env


def _table(records: list[dict]) -> str:
    nccl = {(r["shape"], r["routing"]): r["seconds"] for r in records if r["side"] == "nccl" and "seconds" in r}
    lines = [f"{'shape':<36} {'routing':<9} {'impl':<32} {'time us':>10} {'GB/s/GPU':>9} {'x NCCL':>7} "
             f"{'dropped':>8} {'slow/mean':>9}"]
    order = {"nccl": 0, "torch-ref": 1, "xla": 2, "ours": 3}
    for r in sorted(records, key=lambda r: (r["shape"], r["routing"], order[r["side"]], r["strategy"])):
        name = f"{r['side']} {r['strategy']}" if r["side"] in ("ours", "xla") else r["strategy"]
        if "error" in r:
            lines.append(f"{r['shape']:<36} {r['routing']:<9} {name:<32} failed: {r['error'][:60]}")
            continue
        gbps = 2 * r["rows_per_rank"] * r["d_model"] * 2 / r["seconds"] / 1e9  # bf16: 2 bytes
        base = nccl.get((r["shape"], r["routing"]))
        ratio = f"{r['seconds'] / base:7.2f}" if base else f"{'-':>7}"
        ranks = r.get("rank_seconds")
        tail = f"{max(ranks) / statistics.mean(ranks):9.2f}" if ranks else f"{'-':>9}"
        lines.append(f"{r['shape']:<36} {r['routing']:<9} {name:<32} {r['seconds'] * 1e6:10.1f} {gbps:9.1f} "
                     f"{ratio} {int(r['dropped']):8d} {tail}")
    loads = {(r["shape"], r["routing"]): r["recv_rows_P"] for r in records if "recv_rows_P" in r}
    if loads:
        lines.append("received rows per rank (dropless), max / mean:")
        lines += [f"  {shape:<36} {routing:<9} {max(rows) / statistics.mean(rows):.2f}  ({rows})"
                  for (shape, routing), rows in sorted(loads.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="forward/gradient checks instead of timing")
    parser.add_argument("--ranks", type=int, default=DEFAULT_RANKS,
                        help="ep size P: GPUs (or host devices with --cpu-smoke) and torch processes (default 2)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on P host devices, padded only")
    parser.add_argument("--skip-ragged", action="store_true",
                        help="time the padded strategy and all_to_all only (ragged_all_to_all takes minutes)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error(f"--ranks must be at least 2 (expert parallelism over one rank exchanges nothing); got {args.ranks}")
    experts = sorted({s.experts for s in (SMOKE_SHAPES if args.cpu_smoke else GPU_SHAPES)}
                     | {(SMOKE_CHECK if args.cpu_smoke else GPU_CHECK).experts})
    if any(e % args.ranks for e in experts):
        parser.error(f"--ranks {args.ranks} must divide the expert counts of every shape, {experts}: "
                     "every rank owns the same number of experts (e.g. 2, 4 or 8).")
    if args.worker:
        _worker(args.worker, args.variant, args.cpu_smoke, args.out, args.ranks)
        return 0

    smoke = args.cpu_smoke
    variants = ["default"] + ([] if smoke else ["decomposer"])
    t0 = time.time()
    if args.check:
        results = {v: _run_worker("jax-check", v, smoke, args.ranks) for v in variants}
        failed = []
        for v, r in results.items():
            failed += [f"{v}: {r['error']}"] if "error" in r else [f"{v}: {c}" for c in r["failures"]]
        findings = {v: r.get("raw_ragged_all_to_all_grad") for v, r in results.items()}
        for v, f in findings.items():
            if f:
                bad = [x["case"] for x in f if not x["matches"]]
                print(f"finding ({v}): jax.grad through raw ragged_all_to_all "
                      + (f"is WRONG for: {', '.join(bad)}" if bad else "matches the exact gradient in every case"))
        print(f"check {'FAILED: ' + '; '.join(failed) if failed else 'passed'} ({time.time() - t0:.0f} s)")
        payload = dict(mode="check", cpu_smoke=smoke, ranks=args.ranks, results=results)
    else:
        records, failed = [], []
        jax_variants = ["padded"] if args.skip_ragged else variants
        for kind, variant in [("jax-bench", v) for v in jax_variants] + [("torch-bench", "default")]:
            result = _run_worker(kind, variant, smoke, args.ranks)
            if "error" in result:  # a whole worker died (one failing row is only reported)
                print(f"  {result['error']}", flush=True)
                failed.append(result["error"])
            records += result.get("records", [])
        print(_table(records))
        print(f"({time.time() - t0:.0f} s)" + (f"; FAILED workers: {'; '.join(failed)}" if failed else ""))
        payload = dict(mode="bench", cpu_smoke=smoke, ranks=args.ranks, records=records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
