"""Run a function on N freshly spawned `torch.distributed` ranks and collect what each returns.

`run_ranks(world_size, fn, *args)` starts `world_size` processes with the "spawn" start method,
initialises the default process group in each from a file store in a private temporary folder
(no port to pick, so no race for a free port), calls `fn(rank, world_size, *args)`, and returns
the per-rank results in rank order. `fn` and `args` must be picklable (a module-level function,
not a lambda); results must be picklable and are moved to the CPU before they travel back.

Backend and devices: `backend=None` picks "nccl" when CUDA is available with at least
`world_size` GPUs (rank r then uses `cuda:r`) and "gloo" otherwise (CPU tensors). Under gloo the
children compute on the CPU, so they get `TRITON_INTERPRET=1` unless the caller's environment
sets it explicitly. `rank_device()` tells `fn` which device to put its tensors on.

Failures: an exception in any rank stops all ranks and is raised here as `RankFailed` carrying
the rank and the child's traceback; a rank killed by a signal is reported the same way; when the
ranks have not all finished after `timeout_s` seconds they are terminated and `TimeoutError` is
raised, so a hang (say, mismatched collectives) becomes an error. The process group's own
timeout is set to the same value, so a stuck collective also fails inside the child.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_POLL_S = 0.05


class RankFailed(RuntimeError):
    """A rank of `run_ranks` raised or died; `rank` names it, the message holds its traceback."""

    def __init__(self, rank: int, world_size: int, detail: str):
        super().__init__(f"rank {rank} of {world_size} failed:\n{detail}")
        self.rank = rank


def pick_backend(world_size: int) -> str:
    """"nccl" when CUDA offers at least `world_size` GPUs, else "gloo"."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, the CPU otherwise."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_cpu(value: Any) -> Any:
    """Detached CPU copies of the tensors inside nested lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _result_path(folder: str, rank: int) -> pathlib.Path:
    return pathlib.Path(folder) / f"result_{rank}.pt"


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    folder: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    """Child body: join the group, run `fn`, save its CPU result for the parent."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        # N ranks share the host's cores; more threads each would only oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        backend,
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # On an exception the process exits without destroying the group: peers may still be inside
    # a collective with this rank, and the parent terminates them anyway.
    result = _to_cpu(fn(rank, world_size, *args))
    final = _result_path(folder, rank)
    partial = final.with_suffix(".partial")
    torch.save(result, partial)
    os.replace(partial, final)  # the parent never sees half a file
    dist.destroy_process_group()


@contextlib.contextmanager
def _child_environment(backend: str):
    """Environment the children inherit at spawn: the interpreter for CPU (gloo) ranks."""
    override = backend == "gloo" and "TRITON_INTERPRET" not in os.environ
    if override:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if override:
            del os.environ["TRITON_INTERPRET"]


def _stop(context: mp.ProcessContext) -> list[int]:
    """Terminate (then kill) the ranks still running; return their ranks."""
    alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
    for r in alive:
        context.processes[r].terminate()
    for r in alive:
        context.processes[r].join(5)
        if context.processes[r].is_alive():
            context.processes[r].kill()
            context.processes[r].join()
    return alive


def _wait(context: mp.ProcessContext, world_size: int, timeout_s: float) -> None:
    """Join every rank or raise RankFailed / TimeoutError (no rank left running either way)."""
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=_POLL_S):
            if time.monotonic() > deadline:
                alive = _stop(context)
                raise TimeoutError(f"ranks {alive} of {world_size} still running after {timeout_s:g} s; terminated")
    except mp.ProcessRaisedException as err:
        # ProcessContext.join has already terminated the other ranks.
        raise RankFailed(err.error_index, world_size, str(err)) from None
    except mp.ProcessExitedException as err:
        raise RankFailed(err.error_index, world_size, str(err)) from None


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; results in rank order.

    `backend`: None (auto, see `pick_backend`), "gloo" or "nccl" (needs `world_size` GPUs).
    Raises RankFailed (with the rank and its traceback) if a rank fails, TimeoutError after
    `timeout_s` seconds.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    backend = pick_backend(world_size) if backend is None else backend
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < world_size):
        raise ValueError(f"nccl with {world_size} ranks needs {world_size} CUDA devices")

    with tempfile.TemporaryDirectory(prefix="run_ranks_") as folder:
        with _child_environment(backend):
            context = mp.start_processes(
                _rank_main,
                args=(world_size, backend, folder, timeout_s, fn, args),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
        _wait(context, world_size, timeout_s)
        return [torch.load(_result_path(folder, r), weights_only=False) for r in range(world_size)]
