"""The whole MoE layer, forward + backward, against a torch layer on `torch._grouped_mm` (GPU only).

    python -m benchmarks.layer [--shapes 0,1,2] [--variants auto,static,triton] [--json PATH]

Shapes (routed experts only, top-k softmax routing renormalised, bf16 weights and activations):
Qwen3-30B-A3B (T=4096, D=2048, F=768, top-8 of 128), Mixtral-8x7B (T=8192, D=4096, F=14336,
top-2 of 8), DeepSeek-V3 (T=4096, D=7168, F=2048, top-8 of 256).

Ours: `moe_jax.layers.MoE` (one variant per `--variants` entry: `auto` the default layer, whose
`backend="auto"` picks per kernel (`moe_jax.ops.gmm.plan`); `pallas` all on
`pallas_triton`; `static` that with `GemmOptions(kernel="static")`; `triton` all GEMMs on `triton`; `mosaic` all on
`mosaic_gpu`; `mosaic-dgrad` / `mosaic-fwd-dgrad` the default's table (`moe_jax.ops.BackendTable`)
with the prefill input gradient / forward and input gradient on `mosaic_gpu` where it takes the
shapes; `fused` / `separate` the default with `row_gather` forced either way; `fp8` the routed
experts in blockwise FP8 with trainable master weights, `GemmOptions(quantization=Fp8Blockwise())`,
its error to the bf16 torch layer the recipe's quantization), the gradient of
`sum(y**2)` with respect to the input and every parameter, jitted; device memory is the compiled
step's footprint (`memory_analysis`: arguments + outputs + temporaries - aliased).
Torch: the same weights and tokens through router (fp32 logits, softmax, top-k, renormalise), a
stable sort by expert, the row gather, `torch._grouped_mm` for gate, up and down, SwiGLU, the
weighted combine (`index_add_`), and autograd for every gradient; memory is
`torch.cuda.max_memory_allocated` over the step (parameters and inputs included).
Each variant's output is compared with the torch layer's (relative error in the records).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.gmm import to_torch
from benchmarks.timing import compile_jax, run_meta, time_compiled, time_torch
from moe_jax.layers import Fp8Blockwise, GemmOptions, MoE
from moe_jax.ops import H200_BACKENDS
from moe_jax.routing import SoftmaxTopK


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
            "fp8": dict(quantization=Fp8Blockwise()),
            "mosaic-dgrad": dict(backend=H200_BACKENDS.replace({("gmm_nn", "prefill"): MOSAIC_FIRST})),
            "mosaic-fwd-dgrad": dict(backend=H200_BACKENDS.replace({("gmm_nt", "prefill"): MOSAIC_FIRST,
                                                                    ("gmm_nn", "prefill"): MOSAIC_FIRST}))}


def _layer(shape: LayerShape, **gemm) -> MoE:
    """The layer at `shape` with `GemmOptions(**gemm)` (built here, not at import: a `triton`
    backend is checked against the platform when built)."""
    return MoE(shape.d_model, shape.d_ff, shape.experts, shape.top_k, router=SoftmaxTopK(shape.top_k, renormalize=True),
               dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, gemm=GemmOptions(**gemm), rngs=nnx.Rngs(0))


def _ours(layer: MoE, x, reps: int):
    graph, state = nnx.split(layer)

    def step(state, x):
        def loss(state, x):
            y, _ = nnx.merge(graph, state)(x)
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return y, grads

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
    return time_compiled(run, reps, trials=5), footprint, y


def _device_bytes() -> int:
    return jax.devices()[0].memory_stats().get("bytes_limit", 0)


def torch_layer(params: dict, x, top_k: int):
    """The torch MoE layer: returns the loss, output and gradients of (x, router, gate, up, down)."""
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
    gate = torch._grouped_mm(xs, wg.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(xs, wu.transpose(-2, -1), offs=offs)
    h = torch.nn.functional.silu(gate) * up
    ys = torch._grouped_mm(h, wd.transpose(-2, -1), offs=offs)
    ys = ys * weights.flatten()[order, None].to(ys.dtype)
    y = torch.zeros_like(x).index_add_(0, token, ys)
    loss = (y.float() ** 2).sum()
    grads = torch.autograd.grad(loss, (x, wr, wg, wu, wd))
    return y, grads, idx


def _torch_side(layer: MoE, x, top_k: int, reps: int):
    import torch

    params = {k: to_torch(getattr(layer, k)[...]).detach().clone().requires_grad_(True)
              for k in ("w_router", "w_gate", "w_up", "w_down")}
    tx = to_torch(x).detach().clone().requires_grad_(True)
    y, _, idx = torch_layer(params, tx, top_k)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch_layer(params, tx, top_k)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    t = time_torch(lambda: torch_layer(params, tx, top_k), [()], reps=reps, trials=5, graph=False)
    return t, peak, y.detach(), idx


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))))
    p.add_argument("--variants", default="auto,pallas,static,triton")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch

    rows = []
    for i in (int(s) for s in args.shapes.split(",")):
        shape = SHAPES[i]
        base = _layer(shape)
        x = jax.random.normal(jax.random.PRNGKey(1), (shape.tokens, shape.d_model), jnp.bfloat16)
        t_torch, peak_torch, y_torch, idx_torch = _torch_side(base, x, shape.top_k, args.reps)
        torch.cuda.empty_cache()
        row = dict(shape=shape.name, **dataclasses.asdict(shape), flops=shape.flops, torch_ms=t_torch * 1e3,
                   torch_peak_gib=peak_torch / 2**30, variants={})
        for v in args.variants.split(","):
            layer = _layer(shape, **VARIANTS[v])
            nnx.update(layer, nnx.state(base))
            try:
                t, footprint, y = _ours(layer, x, args.reps)
            except Exception as e:  # a variant that cannot run here is reported, not fatal
                row["variants"][v] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                print(f"  {shape.name} {v}: {row['variants'][v]['error']}", flush=True)
                continue
            yf = np.asarray(y, np.float32)
            tf = y_torch.float().cpu().numpy()
            err = float(np.linalg.norm(yf - tf) / max(np.linalg.norm(tf), 1e-30))
            row["variants"][v] = dict(ms=t * 1e3, footprint_gib=footprint / 2**30, torch_over_ours=t_torch / t,
                                      tflops=shape.flops / t / 1e12, rel_err_vs_torch=err)
            print(f"  {shape.name:<14} {v:<7} {t * 1e3:8.3f} ms ({shape.flops / t / 1e12:5.0f} TF/s) | torch "
                  f"{t_torch * 1e3:8.3f} ms | torch/ours x{t_torch / t:4.2f} | memory ours {footprint / 2**30:6.2f} "
                  f"GiB torch {peak_torch / 2**30:6.2f} GiB | rel err {err:.1e}", flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=run_meta("python -m benchmarks.layer " + " ".join(sys.argv[1:])), rows=rows), f,
                      indent=1)
    print("\nshape | variant | ms | torch ms | torch/ours | GiB ours | GiB torch")
    for r in rows:
        for v, rec in r["variants"].items():
            if "ms" in rec:
                print(f"{r['shape']} | {v} | {rec['ms']:.3f} | {r['torch_ms']:.3f} | {rec['torch_over_ours']:.2f} | "
                      f"{rec['footprint_gib']:.2f} | {r['torch_peak_gib']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
