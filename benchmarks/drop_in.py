"""Drop-in checks on one GPU: a converted Hugging Face block against the same layer built
natively, and the layer compiled on user meshes.

    python -m benchmarks.drop_in [--tokens 4096] [--json PATH]

1. Converted vs native: a transformers `Qwen3MoeSparseMoeBlock` at the Qwen3-30B-A3B shape
   (D = 2048, F = 768, E = 128, top-8, `norm_topk_prob`), random weights, read by
   `moe_jax.convert.from_hf` into a bf16 `MoE`; the same layer built with the `MoE` constructor
   and given the same weights. Both run forward + backward (input and every weight) on the same
   tokens: outputs must be bit-identical and the times equal within noise (conversion adds no
   copy, cast or layout change to the step).
2. User meshes on the GPUs this host has: a `("data", "fsdp", "expert")` mesh with
   `AxisRules`, Explicit axes; `make_mesh(axis_type=Explicit)`; and a layer without a mesh under
   `jax.set_mesh` on batch-sharded input. Each compiles with the Pallas kernels (inside
   `shard_map`) and matches the no-mesh layer to the bf16 tolerance; times beside it.

Times: `benchmarks.timing` (median over trials of back-to-back calls in one program).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from benchmarks.timing import compile_jax, time_compiled
from moe_jax import convert
from moe_jax.layers import MoE, SharedExperts
from moe_jax.parallel import AxisRules, make_mesh
from moe_jax.routing import SoftmaxTopK
from moe_jax.testing import rel_err, tolerance

D, F, E, K = 2048, 768, 128, 8


def _step(graph):
    """Forward + backward of the layer (`graph` + state) on x: loss, d state, dx."""

    def loss(state, x):
        y, stats = nnx.merge(graph, state)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2) * 1e-6 + 1e-2 * stats.aux_loss, y

    def step(state, x):
        (value, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return value, y, grads

    return step


def _time(layer, x, reps: int = 10) -> tuple[float, jax.Array]:
    graph, state = nnx.split(layer)
    step = _step(graph)
    y = jax.jit(step)(state, x)[1]
    run, reps = compile_jax(step, [(state, x)], reps=reps)
    return time_compiled(run, reps, trials=5), y


def converted_vs_native(tokens: int) -> dict:
    import torch
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    config = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                                         norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=16,
                                         num_key_value_heads=4, vocab_size=128)
    torch.manual_seed(0)
    block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    converted = convert.from_hf(block, config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    native = MoE(D, F, E, K, router=SoftmaxTopK(K, renormalize=True), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                 rngs=nnx.Rngs(0))
    nnx.update(native, nnx.state(converted))
    x = jax.random.normal(jax.random.PRNGKey(0), (tokens, D), jnp.bfloat16)
    t_native, y_native = _time(native, x)
    t_conv, y_conv = _time(converted, x)
    return dict(case=f"Qwen3-30B-A3B block T={tokens}", native_ms=t_native * 1e3, converted_ms=t_conv * 1e3,
                ratio=t_conv / t_native, bit_identical=bool(np.array_equal(np.asarray(y_native), np.asarray(y_conv))))


def user_meshes(tokens: int) -> list[dict]:
    devices = jax.devices()
    n = len(devices)
    base = MoE(1024, 512, 64, 4, shared_experts=SharedExperts(1), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.PRNGKey(1), (tokens, 1024), jnp.bfloat16)
    t_base, y_base = _time(base, x, reps=5)
    rows = [dict(case="no mesh", ms=t_base * 1e3, rel_err=0.0)]
    user = jax.make_mesh((1, 1, n), ("data", "fsdp", "expert"), axis_types=(AxisType.Explicit,) * 3, devices=devices)
    explicit = make_mesh(ep=n, data=1, devices=devices, axis_type=AxisType.Explicit)
    batch = jax.make_mesh((n,), ("batch",), axis_types=(AxisType.Explicit,), devices=devices)
    cases = [
        ("data x fsdp x expert, Explicit", user, dict(mesh=user, axis_rules=AxisRules(("data", "fsdp", "expert"),
                                                                                      "expert")), x),
        ("make_mesh Explicit", explicit, dict(mesh=explicit), x),
        ("no mesh, ambient Explicit batch", batch, {}, None),
    ]
    for name, mesh, kw, inputs in cases:
        layer = MoE(1024, 512, 64, 4, shared_experts=SharedExperts(1), dtype=jnp.bfloat16, rngs=nnx.Rngs(1), **kw)
        with jax.set_mesh(mesh):
            xs = inputs if inputs is not None else jax.device_put(x, NamedSharding(mesh, PartitionSpec("batch")))
            t, y = _time(layer, xs, reps=5)
        err = rel_err(jnp.asarray(y, jnp.float32), jnp.asarray(y_base, jnp.float32))
        rows.append(dict(case=name, ms=t * 1e3, rel_err=err, ok=err <= tolerance(jnp.bfloat16)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error(f"this benchmark needs a GPU (jax.default_backend() is {jax.default_backend()!r})")
    conv = converted_vs_native(args.tokens)
    print(f"{conv['case']}: native {conv['native_ms']:.3f} ms, converted {conv['converted_ms']:.3f} ms "
          f"(x{conv['ratio']:.3f}), outputs bit-identical: {conv['bit_identical']}", flush=True)
    meshes = user_meshes(args.tokens)
    for r in meshes:
        print(f"  {r['case']:<36} {r['ms']:8.3f} ms  rel err vs no mesh {r['rel_err']:.1e}", flush=True)
    failed = not conv["bit_identical"] or not all(r.get("ok", True) for r in meshes)
    if args.json:
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    device=jax.devices()[0].device_kind, jax=jax.__version__,
                    command="python -m benchmarks.drop_in " + " ".join(sys.argv[1:]))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, converted=conv, meshes=meshes), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
