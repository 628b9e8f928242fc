"""The error an FP8 weight gradient would add, against the weight gradient the FP8 linear
computes today; numerics only (the operands quantized and dequantized, the products in float64),
so it runs anywhere.

    python -m benchmarks.fp8_wgrad_error [--json OUT.json] [--quick]

Legend: M packed rows, E groups (experts), C the layer input's width, O the output's; a weight
gradient is `dW[e] = dy_e^T x_e` `[E, O, C]`, contracted over each group's rows.

Today (`moe_jax.ops.fp8_linear`): the backward keeps the forward's FP8 rows (1 x 128 tiles along
C), dequantizes them to x's dtype (bf16) and multiplies them with the bf16 `dy`. An FP8 weight
gradient in DeepSeek-V3's recipe (arXiv:2412.19437, section 3.3) contracts over the rows, so both
operands are quantized per 128 x 1 tile (128 consecutive rows of one column, tiles laid from each
group's first row so that no tile spans two experts) and each 128-row step's partial sum is
promoted with its two scales; in exact arithmetic that equals the product of the dequantized
operands, which is what is computed here. Variants, each against `dy^T x` of the unquantized fp32
operands (relative Frobenius error over all experts, and the worst expert's):

- `today`: the dequantized FP8 rows in bf16 against bf16 `dy`;
- `fp8`: the saved FP8 rows dequantized and quantized again per 128 x 1 tile, `dy` quantized
  per 128 x 1 tile (what the backward can do without keeping more than today);
- `fp8-from-x`: x itself quantized per 128 x 1 tile (the backward would keep x in bf16 too);
- `dy-only`: today's rows against `dy` quantized per 128 x 1 tile (the share of the error `dy`'s
  quantization brings).

Data: `normal` (x and dy standard normal) and `outliers` (1% of x's channels 30x larger, as
activation outlier channels are; each row of dy scaled by a log-normal factor, as routing weights
and per-token losses spread them). Group sizes are ragged (an empty group, sizes not multiples
of 128).
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from moe_jax.ops.fp8 import BLOCK, dequantize_rows, quantize_rows

SHAPES = {  # name: (M, E, C, O), at Qwen3-30B-A3B's widths with 256 rows per expert on average
    "qwen3-gate-up": (8192, 32, 2048, 1536),
    "qwen3-down": (8192, 32, 768, 2048),
}
QUICK = {"small": (1024, 8, 256, 384)}
VARIANTS = ("today", "fp8", "fp8-from-x", "dy-only")


def group_sizes(m: int, e: int, rng: np.random.Generator) -> np.ndarray:
    """Ragged sizes summing to m: one empty group, the rest from a Dirichlet draw."""
    share = rng.dirichlet(np.full(e - 1, 2.0))
    sizes = np.floor(share * m).astype(np.int64)
    sizes[0] += m - sizes.sum()
    return np.concatenate([[0], sizes])


def operands(m: int, c: int, o: int, data: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x_MC = rng.standard_normal((m, c)).astype(np.float32)
    dy_MO = rng.standard_normal((m, o)).astype(np.float32)
    if data == "outliers":
        x_MC[:, rng.choice(c, max(1, c // 100), replace=False)] *= 30.0
        dy_MO *= rng.lognormal(0.0, 1.0, (m, 1)).astype(np.float32)
    return x_MC, dy_MO


def fp8_rows(a_MC: np.ndarray) -> np.ndarray:
    """`a` through the forward's FP8 rows (1 x 128 tiles along C), dequantized to fp32."""
    return np.asarray(dequantize_rows(quantize_rows(jnp.asarray(a_MC))), np.float32)


def fp8_columns(a_MC: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """`a` quantized per 128 x 1 tile, tiles laid from each group's first row, dequantized."""
    out, start = np.zeros_like(a_MC), 0
    for size in sizes:
        if size:
            pad = -size % BLOCK
            block = np.pad(a_MC[start:start + size], ((0, pad), (0, 0)))
            out[start:start + size] = fp8_rows(block.T).T[:size]
        start += size
    return out


def bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))


def weight_gradient(x_MC: np.ndarray, dy_MO: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """`[E, O, C]`, each group's `dy^T x` in float64."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return np.stack([dy_MO[a:b].astype(np.float64).T @ x_MC[a:b].astype(np.float64)
                     for a, b in zip(bounds[:-1], bounds[1:])])


def errors(dw: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(relative Frobenius error over all experts, the worst non-empty expert's)."""
    per = [np.linalg.norm(d - e) / np.linalg.norm(e) for d, e in zip(dw, exact) if np.linalg.norm(e) > 0]
    return float(np.linalg.norm(dw - exact) / np.linalg.norm(exact)), float(max(per))


def measure(name: str, shape: tuple[int, int, int, int], data: str, seed: int = 0) -> dict:
    m, e, c, o = shape
    rng = np.random.default_rng(seed)
    sizes = group_sizes(m, e, rng)
    x_MC, dy_MO = operands(m, c, o, data, rng)
    exact = weight_gradient(x_MC, dy_MO, sizes)
    saved = fp8_rows(x_MC)
    dy_cols = fp8_columns(dy_MO, sizes)
    lhs = {"today": (bf16(saved), bf16(dy_MO)), "fp8": (fp8_columns(saved, sizes), dy_cols),
           "fp8-from-x": (fp8_columns(x_MC, sizes), dy_cols), "dy-only": (bf16(saved), dy_cols)}
    rec = {"shape": name, "m": m, "e": e, "c": c, "o": o, "data": data, "group_sizes": sizes.tolist()}
    for variant in VARIANTS:
        total, worst = errors(weight_gradient(*lhs[variant], sizes), exact)
        rec[variant] = {"rel_err": total, "worst_expert": worst}
    return rec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    args = parser.parse_args(argv)
    shapes = QUICK if args.quick else SHAPES
    records = [measure(name, shape, data) for name, shape in shapes.items() for data in ("normal", "outliers")]
    print("| shape | data | " + " | ".join(VARIANTS) + " |")
    print("|---|---|" + "---|" * len(VARIANTS))
    for rec in records:
        cells = [f"{rec[v]['rel_err']:.2e} (worst {rec[v]['worst_expert']:.2e})" for v in VARIANTS]
        print(f"| {rec['shape']} | {rec['data']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
