"""Where a layer's forward+backward step spends its GPU time: one step of each variant of
`benchmarks.layer` at one of its shapes, traced by JAX's profiler (CUPTI on a GPU), each kernel's
duration grouped (a diagnosis; the figures to quote are `benchmarks.layer`'s back-to-back steps).

    python -m benchmarks.layer_profile --shape 0 --variants auto,fp8 --out DIR [--micro-batches N]
    python -m benchmarks.layer_profile --compare A/layer_profile.json B/layer_profile.json   # no GPU needed

Each variant's step is compiled and run twice, then one more step runs under
`jax.profiler.trace`. The kernels are the events on the device's stream lines, each with the HLO
op XLA annotated it with (on a machine without a GPU, the host's XLA thunks).
Per variant it prints the step's summed kernel time, its span (first kernel's start to the last
one's end: the difference is time the device waited), and its largest groups: kernels of one name
with XLA's trailing fusion number dropped (`loop_convert_fusion_3` and `_12` are one group), with
the HLO ops they came from. `DIR/layer_profile.json` keeps every kernel. `--compare` reads two
such files (e.g. two trees of the code profiled on one card) and prints, per variant both hold,
each one's summed kernel time and span and the groups whose time changed most.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
from typing import NamedTuple

TOP = 18


class Kernel(NamedTuple):
    """One traced kernel: its name, the HLO op XLA ran it for, start and duration in ns."""

    name: str
    hlo_op: str
    start_ns: float
    duration_ns: float


def trace_kernels(xspace_path: str) -> list[Kernel]:
    """The kernels of one trace file: every event on the GPU planes' stream lines (`hlo_op` is the
    HLO op XLA annotated it with, "" if none), or, when the trace has no GPU plane, the events with
    an `hlo_op` on the host's XLA threads."""
    import jax

    data = jax.profiler.ProfileData.from_file(xspace_path)
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    host = not planes
    if host:
        planes = [p for p in data.planes if p.name == "/host:CPU"]
    out = []
    for plane in planes:
        for line in plane.lines:
            if not host and not line.name.startswith("Stream"):
                continue  # "XLA Ops" / "XLA Modules" restate the stream's kernels
            for e in line.events:
                hlo_op = dict(e.stats).get("hlo_op")
                if hlo_op is not None or not host:  # a stream's copies and library kernels count too
                    out.append(Kernel(e.name, str(hlo_op or ""), float(e.start_ns), float(e.duration_ns)))
    return sorted(out, key=lambda k: k.start_ns)


def group(name: str) -> str:
    """A kernel's group: its name up to the argument list, XLA's trailing fusion number dropped."""
    return re.sub(r"(_|\.)\d+$", "", name.split("(")[0].split("<")[0].strip())


def group_times(kernels: list[Kernel]) -> tuple[collections.Counter, float, float]:
    """`(ns per group, summed ns, span ns)` of one step's kernels (span: the first kernel's start to
    the last one's end)."""
    time: collections.Counter = collections.Counter()
    for k in kernels:
        time[group(k.name)] += k.duration_ns
    span = max(k.start_ns + k.duration_ns for k in kernels) - min(k.start_ns for k in kernels)
    return time, sum(time.values()), span


def table(label: str, kernels: list[Kernel]) -> list[str]:
    """Markdown lines for one profiled step: summed kernel time, span, and the `TOP` largest groups."""
    if not kernels:
        raise ValueError(f"{label}: the trace holds no kernels.")
    time, total, span = group_times(kernels)
    count = collections.Counter(group(k.name) for k in kernels)
    ops: dict = collections.defaultdict(collections.Counter)
    for k in kernels:
        ops[group(k.name)][group(k.hlo_op)] += 1
    out = [f"## {label}: {total / 1e6:.3f} ms in {len(kernels)} kernels, span {span / 1e6:.3f} ms",
           "| kernel | ms | launches | share | HLO ops |", "|---|---|---|---|---|"]
    for g, ns in time.most_common(TOP):
        names = ", ".join(f"{op}" + (f" x{n}" if n > 1 else "") for op, n in ops[g].most_common(3))
        out.append(f"| `{g[:60]}` | {ns / 1e6:.3f} | {count[g]} | {ns / total:.1%} | {names[:80]} |")
    out.append("")
    return out


def compare(a: dict, b: dict, *, top: int = 10) -> list[str]:
    """Markdown lines comparing two `layer_profile.json` records `a` and `b` (same shape and
    micro-batches): per variant in both, the summed kernel time and span of each and the `top`
    groups by |b - a|."""
    if a["shape"] != b["shape"]:
        raise ValueError(f"compare: the profiles are of different shapes ({a['shape']} and {b['shape']}).")
    n_a, n_b = (rec.get("micro_batches", 1) for rec in (a, b))  # records written before the option: 1
    if n_a != n_b:
        raise ValueError(f"compare: the profiles' steps hold different micro-batches ({n_a} and {n_b}).")
    out = []
    for variant in (v for v in a["kernels"] if v in b["kernels"]):
        (ta, sa, pa), (tb, sb, pb) = (group_times([Kernel(**k) for k in rec["kernels"][variant]]) for rec in (a, b))
        out += [f"## {a['shape']} {variant}: kernels {sa / 1e6:.3f} -> {sb / 1e6:.3f} ms ({sb / sa:.3f}x), "
                f"span {pa / 1e6:.3f} -> {pb / 1e6:.3f} ms", "| kernel | a ms | b ms | b - a |", "|---|---|---|---|"]
        for g in sorted(set(ta) | set(tb), key=lambda g: -abs(tb[g] - ta[g]))[:top]:
            out.append(f"| `{g[:60]}` | {ta[g] / 1e6:.3f} | {tb[g] / 1e6:.3f} | {(tb[g] - ta[g]) / 1e6:+.3f} |")
        out.append("")
    return out


def profile(shape, variants: list[str], out_dir: str, micro_batches: int = 1) -> list[str]:
    """Trace one step of each variant at `shape` (a `benchmarks.layer.LayerShape`); with
    `micro_batches` N > 1 the step accumulates N micro-batches of the shape's tokens in one
    `lax.scan` (`benchmarks.layer.grad_step`), so the table's launch counts show which kernels run
    once per step and which once per micro-batch (the FP8 master weights' quantization, if XLA
    does not hoist it out of the loop). Writes `out_dir/layer_profile.json` and `.md`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.layer import QUANTIZED_ONCE, build_layer, grad_step, micro_batch_tokens, variant_layer

    base = build_layer(shape)
    x = micro_batch_tokens(jax.random.normal(jax.random.PRNGKey(1), (shape.tokens, shape.d_model), jnp.bfloat16),
                           micro_batches)
    suffix = f" x {micro_batches} micro-batches" if micro_batches > 1 else ""
    lines, record = [], {}
    for v in variants:
        step, state = grad_step(variant_layer(base, shape, v), micro_batches, v in QUANTIZED_ONCE)
        compiled = jax.jit(step).lower(state, x).compile()
        for _ in range(2):
            jax.block_until_ready(compiled(state, x))
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                jax.block_until_ready(compiled(state, x))
            (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
            kernels = trace_kernels(path)
        lines += table(f"{shape.name} {v}{suffix}", kernels)
        record[v] = [k._asdict() for k in kernels]
        print("\n".join(lines[-TOP - 5:]), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "layer_profile.json"), "w") as f:
        json.dump(dict(shape=shape.name, micro_batches=micro_batches, device=str(jax.devices()[0]), kernels=record), f)
    with open(os.path.join(out_dir, "layer_profile.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, default=0, help="index into benchmarks.layer's SHAPES")
    p.add_argument("--variants", default="auto,fp8")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches accumulated in the traced step")
    p.add_argument("--out", help="folder for layer_profile.json and layer_profile.md")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two layer_profile.json files to compare")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.compare:
        records = []
        for path in args.compare:
            with open(path) as f:
                records.append(json.load(f))
        print("\n".join(compare(*records)))
        return 0
    if not args.out:
        p.error("--out is required to profile (or pass --compare A B)")
    from benchmarks.layer import SHAPES

    profile(SHAPES[args.shape], args.variants.split(","), args.out, args.micro_batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
