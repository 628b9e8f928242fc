"""The combine's forward and backward (`moe_jax.permute.combine`) against the same computation left
to autodiff, in one process on the same inputs. `combine`'s backward gathers each packed row's
token cotangent through `order_R`; autodiff transposes the forward's gather `y_RD[inverse_R]` into
a scatter of `[R, D]` rows, declared unique (`inverse_R` is a permutation) or, with plain
indexing, one XLA must assume may repeat indices (atomics, or on a GPU its deterministic scatter's
sort).

    python -m benchmarks.combine [--json OUT.json]

At the layer shapes of `benchmarks.layer` (bf16 rows, balanced random routing): ms per forward +
backward (the gradients of `y_RD` and of the weights). The outputs and the rows' gradients are
checked equal first; the weight gradient sums over D in another order, so its largest relative
difference is reported.
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

OURS, UNIQUE, PLAIN = "combine", "autodiff, unique scatter", "autodiff, plain indexing"


def autodiff_combine(y_RD, weights_TK, packing, *, unique: bool):
    """`combine`'s forward (no mask) with the backward autodiff gives it: the gather's transpose."""
    num_tokens, top_k = weights_TK.shape
    valid_TK1 = (packing.inverse_R < jnp.sum(packing.group_sizes_E)).reshape(num_tokens, top_k, 1)
    y_TKD = y_RD.at[packing.inverse_R].get(unique_indices=unique)
    y_TKD = y_TKD.reshape(num_tokens, top_k, y_RD.shape[1]).astype(jnp.float32)
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

    fns = {OURS: step(combine), UNIQUE: step(lambda a, b, p: autodiff_combine(a, b, p, unique=True)),
           PLAIN: step(lambda a, b, p: autodiff_combine(a, b, p, unique=False))}
    got = {name: jax.jit(fn)(y, w, ct) for name, fn in fns.items()}
    (y0, dy0, dw0) = got[OURS]
    rec = dict(shape=shape.name, equal=all(bool(jnp.array_equal(y0, o)) and bool(jnp.array_equal(dy0, dy))
                                           for o, dy, _ in got.values()),
               dw_max_rel_diff=max(float(jnp.max(jnp.abs(dw0 - dw)) / jnp.max(jnp.abs(dw))) for _, _, dw in got.values()),
               ms={})
    for name, fn in fns.items():
        run, reps = compile_jax(fn, [(y, w, ct)], reps=20)
        rec["ms"][name] = time_compiled(run, reps) * 1e3
    for name in (UNIQUE, PLAIN):
        rec[f"{name} / combine"] = rec["ms"][name] / rec["ms"][OURS]
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
    print(f"\n| shape | {OURS} f+b ms | {UNIQUE} ms | {PLAIN} ms | unique / combine | plain / combine | equal | dw max rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['shape']} | {r['ms'][OURS]:.3f} | {r['ms'][UNIQUE]:.3f} | {r['ms'][PLAIN]:.3f} | "
              f"{r[f'{UNIQUE} / combine']:.2f} | {r[f'{PLAIN} / combine']:.2f} | {r['equal']} | {r['dw_max_rel_diff']:.1e} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
