"""Decode grouped GEMM against the bytes it must read (GPU only).

    python -m benchmarks.decode sweep [--tokens 1,2,4,8] [--json PATH]   # every decode candidate, timed
    python -m benchmarks.decode kernels [--from PATH --top 4]            # a few calls each, for `ncu`
    python -m benchmarks.decode ncu-table NCU.csv                          # ncu's CSV, per call (no GPU)

At decode the forward grouped GEMM reads the active experts' weights once and little else (the
Qwen3-30B-A3B gate+up shape of `benchmarks.shapes.decode_shape`: top-8 of 128 experts, N = 1536,
K = 2048, bf16; 50 MB of weights at one token). `sweep` times, in one process and on the same
inputs (weights rotated over four copies, so a bucket's experts are not in L2):
- the group-major and split-K kernels over a grid of tile widths, K steps, warps and pipeline
  stages, the selector's choice (`gmm(..., config="auto")`) and the static table's;
- what the same harness gets reading the same bytes: XLA's reduction over a contiguous slab of as
  many experts' weights (a read-only kernel), and a dense XLA matmul of the slab with 16 rows;
- the harness floor: a call whose kernel moves almost nothing (what every timed call pays in
  launch and ordering on top of its kernel);
- `torch._grouped_mm` on the same counts (CUDA graph), and torch's reduction over the slab.
Bandwidth is the active experts' weight bytes over the time, and its fraction of the large copy
(`benchmarks.gmm.measure_copy_tbps`, bytes read + written, 4 GiB).

`kernels` runs the fastest `--top` candidates of a sweep file (without `--from`: every candidate,
since the harness and the kernels alone rank them differently), the default configs and the peers
a few times each with no timing around them, so `ncu --clock-control none` can report each
kernel's own duration (`benchmarks/gpu_run.sh decode-ncu`). Around each call's runs (after its
compile and autotuning) it launches one-block marker kernels named `marker_<i>` and `marker_end`;
`ncu-table` keeps the kernels between them and prints each call's kernels with their median
duration and DRAM bytes read.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp

from benchmarks import shapes as S
from benchmarks.gmm import compile_all, decode_config, encode_config, make_inputs, measure_copy_tbps, to_torch, torch_offsets
from benchmarks.timing import run_meta, time_compiled, time_torch
from moe_jax.ops import GmmConfig, TileConfig, gmm, gmm_config
from moe_jax.ops.pallas_triton import launch

SMEM_BYTES = 227 * 1024


def _stage_bytes(bn: int, bk: int, bm: int = 16) -> int:
    """Shared memory of one pipeline stage: a bf16 `[bm, bk]` row block and `[bn, bk]` weight block."""
    return (bm + bn) * bk * 2


def candidates(tokens: int) -> list[GmmConfig]:
    """The decode grid: group-major over widths, K steps, warps and stages that fit in shared
    memory, and split-K over 2 and 4 at the mid widths. Wider at T = 1, where the fixed costs
    of a launch are the largest part of the time."""
    widths = (16, 32, 64, 128) if tokens == 1 else (32, 64)
    ks = (128, 256, 512)
    warps = (2, 4) if tokens == 1 else (4,)
    stages = (2, 3, 4, 6) if tokens == 1 else (3, 4)
    out = []
    for bn in widths:
        for bk in ks:
            for w in warps:
                for s in stages:
                    if s * _stage_bytes(bn, bk) > SMEM_BYTES * 0.9:
                        continue
                    out.append(GmmConfig("group_major", TileConfig(16, bn, bk, w, s, 1)))
    for bn in (32, 64):
        for splits in (2, 4):
            out.append(GmmConfig("split_k", TileConfig(16, bn, 256, 4, 3, 1), splits=splits))
    return out


def _inputs(tokens: int, ws):
    shape = S.decode_shape(tokens)
    counts = S.decode_counts(tokens)
    x = jax.random.normal(jax.random.PRNGKey(tokens), (shape.m, shape.k), jnp.bfloat16)
    return shape, counts, x, jnp.asarray(counts, jnp.int32)


def _slab_peers(active: int, ws):
    """XLA callables reading `active` experts' weights from a contiguous slab of each copy."""
    slabs = [w[:active] for w in ws]  # copies made once, outside the timed calls
    x16 = jnp.ones((16, ws[0].shape[2]), ws[0].dtype)
    read = lambda s: jnp.sum(s.astype(jnp.float32), axis=2)
    dense = lambda s, x: jnp.einsum("enk,mk->enm", s, x, preferred_element_type=jnp.float32)
    return [("xla_read_slab", read, [(s,) for s in slabs]), ("xla_dense_slab", dense, [(s, x16) for s in slabs])]


def cmd_sweep(args):
    copy = measure_copy_tbps()
    print(f"copy bandwidth: {copy:.2f} TB/s (read + write)", flush=True)
    _, ws, _, _ = make_inputs(S.decode_shape(1), S.decode_counts(1), seed=7, weight_sets=4)
    tiny = jnp.zeros((8, 128), jnp.float32)
    rows, jobs = [], []
    for tokens in args.tokens:
        shape, counts, x, gs = _inputs(tokens, ws)
        active = int((counts > 0).sum())
        wbytes = active * shape.n * shape.k * 2
        base = dict(tokens=tokens, m=shape.m, active=active, weight_bytes=wbytes)
        sets = [(x, w, gs) for w in ws]
        for c in candidates(tokens):
            jobs.append(({**base, "impl": "candidate", "config": encode_config(c)},
                         lambda x, w, gs, c=c: gmm(x, w, gs, config=c), sets, 40))
        jobs.append(({**base, "impl": "selector"}, lambda x, w, gs: gmm(x, w, gs, config="auto"), sets, 40))
        static = gmm_config(shape.m, shape.n, shape.k, shape.e)
        jobs.append(({**base, "impl": "static", "config": encode_config(static)},
                     lambda x, w, gs: gmm(x, w, gs), sets, 40))
        for name, fn, psets in _slab_peers(active, ws):
            jobs.append(({**base, "impl": name}, fn, psets, 40))
        jobs.append(({**base, "impl": "harness_floor"}, lambda t: t + 1.0, [(tiny,)], 40))
    print(f"compiling {len(jobs)} executables ...", flush=True)
    built = compile_all([j[1:] for j in jobs])
    for (label, *_), b in zip(jobs, built):
        if isinstance(b, Exception):
            rows.append({**label, "seconds": None, "error": f"{type(b).__name__}: {str(b).splitlines()[0][:200]}"})
            continue
        rows.append({**label, "seconds": time_compiled(*b, trials=7)})
    import torch

    for tokens in args.tokens:
        shape, counts, x, gs = _inputs(tokens, ws)
        active = int((counts > 0).sum())
        base = dict(tokens=tokens, m=shape.m, active=active, weight_bytes=active * shape.n * shape.k * 2)
        tx, tws, offs = to_torch(x), [to_torch(w) for w in ws], torch_offsets(counts)
        t = time_torch(lambda w: torch._grouped_mm(tx, w.transpose(-2, -1), offs=offs), [(w,) for w in tws], reps=40)
        rows.append({**base, "impl": "torch_grouped_mm", "seconds": t})
        tslabs = [w[:active].contiguous() for w in tws]
        t = time_torch(lambda s: s.sum(dim=2, dtype=torch.float32), [(s,) for s in tslabs], reps=40)
        rows.append({**base, "impl": "torch_read_slab", "seconds": t})
    for r in rows:
        if r.get("seconds"):
            r["tbps"] = r["weight_bytes"] / r["seconds"] / 1e12
            r["fraction_of_copy"] = r["tbps"] / copy
    _print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta={**run_meta("python -m benchmarks.decode " + " ".join(sys.argv[1:])), "copy_tbps": copy},
                           rows=rows), f, indent=1)
        print(f"wrote {args.json}")


def _name(r) -> str:
    if r["impl"] in ("candidate", "static"):
        c = decode_config(r["config"])
        return f"{r['impl']}: {c.name}"
    return r["impl"]


def _print_table(rows):
    for tokens in sorted({r["tokens"] for r in rows}):
        mine = [r for r in rows if r["tokens"] == tokens and r.get("seconds")]
        cands = sorted((r for r in mine if r["impl"] == "candidate"), key=lambda r: r["seconds"])
        shown = cands[:6] + [r for r in mine if r["impl"] != "candidate"]
        print(f"\nT={tokens}: {mine[0]['active']} active experts, {mine[0]['weight_bytes'] / 1e6:.1f} MB "
              f"({len(cands)} candidates; fastest six shown)")
        print("| kernel | us | TB/s | x copy |\n|---|---|---|---|")
        for r in shown:
            print(f"| {_name(r)} | {r['seconds'] * 1e6:.1f} | {r['tbps']:.2f} | {r['fraction_of_copy']:.2f} |")
    failed = [r for r in rows if r.get("error")]
    for r in failed[:10]:
        print(f"failed T={r['tokens']} {r.get('config')}: {r['error'][:150]}")


def cmd_kernels(args):
    """Each chosen callable a few times, synchronised, with nothing timed (for `ncu`)."""
    rows = None
    if args.source:
        with open(args.source) as f:
            rows = json.load(f)["rows"]
    _, ws, _, _ = make_inputs(S.decode_shape(1), S.decode_counts(1), seed=7, weight_sets=4)
    labels: list[str] = []
    for tokens in args.tokens:
        shape, counts, x, gs = _inputs(tokens, ws)
        active = int((counts > 0).sum())
        if rows is None:
            configs = candidates(tokens)
        else:
            timed = sorted((r for r in rows if r["tokens"] == tokens and r["impl"] == "candidate" and r.get("seconds")),
                           key=lambda r: r["seconds"])[:args.top]
            configs = [decode_config(r["config"]) for r in timed]
        calls = [(f"T={tokens} {c.name}", jax.jit(lambda x, w, gs, c=c: gmm(x, w, gs, config=c)), (x, ws[0], gs))
                 for c in configs]
        calls.append((f"T={tokens} static", jax.jit(lambda x, w, gs: gmm(x, w, gs)), (x, ws[0], gs)))
        calls += [(f"T={tokens} {name}", jax.jit(fn), psets[0]) for name, fn, psets in _slab_peers(active, ws)]
        for label, fn, a in calls:
            jax.block_until_ready(fn(*a))  # compile (and autotune) before the marker
            _marker(len(labels))
            labels.append(label)
            for _ in range(3):
                jax.block_until_ready(fn(*a))
            _marker("end")
    import torch

    for tokens in args.tokens:
        shape, counts, x, gs = _inputs(tokens, ws)
        tx, tw, offs = to_torch(x), to_torch(ws[0]), torch_offsets(counts)
        torch._grouped_mm(tx, tw.transpose(-2, -1), offs=offs)
        torch.cuda.synchronize()
        _marker(len(labels))
        labels.append(f"T={tokens} torch_grouped_mm")
        for _ in range(3):
            torch._grouped_mm(tx, tw.transpose(-2, -1), offs=offs)
        torch.cuda.synchronize()
        _marker("end")
    with open(args.labels, "w") as f:
        json.dump(labels, f)


def _marker(i: int | str):
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.zeros((16, 16), jnp.float32)
    jax.block_until_ready(launch(body, (x,), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,), num_warps=1,
                                 num_stages=1, interpret=False, name=f"marker_{i}"))


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def cmd_ncu_table(args):
    """Each call's kernels between its marker and the next: median duration over the call's runs."""
    with open(args.csv) as f:
        lines = [ln for ln in f if not ln.startswith("==")]
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(lines):
        k = kernels.setdefault(row["ID"], dict(name=row["Kernel Name"], grid=row.get("Grid Size", "")))
        k[row["Metric Name"]] = float(row["Metric Value"].replace(",", "") or "nan")
    labels = json.load(open(args.labels)) if args.labels and os.path.exists(args.labels) else None
    groups: list[list[dict]] = []
    inside = False  # kernels between `marker_<i>` and `marker_end` are call i's runs
    for k in kernels.values():
        if k["name"].startswith("marker_"):
            inside = k["name"] != "marker_end"
            if inside:
                groups.append([])
        elif inside:
            groups[-1].append(k)
    print("| call | kernel | grid | us (median of runs) | DRAM MB read | regs |\n|---|---|---|---|---|---|")
    for i, ks in enumerate(groups):
        by_name: dict[str, list[dict]] = {}
        for k in ks:
            by_name.setdefault(k["name"][:60], []).append(k)
        label = labels[i] if labels and i < len(labels) else f"call {i}"
        for name, runs in by_name.items():
            dur, mb = (_median([r[m] for r in runs if m in r]) for m in ("gpu__time_duration.sum", "dram__bytes_read.sum"))
            # `--print-units base`: nanoseconds and bytes.
            print(f"| {label} | {name} | {runs[0]['grid']} | {dur / 1e3:.1f} | {mb / 1e6:.1f} | "
                  f"{runs[0].get('launch__registers_per_thread', float('nan')):.0f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep")
    sw.add_argument("--json", default=None)
    kn = sub.add_parser("kernels")
    kn.add_argument("--from", dest="source", default=None,
                    help="a `sweep --json` result (default: none, profile every candidate)")
    kn.add_argument("--top", type=int, default=4, help="with --from: how many of its fastest candidates")
    kn.add_argument("--labels", default="decode_ncu_labels.json", help="where to write the calls' labels, in order")
    for q in (sw, kn):
        q.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2, 4, 8])
    nt = sub.add_parser("ncu-table")
    nt.add_argument("csv")
    nt.add_argument("--labels", default=None, help="`kernels --labels` output")
    args = p.parse_args(argv)
    if args.cmd == "ncu-table":
        return cmd_ncu_table(args)
    if jax.default_backend() != "gpu":
        p.error("this benchmark needs a CUDA GPU (jax.default_backend() is %r)" % jax.default_backend())
    {"sweep": cmd_sweep, "kernels": cmd_kernels}[args.cmd](args)


if __name__ == "__main__":
    main()
