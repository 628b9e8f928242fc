"""Grouped-GEMM benchmark and tile-config sweep (GPU only).

    python -m benchmarks.gmm run  [--quick] [--json PATH]   # the table, peers side by side
    python -m benchmarks.gmm tune [--quick] [--json PATH]   # sweep TileConfigs per shape class

`run` times, on the same inputs in one process: our `gmm` (Pallas/Triton) forward and
forward+backward, `jax.lax.ragged_dot`, JAX's Mosaic GPU example `ragged_dot_mgpu` (forward),
`torch._grouped_mm` (CUTLASS; autograd for backward), the seed-style Triton kernel from
`parity.reference` (forward), and a dense bf16 matmul of equal FLOPs. Prefill shapes run with
balanced and Zipf-skewed counts at the same total; decode buckets report achieved bandwidth on
the active experts' weight bytes against a device copy measured in the same run.

This lives outside `moe_jax` because it imports torch; `moe_jax` never does.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import platform
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import shapes as S
from benchmarks.timing import compile_jax, cupti_kernel_time_jax, time_compiled, time_jax, time_torch
from moe_jax.ops import TileConfig, gmm, gmm_config, grouped_linear, make_group_metadata, tgmm, tgmm_config
from moe_jax.ops.gmm import gmm_pallas

COPY_TBPS_NOMINAL = 4.25


def _rel(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _torch():
    import torch

    return torch


def _to_torch(x):
    torch = _torch()
    return torch.utils.dlpack.from_dlpack(x)


def _inputs(shape: S.GemmShape, counts: np.ndarray, seed: int = 0, weight_sets: int = 1):
    key = jax.random.PRNGKey(seed)
    kx, kd, *kw = jax.random.split(key, 2 + weight_sets)
    x = jax.random.normal(kx, (shape.m, shape.k), jnp.bfloat16)
    dy = jax.random.normal(kd, (shape.m, shape.n), jnp.bfloat16)
    ws = [(jax.random.normal(k, (shape.e, shape.n, shape.k), jnp.bfloat16) * (1 / math.sqrt(shape.k))).astype(jnp.bfloat16)
          for k in kw]
    gs = jnp.asarray(counts, jnp.int32)
    return x, ws, dy, gs


def _reps(out_bytes: int, cap: int = 20) -> int:
    return int(max(2, min(cap, (6 << 30) // max(out_bytes, 1))))


def _try(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as e:  # a peer that cannot run a shape is reported, not fatal
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        print(f"    [skipped] {getattr(fn, '__name__', fn)}: {msg}", flush=True)
        return None


def measure_copy_tbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written), torch, 4 GiB."""
    torch = _torch()
    src = torch.empty(1 << 31, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_torch(lambda: dst.copy_(src), [()], reps=10, trials=5, graph=False)
    return 2 * src.numel() * 2 / t / 1e12


# ---------------------------------------------------------------------------------------------
# run


def load_tuned(path) -> dict:
    """`{shape name: {kernel: TileConfig}}` from the `best` summary of a `tune` JSON."""
    if not path:
        return {}
    with open(path) as f:
        best = json.load(f)["summary"]
    out: dict = {}
    for key, v in best.items():
        shape, kernel = (p.strip() for p in key.split("|"))
        out.setdefault(shape, {})[kernel] = TileConfig(*v["config"])
    return out


def _prefill_case(shape: S.GemmShape, skew: str, counts: np.ndarray, rows: list, quick: bool, tuned: dict):
    x, (w,), dy, gs = _inputs(shape, counts)
    cfg = tuned.get(shape.name, {})
    fwd_cfg, dgrad_cfg, wgrad_cfg = cfg.get("fwd"), cfg.get("dgrad"), cfg.get("wgrad")
    useful = int(counts.sum())
    flops = 2 * useful * shape.n * shape.k
    reps = _reps(shape.m * shape.n * 2, cap=10)
    torch = _torch()
    tx, tw, tdy = _to_torch(x), _to_torch(w), _to_torch(dy)
    offs = torch.as_tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    rec = dict(shape=shape.name, skew=skew, m=shape.m, e=shape.e, k=shape.k, n=shape.n, flops=flops,
               max_count=int(counts.max()), active=int((counts > 0).sum()),
               configs={k: dataclasses.astuple(v) for k, v in cfg.items()})

    ours = jax.jit(lambda x, w, gs: gmm(x, w, gs, config=fwd_cfg))
    y = ours(x, w, gs)
    ty = torch._grouped_mm(tx, tw.transpose(-2, -1), offs=offs)
    rec["rel_err_vs_torch"] = _rel(y, jnp.asarray(ty.float().cpu().numpy()))
    del ty

    def fwdbwd(x, w, gs, dy):
        yy, vjp = jax.vjp(lambda x, w: grouped_linear(x, w, gs, fwd_config=fwd_cfg, dgrad_config=dgrad_cfg,
                                                      wgrad_config=wgrad_cfg), x, w)
        return vjp(dy)

    times = {}
    times["ours"] = time_jax(ours, [(x, w, gs)], reps=reps)
    times["ours_fb"] = time_jax(fwdbwd, [(x, w, gs, dy)], reps=max(2, reps // 3))
    w_ekn = jnp.swapaxes(w, 1, 2)
    times["ragged_dot"] = _try(time_jax, jax.lax.ragged_dot, [(x, w_ekn, gs)], reps=reps)

    def rd_fb(x, w_ekn, gs, dy):
        _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, gs), x, w_ekn)
        return vjp(dy)

    times["ragged_dot_fb"] = None if quick else _try(time_jax, rd_fb, [(x, w_ekn, gs, dy)], reps=2)
    del w_ekn
    times["mgpu"] = _try(_time_mgpu, x, w, gs, reps)
    times["torch"] = time_torch(lambda: torch._grouped_mm(tx, tw.transpose(-2, -1), offs=offs), [()], reps=reps)

    txg = tx.detach().clone().requires_grad_(True)
    twg = tw.detach().clone().requires_grad_(True)

    def torch_fb():
        out = torch._grouped_mm(txg, twg.transpose(-2, -1), offs=offs)
        return torch.autograd.grad(out, (txg, twg), tdy)

    times["torch_fb"] = _try(time_torch, torch_fb, [()], reps=max(2, reps // 3), graph=False)
    del txg, twg
    times["seed_triton"] = None if quick else _try(_time_seed_triton, tx, tw, offs, reps)
    a = torch.empty(shape.m, shape.k, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty(shape.k, shape.n, dtype=torch.bfloat16, device="cuda").normal_()
    times["dense"] = time_torch(lambda: a @ b, [()], reps=reps)
    del a, b
    for impl, t in times.items():
        f = flops * (3 if impl.endswith("_fb") else 1)
        rows.append({**rec, "impl": impl, "seconds": t, "tflops": None if t is None else f / t / 1e12})
    _print_prefill(rec, times, flops)


def _time_mgpu(x, w, gs, reps):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    f = lambda x, w, gs: ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=gs, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
        grid_block_n=1, transpose_rhs=True)
    return time_jax(f, [(x, w, gs)], reps=reps)


def _time_seed_triton(tx, tw, offs, reps):
    torch = _torch()
    from parity.reference import grouped_gemm

    full = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), offs])
    return time_torch(lambda: grouped_gemm.grouped_mm(tx, tw, full), [()], reps=reps, graph=False)


def _print_prefill(rec, times, flops):
    def tf(key, mult=1):
        t = times.get(key)
        return "   -  " if t is None else f"{flops * mult / t / 1e12:6.0f}"

    def ratio(a, b):
        return "  -  " if times.get(a) is None or times.get(b) is None else f"{times[b] / times[a]:5.2f}"

    print(f"  {rec['shape']:<24} {rec['skew']:<8} fwd TF/s ours {tf('ours')} torch {tf('torch')} "
          f"x{ratio('ours', 'torch')} | ragged_dot {tf('ragged_dot')} mgpu {tf('mgpu')} seed {tf('seed_triton')} "
          f"dense {tf('dense')} | f+b ours {tf('ours_fb', 3)} torch {tf('torch_fb', 3)} x{ratio('ours_fb', 'torch_fb')} "
          f"rd {tf('ragged_dot_fb', 3)} | err {rec['rel_err_vs_torch']:.1e}", flush=True)


def _decode_case(tokens: int, rows: list, copy_tbps: float, tuned: dict):
    shape = S.decode_shape(tokens)
    sets = 4  # rotate weight copies: one bucket's active experts fit in L2
    counts = S.decode_counts(tokens)
    x, ws, _, gs = _inputs(shape, counts, weight_sets=sets)
    active = int((counts > 0).sum())
    wbytes = active * shape.n * shape.k * 2
    torch = _torch()
    offs = torch.as_tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    tx = _to_torch(x)
    tws = [_to_torch(w) for w in ws]
    cfg = tuned.get(shape.name, {}).get("fwd") or gmm_config(shape.m, shape.n, shape.k, shape.e)
    meta = make_group_metadata(gs, num_rows=shape.m, block_m=cfg.block_m)
    kernel_only = lambda x, w, meta: gmm_pallas(x, w, meta, transpose_rhs=True, config=cfg, out_dtype=x.dtype,
                                                precision=jax.lax.Precision.DEFAULT, interpret=False)
    ours = lambda x, w, gs: gmm(x, w, gs, config=cfg)
    y = jax.jit(ours)(x, ws[0], gs)
    ty = torch._grouped_mm(tx, tws[0].transpose(-2, -1), offs=offs)
    err = _rel(y, jnp.asarray(ty.float().cpu().numpy()))
    times = {
        "ours": time_jax(ours, [(x, w, gs) for w in ws], reps=40),
        "ours_kernel": time_jax(kernel_only, [(x, w, meta) for w in ws], reps=40),
        "ours_cupti": cupti_kernel_time_jax(ours, (x, ws[0], gs)),
        "ragged_dot": _try(time_jax, jax.lax.ragged_dot, [(x, jnp.swapaxes(w, 1, 2), gs) for w in ws[:2]], reps=40),
        "torch": time_torch(lambda w: torch._grouped_mm(tx, w.transpose(-2, -1), offs=offs), [(w,) for w in tws], reps=40),
    }
    rec = dict(shape=shape.name, skew="decode", m=shape.m, e=shape.e, k=shape.k, n=shape.n, tokens=tokens,
               active=active, weight_bytes=wbytes, rel_err_vs_torch=err, copy_tbps=copy_tbps,
               configs={"fwd": dataclasses.astuple(cfg)})
    for impl, t in times.items():
        rows.append({**rec, "impl": impl, "seconds": t,
                     "tbps": None if t is None else wbytes / t / 1e12})

    def bw(key):
        t = times.get(key)
        return "   -   " if t is None else f"{wbytes / t / 1e12:5.2f} ({wbytes / t / 1e12 / copy_tbps:4.2f})"

    def us(key):
        t = times.get(key)
        return "  -  " if t is None else f"{t * 1e6:6.1f}"

    print(f"  decode T={tokens:<4} active={active:<3} {wbytes / 1e6:6.1f} MB | us: ours {us('ours')} kernel {us('ours_kernel')} "
          f"cupti {us('ours_cupti')} torch {us('torch')} ragged_dot {us('ragged_dot')} | TB/s (x copy): ours {bw('ours')} "
          f"kernel {bw('ours_kernel')} torch {bw('torch')} | err {err:.1e}", flush=True)


def cmd_run(args):
    rows: list = []
    tuned = load_tuned(args.configs)
    copy = measure_copy_tbps()
    print(f"copy bandwidth: {copy:.2f} TB/s (read + write)", flush=True)
    prefill = S.PREFILL[:1] if args.quick else S.PREFILL
    for shape in prefill:
        for skew in ("balanced", "zipf"):
            counts = S.balanced_counts(shape.m, shape.e) if skew == "balanced" else S.zipf_counts(
                shape.m, shape.e, cap=shape.tokens)
            _prefill_case(shape, skew, counts, rows, args.quick, tuned)
    for t in S.DECODE_TOKENS:
        _decode_case(t, rows, copy, tuned)
    summary = _summary(rows, copy)
    print(json.dumps(summary, indent=1))
    _write(args.json, "run", rows, summary, dict(copy_tbps=copy, configs_from=args.configs or "table"))


def _geomean(xs):
    xs = [x for x in xs if x]
    return float(np.exp(np.mean(np.log(xs)))) if xs else None


def _summary(rows, copy):
    def t(shape, skew, impl):
        for r in rows:
            if r["shape"] == shape and r["skew"] == skew and r["impl"] == impl:
                return r["seconds"]
        return None

    cases = sorted({(r["shape"], r["skew"]) for r in rows if r["skew"] != "decode"})
    fwd = [t(*c, "torch") / t(*c, "ours") for c in cases if t(*c, "torch") and t(*c, "ours")]
    fb = [t(*c, "torch_fb") / t(*c, "ours_fb") for c in cases if t(*c, "torch_fb") and t(*c, "ours_fb")]
    rd = [t(*c, "ragged_dot") / t(*c, "ours") for c in cases if t(*c, "ragged_dot") and t(*c, "ours")]
    dec = {r["shape"]: r["tbps"] / copy for r in rows if r["skew"] == "decode" and r["impl"] == "ours" and r["tbps"]}
    deck = {r["shape"]: r["tbps"] / copy for r in rows if r["skew"] == "decode" and r["impl"] == "ours_kernel" and r["tbps"]}
    return {
        "fwd_geomean_ours_over_torch": _geomean(fwd), "target_fwd": 0.8,
        "fwdbwd_geomean_ours_over_torch": _geomean(fb), "target_fwdbwd": 0.7,
        "fwd_geomean_speedup_over_ragged_dot": _geomean(rd),
        "decode_fraction_of_copy_bw": dec, "decode_kernel_only_fraction_of_copy_bw": deck, "target_decode": 0.7,
    }


# ---------------------------------------------------------------------------------------------
# tune

FWD_CANDIDATES = [
    TileConfig(128, 128, 64, 4, 4, 8), TileConfig(128, 128, 64, 8, 3, 8), TileConfig(128, 256, 64, 8, 3, 8),
    TileConfig(128, 256, 64, 8, 4, 8), TileConfig(128, 128, 128, 8, 3, 8), TileConfig(256, 128, 64, 8, 3, 8),
    TileConfig(64, 128, 64, 4, 4, 8), TileConfig(64, 256, 64, 8, 4, 8), TileConfig(128, 256, 64, 8, 3, 1),
    TileConfig(128, 128, 64, 8, 4, 16), TileConfig(64, 128, 128, 4, 3, 8), TileConfig(128, 64, 64, 4, 4, 8),
]
TGMM_CANDIDATES = [
    TileConfig(64, 128, 128, 8, 3, 1), TileConfig(32, 128, 128, 8, 3, 1), TileConfig(64, 128, 64, 4, 3, 1),
    TileConfig(64, 64, 128, 4, 3, 1), TileConfig(128, 128, 128, 8, 3, 1), TileConfig(64, 256, 128, 8, 3, 1),
    TileConfig(32, 64, 64, 4, 4, 1), TileConfig(64, 128, 128, 8, 4, 1), TileConfig(32, 128, 64, 4, 4, 1),
]
DECODE_CANDIDATES = [
    TileConfig(16, 64, 128, 4, 4, 1), TileConfig(16, 32, 128, 4, 4, 1), TileConfig(16, 64, 256, 4, 3, 1),
    TileConfig(16, 128, 128, 4, 4, 1), TileConfig(16, 64, 64, 4, 6, 1), TileConfig(16, 32, 256, 4, 3, 1),
    TileConfig(32, 64, 128, 4, 4, 1), TileConfig(16, 64, 128, 2, 4, 1), TileConfig(16, 128, 64, 4, 5, 1),
]


def cmd_tune(args):
    rows: list = []
    prefill = S.PREFILL[:2] if args.quick else S.PREFILL
    jobs = []  # (label dict, fn, arg_sets, reps)
    for shape in prefill:
        counts = S.balanced_counts(shape.m, shape.e)
        x, (w,), dy, gs = _inputs(shape, counts)
        reps = _reps(shape.m * max(shape.n, shape.k) * 2, cap=8)
        for c in FWD_CANDIDATES:
            jobs.append((dict(shape=shape.name, kernel="fwd", config=dataclasses.astuple(c)),
                         lambda x, w, gs, c=c: gmm(x, w, gs, config=c), [(x, w, gs)], reps, shape))
            jobs.append((dict(shape=shape.name, kernel="dgrad", config=dataclasses.astuple(c)),
                         lambda dy, w, gs, c=c: gmm(dy, w, gs, transpose_rhs=False, config=c), [(dy, w, gs)], reps, shape))
        wreps = _reps(shape.e * shape.n * shape.k * 2, cap=6)
        for c in TGMM_CANDIDATES:
            jobs.append((dict(shape=shape.name, kernel="wgrad", config=dataclasses.astuple(c)),
                         lambda x, dy, gs, c=c: tgmm(x, dy, gs, config=c), [(x, dy, gs)], wreps, shape))
    for tokens in S.DECODE_TOKENS:
        shape = S.decode_shape(tokens)
        x, ws, _, gs = _inputs(shape, S.decode_counts(tokens), weight_sets=4)
        for c in DECODE_CANDIDATES:
            jobs.append((dict(shape=shape.name, kernel="fwd", config=dataclasses.astuple(c)),
                         lambda x, w, gs, c=c: gmm(x, w, gs, config=c), [(x, w, gs) for w in ws], 40, shape))

    def build(job):
        label, fn, arg_sets, reps, _ = job
        try:
            return compile_jax(fn, arg_sets, reps=reps)
        except Exception as e:
            return e

    print(f"compiling {len(jobs)} candidates ...", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 8) as pool:
        built = list(pool.map(build, jobs))
    for (label, fn, arg_sets, reps, shape), b in zip(jobs, built):
        if isinstance(b, Exception):
            rows.append({**label, "seconds": None, "error": f"{type(b).__name__}: {str(b)[:200]}"})
            continue
        t = time_compiled(*b, trials=5)
        rows.append({**label, "seconds": t, "tflops": 2 * shape.m * shape.n * shape.k / t / 1e12})
    best = {}
    for r in rows:
        if r.get("seconds") is None:
            continue
        key = f"{r['shape']} | {r['kernel']}"
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    for key, r in best.items():
        print(f"  {key:<40} best {r['config']}  {r['seconds'] * 1e6:9.1f} us  {r['tflops']:6.0f} TF/s", flush=True)
    for r in rows:
        if r.get("error"):
            print(f"  failed {r['shape']} {r['kernel']} {r['config']}: {r['error'][:120]}")
    _write(args.json, "tune", rows, {k: dict(config=v["config"], seconds=v["seconds"]) for k, v in best.items()}, {})


# ---------------------------------------------------------------------------------------------


def _write(path, kind, rows, summary, extra):
    if not path:
        return
    torch = _torch()
    meta = dict(
        kind=kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=jax.devices()[0].device_kind, jax=jax.__version__, torch=torch.__version__,
        python=platform.python_version(), command=" ".join(sys.argv), **extra,
    )
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    with open(path, "w") as f:
        json.dump(dict(meta=meta, summary=summary, rows=rows), f, indent=1)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "tune"):
        q = sub.add_parser(name)
        q.add_argument("--quick", action="store_true", help="fewer shapes and peers")
        q.add_argument("--json", default=None, help="write full results here")
    sub.choices["run"].add_argument("--configs", default=None,
                                    help="a `tune` JSON: use its best config per shape and kernel instead of the table")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        p.error("this benchmark needs a CUDA GPU (jax.default_backend() is %r)" % jax.default_backend())
    {"run": cmd_run, "tune": cmd_tune}[args.cmd](args)


if __name__ == "__main__":
    main()
