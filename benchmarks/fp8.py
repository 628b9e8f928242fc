"""FP8 grouped GEMMs on one GPU: our blockwise-FP8 kernel (`moe_jax.ops.gmm.fp8_api.gmm_fp8`)
against our bf16 `gmm`, `torch._grouped_mm` (bf16) and `torch._scaled_grouped_mm` (FP8, rowwise
scales: torch's own FP8 grouped GEMM), in one process on the same inputs; then the differentiable
linear layer forward+backward (`fp8_grouped_linear` vs `grouped_linear`, one pass per step and
four micro-batches accumulated in one `lax.scan`, FP8 also with the weights quantized once before
the loop), the weights'
quantization (XLA's `quantize_weights` against the fused kernel, alone and with the input
gradient's `[E, K, N]` copy as a second output), decode with FP8 weights against copy bandwidth, and the dense ceilings (`torch._scaled_mm`
FP8 and bf16 `mm`, 8192^3).

    python -m benchmarks.fp8 [--json OUT.json] [--sections gemm,fb,quantize,decode,dense] [--variants]

Effective TFLOP/s count 2 M N K per GEMM (the routed rows only). The `gemm` section also times the
input gradient's FP8 product (`dy` `[M, N]` against the weights' `[E, K, N]` copy the linear's
forward keeps) on `auto` and on each FP8 kernel (`dgrad_tflops`). Every kernel result is checked
against the recipe's fp32 reference (`gmm_fp8_reference`) before it is timed (relative error
printed). Decode bytes: the active experts' e4m3 weights and their scales (FP8) or bf16 weights,
read once; the ratio is to the measured copy bandwidth (read + write bytes per second).
Quantization (`quantize`): XLA's `quantize_weights` (and `transpose_weights`) against the fused
kernel (`moe_jax.ops.quantize`, with and without the `[E, K, N]` copy; with --variants also other
num_warps), the kernel's bits checked against XLA's first; bytes: the bf16 weights read once, each
e4m3 layout and the fp32 scales written once, in GB/s and as a fraction of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import shapes as S
from benchmarks.gmm import attempt, make_inputs, measure_copy_tbps, reps_for, to_torch, torch_offsets
from benchmarks.timing import compile_jax, run_meta, time_compiled, time_torch
from moe_jax.ops import TileConfig, gmm, grouped_linear
from moe_jax.ops.fp8 import quantize_rows, quantize_weights, transpose_weights
from moe_jax.ops.fp8_linear import fp8_grouped_linear, fp8_weight_copies
from moe_jax.ops.gmm.fp8_api import fp8_kernel, fp8_tiles, gmm_fp8
from moe_jax.ops.gmm.mosaic_gpu.fp8_kernel import Fp8MosaicTiles
from moe_jax.ops.gmm.reference import gmm_fp8_reference
from moe_jax.ops.quantize import quantize_master_weights
from moe_jax.ops.quantize.backends import NUM_WARPS
from moe_jax.ops.quantize.kernel import quantize_weights_pallas

VARIANTS = (  # tile candidates timed beside the rule's choice with --variants
    TileConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3, group_m=8),
    TileConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, group_m=8),
    TileConfig(block_m=128, block_n=64, block_k=128, num_warps=4, num_stages=4, group_m=8),
    TileConfig(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=3, group_m=8),
)

DECODE_VARIANTS = (  # decode tile candidates timed beside the rule's choice with --variants
    TileConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=6, group_m=1),
    TileConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4, group_m=1),
    TileConfig(block_m=16, block_n=32, block_k=128, num_warps=2, num_stages=8, group_m=1),
    TileConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, group_m=1),
)

MOSAIC_TILES = (  # Mosaic FP8 candidates timed beside the rule's choice with --variants
    Fp8MosaicTiles(tile_n=128, stages=4), Fp8MosaicTiles(tile_n=128, stages=5), Fp8MosaicTiles(tile_n=256, stages=3),
)

MICRO_BATCHES = 4  # the f+b section's gradient-accumulation rows


def _tflops(m, n, k, t):
    return 2 * m * n * k / t / 1e12 if t else None


def _rel(a, b) -> float:
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _head_ref(rows, wq, counts, groups: int = 2):
    """The recipe's fp32 reference for the first `groups` experts' rows (the checked slice): the
    fp32 reference of the whole shape costs more than the benchmark."""
    from moe_jax.ops.fp8 import Fp8Rows, Fp8Weights

    m = int(counts[:groups].sum())
    head = Fp8Rows(rows.values_MK[:m], rows.scale_MKb[:m])
    return m, jax.jit(gmm_fp8_reference)(head, Fp8Weights(wq.values_ENK[:groups], wq.scale_ENbKb[:groups]),
                                         jnp.asarray(counts[:groups], jnp.int32))


def _time_jax(fn, args, reps):
    run, reps = compile_jax(fn, [args], reps=reps)
    return time_compiled(run, reps)


def torch_fp8_rowwise(tx, tw):
    """Rowwise e4m3 operands for `torch._scaled_grouped_mm`: per-row scales of x `[M]` and per
    output channel of each expert's weights `[E, N]` (the rowwise scaling torch's FP8 grouped GEMM takes on Hopper)."""
    import torch

    fmax = torch.finfo(torch.float8_e4m3fn).max
    sx = tx.float().abs().amax(dim=1).clamp(min=1e-12) / fmax
    xq = (tx.float() / sx[:, None]).to(torch.float8_e4m3fn)
    sw = tw.float().abs().amax(dim=2).clamp(min=1e-12) / fmax  # [E, N]
    wq = (tw.float() / sw[:, :, None]).to(torch.float8_e4m3fn)
    return xq, sx, wq, sw


def gemm_rows(shape: S.GemmShape, variants: bool) -> dict:
    import torch

    counts = S.balanced_counts(shape.m, shape.e)
    x, (w,), dy, gs = make_inputs(shape, counts)
    rows, wq = jax.jit(quantize_rows)(x), jax.jit(quantize_weights)(w)
    reps = reps_for(shape.m * shape.n * 2)
    rec = dict(shape=shape.name, m=shape.m, e=shape.e, k=shape.k, n=shape.n, times={}, errors={}, dgrad_times={})
    head, ref = _head_ref(rows, wq, counts)
    rec["rule_tiles"] = str(fp8_tiles(shape.m, shape.n, shape.k, shape.e))
    rec["auto_kernel"] = fp8_kernel(shape.m, shape.n, shape.k, shape.e)
    # `auto` (the default), each kernel at its rule, and with --variants the tile candidates.
    runs = [("auto", "auto", None), ("triton", "triton", None), ("mosaic", "mosaic_gpu", None)]
    if variants:
        runs += [(f"triton {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}", "triton", t) for t in VARIANTS]
        runs += [(f"mosaic 128x{t.tile_n} s{t.stages}", "mosaic_gpu", t) for t in MOSAIC_TILES]
    for label, backend, cfg in runs:
        fn = jax.jit(lambda r, w_, g, b=backend, cfg=cfg: gmm_fp8(r, w_, g, backend=b, config=cfg,
                                                                  out_dtype=jnp.bfloat16))
        out = attempt(fn, rows, wq, gs)
        if out is None:
            continue
        rec["errors"][f"fp8 {label}"] = _rel(out[:head], ref)
        rec["times"][f"fp8 {label}"] = _time_jax(fn, (rows, wq, gs), reps)
    # The input gradient's product on the weights' [E, K, N] copy (what the linear's forward keeps):
    # dy [M, N] quantized per 1 x 128 tile, contracted over N; K outputs.
    dy_rows, wq_t = jax.jit(quantize_rows)(dy), jax.jit(transpose_weights)(wq)
    for label, backend in (("auto", "auto"), ("triton", "triton"), ("mosaic", "mosaic_gpu")):
        fn = jax.jit(lambda r, w_, g, b=backend: gmm_fp8(r, w_, g, backend=b, out_dtype=jnp.bfloat16))
        if attempt(fn, dy_rows, wq_t, gs) is not None:
            rec["dgrad_times"][f"fp8 {label}"] = _time_jax(fn, (dy_rows, wq_t, gs), reps)
    del dy_rows, wq_t
    bf = jax.jit(lambda a, b, g: gmm(a, b, g))
    rec["times"]["bf16 ours"] = _time_jax(bf, (x, w, gs), reps)
    rec["errors"]["bf16 ours"] = _rel(bf(x, w, gs)[:head], ref)
    offs = torch_offsets(counts)
    tx, tw = to_torch(x), to_torch(w)
    rec["times"]["bf16 torch"] = attempt(time_torch, lambda: torch._grouped_mm(tx, tw.transpose(-2, -1), offs=offs),
                                         [()], reps=reps)
    xq, sx, twq, sw = torch_fp8_rowwise(tx, tw)
    scaled = lambda: torch._scaled_grouped_mm(xq, twq.transpose(-2, -1), sx, sw, offs=offs,  # noqa: E731
                                               out_dtype=torch.bfloat16, use_fast_accum=True)
    out = attempt(scaled)
    if out is not None:
        rec["errors"]["fp8 torch rowwise"] = _rel(out[:head].float().cpu().numpy(), ref)
        rec["times"]["fp8 torch rowwise"] = time_torch(scaled, [()], reps=reps)
    del tx, tw, xq, twq
    rec["tflops"] = {k: _tflops(shape.m, shape.n, shape.k, t) for k, t in rec["times"].items() if t}
    rec["dgrad_tflops"] = {k: _tflops(shape.m, shape.n, shape.k, t) for k, t in rec["dgrad_times"].items() if t}
    return rec


def fb_rows(shape: S.GemmShape) -> dict:
    """Forward + backward of the grouped linear layer (dx and dw), FP8 recipe vs bf16."""
    counts = S.balanced_counts(shape.m, shape.e)
    x, (w,), dy, gs = make_inputs(shape, counts)
    # Two calls' weight gradients stay live across the timing barrier: at DeepSeek-V3's 15 GB of
    # bf16 weights per call (and the e4m3 layouts beside them), one call per program.
    reps = max(1, min(6, (20 << 30) // (shape.e * shape.n * shape.k * 2)))

    def step(lin):
        def f(x, w, gs, dy):
            y, vjp = jax.vjp(lambda a, b: lin(a, b, gs), x, w)
            return y, *vjp(dy)
        return jax.jit(f)

    def accumulated(lin, once: bool = False):
        """MICRO_BATCHES forward+backward passes in one `lax.scan`, the weight gradient summed in
        fp32 (gradient accumulation). The weights are loop-invariant, yet XLA's GPU compiler leaves
        the FP8 quantization kernel in the loop; with `once` the weights are quantized before it
        (`fp8_weight_copies`) and every micro-batch reads the copies. Timed per micro-batch."""
        def f(xs, w, gs, dys):
            extra = {"copies": fp8_weight_copies(w, backend="auto")} if once else {}

            def body(acc, operands):
                y, vjp = jax.vjp(lambda a, b: lin(a, b, gs, **extra), operands[0], w)
                dx, dw = vjp(operands[1])
                return acc + dw.astype(jnp.float32), (y, dx)
            return jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), (xs, dys))
        return jax.jit(f)

    fp8_linear = lambda a, b, g, **kw: fp8_grouped_linear(a, b, g, backend="auto", **kw)  # noqa: E731
    fp8, bf = step(fp8_linear), step(lambda a, b, g: grouped_linear(a, b, g))
    y8, dx8, dw8 = fp8(x, w, gs, dy)
    yb, dxb, dwb = bf(x, w, gs, dy)
    rec = dict(shape=shape.name, errors=dict(y=_rel(y8, yb), dx=_rel(dx8, dxb), dw=_rel(dw8, dwb)))
    rec["times"] = {"fp8 f+b": _time_jax(fp8, (x, w, gs, dy), reps), "bf16 f+b": _time_jax(bf, (x, w, gs, dy), reps)}
    del y8, dx8, dw8, yb, dxb, dwb
    # Micro-batches: the same rows, scaled, so no two passes are the same computation.
    xs = jnp.stack([x * (1 + i / 8) for i in range(MICRO_BATCHES)]).astype(x.dtype)
    dys = jnp.stack([dy * (1 - i / 8) for i in range(MICRO_BATCHES)]).astype(dy.dtype)
    for name, lin, once in (("fp8 f+b, micro-batch", fp8_linear, False),
                            ("fp8 f+b, micro-batch, quantized once", fp8_linear, True),
                            ("bf16 f+b, micro-batch", grouped_linear, False)):
        t = attempt(_time_jax, accumulated(lin, once), (xs, w, gs, dys), 1)
        rec["times"][name] = t / MICRO_BATCHES if t else None
    rec["tflops"] = {k: _tflops(shape.m, shape.n, shape.k, t) * 3 for k, t in rec["times"].items() if t}
    return rec


QUANTIZE_WARPS = (4, 8)  # the fused kernel's num_warps timed beside its defaults with --variants


def _same_bits(got, want) -> bool:
    """Whether two `Fp8Weights` hold the same bits (values and scales), compared on the device."""
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8 if a.dtype.itemsize == 1 else jnp.uint32)  # noqa: E731
    return all(bool(jnp.array_equal(bits(g), bits(w))) for g, w in zip(got, want))


def quantize_records(shape: S.GemmShape, copy_tbps: float, variants: bool = False) -> dict:
    """The weights `[E, N, K]` of `shape` quantized alone and with the `[E, K, N]` copy as a second
    output (what `fp8_grouped_linear`'s forward writes for its backward), by XLA
    (`quantize_weights`, `transpose_weights`) and by the fused kernel (`quantize_master_weights` on
    `pallas_triton`), each fused result checked bit for bit against XLA's before it is timed:
    milliseconds, GB/s on the minimal bytes (the weights read once, each e4m3 layout and its fp32
    scales written once) and that rate as a fraction of copy bandwidth."""
    _, (w,), _, _ = make_inputs(shape, S.balanced_counts(shape.m, shape.e))
    params = shape.e * shape.n * shape.k
    scales = shape.e * -(-shape.n // 128) * -(-shape.k // 128) * 4
    read = params * w.dtype.itemsize
    one, two = read + params + scales, read + 2 * (params + scales)

    def xla_pair(v):
        q = quantize_weights(v)
        return q, transpose_weights(q)

    def fused(transposed, num_warps=None):
        """The kernel's outputs as a tuple of `Fp8Weights` (one, or two with the copy)."""
        if num_warps is None:
            return lambda v: quantize_master_weights(v, transposed=True, backend="pallas_triton") if transposed else (
                quantize_master_weights(v, backend="pallas_triton"),)
        return lambda v: tuple(q for q in quantize_weights_pallas(v, transposed=transposed, num_warps=num_warps,
                                                                   interpret=False) if q is not None)

    ways = {"xla": (quantize_weights, one), "xla + transposed": (xla_pair, two)}
    rec = dict(shape=shape.name, e=shape.e, n=shape.n, k=shape.k, ms={}, gbps={}, of_copy={}, bit_equal={})
    want = jax.jit(xla_pair)(w)
    fused_ways = {"fused": (fused(False), one), "fused + transposed": (fused(True), two)}
    for transposed in (False, True) if variants else ():
        for nw in (nw for nw in QUANTIZE_WARPS if nw != NUM_WARPS[transposed]):
            fused_ways[f"fused{' + transposed' if transposed else ''} w{nw}"] = (fused(transposed, nw),
                                                                                  two if transposed else one)
    for name, (fn, nbytes) in fused_ways.items():
        got = jax.jit(fn)(w)
        rec["bit_equal"][name] = all(_same_bits(g, r) for g, r in zip(got, want))
        ways[name] = (fn, nbytes)
    del want, got
    # Two calls' outputs stay live across the timing barrier (DeepSeek-V3: 15 GB of bf16 weights).
    reps = max(2, min(10, (24 << 30) // (5 * params)))
    for name, (fn, nbytes) in ways.items():
        t = _time_jax(fn, (w,), reps)
        rec["ms"][name] = t * 1e3
        rec["gbps"][name] = nbytes / t / 1e9
        rec["of_copy"][name] = nbytes / t / 1e12 / copy_tbps
    return rec


def decode_rows(copy_tbps: float, variants: bool = False) -> list[dict]:
    out = []
    for tokens in (1, 8, 32, 128):
        shape = S.decode_shape(tokens)
        counts = S.decode_counts(tokens)
        x, (w,), _, gs = make_inputs(shape, counts)
        rows, wq = jax.jit(quantize_rows)(x), jax.jit(quantize_weights)(w)
        active = int((counts > 0).sum())
        fp8_bytes = active * shape.n * shape.k + active * (-(-shape.n // 128)) * (-(-shape.k // 128)) * 4
        bf_bytes = active * shape.n * shape.k * 2
        f8 = jax.jit(lambda r, w_, g: gmm_fp8(r, w_, g, backend="triton", out_dtype=jnp.bfloat16))
        bf = jax.jit(lambda a, b, g: gmm(a, b, g))
        ref = jax.jit(gmm_fp8_reference)(rows, wq, gs)
        rec = dict(tokens=tokens, active_experts=active, error=_rel(f8(rows, wq, gs), ref),
                   tiles=str(fp8_tiles(shape.m, shape.n, shape.k, shape.e)))
        rec["fp8 s"] = _time_jax(f8, (rows, wq, gs), 50)
        rec["bf16 s"] = _time_jax(bf, (x, w, gs), 50)
        rec["fp8 of copy"] = fp8_bytes / rec["fp8 s"] / 1e12 / (copy_tbps / 2)
        rec["bf16 of copy"] = bf_bytes / rec["bf16 s"] / 1e12 / (copy_tbps / 2)
        for cfg in DECODE_VARIANTS if variants else ():
            fn = jax.jit(lambda r, w_, g, cfg=cfg: gmm_fp8(r, w_, g, backend="triton", config=cfg,
                                                           out_dtype=jnp.bfloat16))
            label = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
            got = attempt(fn, rows, wq, gs)
            if got is not None:
                t = _time_jax(fn, (rows, wq, gs), 50)
                rec.setdefault("variants", {})[label] = dict(s=t, of_copy=fp8_bytes / t / 1e12 / (copy_tbps / 2),
                                                             error=_rel(got, ref))
        out.append(rec)
    return out


def dense_rows() -> dict:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t8 = time_torch(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
                    [()], reps=20)
    tb = time_torch(lambda: a @ b, [()], reps=20)
    return {"fp8 _scaled_mm TFLOP/s": _tflops(n, n, n, t8), "bf16 mm TFLOP/s": _tflops(n, n, n, tb)}


def _fmt_err(v):
    return "-" if v is None else f"{v:.2e}"


def _fmt(v):
    return "-" if v is None else f"{v:.0f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the records here")
    p.add_argument("--sections", default="dense,gemm,fb,quantize,decode")
    p.add_argument("--shapes", default=None, help="indices into benchmarks.shapes.PREFILL (default all)")
    p.add_argument("--variants", action="store_true",
                   help="also time the tile candidates of VARIANTS (gemm) and DECODE_VARIANTS (decode), and "
                        "QUANTIZE_WARPS (quantize)")
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - {"dense", "gemm", "fb", "quantize", "decode"})
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from dense, gemm, fb, quantize, decode")
    shapes = [S.PREFILL[int(i)] for i in args.shapes.split(",")] if args.shapes else list(S.PREFILL)
    result = dict(meta=run_meta("python -m benchmarks.fp8 " + " ".join(argv if argv is not None else sys.argv[1:])))
    if "dense" in sections:
        result["dense"] = dense_rows()
        print("dense 8192^3:", {k: round(v) for k, v in result["dense"].items()}, flush=True)
    if "gemm" in sections:
        result["gemm"] = []
        for shape in shapes:
            rec = gemm_rows(shape, args.variants)
            result["gemm"].append(rec)
            print(shape.name, "auto:", rec["auto_kernel"], "| triton rule", rec["rule_tiles"], flush=True)
            for k in rec["times"]:
                print(f"  {k:28s} {_fmt(rec['tflops'].get(k)):>6} TFLOP/s  err {rec['errors'].get(k, float('nan')):.2e}",
                      flush=True)
            for k, v in rec["dgrad_tflops"].items():
                print(f"  dgrad {k:22s} {_fmt(v):>6} TFLOP/s", flush=True)
    if "fb" in sections:
        result["fb"] = []
        for shape in shapes:
            rec = fb_rows(shape)
            result["fb"].append(rec)
            print(shape.name, "f+b", {k: _fmt(v) for k, v in rec["tflops"].items()},
                  {k: f"{v:.1e}" for k, v in rec["errors"].items()}, flush=True)
    if "quantize" in sections or "decode" in sections:
        result["copy_tbps"] = copy = measure_copy_tbps()
    if "quantize" in sections:
        result["quantize"] = []
        for shape in shapes:
            rec = quantize_records(shape, copy, args.variants)
            result["quantize"].append(rec)
            print(shape.name, "quantize", {k: f"{v:.3f} ms ({rec['of_copy'][k]:.2f} of copy)" for k, v in rec["ms"].items()},
                  "bit-equal:", rec["bit_equal"] or "-", flush=True)
        print("\n| shape | way | ms | GB/s | of copy | bit-equal to XLA |")
        print("|---|---|---|---|---|---|")
        for rec in result["quantize"]:
            for k, ms in rec["ms"].items():
                print(f"| {rec['shape']} | {k} | {ms:.3f} | {rec['gbps'][k]:.0f} | {rec['of_copy'][k]:.2f} | "
                      f"{rec['bit_equal'].get(k, '-')} |")
    if "decode" in sections:
        result["decode"] = decode_rows(copy, args.variants)
        for rec in result["decode"]:
            print(f"decode T={rec['tokens']:4d} fp8 {rec['fp8 s'] * 1e6:7.1f} us ({rec['fp8 of copy']:.2f} of copy) "
                  f"bf16 {rec['bf16 s'] * 1e6:7.1f} us ({rec['bf16 of copy']:.2f})  err {rec['error']:.1e}", flush=True)
            for label, v in rec.get("variants", {}).items():
                print(f"    {label:18s} {v['s'] * 1e6:7.1f} us ({v['of_copy']:.2f} of copy)  err {v['error']:.1e}",
                      flush=True)
    if "gemm" in sections:
        print("\n| shape | ours FP8 (auto) | ours bf16 | torch bf16 | torch FP8 rowwise | FP8/bf16 ours | FP8/torch FP8 |")
        print("|---|---|---|---|---|---|---|")
        for rec in result["gemm"]:
            tf = rec["tflops"]
            best = tf.get("fp8 auto")
            bfo, t8 = tf.get("bf16 ours"), tf.get("fp8 torch rowwise")
            print(f"| {rec['shape']} | {_fmt(best)} | {_fmt(bfo)} | {_fmt(tf.get('bf16 torch'))} | {_fmt(t8)} | "
                  f"{best / bfo if best and bfo else float('nan'):.2f} | {best / t8 if best and t8 else float('nan'):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
