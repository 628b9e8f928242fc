"""The whole MoE layer, forward + backward, against a torch layer on `torch._grouped_mm` (GPU only).

    python -m benchmarks.layer [--shapes 0,1,2] [--variants auto,static,triton,fp8] [--micro-batches N] [--json PATH]

Shapes (routed experts only, top-k softmax routing renormalised, bf16 weights and activations):
Qwen3-30B-A3B (T=4096, D=2048, F=768, top-8 of 128), Mixtral-8x7B (T=8192, D=4096, F=14336,
top-2 of 8), DeepSeek-V3 (T=4096, D=7168, F=2048, top-8 of 256; its torch peer's weights alias
ours through DLPack, so it fits beside ours on an 80 GB H100; torch's FP8 layer does not).

Ours: `moe_jax.layers.MoE` (one variant per `--variants` entry: `auto` the default layer, whose
`backend="auto"` picks per kernel (`moe_jax.ops.gmm.plan`); `pallas` all on
`pallas_triton`; `static` that with `GemmOptions(kernel="static")`; `triton` all GEMMs on `triton`; `mosaic` all on
`mosaic_gpu`; `mosaic-dgrad` / `mosaic-fwd-dgrad` the default's table (`moe_jax.ops.BackendTable`)
with the prefill input gradient / forward and input gradient on `mosaic_gpu` where it takes the
shapes; `fused` / `separate` the default with `row_gather` forced either way; `fused-gate-up` the
default with gate and up as one `[E, 2F, D]` weight (`GemmOptions(fused_gate_up=True)`);
`fp32-params` the default with the layer's default fp32 variables (bf16 compute); `fp8` the routed
experts in blockwise FP8 with trainable master weights, `GemmOptions(quantization=Fp8Blockwise())`,
its error to the bf16 torch layer the recipe's quantization (`row_gather="auto"`: each token row
quantized once and its e4m3 bytes gathered); `fp8-gather` that with `row_gather="fused"` named;
`fp8-once` that with the master weights quantized once per step, before its micro-batch loop
(`MoE.fp8_weight_copies()`, read by every micro-batch's call: `fp8_copies=`; with one pass the
same work as `fp8`); `fp8-packed` with `row_gather="separate"` (the bf16 rows packed first); `fp8-fp32-params` with
fp32 master weights; `fp8-triton` that with every FP8 product on the Triton FP8 kernel
(`auto` takes the Mosaic GPU one where it runs the shape); `fp8-master-dgrad` with the input
gradients from the master weights in bf16, `Fp8Blockwise(input_gradient="master")` (no e4m3 weights
kept for the backward); `fp8-stored` with
stored e4m3 weights, `Fp8Blockwise(weights="stored")`: no weight quantization and no weight
gradient, the rest of the step as `fp8`), the gradient of
`sum(y**2)` with respect to the input and every parameter, jitted; device memory is the compiled
step's footprint (`memory_analysis`: arguments + outputs + temporaries - aliased). With
`--micro-batches N` our step accumulates N micro-batches of the shape's tokens in one `lax.scan`
(gradient accumulation, `grad_step`), timed per micro-batch: what a training step that
accumulates pays per pass, where work that depends only on the weights (FP8's weight
quantization) need not repeat; the torch layers still run one pass.
Torch: the same weights and tokens through router (fp32 logits, softmax, top-k, renormalise), a
stable sort by expert, the row gather, `torch._grouped_mm` for gate, up and down, SwiGLU, the
weighted combine (`index_add_`), and autograd for every gradient; memory is
`torch.cuda.max_memory_allocated` over the step (parameters and inputs included).
Each variant's output is compared with the torch layer's (relative error in the records).

Torch FP8 (timed once per shape when `fp8` is among the variants, so `fp8` has an FP8 peer): the
same torch layer with its three expert GEMMs on `torch_fp8_grouped_linear`, the rowwise recipe of
torchao's FP8 MoE training on Hopper: rows per row and weights per (expert, output channel) in
e4m3, amax / 448 scales, `torch._scaled_grouped_mm` (fast accumulation, bf16 out); the input
gradient in FP8 too (dy per row, the transposed weights per (expert, k)); the weight gradient in
bf16 on `torch._grouped_mm`, as ours is (torchao also quantizes that one, and rounds its scales
to powers of two). It keeps the bf16 rows and weights for the backward and quantizes the weights
again, transposed, there. Its quantization is `torch.compile`d (fused amax, scale and cast kernels,
as torchao's Triton quantizers are; eager torch ops would make fp32 temporaries of every operand and
take 2-3x the step). Records: `torch_fp8_ms`,
`torch_fp8_peak_gib`, `torch_fp8_rel_err_vs_torch` (its output against the bf16 torch layer's) in
the shape's row, or `torch_fp8_error` when it cannot run the shape (`_scaled_grouped_mm` needs dims
that are multiples of 16); `torch_fp8_over_ours` in the `fp8` variant's record.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.fp8 import torch_fp8_rowwise
from benchmarks.gmm import to_torch
from benchmarks.timing import compile_jax, run_meta, time_compiled, time_torch
from moe_jax.experts import fuse_gate_up
from moe_jax.layers import Fp8Blockwise, GemmOptions, MoE, stored_fp8
from moe_jax.ops import H200_BACKENDS
from moe_jax.routing import SoftmaxTopK
from moe_jax.testing import rel_err


@dataclasses.dataclass(frozen=True)
class LayerShape:
    name: str
    tokens: int
    d_model: int
    d_ff: int
    experts: int
    top_k: int

    @property
    def flops(self) -> int:
        """Forward + backward FLOPs of the expert GEMMs (3 GEMMs, x3 for the two gradients)."""
        return 3 * 3 * 2 * self.tokens * self.top_k * self.d_model * self.d_ff


SHAPES = (
    LayerShape("qwen3-30b-a3b", 4096, 2048, 768, 128, 8),
    LayerShape("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
    LayerShape("deepseek-v3", 4096, 7168, 2048, 256, 8),
)
MOSAIC_FIRST = ("mosaic_gpu", "triton", "pallas_triton")  # Mosaic where it takes the shapes, else as `auto`
VARIANTS = {"auto": dict(), "pallas": dict(backend="pallas_triton"), "static": dict(backend="pallas_triton", kernel="static"),
            "triton": dict(backend="triton"), "separate": dict(row_gather="separate"),
            "fused": dict(row_gather="fused"), "mosaic": dict(backend="mosaic_gpu"),
            "fused-gate-up": dict(fused_gate_up=True),
            "fp32-params": dict(param_dtype=jnp.float32),  # the layer's default: fp32 variables, bf16 compute
            "fp8-fp32-params": dict(param_dtype=jnp.float32, quantization=Fp8Blockwise()),
            "fp8": dict(quantization=Fp8Blockwise()),
            "fp8-once": dict(quantization=Fp8Blockwise()),  # its step: `grad_step(quantize_once=True)`
            "fp8-gather": dict(quantization=Fp8Blockwise(), row_gather="fused"),
            "fp8-packed": dict(quantization=Fp8Blockwise(), row_gather="separate"),
            "fp8-triton": dict(backend="triton", quantization=Fp8Blockwise()),
            "fp8-stored": dict(quantization=Fp8Blockwise(weights="stored")),
            "fp8-master-dgrad": dict(quantization=Fp8Blockwise(input_gradient="master")),
            "mosaic-dgrad": dict(backend=H200_BACKENDS.replace({("gmm_nn", "prefill"): MOSAIC_FIRST})),
            "mosaic-fwd-dgrad": dict(backend=H200_BACKENDS.replace({("gmm_nt", "prefill"): MOSAIC_FIRST,
                                                                    ("gmm_nn", "prefill"): MOSAIC_FIRST}))}

# Variants whose step quantizes the FP8 master weights once, before its micro-batch loop.
QUANTIZED_ONCE = ("fp8-once",)


def build_layer(shape: LayerShape, param_dtype=jnp.bfloat16, **gemm) -> MoE:
    """The bf16 layer at `shape` with `param_dtype` variables and `GemmOptions(**gemm)` (built here,
    not at import: a `triton` backend is checked against the platform when built)."""
    return MoE(shape.d_model, shape.d_ff, shape.experts, shape.top_k, router=SoftmaxTopK(shape.top_k, renormalize=True),
               dtype=jnp.bfloat16, param_dtype=param_dtype, gemm=GemmOptions(**gemm), rngs=nnx.Rngs(0))


def variant_layer(base: MoE, shape: LayerShape, variant: str) -> MoE:
    """The layer of `VARIANTS[variant]` at `shape` holding `base`'s variables (for stored FP8,
    base's experts quantized once)."""
    gemm = VARIANTS[variant]
    if gemm.get("quantization") is not None and gemm["quantization"].stored:
        return stored_fp8(base)
    layer = build_layer(shape, **gemm)
    if gemm.get("fused_gate_up"):  # base's gate and up weights as one [E, 2F, D] weight
        layer.w_router[...], layer.w_down[...] = base.w_router[...], base.w_down[...]
        layer.w_gate_up[...] = fuse_gate_up(base.w_gate[...], base.w_up[...])
        return layer
    # In the variant's own dtypes (fp32 parameters hold base's bf16 values exactly).
    nnx.update(layer, jax.tree.map(lambda mine, a: a.astype(mine.dtype), nnx.state(layer), nnx.state(base)))
    return layer


def grad_step(layer: MoE, micro_batches: int = 1, quantize_once: bool = False):
    """`(step, state)`: `step(state, x) -> (y, grads)` is the layer's forward and backward (the
    gradients of `sum(y^2)` for its variables and `x`), as a training step runs it; `state` is the
    layer's variables. With `micro_batches` N > 1, `x` is `[N, T, D]` and the step is gradient
    accumulation: one forward and backward per micro-batch in a `lax.scan`, the variables'
    gradients summed (in their own dtype), `y` and `x`'s gradient stacked. With `quantize_once`
    (FP8 master weights) the step makes `layer.fp8_weight_copies()` once, before its loop, and
    every micro-batch reads them."""
    graph, state = nnx.split(layer)

    def one(state, x, copies=None):
        def loss(state, x):
            y, _ = nnx.merge(graph, state)(x, fp8_copies=copies)
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return y, grads

    def copies_of(state):
        return nnx.merge(graph, state).fp8_weight_copies() if quantize_once else None

    if micro_batches == 1:
        return (lambda state, x: one(state, x, copies_of(state))), state

    def accumulated(state, xs):
        copies = copies_of(state)

        def body(acc, x):
            y, (g_state, g_x) = one(state, x, copies)
            return jax.tree.map(jnp.add, acc, g_state), (y, g_x)

        zeros = jax.tree.map(jnp.zeros_like, state)
        acc, (ys, g_xs) = jax.lax.scan(body, zeros, xs)
        return ys, (acc, g_xs)

    return accumulated, state


def micro_batch_tokens(x_TD: jax.Array, micro_batches: int) -> jax.Array:
    """`x` alone for one micro-batch, else `[N, T, D]`: micro-batch i is `x * (1 + i / 8)` (the
    first is `x`; no two are the same computation)."""
    if micro_batches == 1:
        return x_TD
    return jnp.stack([x_TD * (1 + i / 8) for i in range(micro_batches)]).astype(x_TD.dtype)


def _ours(layer: MoE, x, reps: int, micro_batches: int = 1, quantize_once: bool = False):
    """(seconds per micro-batch, footprint bytes, output of the micro-batch that is `x`)."""
    step, state = grad_step(layer, micro_batches, quantize_once)
    x = micro_batch_tokens(x, micro_batches)
    compiled = jax.jit(step).lower(state, x).compile()
    mem = compiled.memory_analysis()
    footprint = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    y, grads = compiled(state, x)
    if 3 * footprint < _device_bytes():
        run, reps = compile_jax(step, [(state, x)], reps=reps)
    else:  # two steps' gradients do not fit beside each other (DeepSeek-V3): time one call per dispatch
        del grads
        run, reps = (lambda: compiled(state, x)[0]), 1
        y = run()
    t = time_compiled(run, reps, trials=5) / micro_batches
    return t, footprint, (y if micro_batches == 1 else y[0])


def _device_bytes() -> int:
    return jax.devices()[0].memory_stats().get("bytes_limit", 0)


def torch_grouped_linear(xs_MK, w_ENK, offs_E):
    """The bf16 expert GEMM of the torch layer: `y[M, N]`, each group of rows (ending at `offs_E`)
    times its expert's `w[e].T` on `torch._grouped_mm` (autograd gives dx and dw)."""
    import torch

    return torch._grouped_mm(xs_MK, w_ENK.transpose(-2, -1), offs=offs_E)


@functools.cache
def _fp8_grouped_linear():
    """The autograd Function of `torch_fp8_grouped_linear` (built on first use: torch is imported
    only by the torch side)."""
    import torch

    class Fp8GroupedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, xs_MK, w_ENK, offs_E, scaled_mm, quantize):
            xq_MK, sx_M, wq_ENK, sw_EN = quantize(xs_MK, w_ENK)
            ctx.save_for_backward(xs_MK, w_ENK, offs_E)
            ctx.scaled_mm, ctx.quantize = scaled_mm, quantize
            return scaled_mm(xq_MK, wq_ENK.transpose(-2, -1), sx_M, sw_EN, offs=offs_E, out_dtype=xs_MK.dtype,
                             use_fast_accum=True)

        @staticmethod
        def backward(ctx, dy_MN):
            xs_MK, w_ENK, offs_E = ctx.saved_tensors
            dy_MN = dy_MN.contiguous()  # `_grouped_mm` takes dy^T as the transposed view of row-major dy
            # Per (expert, k) scales reduce over N, so the weights are quantized from a [E, K, N] copy.
            dyq_MN, sdy_M, wtq_EKN, swt_EK = ctx.quantize(dy_MN, w_ENK.transpose(-2, -1).contiguous())
            dx_MK = ctx.scaled_mm(dyq_MN, wtq_EKN.transpose(-2, -1), sdy_M, swt_EK, offs=offs_E,
                                  out_dtype=dy_MN.dtype, use_fast_accum=True)
            dw_ENK = torch._grouped_mm(dy_MN.t(), xs_MK, offs=offs_E)
            return dx_MK, dw_ENK, None, None, None

    return Fp8GroupedLinear


def torch_fp8_grouped_linear(xs_MK, w_ENK, offs_E, scaled_mm=None, quantize=torch_fp8_rowwise):
    """`torch_grouped_linear` with the rowwise-FP8 recipe of torchao's MoE training on Hopper, but
    for its bf16 weight gradient and scales not rounded to powers of two.

    Forward: `xs [M, K]` quantized per row and `w [E, N, K]` per (expert, output channel), both
    over K, to e4m3 (scale amax / 448, clamped so an all-zero row or channel does not divide by
    zero: `benchmarks.fp8.torch_fp8_rowwise`); `y [M, N] = scaled_mm(xq, wq^T, sx, sw, offs)` in
    the rows' dtype. Backward: `dx [M, K]` in FP8 too, `dy` quantized per row over N and the
    weights, transposed to `[E, K, N]`, per (expert, k) over N; `dw [E, N, K]` unquantized in the
    rows' dtype (bf16 in the benchmark, like our FP8 layer's weight gradient),
    `torch._grouped_mm(dy^T, xs, offs)`. Kept for the backward: the unquantized rows and weights
    (the forward's FP8 operands are freed; the weights are quantized again, transposed).

    `offs_E`: int32 end row of each expert's group (equal ends are empty experts). `scaled_mm`: the
    scaled grouped product, called as `torch._scaled_grouped_mm` is (the default; CUDA only, its
    dims multiples of 16), so a test can pass an emulation on CPU. `quantize`: `torch_fp8_rowwise`
    or a compiled form of it (the benchmark's).
    """
    import torch

    return _fp8_grouped_linear().apply(xs_MK, w_ENK, offs_E, scaled_mm or torch._scaled_grouped_mm, quantize)


def torch_layer(params: dict, x, top_k: int, linear=torch_grouped_linear):
    """The torch MoE layer: returns its output, the gradients of `sum(y**2)` with respect to (x, router,
    gate, up, down) and the top-k expert ids.

    `linear(xs_MK, w_ENK, offs_E) -> y_MN` is each of the three expert GEMMs
    (`torch_grouped_linear` or `torch_fp8_grouped_linear`)."""
    import torch

    wr, wg, wu, wd = (params[k] for k in ("w_router", "w_gate", "w_up", "w_down"))
    num_experts = wr.shape[0]
    probs = torch.softmax(x.float() @ wr.float().t(), dim=-1)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // top_k
    offs = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    xs = x[token]
    gate = linear(xs, wg, offs)
    up = linear(xs, wu, offs)
    h = torch.nn.functional.silu(gate) * up
    ys = linear(h, wd, offs)
    ys = ys * weights.flatten()[order, None].to(ys.dtype)
    y = torch.zeros_like(x).index_add_(0, token, ys)
    loss = (y.float() ** 2).sum()
    grads = torch.autograd.grad(loss, (x, wr, wg, wu, wd))
    return y, grads, idx


def _torch_side(layer: MoE, x, top_k: int, reps: int, linear=torch_grouped_linear):
    """Time `torch_layer` with `linear` on `layer`'s weights and `x`: (seconds, peak bytes, output, top-k ids)."""
    import torch

    # The weights alias our layer's buffers (DLPack, no copy; nothing writes them): a copy would hold
    # a second set beside ours, which at DeepSeek-V3 (22.5 GB) does not fit an 80 GB card. They
    # count in torch's peak as the weights a torch layer holds.
    params = {k: to_torch(getattr(layer, k)[...]).detach().requires_grad_(True)
              for k in ("w_router", "w_gate", "w_up", "w_down")}
    weight_bytes = sum(w.numel() * w.element_size() for w in params.values())
    tx = to_torch(x).detach().clone().requires_grad_(True)
    y, _, idx = torch_layer(params, tx, top_k, linear)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch_layer(params, tx, top_k, linear)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() + weight_bytes
    t = time_torch(lambda: torch_layer(params, tx, top_k, linear), [()], reps=reps, trials=5, graph=False)
    return t, peak, y.detach(), idx


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))))
    p.add_argument("--variants", default="auto,pallas,static,triton")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--micro-batches", type=int, default=1,
                   help="N > 1: our step accumulates N micro-batches of the shape's tokens in one lax.scan "
                        "(timed per micro-batch; the torch layers run one pass)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.micro_batches < 1:
        p.error(f"--micro-batches={args.micro_batches}: pass 1 (one pass) or more.")
    import torch

    variants = args.variants.split(",")
    # Each distinct operand shape compiles once: six per layer shape (rows, dy, three weight layouts).
    torch._dynamo.config.recompile_limit = 64
    fp8_linear = functools.partial(torch_fp8_grouped_linear,
                                   quantize=torch.compile(torch_fp8_rowwise, dynamic=False))
    rows = []
    for i in (int(s) for s in args.shapes.split(",")):
        shape = SHAPES[i]
        base = build_layer(shape)
        x = jax.random.normal(jax.random.PRNGKey(1), (shape.tokens, shape.d_model), jnp.bfloat16)
        t_torch, peak_torch, y_torch, idx_torch = _torch_side(base, x, shape.top_k, args.reps)
        y_ref = y_torch.float().cpu().numpy()
        torch.cuda.empty_cache()
        row = dict(shape=shape.name, **dataclasses.asdict(shape), flops=shape.flops, micro_batches=args.micro_batches,
                   torch_ms=t_torch * 1e3,
                   torch_peak_gib=peak_torch / 2**30, variants={})
        if {"fp8", *QUANTIZED_ONCE} & set(variants):
            try:
                t8, peak8, y8, _ = _torch_side(base, x, shape.top_k, args.reps, fp8_linear)
            except Exception as e:  # e.g. `_scaled_grouped_mm`'s alignment: reported, not fatal
                row["torch_fp8_error"] = _error(e)
                print(f"  {shape.name} torch fp8: {row['torch_fp8_error']}", flush=True)
            else:
                row.update(torch_fp8_ms=t8 * 1e3, torch_fp8_peak_gib=peak8 / 2**30,
                           torch_fp8_rel_err_vs_torch=rel_err(y8.float().cpu().numpy(), y_ref))
                print(f"  {shape.name:<14} torch fp8 {t8 * 1e3:8.3f} ms | torch {t_torch * 1e3:8.3f} ms | memory "
                      f"{peak8 / 2**30:6.2f} GiB | rel err to torch {row['torch_fp8_rel_err_vs_torch']:.1e}",
                      flush=True)
            torch.cuda.empty_cache()
        for v in variants:
            layer = variant_layer(base, shape, v)
            try:
                t, footprint, y = _ours(layer, x, args.reps, args.micro_batches, v in QUANTIZED_ONCE)
            except Exception as e:  # a variant that cannot run here is reported, not fatal
                row["variants"][v] = dict(error=_error(e))
                print(f"  {shape.name} {v}: {row['variants'][v]['error']}", flush=True)
                continue
            err = rel_err(np.asarray(y, np.float32), y_ref)
            rec = row["variants"][v] = dict(ms=t * 1e3, footprint_gib=footprint / 2**30, torch_over_ours=t_torch / t,
                                            tflops=shape.flops / t / 1e12, rel_err_vs_torch=err)
            versus_fp8 = ""
            if v in ("fp8", *QUANTIZED_ONCE) and "torch_fp8_ms" in row:
                rec["torch_fp8_over_ours"] = row["torch_fp8_ms"] / rec["ms"]
                versus_fp8 = f" | torch fp8/ours x{rec['torch_fp8_over_ours']:4.2f}"
            per = f" per micro-batch of {args.micro_batches}" if args.micro_batches > 1 else ""
            print(f"  {shape.name:<14} {v:<7} {t * 1e3:8.3f} ms{per} ({shape.flops / t / 1e12:5.0f} TF/s) | torch "
                  f"{t_torch * 1e3:8.3f} ms | torch/ours x{t_torch / t:4.2f}{versus_fp8} | memory ours "
                  f"{footprint / 2**30:6.2f} GiB torch {peak_torch / 2**30:6.2f} GiB | rel err {err:.1e}", flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=run_meta("python -m benchmarks.layer " + " ".join(sys.argv[1:])), rows=rows), f,
                      indent=1)
    ours_ms = "ms per micro-batch" if args.micro_batches > 1 else "ms"
    print(f"\nshape | variant | {ours_ms} | torch ms | torch/ours | torch fp8/ours | GiB ours | GiB torch")
    for r in rows:
        for v, rec in r["variants"].items():
            if "ms" in rec:
                versus_fp8 = f"{rec['torch_fp8_over_ours']:.2f}" if "torch_fp8_over_ours" in rec else "-"
                print(f"{r['shape']} | {v} | {rec['ms']:.3f} | {r['torch_ms']:.3f} | {rec['torch_over_ours']:.2f} | "
                      f"{versus_fp8} | {rec['footprint_gib']:.2f} | {r['torch_peak_gib']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
