"""Command line of the EP benchmark: arguments, the worker processes and the run that ties them
together. Every JAX run is a fresh interpreter (`--worker jax-bench`), since XLA reads its flags
(the ragged_all_to_all decomposer, the host-device count of the CPU smoke) once per process; the
torch rows run in another (`--worker torch-bench`), which spawns the P ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.ep.routing import GPU_SHAPES, SMOKE_SHAPES
from benchmarks.ep.table import table

__all__ = ["DECOMPOSER_FLAG", "DEFAULT_RANKS", "main", "run_worker", "worker", "worker_env"]

DEFAULT_RANKS = 2
DECOMPOSER_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"


def worker_env(variant: str, smoke: bool, ranks: int) -> dict:
    """The environment of a worker: host devices and CPU for the smoke, the decomposer flag for
    the "decomposer" variant."""
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


def run_worker(kind: str, variant: str, smoke: bool, ranks: int, timeout_s: float = 900,
               chunks: tuple[int, ...] = ()) -> dict:
    """Run `--worker kind` in a fresh interpreter; its JSON result, or `{"error": ...}`."""
    with tempfile.TemporaryDirectory(prefix="ep_bench_") as folder:
        out = os.path.join(folder, "out.json")
        cmd = [sys.executable, "-m", "benchmarks.ep", "--worker", kind, "--variant", variant, "--out", out,
               "--ranks", str(ranks)]
        if chunks:
            cmd += ["--chunks", ",".join(map(str, chunks))]
        if smoke:
            cmd.append("--cpu-smoke")
        print(f"--- {kind} worker ({variant}, {ranks} ranks{', cpu smoke' if smoke else ''})", flush=True)
        proc = subprocess.run(cmd, env=worker_env(variant, smoke, ranks), timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out):
            return dict(error=f"{kind}/{variant} worker exited with code {proc.returncode}")
        with open(out) as f:
            return json.load(f)


def worker(kind: str, variant: str, smoke: bool, out: str, ranks: int, chunks: tuple[int, ...] = ()) -> None:
    """Inside a worker: time its rows and write `{"records": [...], "env": {...}}` to `out`."""
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    if kind == "jax-bench":
        from benchmarks.ep.jax_bench import (
            DECOMPOSER_VARIANTS,
            PADDED_VARIANTS,
            RAGGED_VARIANTS,
            chunk_variants,
            jax_bench,
        )

        padded = tuple(v for v in PADDED_VARIANTS if ranks == 2 or v.exchange != "ppermute")
        padded += chunk_variants(chunks)
        if variant == "decomposer":
            variants = DECOMPOSER_VARIANTS
        elif smoke or variant == "padded":  # XLA:CPU has no ragged_all_to_all
            variants = padded
        else:
            variants = padded + RAGGED_VARIANTS + chunk_variants(chunks, ("ragged",))
        result = dict(records=jax_bench(shapes, variants, smoke, ranks))
    elif kind == "torch-bench":
        from benchmarks.ep.torch_bench import torch_bench

        result = dict(records=torch_bench(shapes, smoke, ranks))
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


def _parser() -> argparse.ArgumentParser:
    import benchmarks.ep

    parser = argparse.ArgumentParser(prog="python -m benchmarks.ep", description=benchmarks.ep.__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=DEFAULT_RANKS,
                        help="ep size P: GPUs (or host devices with --cpu-smoke) and torch processes (default 2)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on P host devices, padded only")
    parser.add_argument("--skip-ragged", action="store_true",
                        help="time the padded strategy and all_to_all only (ragged_all_to_all takes minutes)")
    parser.add_argument("--chunks", type=_chunk_list, default=(),
                        help="comma-separated chunk counts, e.g. 1,2,4: add rows of ep_moe with one grouped GEMM "
                             "as the experts, dropless, its exchange in that many chunks (EPOptions(chunks=n); "
                             "1 is the unchunked baseline of the same work)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def _chunk_list(text: str) -> tuple[int, ...]:
    """`--chunks`: "1,2,4" -> (1, 2, 4), every entry an int >= 1."""
    try:
        chunks = tuple(int(part) for part in text.split(","))
    except ValueError:
        chunks = ()
    if not chunks or min(chunks) < 1:
        raise argparse.ArgumentTypeError(f"--chunks takes comma-separated ints >= 1 (e.g. 1,2,4); got {text!r}")
    return chunks


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error(f"--ranks must be at least 2 (expert parallelism over one rank exchanges nothing); got {args.ranks}")
    experts = sorted({s.experts for s in (SMOKE_SHAPES if args.cpu_smoke else GPU_SHAPES)})
    if any(e % args.ranks for e in experts):
        parser.error(f"--ranks {args.ranks} must divide the expert counts of every shape, {experts}: "
                     "every rank owns the same number of experts (e.g. 2, 4 or 8).")
    if args.worker:
        worker(args.worker, args.variant, args.cpu_smoke, args.out, args.ranks, args.chunks)
        return 0

    smoke = args.cpu_smoke
    t0 = time.time()
    records, failed = [], []
    jax_variants = ["padded"] if args.skip_ragged else ["default"] + ([] if smoke else ["decomposer"])
    for kind, variant in [("jax-bench", v) for v in jax_variants] + [("torch-bench", "default")]:
        result = run_worker(kind, variant, smoke, args.ranks, chunks=args.chunks if kind == "jax-bench" else ())
        if "error" in result:  # a whole worker died (one failing row is only reported)
            print(f"  {result['error']}", flush=True)
            failed.append(result["error"])
        records += result.get("records", [])
    print(table(records))
    print(f"({time.time() - t0:.0f} s)" + (f"; FAILED workers: {'; '.join(failed)}" if failed else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(mode="bench", cpu_smoke=smoke, ranks=args.ranks, records=records), f, indent=1)
    return 1 if failed else 0
