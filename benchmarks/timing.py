"""Device timing for JAX and PyTorch callables, measured the same way.

Both sides run `reps` calls back to back over rotating input sets (so repeated calls do not hit a
warm L2) with one host synchronisation per trial, after warm-up; the per-call time is the median
over trials of trial time / reps. JAX calls are traced into one program per trial; torch calls are
captured in a CUDA graph when possible, so neither side pays per-call host dispatch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def compile_jax(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, reps: int = 20):
    """Compile `reps` back-to-back calls of `fn` over rotating `arg_sets` into one executable.

    Each call's inputs pass through an optimization barrier together with the previous call's
    output: XLA cannot merge identical calls (CSE would otherwise time one call `reps` times
    over), the calls run in order, and only two outputs are alive at once.

    Returns `(run, reps)` where `run()` executes them once; `run(other_sets)` runs the same
    executable on other arrays of the same shapes (e.g. another histogram's `group_sizes`).
    Compiling is thread-safe, so callers may build many candidates in parallel and time them one
    by one.
    """
    n = len(arg_sets)

    def many(sets):
        out, firsts = None, []
        for i in range(reps):
            args = sets[i % n]
            if out is not None:
                # Both barrier outputs are used, or XLA drops the barrier and merges the calls.
                args, out = jax.lax.optimization_barrier((args, out))
                firsts.append(_touch(out))
            out = fn(*args)
        firsts.append(_touch(out))
        return jnp.stack(firsts)

    compiled = jax.jit(many).lower(arg_sets).compile()
    return (lambda sets=arg_sets: compiled(sets)), reps


def _touch(out):
    """One element of every output leaf, so no output (and none of its producers) is dead code."""
    return sum(leaf.ravel()[0].astype(jnp.float32) for leaf in jax.tree.leaves(out))


def time_compiled(run: Callable[[], Any], reps: int, *, trials: int = 7) -> float:
    """Median seconds per call of `run()`, which makes `reps` calls (a `compile_jax` executable or
    any jitted loop), after two warm-up runs."""
    jax.block_until_ready(run())
    jax.block_until_ready(run())
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def time_torch(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, reps: int = 20, trials: int = 7,
               graph: bool = True) -> float:
    """Median seconds per call of `fn(*args)`, with CUDA events; CUDA-graph replay when `graph`."""
    import torch

    n = len(arg_sets)

    def body():
        for i in range(reps):
            fn(*arg_sets[i % n])

    body()  # warm-up (autotuning, allocator)
    torch.cuda.synchronize()
    run = body
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            run = g.replay
        except Exception:  # ops that cannot be captured (host syncs) run eagerly
            torch.cuda.synchronize()
            run = body
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(samples)


def run_meta(command: str) -> dict:
    """Date, device and library versions of a benchmark run, and its `command`, for result files."""
    import datetime
    import platform

    import torch

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, jax=jax.__version__, torch=torch.__version__,
                python=platform.python_version(), command=command)
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta
