"""Grouped-GEMM benchmark and tile-config sweep (GPU only).

    python -m benchmarks.gmm run  [--quick] [--configs tune.json] [--json PATH]  # the table, peers side by side
    python -m benchmarks.gmm tune [--quick] [--only {all,prefill,decode}] [--json PATH]  # sweep TileConfigs

`run --configs tune.json` takes each shape's and kernel's tile config from a `tune --json` result
instead of the built-in table.

`run` times, on the same inputs in one process: our `gmm` (Pallas/Triton) forward and
forward+backward, `jax.lax.ragged_dot`, JAX's Mosaic GPU example `ragged_dot_mgpu` (forward),
`torch._grouped_mm` (CUTLASS; autograd for backward), the reference Triton kernel of
`parity.reference` (forward; `seed_triton` in the records), and a dense bf16 matmul of equal FLOPs. Prefill shapes run with
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
from benchmarks.timing import compile_jax, time_compiled, time_torch
from moe_jax.ops import GmmConfig, TileConfig, gmm, gmm_config, grouped_linear, tgmm
from moe_jax.ops.gmm.pallas_triton.row_tile import gmm_row_tile_pallas
from moe_jax.testing import rel_err

RAGGED_DOT_MAX_BYTES = 32 << 30


def _torch():
    import torch

    return torch


def to_torch(x):
    torch = _torch()
    return torch.utils.dlpack.from_dlpack(x)


def make_inputs(shape: S.GemmShape, counts: np.ndarray, seed: int = 0, weight_sets: int = 1):
    key = jax.random.PRNGKey(seed)
    kx, kd, *kw = jax.random.split(key, 2 + weight_sets)
    x = jax.random.normal(kx, (shape.m, shape.k), jnp.bfloat16)
    dy = jax.random.normal(kd, (shape.m, shape.n), jnp.bfloat16)
    ws = [(jax.random.normal(k, (shape.e, shape.n, shape.k), jnp.bfloat16) * (1 / math.sqrt(shape.k))).astype(jnp.bfloat16)
          for k in kw]
    gs = jnp.asarray(counts, jnp.int32)
    return x, ws, dy, gs


def reps_for(out_bytes: int, cap: int = 20) -> int:
    return int(max(2, min(cap, (6 << 30) // max(out_bytes, 1))))


def attempt(fn, *args, **kw):
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


def encode_config(config: GmmConfig | TileConfig) -> list:
    """A candidate as JSON: `[family, *tiles, splits]` for a `GmmConfig`, the six tile fields for a `TileConfig`."""
    if isinstance(config, GmmConfig):
        return [config.family, *dataclasses.astuple(config.tiles), config.splits]
    return list(dataclasses.astuple(config))


def decode_config(fields: list) -> GmmConfig | TileConfig:
    """`encode_config`'s inverse; also reads tune files written before kernel families had names,
    whose seventh field was a bool choosing the group-major kernel."""
    if isinstance(fields[0], str):
        return GmmConfig(fields[0], TileConfig(*fields[1:7]), *fields[7:])
    if len(fields) == 7:
        return GmmConfig("group_major" if fields[6] else "row_tile", TileConfig(*fields[:6]))
    return TileConfig(*fields)


def load_tuned(path) -> dict:
    """`{shape name: {kernel: GmmConfig or TileConfig}}` from the `best` summary of a `tune` JSON."""
    if not path:
        return {}
    with open(path) as f:
        best = json.load(f)["summary"]
    out: dict = {}
    for key, v in best.items():
        shape, kernel = (p.strip() for p in key.split("|"))
        out.setdefault(shape, {})[kernel] = decode_config(v["config"])
    return out


@dataclasses.dataclass
class Case:
    """One benchmark row group: a shape, a skew, its inputs and what was measured."""

    shape: S.GemmShape
    skew: str
    counts: np.ndarray
    inputs: dict
    configs: dict
    times: dict = dataclasses.field(default_factory=dict)
    rec: dict = dataclasses.field(default_factory=dict)


def _mgpu(x, w, gs):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, block_m=128, block_n=128, block_k=64,
                                      max_concurrent_steps=4, grid_block_n=1, transpose_rhs=True)


def _prefill_jobs(case: Case):
    x, w, dy, gs = (case.inputs[k] for k in ("x", "w", "dy", "gs"))
    cfg = case.configs
    fwd, dgrad, wgrad = cfg.get("fwd"), cfg.get("dgrad"), cfg.get("wgrad")
    reps = reps_for(case.shape.m * case.shape.n * 2, cap=10)

    def ours_fb(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x, w: grouped_linear(x, w, gs, fwd_config=fwd, dgrad_config=dgrad,
                                                     wgrad_config=wgrad), x, w)
        return (y, *vjp(dy))

    # Forward+backward keeps two calls' outputs alive, weight gradient included (14 GiB at the
    # DeepSeek-V3 shape: three of them ran out of memory on 2026-11-30).
    fb_reps = max(2, min(reps // 3, reps_for(case.shape.e * case.shape.n * case.shape.k * 2)))
    jobs = [
        ("ours", lambda x, w, gs: gmm(x, w, gs, config=fwd), [(x, w, gs)], reps),
        ("ours_fb", ours_fb, [(x, w, gs, dy)], fb_reps),
        ("mgpu", _mgpu, [(x, w, gs)], reps),
    ]
    # XLA's ragged_dot can materialise a dense [E, M, K] masked operand (16 GiB at the Qwen3
    # shape, 112 GiB at the DeepSeek-V3 one: out of memory on 2026-11-30), and its backward more;
    # it runs forward only, where that operand fits (`w_ekn` is built only then).
    if case.inputs["w_ekn"] is not None:
        jobs.append(("ragged_dot", jax.lax.ragged_dot, [(x, case.inputs["w_ekn"], gs)], 2))
    return jobs


def _ragged_dot_fits(shape: S.GemmShape) -> bool:
    return shape.e * shape.m * shape.k * 2 <= RAGGED_DOT_MAX_BYTES


def _decode_jobs(case: Case):
    x, ws, gs = case.inputs["x"], case.inputs["ws"], case.inputs["gs"]
    shape = case.shape
    cfg = case.configs.get("fwd") or gmm_config(shape.m, shape.n, shape.k, shape.e)
    tiles = cfg.tiles if isinstance(cfg, GmmConfig) else cfg
    tiles_kernel = lambda x, w, gs: gmm_row_tile_pallas(x, w, gs, transpose_rhs=True, tiles=tiles,
                                                          out_dtype=x.dtype, precision=jax.lax.Precision.DEFAULT,
                                                          interpret=False)
    case.rec["configs"] = {"fwd": encode_config(cfg), "tiles_kernel": encode_config(tiles)}
    return [
        ("ours", lambda x, w, gs: gmm(x, w, gs, config=cfg), [(x, w, gs) for w in ws], 40),
        ("ours_tiles_kernel", tiles_kernel, [(x, w, gs) for w in ws], 40),
        ("ragged_dot", jax.lax.ragged_dot, [(x, jnp.swapaxes(w, 1, 2), gs) for w in ws[:2]], 10),
    ]


def torch_offsets(counts: np.ndarray):
    """`torch._grouped_mm`'s `offs`: the end row of each group, int32 on the GPU."""
    torch = _torch()
    return torch.as_tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")


def torch_forward_backward(tx, tw, tdy, offs):
    """A call of `torch._grouped_mm`'s forward and autograd backward (dx, dw) on copies of `tx`, `tw`."""
    torch = _torch()
    txg = tx.detach().clone().requires_grad_(True)
    twg = tw.detach().clone().requires_grad_(True)

    def run():
        out = torch._grouped_mm(txg, twg.transpose(-2, -1), offs=offs)
        return torch.autograd.grad(out, (txg, twg), tdy)

    return run


def _err_vs_torch(case: Case, w, tx, tw, offs) -> float:
    """Relative error of our forward (`case`'s fwd config) against `torch._grouped_mm` on `w`."""
    ty = _torch()._grouped_mm(tx, tw.transpose(-2, -1), offs=offs)
    y = jax.jit(lambda x, w, gs: gmm(x, w, gs, config=case.configs.get("fwd")))(case.inputs["x"], w, case.inputs["gs"])
    return rel_err(jnp.asarray(y, jnp.float32), ty.float().cpu().numpy())


def _torch_prefill(case: Case, quick: bool):
    torch = _torch()
    shape = case.shape
    tx, tw, tdy = (to_torch(case.inputs[k]) for k in ("x", "w", "dy"))
    offs = torch_offsets(case.counts)
    reps = reps_for(shape.m * shape.n * 2, cap=10)
    case.rec["rel_err_vs_torch"] = _err_vs_torch(case, case.inputs["w"], tx, tw, offs)
    t = case.times
    t["torch"] = time_torch(lambda: torch._grouped_mm(tx, tw.transpose(-2, -1), offs=offs), [()], reps=reps)
    t["torch_fb"] = attempt(time_torch, torch_forward_backward(tx, tw, tdy, offs), [()], reps=max(2, reps // 3),
                            graph=False)
    if not quick:
        from parity.reference import grouped_gemm

        full = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), offs])
        t["seed_triton"] = attempt(time_torch, lambda: grouped_gemm.grouped_mm(tx, tw, full), [()], reps=2,
                                trials=3, graph=False)
    a = torch.empty(shape.m, shape.k, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty(shape.k, shape.n, dtype=torch.bfloat16, device="cuda").normal_()
    t["dense"] = time_torch(lambda: a @ b, [()], reps=reps)


def _torch_decode(case: Case):
    torch = _torch()
    offs = torch_offsets(case.counts)
    tx = to_torch(case.inputs["x"])
    tws = [to_torch(w) for w in case.inputs["ws"]]
    case.rec["rel_err_vs_torch"] = _err_vs_torch(case, case.inputs["ws"][0], tx, tws[0], offs)
    case.times["torch"] = time_torch(lambda w: torch._grouped_mm(tx, w.transpose(-2, -1), offs=offs),
                                     [(w,) for w in tws], reps=40)


def _print_prefill(case: Case):
    times, flops, rec = case.times, case.rec["flops"], case.rec

    def tf(key, mult=1):
        t = times.get(key)
        return "   -  " if t is None else f"{flops * mult / t / 1e12:6.0f}"

    def ratio(a, b):
        return "  -  " if times.get(a) is None or times.get(b) is None else f"{times[b] / times[a]:5.2f}"

    print(f"  {rec['shape']:<22} {rec['skew']:<8} fwd TF/s ours {tf('ours')} torch {tf('torch')} "
          f"x{ratio('ours', 'torch')} | ragged_dot {tf('ragged_dot')} mgpu {tf('mgpu')} seed {tf('seed_triton')} "
          f"dense {tf('dense')} | f+b ours {tf('ours_fb', 3)} torch {tf('torch_fb', 3)} x{ratio('ours_fb', 'torch_fb')} "
          f"| err {rec.get('rel_err_vs_torch', float('nan')):.1e}", flush=True)


def _print_decode(case: Case, copy_tbps: float):
    times, wbytes = case.times, case.rec["weight_bytes"]

    def bw(key):
        t = times.get(key)
        return "    -     " if t is None else f"{wbytes / t / 1e12:4.2f} ({wbytes / t / 1e12 / copy_tbps:4.2f})"

    def us(key):
        t = times.get(key)
        return "   -  " if t is None else f"{t * 1e6:6.1f}"

    print(f"  decode T={case.rec['tokens']:<4} active={case.rec['active']:<3} {wbytes / 1e6:6.1f} MB | us: ours {us('ours')} "
          f"tiles-kernel {us('ours_tiles_kernel')} torch {us('torch')} ragged_dot {us('ragged_dot')} | TB/s (x copy): "
          f"ours {bw('ours')} tiles-kernel {bw('ours_tiles_kernel')} torch {bw('torch')} | "
          f"err {case.rec.get('rel_err_vs_torch', float('nan')):.1e}", flush=True)


def compile_all(specs):
    """`compile_jax(fn, arg_sets, reps=reps)` of every `(fn, arg_sets, reps)` in `specs`, in
    parallel threads; an exception in place of the executable where one does not compile."""
    def build(spec):
        fn, arg_sets, reps = spec
        try:
            return compile_jax(fn, arg_sets, reps=reps)
        except Exception as e:  # a peer or candidate that cannot compile a shape is reported, not fatal
            return e

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 8)) as pool:
        return list(pool.map(build, specs))


def cmd_run(args):
    torch = _torch()
    tuned = load_tuned(args.configs)
    copy = measure_copy_tbps()
    print(f"copy bandwidth: {copy:.2f} TB/s (read + write)", flush=True)
    cases: list[Case] = []
    jobs = []
    for shape in (S.PREFILL[:1] if args.quick else S.PREFILL):
        x, (w,), dy, _ = make_inputs(shape, S.balanced_counts(shape.m, shape.e))
        w_ekn = jnp.swapaxes(w, 1, 2) if _ragged_dot_fits(shape) else None  # a copy: 14 GiB at DeepSeek-V3
        for skew in ("balanced", "zipf"):
            counts = S.balanced_counts(shape.m, shape.e) if skew == "balanced" else S.zipf_counts(
                shape.m, shape.e, cap=shape.tokens)
            gs = jnp.asarray(counts, jnp.int32)
            case = Case(shape, skew, counts, dict(x=x, w=w, dy=dy, w_ekn=w_ekn, gs=gs), tuned.get(shape.name, {}))
            case.rec = dict(shape=shape.name, skew=skew, m=shape.m, e=shape.e, k=shape.k, n=shape.n,
                            flops=2 * int(counts.sum()) * shape.n * shape.k, max_count=int(counts.max()),
                            active=int((counts > 0).sum()),
                            configs={k: encode_config(v) for k, v in case.configs.items()})
            cases.append(case)
            jobs += [(case, *j) for j in _prefill_jobs(case)]
    # Every bucket shares these weights, rotated over 4 copies: one bucket's active experts fit in L2.
    _, ws, _, _ = make_inputs(S.decode_shape(1), S.decode_counts(1), seed=7, weight_sets=4)
    for tokens in S.DECODE_TOKENS:
        shape = S.decode_shape(tokens)
        counts = S.decode_counts(tokens)
        x = jax.random.normal(jax.random.PRNGKey(tokens), (shape.m, shape.k), jnp.bfloat16)
        case = Case(shape, "decode", counts, dict(x=x, ws=ws, gs=jnp.asarray(counts, jnp.int32)),
                    tuned.get(shape.name, {}))
        active = int((counts > 0).sum())
        case.rec = dict(shape=shape.name, skew="decode", m=shape.m, e=shape.e, k=shape.k, n=shape.n, tokens=tokens,
                        active=active, weight_bytes=active * shape.n * shape.k * 2, copy_tbps=copy)
        cases.append(case)
        jobs += [(case, *j) for j in _decode_jobs(case)]
    print(f"compiling {len(jobs)} JAX executables ...", flush=True)
    built = compile_all([job[2:] for job in jobs])
    for (case, key, *_), b in zip(jobs, built):
        if isinstance(b, Exception):
            print(f"    [skipped] {case.shape.name} {case.skew} {key}: {type(b).__name__}: {str(b).splitlines()[0][:150]}")
            case.times[key] = None
        else:
            try:
                case.times[key] = time_compiled(*b, trials=5)
            except jax.errors.JaxRuntimeError as e:  # e.g. a peer running out of memory
                print(f"    [failed] {case.shape.name} {case.skew} {key}: {str(e).splitlines()[0][:150]}")
                case.times[key] = None
    rows = []
    for case in cases:
        if case.skew == "decode":
            _torch_decode(case)
            _print_decode(case, copy)
            for impl, t in case.times.items():
                rows.append({**case.rec, "impl": impl, "seconds": t,
                             "tbps": None if t is None else case.rec["weight_bytes"] / t / 1e12})
        else:
            _torch_prefill(case, args.quick)
            _print_prefill(case)
            for impl, t in case.times.items():
                f = case.rec["flops"] * (3 if impl.endswith("_fb") else 1)
                rows.append({**case.rec, "impl": impl, "seconds": t, "tflops": None if t is None else f / t / 1e12})
        torch.cuda.empty_cache()
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
    deck = {r["shape"]: r["tbps"] / copy for r in rows if r["skew"] == "decode" and r["impl"] == "ours_tiles_kernel" and r["tbps"]}
    return {
        "fwd_geomean_ours_over_torch": _geomean(fwd), "target_fwd": 0.8,
        "fwdbwd_geomean_ours_over_torch": _geomean(fb), "target_fwdbwd": 0.7,
        "fwd_geomean_speedup_over_ragged_dot": _geomean(rd),
        "decode_fraction_of_copy_bw": dec, "decode_tiles_kernel_fraction_of_copy_bw": deck, "target_decode": 0.7,
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
_DECODE_TILES = [
    TileConfig(16, 32, 256, 4, 3, 1), TileConfig(16, 64, 128, 4, 4, 1), TileConfig(16, 64, 256, 4, 3, 1),
    TileConfig(16, 16, 256, 4, 3, 1), TileConfig(16, 32, 512, 4, 3, 1), TileConfig(16, 128, 128, 4, 4, 1),
]
# Each decode tile shape with the row-tile schedule and the group-major launch, and the first three
# with split-K over 2, 4 and 8 programs.
DECODE_CANDIDATES = ([GmmConfig(family, t) for t in _DECODE_TILES for family in ("row_tile", "group_major")]
                     + [GmmConfig("split_k", t, splits=s) for t in _DECODE_TILES[:3] for s in (2, 4, 8)])


def cmd_tune(args):
    rows: list = []
    prefill = () if args.only == "decode" else S.PREFILL[:2] if args.quick else S.PREFILL
    decode = () if args.only == "prefill" else S.DECODE_TOKENS
    jobs = []  # (label dict, fn, arg_sets, reps)
    for shape in prefill:
        counts = S.balanced_counts(shape.m, shape.e)
        x, (w,), dy, gs = make_inputs(shape, counts)
        reps = reps_for(shape.m * max(shape.n, shape.k) * 2, cap=8)
        for c in FWD_CANDIDATES:
            jobs.append((dict(shape=shape.name, kernel="fwd", config=encode_config(c)),
                         lambda x, w, gs, c=c: gmm(x, w, gs, config=c), [(x, w, gs)], reps, shape))
            jobs.append((dict(shape=shape.name, kernel="dgrad", config=encode_config(c)),
                         lambda dy, w, gs, c=c: gmm(dy, w, gs, transpose_rhs=False, config=c), [(dy, w, gs)], reps, shape))
        wreps = reps_for(shape.e * shape.n * shape.k * 2, cap=6)
        for c in TGMM_CANDIDATES:
            jobs.append((dict(shape=shape.name, kernel="wgrad", config=encode_config(c)),
                         lambda x, dy, gs, c=c: tgmm(x, dy, gs, config=c), [(x, dy, gs)], wreps, shape))
    for tokens in decode:
        shape = S.decode_shape(tokens)
        x, ws, _, gs = make_inputs(shape, S.decode_counts(tokens), weight_sets=4)
        for c in DECODE_CANDIDATES:
            jobs.append((dict(shape=shape.name, kernel="fwd", config=encode_config(c)),
                         lambda x, w, gs, c=c: gmm(x, w, gs, config=c), [(x, w, gs) for w in ws], 20, shape))

    print(f"compiling {len(jobs)} candidates ...", flush=True)
    built = compile_all([job[1:4] for job in jobs])
    for (label, *_, shape), b in zip(jobs, built):
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
        python=platform.python_version(), command="python -m benchmarks.gmm " + " ".join(sys.argv[1:]), **extra,
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
    sub.choices["tune"].add_argument("--only", choices=("all", "prefill", "decode"), default="all",
                                     help="sweep only the prefill shapes or only the decode buckets")
    sub.choices["run"].add_argument("--configs", default=None,
                                    help="a `tune` JSON: use its best config per shape and kernel instead of the table")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        p.error("this benchmark needs a CUDA GPU (jax.default_backend() is %r)" % jax.default_backend())
    {"run": cmd_run, "tune": cmd_tune}[args.cmd](args)


if __name__ == "__main__":
    main()
