"""Where a layer's forward+backward step spends its GPU time: one step of each variant of
`benchmarks.layer` at one of its shapes, each kernel's duration read by Nsight Compute, grouped by
kernel (a diagnosis; the figures to quote are `benchmarks.layer`'s back-to-back steps).

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --log-file OUT.csv \\
        python -m benchmarks.layer_profile run --shape 0 --variants auto,fp8 --labels LABELS.json
    python -m benchmarks.layer_profile table OUT.csv --labels LABELS.json     # no GPU needed

`run` compiles each variant's step and runs it twice, then profiles one more step between
`cudaProfilerStart` and `cudaProfilerStop`, after one torch fill kernel that marks where the
variant's kernels begin (the steps themselves launch no torch kernels). `table` splits the log at
the markers and prints, per variant, the step's summed kernel time and its largest kernel groups
(XLA's numbered fusions of one kind, e.g. `loop_convert_fusion_3`, counted as one group).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

MARKER = "FillFunctor"  # torch's fill kernel, launched before each variant's profiled step
TOP = 16


def run(shape_index: int, variants: list[str], labels: str) -> int:
    import jax
    import jax.numpy as jnp
    import torch

    from benchmarks.layer import SHAPES, build_layer, grad_step, variant_layer

    shape = SHAPES[shape_index]
    base = build_layer(shape)
    x = jax.random.normal(jax.random.PRNGKey(1), (shape.tokens, shape.d_model), jnp.bfloat16)
    marker = torch.empty(1, device="cuda")
    for v in variants:
        step, state = grad_step(variant_layer(base, shape, v))
        compiled = jax.jit(step).lower(state, x).compile()
        for _ in range(2):
            jax.block_until_ready(compiled(state, x))
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        marker.fill_(0)
        jax.block_until_ready(compiled(state, x))
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(shape.name, v, "profiled", flush=True)
    with open(labels, "w") as f:
        json.dump(dict(shape=shape.name, variants=variants), f)
    return 0


def _group(name: str) -> str:
    """A kernel's group: its name up to the argument list, XLA's trailing fusion number dropped."""
    return re.sub(r"_\d+$", "", name.split("(")[0].split("<")[0].strip())


def table(path: str, labels: str) -> list[str]:
    """Per profiled variant: the summed kernel time of its step and its `TOP` largest groups."""
    with open(path) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    col = {name: i for i, name in enumerate(rows[0])}
    kernels: dict = collections.OrderedDict()
    for r in rows[1:]:
        if r[col["Metric Name"]] == "gpu__time_duration.sum":
            kernels[r[col["ID"]]] = (r[col["Kernel Name"]], float(r[col["Metric Value"]]))
    with open(labels) as f:
        meta = json.load(f)
    steps: list[list] = []
    for name, ns in kernels.values():
        if MARKER in name:
            steps.append([])
        elif steps:
            steps[-1].append((name, ns))
    if len(steps) != len(meta["variants"]):
        raise ValueError(f"{path}: {len(steps)} profiled steps for the {len(meta['variants'])} variants of {labels}.")
    out = []
    for variant, kernels_of_step in zip(meta["variants"], steps):
        total = sum(ns for _, ns in kernels_of_step)
        groups: dict = collections.Counter()
        counts: dict = collections.Counter()
        for name, ns in kernels_of_step:
            groups[_group(name)] += ns
            counts[_group(name)] += 1
        out.append(f"## {meta['shape']} {variant}: {total / 1e6:.3f} ms in {len(kernels_of_step)} kernels")
        out.append("| kernel | ms | launches | share |")
        out.append("|---|---|---|---|")
        for g, ns in groups.most_common(TOP):
            out.append(f"| `{g[:70]}` | {ns / 1e6:.3f} | {counts[g]} | {ns / total:.1%} |")
        out.append("")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--shape", type=int, default=0)
    r.add_argument("--variants", default="auto,fp8")
    r.add_argument("--labels", required=True)
    t = sub.add_parser("table")
    t.add_argument("csv")
    t.add_argument("--labels", required=True)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "run":
        return run(args.shape, args.variants.split(","), args.labels)
    print("\n".join(table(args.csv, args.labels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
