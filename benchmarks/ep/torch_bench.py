"""The torch rows of the EP benchmark, in P spawned processes (`parity.reference.launch.run_ranks`):
"nccl", two `torch.distributed.all_to_all_single` calls with the routing's split sizes (gloo in
the CPU smoke), and "torch-ref", the torch EP reference `parity.reference.ep` (counts exchange,
host sync, metadata and rows, regroup). Every rank times itself; a record carries every rank's
median (`rank_seconds`) and reports the slowest (`seconds`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.ep.routing import ROUTINGS, make_routing, reps_for, send_counts
from benchmarks.ep.table import progress
from parity.reference.ep import ep_combine, ep_dispatch
from parity.reference.launch import rank_device, run_ranks

__all__ = ["torch_bench", "torch_rank"]


def torch_bench(shapes, smoke: bool, ranks: int) -> list[dict]:
    """Every shape and routing on `ranks` processes (NCCL, or gloo with `smoke`); rank 0's records."""
    per_rank = run_ranks(ranks, torch_rank, shapes, smoke, backend="gloo" if smoke else "nccl", timeout_s=900)
    for record in per_rank[0]:
        progress(record)
    return per_rank[0]


def torch_rank(rank: int, world: int, shapes, smoke: bool) -> list[dict]:
    """One rank: NCCL/gloo all_to_all_single pair and the torch EP reference, per shape/routing."""
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

            reps = reps_for(shape, smoke)
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
