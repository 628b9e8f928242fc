"""The Qwen3-30B-A3B down weight gradient (`tgmm` on `triton`, `auto`'s prefill choice) beside
`torch._grouped_mm(dy^T, x, offs)` (what torch autograd runs), balanced and Zipf-skewed: each run
twice after compiling, for Nsight Compute to read the kernels' counters (GPU only).

    benchmarks/gpu_run.sh jax-triton wgrad-ncu     # ncu over this script, then the table
    python -m benchmarks.wgrad_profile table NCU.csv   # ncu's CSV, one line per kernel run (no GPU)
"""

from __future__ import annotations

import collections
import csv
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp

from benchmarks import shapes as S
from benchmarks.gmm import make_inputs, to_torch, torch_offsets
from moe_jax.ops import tgmm


def table(path: str) -> list[str]:
    """One line per profiled kernel run of ncu's `--csv` log: its name and every metric
    (durations in ns, bytes, percentages of peak), CUTLASS's setup kernel left out."""
    with open(path) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    col = {name: i for i, name in enumerate(rows[0])}
    runs: dict = collections.OrderedDict()
    for r in rows[1:]:
        runs.setdefault((r[col["ID"]], r[col["Kernel Name"]]), {})[r[col["Metric Name"]]] = r[col["Metric Value"]]
    return [f"{i} {name[:48]}: " + " | ".join(f"{m.split('.')[0]}={v}" for m, v in metrics.items())
            for (i, name), metrics in runs.items() if "prepare_grouped_gemm" not in name]


def run() -> int:
    import torch

    shape = S.PREFILL[1]
    for skew in ("balanced", "zipf"):
        counts = (S.balanced_counts(shape.m, shape.e) if skew == "balanced"
                  else S.zipf_counts(shape.m, shape.e, cap=shape.tokens))
        x, _, dy, _ = make_inputs(shape, counts)
        gs = jnp.asarray(counts, jnp.int32)
        ours = jax.jit(lambda x, d, gs: tgmm(x, d, gs, backend="triton"))
        for _ in range(2):
            ours(x, dy, gs).block_until_ready()
        tx, tdy, offs = to_torch(x), to_torch(dy), torch_offsets(counts)
        for _ in range(2):
            torch._grouped_mm(tdy.t(), tx, offs=offs)
        torch.cuda.synchronize()
        print(shape.name, skew, "ran", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"] and len(argv) == 2:
        print("\n".join(table(argv[1])))
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    return run()


if __name__ == "__main__":
    sys.exit(main())
