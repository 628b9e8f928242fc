"""The GPU acceptance run's own checks (the rest are pytest and the example): the MoE layer on every
backend and dtype at the layer shapes, the resource model against the compiled kernels, and the
run's summary. `benchmarks/gpu_run.sh accept` runs every phase in order; docs/acceptance.md says
what each proves.

    python -m benchmarks.accept layers [--shapes 3,4] [--dtypes D] [--backends B] [--json PATH]  # the layer table
    python -m benchmarks.accept launch --labels PATH         # each Pallas/Mosaic kernel once (under ncu)
    python -m benchmarks.accept ncu-table CSV --labels PATH  # their shared memory beside the model's
    python -m benchmarks.accept summary OUT_DIR              # the committed summary, from the logs
    python -m benchmarks.accept failed-ids LOG               # the tests a pytest log names failed
    python -m benchmarks.accept unreached-ids XML PATHS...   # the tests a run stopped at its limit never reported

`layers`: forward + backward (the gradient of `sum(y**2)` with respect to the input and every
parameter, under `nnx.jit`) of `MoE(D, F, E, k, dtype=...)` at the five shapes of `LAYER_SHAPES`,
for fp32 and bf16, on `auto`, `pallas_triton`, `triton`, `mosaic_gpu` and `xla`; each cell is `ok`
(finite, and within the dtype's tolerance of the `xla` layer's output and input gradient) or the
error it raised (a clear ValueError naming the limit is the contract for what a backend does not
take).

`launch`: one configuration of each kind of `pallas_triton` kernel the choosers reach (the one the
model gives the most bytes, `tests.compiled_resources.sample`; every configuration is compiled by
the Triton wheel in the `compiled` step), every `mosaic_gpu` configuration they reach and the
Mosaic FP8 kernel at both branches of its tile rule (`fp8_mosaic_tiles`), each run once on small
inputs, in order; `--labels` holds each one's label and the model's bytes from the start, each
marked `launched` once it has run;
`ncu-table` pairs Nsight Compute's `launch__shared_mem_per_block_dynamic` + `..._static` of those
launches (XLA's own compilation of the kernels) with the labels.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
import traceback
from xml.etree import ElementTree

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

# (T, D, F, E, k): decode-sized to prefill-sized layers; the fp32 failures of 2026-12 were at all
# but the first.
LAYER_SHAPES = ((64, 256, 256, 16, 4), (512, 256, 256, 16, 4), (2048, 512, 512, 32, 4), (8192, 1024, 512, 64, 8),
                (4096, 2048, 768, 128, 8))
# `fp8`: the routed experts in the blockwise FP8 recipe (`GemmOptions(quantization=Fp8Blockwise())` on
# `auto`: the FP8 kernels on a GPU that has them, the weights quantized by the fused kernel with their
# `[E, K, N]` copy); `fp8-master`: the same with `Fp8Blockwise(input_gradient="master")` (the
# quantization without the copy, 16-bit input gradients); both compared with the unquantized reference.
LAYER_BACKENDS = ("auto", "pallas_triton", "triton", "mosaic_gpu", "xla", "fp8", "fp8-master")
FP8_CELLS = {"fp8": dict(), "fp8-master": dict(input_gradient="master")}
DTYPES = ("float32", "bfloat16")
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # relative error against the xla layer (bf16 rounds twice)
FP8_TOLERANCE = 8e-2  # e4m3's 3 mantissa bits: the recipe's GEMMs are ~3e-2 from exact products
# Names of our kernels in a profile: the Pallas Triton ones carry ours; Mosaic GPU's its body's.
KERNEL_NAMES = r"moe_jax_gmm|moe_jax_tgmm|mosaic|_body"


def _layer_step(shape, dtype, backend):
    from flax import nnx

    from moe_jax.layers import Fp8Blockwise, GemmOptions, MoE

    t, d, f, e, k = shape
    gemm = (GemmOptions(backend="auto", quantization=Fp8Blockwise(**FP8_CELLS[backend])) if backend in FP8_CELLS
            else GemmOptions(backend=backend))
    layer = MoE(d, f, e, k, dtype=dtype, gemm=gemm, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (t, d), jnp.float32).astype(dtype)

    @nnx.jit
    def step(layer, x):
        def loss(layer, x):
            y, _ = layer(x)
            return jnp.sum(y.astype(jnp.float32) ** 2), y
        (_, y), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
        return y, grads[1], grads[0]

    y, dx, dparams = step(layer, x)
    return jax.block_until_ready((y, dx, dparams))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _shape_rows(shape, dtypes=DTYPES, backends=LAYER_BACKENDS, on_row=lambda row: None) -> list[dict]:
    """The cells of one layer shape: each of `dtypes` on each of `backends`, `xla` first. The reference
    is the first backend whose layer runs (`xla`'s ragged_dot needs tens of GiB at fp32 prefill sizes),
    whether or not `backends` names it: a backend left out runs only while no reference has, and
    gives no cell. `on_row` sees each cell as it is made."""
    rows = []
    for dtype in dtypes:
        ref = None
        for backend in ("xla",) + tuple(b for b in LAYER_BACKENDS if b != "xla"):
            if backend not in backends and ref is not None:
                continue
            start = time.perf_counter()
            try:
                y, dx, dparams = _layer_step(shape, jnp.dtype(dtype), backend)
                finite = all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves((y, dx, dparams)))
                if ref is None:
                    ref, ref_backend = (y, dx), backend
                err = max(_rel(y, ref[0]), _rel(dx, ref[1]))
                tolerance = FP8_TOLERANCE if backend in FP8_CELLS else TOLERANCE[dtype]
                cell = "ok" if finite and err <= tolerance else f"WRONG (finite={finite}, rel err {err:.2e})"
            except Exception as exc:  # noqa: BLE001  (every failure is a cell of the table)
                err, cell = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                traceback.print_exc(limit=3)
            if backend not in backends:
                continue
            rows.append(dict(shape=shape, dtype=dtype, backend=backend, cell=cell, rel_err=err,
                             reference=None if ref is None else ref_backend,
                             seconds=round(time.perf_counter() - start, 1)))
            print(json.dumps(rows[-1]), flush=True)
            on_row(rows[-1])
    return rows


def _names(arg, known, what):
    if not arg:
        return known
    names = tuple(arg.split(","))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--{what}: {unknown} not among {list(known)}")
    return names


def layers(args) -> None:
    # One process, one cell after another: XLA's fp32 layer needs 48-64 GiB at the two largest
    # shapes, and beside a second process its allocations or its autotuning failed.
    shapes = [LAYER_SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else LAYER_SHAPES
    dtypes = _names(args.dtypes, DTYPES, "dtypes")
    backends = _names(args.backends, LAYER_BACKENDS, "backends")
    rows = []

    def keep(row):  # the file holds every cell made so far, so a phase stopped at its limit keeps them
        rows.append(row)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)

    for shape in shapes:
        _shape_rows(shape, dtypes, backends, keep)
    print(layer_table(rows))


def layer_table(rows) -> str:
    lines = ["| T, D, F, E, k | dtype | " + " | ".join(LAYER_BACKENDS) + " |",
             "|---|---|" + "---|" * len(LAYER_BACKENDS)]
    cells = {(tuple(r["shape"]), r["dtype"], r["backend"]): r for r in rows}
    for shape in LAYER_SHAPES:
        for dtype in DTYPES:
            out = []
            for b in LAYER_BACKENDS:
                r = cells.get((shape, dtype, b))
                out.append("-" if r is None else (f"ok ({r['rel_err']:.1e})" if r["cell"] == "ok" else r["cell"][:120]))
            lines.append(f"| {', '.join(map(str, shape))} | {dtype} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def _launch_one(c, dtype):
    """Run the kernel of `tests.compiled_resources.Compile` `c` once at small shapes."""
    from moe_jax.ops import gmm, tgmm
    from moe_jax.ops.gmm.pallas_triton.group_major import gmm_group_major_pallas
    from moe_jax.ops.gmm.pallas_triton.row_tile import gmm_row_tile_pallas
    from moe_jax.ops.gmm.pallas_triton.wgrad import tgmm_pallas
    from moe_jax.ops.gmm.schedule import clamp_group_sizes

    m, t, n, k, e = 2000, 1000, 1024, 1024, 16
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(rng.multinomial(m - 24, np.ones(e) / e), jnp.int32)
    prec = jax.lax.Precision.HIGHEST if c.ieee else jax.lax.Precision.DEFAULT
    common = dict(out_dtype=dtype, precision=prec, interpret=False)
    x = jnp.asarray(rng.standard_normal((t if c.gather else m, k)), dtype)
    ids = jnp.asarray(rng.integers(0, t, m), jnp.int32) if c.gather else None
    if c.kernel == "tgmm":
        d = jnp.asarray(rng.standard_normal((m, n)), dtype)
        return tgmm_pallas(x, d, clamp_group_sizes(sizes, m), tiles=c.tiles, row_ids=ids, **common)
    nt = c.kernel == "gmm_nt"
    w = jnp.asarray(rng.standard_normal((e, n, k) if nt else (e, k, n)), dtype)
    if c.family == "row_tile":
        return gmm_row_tile_pallas(x, w, sizes, transpose_rhs=nt, tiles=c.tiles, row_ids=ids, **common)
    return gmm_group_major_pallas(x, w, sizes, transpose_rhs=nt, tiles=c.tiles, splits=4 if c.family == "split_k" else 1,
                                  **common)


def launch_plan() -> list[tuple[dict, object]]:
    """`(label, run)` for each kernel `launch` runs, in order: one configuration of each kind of
    `pallas_triton` kernel the choosers reach, every `mosaic_gpu` configuration they reach and the
    Mosaic FP8 kernel at both branches of its tile rule. `run()` launches it once and waits."""
    from moe_jax.ops import gmm
    from moe_jax.ops.fp8 import quantize_rows, quantize_weights
    from moe_jax.ops.gmm.fp8_api import gmm_fp8
    from moe_jax.ops.gmm.mosaic_gpu.config import smem_bytes
    from moe_jax.ops.gmm.mosaic_gpu.fp8_kernel import fp8_mosaic_smem_bytes, fp8_mosaic_tiles
    from tests.compiled_resources import compilations, model_bytes, reachable, sample

    reached = reachable()
    plan = []
    for c in sample(compilations(reached)):
        if c.backend != "pallas_triton":
            continue
        plan.append((dict(backend=c.backend, kernel=c.kernel, family=c.family, tiles=list(c.tiles.__dict__.values()),
                          dtype=c.dtype, ieee=c.ieee, gather=c.gather, model=model_bytes(c)),
                     lambda c=c: jax.block_until_ready(jax.jit(lambda: _launch_one(c, jnp.dtype(c.dtype)))())))
    mosaic = sorted({(r.problem.kernel, r.problem.dtype.name, r.config) for r in reached if r.backend == "mosaic_gpu"},
                    key=str)
    for kernel, dtype, config in mosaic:
        def run(kernel=kernel, dtype=dtype, config=config):
            m, n, k, e = 4096, 4 * config.cta_n, 8 * config.tile_k, 16
            nt = kernel == "gmm_nt"
            x = jnp.ones((m, k), dtype)
            w = jnp.ones((e, n, k) if nt else (e, k, n), dtype)
            sizes = jnp.full((e,), m // e, jnp.int32)
            jax.block_until_ready(jax.jit(lambda x, w, s: gmm(x, w, s, transpose_rhs=nt, backend="mosaic_gpu",
                                                              config=config))(x, w, sizes))
        plan.append((dict(backend="mosaic_gpu", kernel=kernel, family=str(config), tiles=[], dtype=dtype, ieee=False,
                          gather=False, model=smem_bytes(config, dtype, dtype)), run))
    for n in (256, 384):  # the Mosaic FP8 kernel at both branches of its rule, in the layer's bf16 output
        tiles = fp8_mosaic_tiles(n)

        def run(n=n, tiles=tiles):
            m, k, e = 4096, 512, 16
            rows = quantize_rows(jnp.ones((m, k), jnp.float32))
            wq = quantize_weights(jnp.ones((e, n, k), jnp.float32))
            sizes = jnp.full((e,), m // e, jnp.int32)
            jax.block_until_ready(jax.jit(lambda r, w, s: gmm_fp8(r, w, s, backend="mosaic_gpu", config=tiles,
                                                                  out_dtype=jnp.bfloat16))(rows, wq, sizes))
        plan.append((dict(backend="mosaic_gpu", kernel="gmm_fp8", family=str(tiles), tiles=[], dtype="float8_e4m3fn",
                          ieee=False, gather=False, model=fp8_mosaic_smem_bytes(tiles, jnp.bfloat16)), run))
    return plan


def run_plan(plan, labels_path: str) -> None:
    """Launch each of `plan` in order. `labels_path` holds every label from the start, each marked
    `launched` once its kernel has run, so a run stopped at its limit still pairs what it profiled and
    the verdict sees what it did not reach."""
    labels = [dict(label, launched=False) for label, _ in plan]

    def write():
        with open(labels_path, "w") as fh:
            json.dump(labels, fh, indent=1)

    write()
    for label, (_, run) in zip(labels, plan):
        run()
        label["launched"] = True
        write()
    print(f"{len(labels)} kernels launched")


def launch(args) -> None:
    run_plan(launch_plan(), args.labels)


def ncu_table(args) -> None:
    """Pair the profiled launches (in order; the kernels of our names) with the labels."""
    import csv

    labels = [label for label in json.load(open(args.labels)) if label.get("launched", True)]
    launches, others = {}, set()
    with open(args.csv) as fh:
        for row in csv.DictReader(line for line in fh if not line.startswith("==")):
            if not re.search(KERNEL_NAMES, row.get("Kernel Name", "")):
                others.add(row.get("Kernel Name", ""))
                continue
            launch = launches.setdefault(row["ID"], dict(name=row["Kernel Name"]))
            value = float(row["Metric Value"].replace(",", "")) if row["Metric Value"] else 0.0
            launch[row["Metric Name"]] = value
    ordered = [launches[i] for i in sorted(launches, key=int)]
    rows, bad = [], 0
    for label, launch in zip(labels, ordered):
        compiled = int(launch.get("launch__shared_mem_per_block_dynamic", 0)
                       + launch.get("launch__shared_mem_per_block_static", 0))
        ok = compiled <= label["model"]
        bad += not ok
        rows.append(dict(label, compiled=compiled, kernel_name=launch["name"], ok=ok))
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    exact = sum(r["compiled"] == r["model"] for r in rows)
    print(f"{len(rows)} of {len(labels)} launches profiled; model >= compiled on {len(rows) - bad}, exact on {exact}")
    if len(ordered) != len(labels):
        print(f"  {len(ordered)} kernels matched {KERNEL_NAMES!r} for {len(labels)} labels; other kernels: "
              f"{sorted(others)[:20]}")
    for r in rows:
        if not r["ok"] or r["compiled"] != r["model"]:
            print(f"  {r['backend']} {r['kernel']} {r['family']} {r['tiles']} {r['dtype']} ieee={r['ieee']} "
                  f"gather={r['gather']}: model {r['model']} B, compiled {r['compiled']} B")


# What XLA's own layer reports when a shape does not fit one GPU: `ragged_dot` is expanded densely
# over the groups, so its memory grows with E (its autotuner fails the same way when what is left
# cannot hold a candidate's buffers: "All configs failed", or "Failed to get configs" under
# RESOURCE_EXHAUSTED, whose example failure is an allocation).
XLA_OUT_OF_MEMORY = (r"RESOURCE_EXHAUSTED: Out of memory|NOT_FOUND: All configs failed during profiling"
                     r"|RESOURCE_EXHAUSTED: Failed to get configs")


# The example runs of `accept-example` (benchmarks/gpu_run.sh): log suffix -> what it runs.
EXAMPLE_RUNS = {"float32": "example with its defaults (fp32)", "bfloat16": "example, --dtype bfloat16",
                "fp8": "example, --dtype bfloat16 --fp8 (routed experts in blockwise FP8)"}


def loss_curves(bf16_log: str, fp8_log: str, every: int = 50) -> str:
    """Markdown table of two example runs' logs side by side: the training loss every `every`
    steps and at the last logged step (`step N | loss X` lines), then each validation loss
    (`step N | val loss X`), with FP8's difference."""
    def losses(log, pattern):
        return {int(s): float(v) for s, v in re.findall(pattern, log)}

    train = r"step\s+(\d+) \| loss ([\d.]+)"
    val = r"step\s+(\d+) \| val loss ([\d.]+)"
    train_b, train_f = losses(bf16_log, train), losses(fp8_log, train)
    both = train_b.keys() & train_f.keys()
    steps = sorted(s for s in both if s % every == 0 or s == max(both))
    rows = [("train", s, train_b[s], train_f[s]) for s in steps]
    val_b, val_f = losses(bf16_log, val), losses(fp8_log, val)
    rows += [("val", s, val_b[s], val_f[s]) for s in sorted(val_b.keys() & val_f.keys())]
    out = ["| loss | step | bf16 | FP8 | FP8 - bf16 |", "|---|---|---|---|---|"]
    out += [f"| {kind} | {s} | {b:.4f} | {f:.4f} | {f - b:+.4f} |" for kind, s, b, f in rows]
    return "\n".join(out)


def summary_line(log: str) -> str | None:
    """pytest's final `N passed, M failed ... in Ts` line of a log (not a test id that holds such
    words, as `--durations` lists them), or None."""
    found = [ln for ln in log.splitlines()
             if re.search(r"\b\d+ (passed|failed|errors?)\b.* in [\d.]+s", ln) and "::" not in ln]
    return found[-1].strip("= ") if found else None


def outcome_counts(log: str) -> dict[str, int]:
    """pytest's summary counts (`passed`, `failed`, `skipped`, `error(s)`) from a log's final line."""
    return {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|error|errors)\b", summary_line(log) or "")}


def interrupted(log: str) -> bool:
    """True when pytest was stopped before it ran every test: `accept-tests` and `accept-rerun`
    stop it with SIGINT at their limits, so that it still prints its summary and names the tests
    that failed so far (a count of those that ran, not of the suite)."""
    return "KeyboardInterrupt" in log


def failed_ids(log: str) -> list[str]:
    """The ids of the tests a pytest log reports FAILED or ERROR (its short summary)."""
    return [m.group(2) for m in re.finditer(r"^(FAILED|ERROR) (\S+)", log, re.MULTILINE)]


def junit_key(nodeid: str) -> tuple[str, str]:
    """A pytest node id as its JUnit XML report names it: `(classname, name)`, the classname the
    module's path dotted and without `.py`, followed by any test classes."""
    path, *classes, name = nodeid.split("::")
    return ".".join([re.sub(r"\.py$", "", path).replace("/", "."), *classes]), name


def reached_keys(junit_xml: str) -> set[tuple[str, str]]:
    """`(classname, name)` of every test a JUnit XML report holds: those a pytest stopped at its
    limit had reported (pytest writes the report when interrupted too)."""
    return {(c.get("classname"), c.get("name")) for c in ElementTree.fromstring(junit_xml).iter("testcase")}


def unreached_ids(collected: list[str], junit_xml: str) -> list[str]:
    """The node ids of `collected` that the report does not hold, in their order."""
    reached = reached_keys(junit_xml)
    return [i for i in collected if junit_key(i) not in reached]


def collect_ids(paths: list[str]) -> list[str]:
    """The node ids pytest collects from `paths` on this host (GPU hosts collect more cases)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pytest could not collect {paths}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return [ln for ln in done.stdout.splitlines() if "::" in ln]


def _rest_ok(read) -> tuple[bool, str]:
    """Whether `accept-rest` ran every test `accept-tests` did not reach (`tests_rest_ids.txt`) and
    each passed or skipped, and what it reported."""
    ids = [ln for ln in read("tests_rest_ids.txt").splitlines() if ln.strip()]
    log = read("tests_rest.log")
    counts = outcome_counts(log)
    ran = counts.get("passed", 0) + counts.get("skipped", 0)
    ok = (bool(log) and ran == len(ids) and not interrupted(log)
          and not (counts.get("failed") or counts.get("error") or counts.get("errors")))
    return ok, f"the {len(ids)} not reached, run after (`accept-rest`): {counts or 'no result'}"


def verdict(out: str) -> list[tuple[str, bool, str]]:
    """The green criteria of docs/acceptance.md, each `(check, passed, detail)`, from the logs under
    `out`: no test failed (or each that failed passed when `accept-rerun` ran it again alone, from
    `tests_rerun_ids.txt` and `tests_rerun.log`); the example runs (`EXAMPLE_RUNS`) exit 0 with a falling loss; every layer cell of our
    backends is ok or a ValueError, and every `xla` cell ok or XLA's out-of-memory; the model never
    below a compiled kernel (Triton's compiler, and Nsight Compute's reading of XLA's launches)."""

    def read(name):
        path = os.path.join(out, name)
        return open(path).read() if os.path.exists(path) else ""

    checks = []
    log = read("tests.log")
    counts = outcome_counts(log)
    bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    tests_ok, detail = counts.get("passed", 0) > 0 and not bad, str(counts or "no result")
    if bad and os.path.exists(os.path.join(out, "tests_rerun.log")):
        # A card with less memory than the run's workers and the example together need fails tests
        # out of memory; they count as passed only when the same ids, rerun alone, all pass.
        ids = [ln for ln in read("tests_rerun_ids.txt").splitlines() if ln.strip()]
        rerun_log = read("tests_rerun.log")
        rerun = outcome_counts(rerun_log)
        tests_ok = (counts.get("passed", 0) > 0 and len(ids) == bad and rerun.get("passed", 0) == bad
                    and not (rerun.get("failed") or rerun.get("error") or rerun.get("errors"))
                    and not interrupted(rerun_log))
        detail += f"; the {len(ids)} that failed, rerun alone: {rerun or 'no result'}"
    if interrupted(log):  # stopped at its limit: the counts are of the tests that ran, not of the suite
        rest_ok, rest = _rest_ok(read) if read("tests_rest_ids.txt") or read("tests_rest.log") else (False, "")
        tests_ok, detail = tests_ok and rest_ok, f"interrupted at its limit: {detail}" + (f"; {rest}" if rest else "")
    checks.append(("tests and parity compiled", tests_ok, detail))
    for run in EXAMPLE_RUNS:
        log = read(f"example_{run}.log")
        loss = re.findall(r"loss ([\d.]+) -> ([\d.]+)", log)
        falls = bool(loss) and float(loss[-1][1]) < float(loss[-1][0])
        checks.append((f"example {run}", "exit 0" in log and falls, f"loss {' -> '.join(loss[-1]) if loss else '?'}"))
    rows = layer_rows(out)
    twice = len(rows) - len({(tuple(r["shape"]), r["dtype"], r["backend"]) for r in rows})
    bad = [r for r in rows if not (r["cell"] == "ok" or (r["backend"] != "xla" and r["cell"].startswith("ValueError"))
                                   or (r["backend"] == "xla" and re.search(XLA_OUT_OF_MEMORY, r["cell"])))]
    cells = len(LAYER_SHAPES) * len(DTYPES) * len(LAYER_BACKENDS)
    checks.append(("layer table", len(rows) == cells and not bad and not twice,
                   f"{len(rows)} of {cells} cells; not ok: {[(r['shape'], r['dtype'], r['backend']) for r in bad]}"
                   + (f"; {twice} cells more than once" if twice else "")))
    compiled = [json.loads(ln) for ln in read("compiled.jsonl").splitlines() if ln.startswith("{")]
    under = [r for r in compiled if r["compiled"] > r["model"]]
    checks.append(("model vs Triton's compiler", bool(compiled) and not under, f"{len(compiled)} compiled, {len(under)} under"))
    launched = json.loads(read("accept_resources.json") or "[]")
    labels = json.loads(read("accept_labels.json") or "[]")
    checks.append(("model vs launched kernels", bool(launched) and len(launched) == len(labels)
                   and all(r["ok"] for r in launched), f"{len(launched)} of {len(labels)} profiled"))
    return checks


def layer_rows(out: str) -> list:
    """The layer cells of a run: `accept_layers.json` and each lane's (`a-accept_layers.json`, ...:
    `LANE=a ACCEPT_SHAPES=... benchmarks/gpu_run.sh accept-layers` splits the shapes over processes)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*accept_layers.json"))):
        with open(path) as fh:
            rows += json.load(fh)
    return rows


def summary(args) -> None:
    """The acceptance summary (markdown) from the phase logs under `args.out`."""
    out = args.out

    def read(name):
        path = os.path.join(out, name)
        return open(path).read() if os.path.exists(path) else ""

    checks = verdict(out)
    green = all(ok for _, ok, _ in checks)
    lines = [f"# GPU acceptance run, {time.strftime('%Y-%m-%d')}: {'green' if green else 'NOT green'}", "",
             f"Command: `benchmarks/gpu_run.sh accept` on {args.device}; commit {args.commit}.", ""]
    lines += [f"- {'pass' if ok else 'FAIL'}: {name} ({detail})" for name, ok, detail in checks] + [""]
    pip = "; ".join(re.sub(r"\s+", " ", ln.strip()) for ln in read("pip.txt").splitlines() if ln.strip())
    lines += [f"Versions: {pip}", ""]
    lines += [f"- `pytest tests parity` compiled: {summary_line(read('tests.log')) or 'no result (see the log)'}"]
    if summary_line(read("tests_rerun.log")):
        lines += [f"- the tests that failed, rerun alone (`accept-rerun`): {summary_line(read('tests_rerun.log'))}"]
    if summary_line(read("tests_rest.log")):
        lines += [f"- the tests not reached in the limit, run after (`accept-rest`): {summary_line(read('tests_rest.log'))}"]
    for run, title in EXAMPLE_RUNS.items():
        tail = [ln for ln in read(f"example_{run}.log").splitlines() if ln.strip()][-3:]
        lines += [f"- {title}:", "", "  ```", *("  " + ln for ln in tail), "  ```"]
    bf16_log, fp8_log = read("example_bfloat16.log"), read("example_fp8.log")
    if "val loss" in bf16_log and "val loss" in fp8_log:
        lines += ["", "The example in FP8 against bf16, same seed and batches (training loss, then validation):", "",
                  loss_curves(bf16_log, fp8_log)]
    if layer_rows(out):
        lines += ["", "Layer forward+backward, every backend and dtype (relative error to the xla layer):", "",
                  layer_table(layer_rows(out))]
    resources = read("accept_resources.log").strip()
    compiled = read("compiled.jsonl").splitlines()
    if compiled:
        recs = [json.loads(ln) for ln in compiled if ln.startswith("{")]
        under = [r for r in recs if r["compiled"] > r["model"]]
        exact = sum(r["compiled"] == r["model"] for r in recs)
        lines += ["", f"Resource model against Triton 3.6's compiler for sm_90, every reachable configuration: "
                  f"{len(recs)} compiled, model below the compiler on {len(under)}, exact on {exact}."]
    if resources:
        lines += ["", f"Resource model against the kernels XLA compiled and launched on {args.device} (Nsight Compute):", "",
                  "```", resources, "```"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "accept_summary.md"), "w") as fh:
        fh.write(text)
    print(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("layers")
    q.add_argument("--json", default=None)
    q.add_argument("--shapes", default=None, help="indices into LAYER_SHAPES, e.g. 3,4 (default: all)")
    q.add_argument("--dtypes", default=None, help="some of DTYPES, e.g. bfloat16 (default: all)")
    q.add_argument("--backends", default=None,
                   help="some of LAYER_BACKENDS, e.g. mosaic_gpu,fp8 (default: all; the reference runs regardless)")
    q = sub.add_parser("launch")
    q.add_argument("--labels", required=True)
    q = sub.add_parser("ncu-table")
    q.add_argument("csv")
    q.add_argument("--labels", required=True)
    q.add_argument("--out", required=True)
    q = sub.add_parser("summary")
    q.add_argument("out")
    q.add_argument("--commit", default="unknown")
    q.add_argument("--device", default="one H200", help="the card the run had, as the summary names it")
    q = sub.add_parser("failed-ids", help="print the ids a pytest log reports FAILED or ERROR, one a line")
    q.add_argument("log")
    q = sub.add_parser("unreached-ids", help="print the ids pytest collects from PATHS that a JUnit XML report "
                       "(of a run stopped at its limit) does not hold, one a line")
    q.add_argument("junit_xml")
    q.add_argument("paths", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "failed-ids":
        print("\n".join(failed_ids(open(args.log).read())))
        return
    if args.cmd == "unreached-ids":
        print("\n".join(unreached_ids(collect_ids(args.paths), open(args.junit_xml).read())))
        return
    {"layers": layers, "launch": launch, "ncu-table": ncu_table, "summary": summary}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
