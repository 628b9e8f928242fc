"""The grouped GEMM's backends side by side, per kernel, on one GPU (GPU only).

    python -m benchmarks.backends [--quick] [--json PATH]

For each prefill shape and skew of `benchmarks.shapes` (balanced and Zipf at the same rows), and the
decode buckets, times on the same inputs in one process:
- forward `gmm`: `pallas_triton` (the shape table's candidate), `triton` (official Triton through
  jax_triton) at the table's tiles and at each tile of `TRITON_FWD`; `torch._grouped_mm`;
- input gradient (`gmm` with `transpose_rhs=False`): both backends; torch's is the same call as
  its forward on the transposed weight view;
- weight gradient `tgmm`: both backends, at the table's tiles and each of `TRITON_WGRAD`; the
  table's Triton kernel launched from torch by Triton's runtime (`wgrad triton-via-torch`: the
  kernel without jax_triton and XLA);
  `torch._grouped_mm(dy^T, x, offs)` (what torch autograd runs);
- forward + backward `grouped_linear`: both backends; torch autograd.
Every backend's output is checked against `pallas_triton`'s (relative error in the records).
Prints a table of TFLOP/s and ratios to torch, last; `--json` keeps every time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import shapes as S
from benchmarks.gmm import (attempt, compile_all, encode_config, make_inputs, reps_for, to_torch,
                            torch_forward_backward, torch_offsets)
from benchmarks.timing import run_meta, time_compiled, time_torch
from moe_jax.ops import MosaicConfig, TileConfig, gmm, gmm_config, grouped_linear, tgmm, tgmm_config
from moe_jax.ops.gmm.schedule import lane_sizes
from moe_jax.ops.gmm.triton import tgmm_tiles as triton_tgmm_tiles
from moe_jax.ops.gmm.triton.launch import tgmm_launch

TRITON_FWD = [
    TileConfig(128, 256, 64, 8, 3, 8), TileConfig(128, 128, 64, 4, 4, 8), TileConfig(256, 128, 64, 8, 3, 8),
    TileConfig(128, 128, 64, 8, 4, 8),
]
TRITON_WGRAD = [TileConfig(64, 128, 128, 8, 4, 1), TileConfig(64, 256, 128, 8, 3, 1), TileConfig(128, 128, 64, 8, 3, 1),
                TileConfig(32, 128, 128, 8, 4, 1), TileConfig(32, 256, 128, 8, 3, 1), TileConfig(32, 128, 256, 8, 3, 1),
                TileConfig(64, 128, 256, 8, 3, 1), TileConfig(32, 128, 128, 4, 4, 1), TileConfig(16, 128, 128, 4, 5, 1)]
MOSAIC = [MosaicConfig(),  # the 3-stage default, which `mosaic_config` runs at long K
          MosaicConfig(128, 128, 64, 3, pipeline_across_items=True), MosaicConfig(128, 128, 64, 2),
          MosaicConfig(128, 128, 64, 2, pipeline_across_items=True), MosaicConfig(128, 64, 64, 4),
          MosaicConfig(128, 64, 64, 4, pipeline_across_items=True), MosaicConfig(128, 128, 64, 4, out_buffer_rows=64),
          MosaicConfig(128, 128, 64, 4, pipeline_across_items=True, out_buffer_rows=64)]


def _mosaic_takes(m, n, k, dtype, config) -> bool:
    """Whether the `mosaic_gpu` backend supports the forward `[m, k] x [E, n, k]` with `config`."""
    from moe_jax.ops.gmm.mosaic_gpu.config import shape_support, smem_bytes
    from moe_jax.ops.platform import device_facts

    return (shape_support(m, n, k, dtype, config) is None
            and smem_bytes(config, dtype, dtype) <= device_facts().smem_per_block)


def _jobs(shape, x, w, dy, gs, backends, kinds, variants):
    fwd = gmm_config(shape.m, shape.n, shape.k, shape.e)
    dgrad = gmm_config(shape.m, shape.k, shape.n, shape.e)
    wgrad = tgmm_config(shape.m, shape.n, shape.k, shape.e)
    reps = reps_for(shape.m * shape.n * 2, cap=10)
    wreps = max(2, min(reps, reps_for(shape.e * shape.n * shape.k * 2)))

    def fb(backend):
        def run(x, w, gs, dy):
            y, vjp = jax.vjp(lambda x, w: grouped_linear(x, w, gs, backend=backend), x, w)
            return (y, *vjp(dy))
        return run

    jobs = {}
    for b in backends:
        jobs[f"fwd {b}"] = (lambda x, w, gs, b=b: gmm(x, w, gs, backend=b), (x, w, gs), reps)
        jobs[f"dgrad {b}"] = (lambda d, w, gs, b=b: gmm(d, w, gs, transpose_rhs=False, backend=b), (dy, w, gs), reps)
        jobs[f"wgrad {b}"] = (lambda x, d, gs, b=b: tgmm(x, d, gs, backend=b), (x, dy, gs), wreps)
        jobs[f"fb {b}"] = (fb(b), (x, w, gs, dy), max(2, wreps // 2))
    if "triton" in backends:
        for t in TRITON_FWD:
            jobs[f"fwd triton {_name(t)}"] = (lambda x, w, gs, t=t: gmm(x, w, gs, backend="triton", config=t),
                                              (x, w, gs), reps)
        for t in TRITON_WGRAD:
            jobs[f"wgrad triton {_name(t)}"] = (lambda x, d, gs, t=t: tgmm(x, d, gs, backend="triton", config=t),
                                                (x, dy, gs), wreps)
    if "mosaic_gpu" in backends:
        for c in MOSAIC:
            if _mosaic_takes(shape.m, shape.n, shape.k, x.dtype, c):
                jobs[f"fwd mosaic_gpu {_mname(c)}"] = (
                    lambda x, w, gs, c=c: gmm(x, w, gs, backend="mosaic_gpu", config=c), (x, w, gs), reps)
            if _mosaic_takes(shape.m, shape.k, shape.n, x.dtype, c):
                jobs[f"dgrad mosaic_gpu {_mname(c)}"] = (
                    lambda d, w, gs, c=c: gmm(d, w, gs, transpose_rhs=False, backend="mosaic_gpu", config=c),
                    (dy, w, gs), reps)
    configs = {"fwd": encode_config(fwd), "dgrad": encode_config(dgrad), "wgrad": encode_config(wgrad),
               "wgrad_triton": encode_config(triton_tgmm_tiles(shape.m, shape.n, shape.k, shape.e))}
    jobs = {key: job for key, job in jobs.items() if key.split()[0] in kinds and (variants or len(key.split()) == 2)}
    return jobs, configs


def _mname(c: MosaicConfig) -> str:
    options = ("a" if c.pipeline_across_items else "") + (f"b{c.out_buffer_rows}" if c.out_buffer_rows else "")
    return f"{c.tile_m}x{c.cta_n}x{c.tile_k}s{c.max_concurrent_steps}{options}"


def _name(t: TileConfig) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"


def _check(jobs) -> dict:
    """Relative error of each job's output against the pallas_triton job of its kernel, on
    the first 4096 rows (forward, input gradient) or 4 experts (weight gradient)."""
    def head(out):
        return out[:4] if out.ndim == 3 else out[:4096]

    refs, errs = {}, {}
    for key, (fn, args, _) in jobs.items():
        kind, backend = key.split()[:2]
        if kind == "fb":
            continue
        out = attempt(lambda: head(jax.jit(fn)(*args)).astype(jnp.float32))
        if backend == "pallas_triton":
            refs[kind] = out
        elif out is not None and refs.get(kind) is not None:
            errs[key] = float(jnp.linalg.norm(out - refs[kind]) / jnp.maximum(jnp.linalg.norm(refs[kind]), 1e-30))
    return errs


def _triton_wgrad_from_torch(shape, tx, tdy, counts):
    """A call of the `triton` backend's weight-gradient kernel at its rule's tiles,
    launched by Triton's own runtime on the torch tensors (the same kernel as `wgrad triton`, without
    jax_triton and XLA around it)."""
    import torch

    from moe_jax.ops.gmm.triton.kernels import tgmm_kernel

    launch = tgmm_launch(m=shape.m, n=shape.n, k=shape.k, num_groups=shape.e, dtype=jnp.bfloat16, precision=None,
                         interpret=False, tiles=triton_tgmm_tiles(shape.m, shape.n, shape.k, shape.e))
    sizes = to_torch(lane_sizes(jnp.asarray(counts, jnp.int32), shape.m))
    out = torch.empty((shape.e, shape.n, shape.k), dtype=tx.dtype, device="cuda")
    return lambda: tgmm_kernel[launch.grid](sizes, sizes, tx, tdy, out, num_warps=launch.num_warps,
                                            num_stages=launch.num_stages, **launch.constants)


def _torch_times(shape, x, w, dy, counts, reps, backends):
    import torch

    tx, tw, tdy = (to_torch(a) for a in (x, w, dy))
    offs = torch_offsets(counts)
    t = {}
    if "triton" in backends:
        t["wgrad triton-via-torch"] = attempt(time_torch, _triton_wgrad_from_torch(shape, tx, tdy, counts), [()],
                                              reps=max(2, reps // 2))
    t["fwd torch"] = time_torch(lambda: torch._grouped_mm(tx, tw.transpose(-2, -1), offs=offs), [()], reps=reps)
    t["dgrad torch"] = time_torch(lambda: torch._grouped_mm(tdy, tw, offs=offs), [()], reps=reps)
    t["wgrad torch"] = attempt(time_torch, lambda: torch._grouped_mm(tdy.t(), tx, offs=offs), [()],
                            reps=max(2, reps // 2))
    t["fb torch"] = attempt(time_torch, torch_forward_backward(tx, tw, tdy, offs), [()], reps=max(2, reps // 3),
                            graph=False)
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the first prefill shape only")
    p.add_argument("--shapes", default=None, help="comma-separated indices into the prefill shapes (default all)")
    p.add_argument("--backends", default="pallas_triton,triton,mosaic_gpu",
                   help="comma-separated backends to time (each with its tile variants)")
    p.add_argument("--kernels", default="fwd,dgrad,wgrad,fb", help="comma-separated subset of fwd,dgrad,wgrad,fb")
    p.add_argument("--no-variants", action="store_true", help="each backend at its default tiles only")
    p.add_argument("--no-check", action="store_true", help="skip the error check (it compiles every job twice)")
    p.add_argument("--jobs", default=None,
                   help="a regular expression: only the jobs whose key (e.g. 'fwd mosaic_gpu 128x256x64s2a') it finds")
    p.add_argument("--skews", default="balanced,zipf", help="comma-separated subset of balanced,zipf")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    kinds = args.kernels.split(",")
    skews = args.skews.split(",")
    if set(skews) - {"balanced", "zipf"}:
        p.error(f"--skews {args.skews!r}: name balanced, zipf or both")
    import torch

    cases = []
    picked = S.PREFILL if args.shapes is None else [S.PREFILL[int(i)] for i in args.shapes.split(",")]
    for shape in (S.PREFILL[:1] if args.quick else picked):
        x, (w,), dy, _ = make_inputs(shape, S.balanced_counts(shape.m, shape.e))
        for skew in skews:
            counts = S.balanced_counts(shape.m, shape.e) if skew == "balanced" else S.zipf_counts(
                shape.m, shape.e, cap=shape.tokens)
            jobs, configs = _jobs(shape, x, w, dy, jnp.asarray(counts, jnp.int32), backends, kinds, not args.no_variants)
            if args.jobs:
                jobs = {key: job for key, job in jobs.items() if re.search(args.jobs, key)}
            cases.append((shape, skew, counts, (x, w, dy), jobs, configs))
    rows, table = [], []
    for shape, skew, counts, (x, w, dy), jobs, configs in cases:
        errs = {} if args.no_check else _check(jobs)
        times = {}
        built = iter(compile_all([(fn, [a], reps) for fn, a, reps in jobs.values()]))
        for key in jobs:
            b = next(built)
            times[key] = None if isinstance(b, Exception) else attempt(time_compiled, *b, trials=5)
        times.update(_torch_times(shape, x, w, dy, counts, reps_for(shape.m * shape.n * 2, cap=10), backends))
        flops = 2 * int(counts.sum()) * shape.n * shape.k
        rec = dict(shape=shape.name, skew=skew, m=shape.m, e=shape.e, k=shape.k, n=shape.n, flops=flops,
                   configs=configs, times=times, rel_err_vs_pallas=errs)
        rows.append(rec)
        table.append(_row(rec, backends))
        print(table[-1], flush=True)
        if args.jobs:  # a chosen set of jobs: every one's rate, not only each backend's best
            mult = dict(KINDS)
            print("    " + " | ".join(f"{key} {flops * mult[key.split()[0]] / s / 1e12:.0f}"
                                      for key, s in times.items() if s), flush=True)
        torch.cuda.empty_cache()
        summary = _summary(rows, backends)
        if args.json:  # after every row, so a run stopped by its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(dict(meta=run_meta("python -m benchmarks.backends " + " ".join(sys.argv[1:])),
                               summary=summary, rows=rows), f, indent=1)
    print("\nTFLOP/s per kernel (forward+backward counts 3x the forward FLOPs): torch, then each backend at its "
          "default tiles (and its best tile) with torch time / its time")
    for line in table:
        print(line)
    print(json.dumps(summary, indent=1))


def _best(times, prefix):
    """The fastest job whose key is `prefix` or `prefix` plus a tile name: (key, seconds)."""
    cands = {k: v for k, v in times.items() if (k == prefix or k.startswith(prefix + " ")) and v}
    return min(cands.items(), key=lambda kv: kv[1]) if cands else (None, None)


KINDS = (("fwd", 1), ("dgrad", 1), ("wgrad", 1), ("fb", 3))


def _row(rec, backends) -> str:
    """`kind: torch TF/s | backend TF/s (best tile TF/s) x ratio to torch (best's) ...` per kernel."""
    t, f = rec["times"], rec["flops"]
    tf = lambda s, mult: "  -" if not s else f"{f * mult / s / 1e12:3.0f}"  # noqa: E731
    lines = [f"{rec['shape']} | {rec['skew']}"]
    for kind, mult in KINDS:
        tor = t.get(f"{kind} torch")
        cells = [f"torch {tf(tor, mult)}"]
        for b in backends:
            own, (best_key, best) = t.get(f"{kind} {b}"), _best(t, f"{kind} {b}")
            if best is None:
                continue
            ratio = lambda s: " - " if not s or not tor else f"{tor / s:.2f}"  # noqa: E731
            tile = (best_key or "")[len(f"{kind} {b}"):].strip() or "default"
            cells.append(f"{b} {tf(own, mult)} ({tf(best, mult)} {tile}) x{ratio(own)} ({ratio(best)})")
        lines.append(f"    {kind:<5} " + " | ".join(cells))
    return "\n".join(lines)


def _summary(rows, backends):
    """Geomean and minimum of torch time / backend time per kernel, at the default tiles and at
    the best tile of each row."""
    out = {}
    for kind, _ in KINDS:
        for b in backends:
            for side in ("default", "best"):
                ratios = []
                for r in rows:
                    t = r["times"]
                    s = _best(t, f"{kind} {b}")[1] if side == "best" else t.get(f"{kind} {b}")
                    if s and t.get(f"{kind} torch"):
                        ratios.append(t[f"{kind} torch"] / s)
                if ratios:
                    out[f"{kind} {b} {side}: geomean over torch"] = float(np.exp(np.mean(np.log(ratios))))
                    out[f"{kind} {b} {side}: min over torch"] = float(min(ratios))
    return out


if __name__ == "__main__":
    main()
