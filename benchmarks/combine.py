"""The combine's forward and backward (`moe_jax.permute.combine`) against the same computation with
plain indexing, in one process on the same inputs: the backward of `y_RD[inverse_R]` is a scatter
that XLA must assume may repeat indices (atomics, or on a GPU its deterministic scatter's sort),
where `combine` declares them unique (`inverse_R` is a permutation).

    python -m benchmarks.combine [--json OUT.json]

At the layer shapes of `benchmarks.layer` (bf16 rows, balanced random routing): ms per forward +
backward (the gradients of `y_RD` and of the weights), both results checked equal first.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.layer import SHAPES
from benchmarks.timing import compile_jax, run_meta, time_compiled
from moe_jax.permute import combine, pack


def plain_combine(y_RD, weights_TK, packing):
    """`combine` without the unique-index declaration (no mask): the same values."""
    num_tokens, top_k = weights_TK.shape
    valid_TK1 = (packing.inverse_R < jnp.sum(packing.group_sizes_E)).reshape(num_tokens, top_k, 1)
    y_TKD = y_RD[packing.inverse_R].reshape(num_tokens, top_k, y_RD.shape[1]).astype(jnp.float32)
    y_TKD = jnp.where(valid_TK1, y_TKD, 0.0)
    w_TK1 = jnp.where(valid_TK1, weights_TK.astype(jnp.float32)[:, :, None], 0.0)
    return jnp.sum(w_TK1 * y_TKD, axis=1).astype(y_RD.dtype)


def rows(shape) -> dict:
    t, d, e, k = shape.tokens, shape.d_model, shape.experts, shape.top_k
    rng = np.random.default_rng(0)
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    y = jax.random.normal(jax.random.PRNGKey(1), (t * k, d), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.uniform(jax.random.PRNGKey(2), (t, k), jnp.float32)
    ct = jax.random.normal(jax.random.PRNGKey(3), (t, d), jnp.float32).astype(jnp.bfloat16)
    packing = jax.jit(lambda i: pack(i, e))(idx)

    def step(fn):
        def f(y, w, ct):
            out, vjp = jax.vjp(lambda a, b: fn(a, b, packing), y, w)
            return out, *vjp(ct)
        return f

    ours, plain = step(combine), step(plain_combine)
    got, want = jax.jit(ours)(y, w, ct), jax.jit(plain)(y, w, ct)
    rec = dict(shape=shape.name, equal=all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want)), ms={})
    for name, fn in (("combine (unique indices)", ours), ("plain indexing", plain)):
        run, reps = compile_jax(fn, [(y, w, ct)], reps=20)
        rec["ms"][name] = time_compiled(run, reps) * 1e3
    rec["plain / combine"] = rec["ms"]["plain indexing"] / rec["ms"]["combine (unique indices)"]
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = dict(meta=run_meta("python -m benchmarks.combine"), rows=[])
    for shape in SHAPES:
        rec = rows(shape)
        out["rows"].append(rec)
        print(json.dumps(rec), flush=True)
    print("\n| shape | combine f+b ms (unique) | plain indexing ms | plain / combine | equal |")
    print("|---|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['shape']} | {r['ms']['combine (unique indices)']:.3f} | {r['ms']['plain indexing']:.3f} | "
              f"{r['plain / combine']:.2f} | {r['equal']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
