"""Routing-shaped grouped-GEMM benchmark: every candidate on every histogram, the selector's
table fitted from them, and the selector timed on held-out histograms (GPU only for `sweep`).

    python -m benchmarks.routed_gmm sweep [--quick] [--traces PATH] --json OUT.json   # GPU
    python -m benchmarks.routed_gmm fit OUT.json [--write moe_jax/ops/gmm/pallas_triton/tables.py]
    python -m benchmarks.routed_gmm report OUT.json            # the markdown tables
    python -m benchmarks.routed_gmm score OUT.json [...]       # the shipped tables on its test histograms

`sweep` times each `CANDIDATES` member, `torch._grouped_mm` and today's static rule
(`gmm_config`) on routing-shaped histograms at the forward shapes of Qwen3-30B-A3B (gate+up and
down), Mixtral-8x7B and DeepSeek-V3, from decode (T = 1 token) to prefill:
- synthetic: at each T and top-k (U = T*k rows), uniform routing, Zipf-skewed routing (s = 0.8,
  1.2, 2.0), routing concentrated on k, 2k or 4k experts, and four hot experts that every token
  picks; each with two seeds, `train` (fits the table) and `test` (scores it);
- traces (`--traces benchmarks/data/expert_counts.npz`, made by `benchmarks/traces.py`): at each
  T, every layer's decode step of the nearest recorded T and its first and last training step
  (`trace_picks`), rescaled onto the shape's experts (all `test`).
For each histogram it records every candidate's time, executed rows P, padding fraction, effective
(useful rows) and physical (executed rows) TFLOP/s and active weight bytes. It then fits a
`SelectorTable` per shape from the `train` histograms (`fit_table`), compiles the selector path
(`gmm(config=table)`: features, table lookup and `lax.switch` on device) and times it on the
`test` histograms beside the oracle (best candidate per histogram), the best single static
candidate per shape and `torch._grouped_mm`.

`fit` rebuilds the tables from a sweep's `train` rows and writes the tables module (`moe_jax.ops.gmm.pallas_triton.tables`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import numpy as np

from benchmarks import shapes as S

R_BUCKETS = 16  # M up to 2^15 packed rows per table row; larger M use the last row


# ---------------------------------------------------------------------------------------------
# histograms


def routed_counts(tokens: int, e: int, top_k: int, rng, *, subset: int | None = None, hot: int = 0) -> np.ndarray:
    """Counts of `tokens` tokens, each routed to `top_k` distinct experts: uniformly among a random
    `subset` of experts (default all), or with `hot` experts that every token picks and the rest
    uniform among the others."""
    pool = rng.permutation(e)[: subset or e]
    hot_ids, rest = pool[:hot], pool[hot:]
    keys = rng.random((tokens, rest.size))
    picks = rest[np.argsort(keys, axis=1)[:, : top_k - hot]]
    counts = np.bincount(picks.ravel(), minlength=e)
    counts[hot_ids] += tokens
    return counts


def zipf_routed(tokens: int, e: int, top_k: int, s: float, seed: int) -> np.ndarray:
    """Zipf-skewed counts (`shapes.zipf_counts`) at U = tokens * top_k, each expert <= tokens."""
    return S.zipf_counts(tokens * top_k, e, cap=tokens, s=s, seed=seed)


def synthetic_histograms(tokens: int, e: int, top_k: int, seed: int) -> list[tuple[str, np.ndarray]]:
    """The synthetic family at one (T, E, k): broad to concentrated at the same U = T*k."""
    rng = np.random.default_rng(seed)
    out = [("uniform", routed_counts(tokens, e, top_k, rng))]
    out += [(f"zipf{s}", zipf_routed(tokens, e, top_k, s, seed)) for s in (0.8, 1.2, 2.0)]
    for mult in (1, 2, 4):
        if mult * top_k < e:
            out.append((f"on{mult * top_k}", routed_counts(tokens, e, top_k, rng, subset=mult * top_k)))
    if top_k > 4:
        out.append(("hot4", routed_counts(tokens, e, top_k, rng, hot=4)))
    seen, unique = set(), []
    for name, c in out:  # at tiny T several families give the same multiset of counts
        key = tuple(sorted(c.tolist()))
        if key not in seen:
            seen.add(key)
            unique.append((name, c.astype(np.int64)))
    return unique


def rescale_trace(counts: np.ndarray, e: int, top_k: int, tokens: int, seed: int) -> np.ndarray:
    """A recorded histogram over its own experts mapped onto `e` experts and `tokens * top_k`
    rows: each recorded expert's share of the routes goes to `e / E_trace` experts (or the shares
    of `E_trace / e` recorded experts to one), then rounded to sum to U with each count <= tokens."""
    src = counts.astype(np.float64)
    share = src / max(src.sum(), 1)
    if e >= share.size:
        share = np.repeat(share, e // share.size) / (e // share.size)
        share = np.pad(share, (0, e - share.size))
    else:
        share = share.reshape(e, -1).sum(axis=1)
    rows = tokens * top_k
    raw = np.minimum(share * rows, tokens)
    out = np.floor(raw).astype(np.int64)
    rng = np.random.default_rng(seed)
    while out.sum() < rows:  # hand out the remainder to experts below the cap, largest remainder first
        room = out < tokens
        frac = np.where(room, raw - out + 1e-9 * rng.random(e), -1)
        out[np.argmax(frac)] += 1
    return out[rng.permutation(e)]


def trace_picks(traces: dict, tokens: int) -> list[str]:
    """The recorded histograms timed at `tokens`: each layer's decode step of the nearest recorded
    T, and each layer's first and last training step (six or so per token count, not all)."""
    decode = [k for k in traces if k.startswith("decode/")]
    picks = []
    if decode:
        recorded = sorted({int(k.split("/")[1][1:]) for k in decode})
        nearest = min(recorded, key=lambda t: (abs(math.log2(t) - math.log2(tokens)), t))
        picks += sorted(k for k in decode if k.startswith(f"decode/T{nearest}/"))
    train = [k for k in traces if k.startswith("train/")]
    if train:
        steps = sorted({int(k.split("/")[1][4:]) for k in train})
        picks += sorted(k for k in train if int(k.split("/")[1][4:]) in (steps[0], steps[-1]))
    return picks


# ---------------------------------------------------------------------------------------------
# shapes of the sweep


def sweep_shapes(quick: bool, only: str | None = None) -> list[tuple[S.GemmShape, tuple[int, ...]]]:
    """`(shape, token counts)`: decode to prefill at each forward shape (`only`: comma-separated
    indices into that list)."""
    qwen_up, qwen_down, mixtral, dsv3 = S.PREFILL
    if quick:
        return [(qwen_up, (1, 8, 64, 256, 1024))]
    every = [
        (qwen_up, (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)),
        (qwen_down, (1, 32, 512, 4096)),
        (mixtral, (1, 16, 256, 2048, 8192)),
        (dsv3, (1, 16, 256, 4096)),
    ]
    return every if not only else [every[int(i)] for i in only.split(",")]


def histogram_stats(counts: np.ndarray) -> dict:
    """Host copies of the selector's features (the device computes the same ones)."""
    u = int(counts.sum())
    sq = float((counts.astype(np.float64) ** 2).sum())
    return dict(useful_rows=u, active=int((counts > 0).sum()), max_rows=int(counts.max()),
                effective=u * u / sq if sq else 0.0)


# ---------------------------------------------------------------------------------------------
# fitting


def table_dims(num_experts: int) -> tuple[int, int]:
    return R_BUCKETS, int(math.ceil(math.log2(num_experts))) + 1


def host_cell(num_rows: int, effective: float, dims: tuple[int, int]) -> tuple[int, int]:
    """`SelectorTable.row` / `column` on the host (the same buckets)."""
    r = 0 if num_rows <= 1 else (int(num_rows) - 1).bit_length()
    x = int(np.round(np.log2(np.float32(max(effective, 1.0)))))
    return min(r, dims[0] - 1), min(x, dims[1] - 1)


# Extra time of a row with several candidates over running its choice alone (median, H200,
# benchmarks/results/2026-12-01-h200-routed-gmm.md): the on-device features and table lookup plus
# one gated, empty launch per other candidate. A row takes a second candidate only where the
# histograms it wins on gain more than this.
CHAIN_OVERHEAD_S = {1: 0.0, 2: 14.5e-6, 3: 20.0e-6}


def fit_table(rows: list[dict], shape: S.GemmShape, names: list[str],
              overhead: dict[int, float] = CHAIN_OVERHEAD_S) -> list[list[str]]:
    """`choice[r][x]` from measured `rows` (one dict per histogram with `times[name]`).

    Per row bucket r (packed rows M), every set of at most `max(overhead)` candidates is scored:
    each effective-expert column takes the set's member with the lowest summed log time ratio to
    the per-histogram best over the histograms in that cell, and every histogram pays the set's
    `overhead`; the lowest total wins. Rows without histograms copy the nearest measured row,
    columns without histograms the nearest measured column."""
    import itertools

    dims = table_dims(shape.e)
    by_row: dict = {}
    for row in rows:
        times = {n: row["times"].get(n) for n in names}
        if not any(times.values()):
            continue
        r, x = host_cell(row["m"], row["effective"], dims)
        by_row.setdefault(r, []).append((x, times, min(t for t in times.values() if t)))
    if not by_row:
        raise ValueError(f"no measured histogram for {shape.name}: nothing to fit")

    def fit_row(hists):
        best = None
        for size in sorted(overhead):
            for subset in itertools.combinations(names, size):
                cols, total = {}, 0.0
                for x in {h[0] for h in hists}:
                    cell = [h for h in hists if h[0] == x]
                    loss = {c: sum(math.log((h[1][c] + overhead[size]) / h[2]) if h[1][c] else 1e9 for h in cell)
                            for c in subset}
                    cols[x] = min(loss, key=loss.get)
                    total += loss[cols[x]]
                if best is None or total < best[0] - 1e-12:
                    best = (total, cols)
        cols = best[1]
        return [cols[min(cols, key=lambda c: (abs(c - x), c))] for x in range(dims[1])]

    fitted = {r: fit_row(h) for r, h in by_row.items()}
    return [fitted[min(fitted, key=lambda q: (abs(q - r), q))] for r in range(dims[0])]


def table_for(shape: S.GemmShape, choice, device: str, source: str):
    from moe_jax.ops.gmm.pallas_triton.selector import SelectorTable

    return SelectorTable(shape=(shape.n, shape.k, shape.e), choice=tuple(map(tuple, choice)), device=device,
                         source=source)


# ---------------------------------------------------------------------------------------------
# sweep (GPU)


def _geomean(xs):
    xs = [x for x in xs if x]
    return float(np.exp(np.mean(np.log(xs)))) if xs else None


def cmd_sweep(args):
    import jax
    import jax.numpy as jnp
    import torch

    from benchmarks.timing import compile_jax, time_compiled, time_torch
    from moe_jax.ops import CANDIDATES, candidate_index, gmm, gmm_config

    names = list(CANDIDATES)
    chainable = [n for n, c in CANDIDATES.items() if c.family != "split_k"]  # the selector's gated chain
    device = jax.devices()[0].device_kind
    traces = dict(np.load(args.traces)) if args.traces else {}
    results = dict(meta=_meta(args, jax, torch), rows=[], tables={}, summary={})
    t_start = time.time()

    def compile_many(specs):
        def build(spec):
            try:
                return compile_jax(*spec[:2], reps=spec[2])
            except Exception as e:  # a candidate that cannot compile a shape is reported, not fatal
                return e
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(12, os.cpu_count() or 8)) as pool:
            return list(pool.map(build, specs))

    for shape, token_counts in sweep_shapes(args.quick, args.shapes):
        wbytes = shape.e * shape.n * shape.k * 2
        sets = 4 if wbytes * 4 < (6 << 30) else 1  # rotate weights so one call's experts are not in L2
        key = jax.random.PRNGKey(0)
        ws = [(jax.random.normal(k, (shape.e, shape.n, shape.k), jnp.bfloat16) / math.sqrt(shape.k)).astype(jnp.bfloat16)
              for k in jax.random.split(key, sets)]
        tws = [torch.utils.dlpack.from_dlpack(w) for w in ws]
        shape_rows = []
        for tokens in token_counts:
            m, x, reps = _rows(shape, tokens)
            tx = torch.utils.dlpack.from_dlpack(x)
            hists = [(f"{n}", "train", c) for n, c in synthetic_histograms(tokens, shape.e, shape.top_k, 0)]
            hists += [(f"{n}", "test", c) for n, c in synthetic_histograms(tokens, shape.e, shape.top_k, 1)]
            for tname in trace_picks(traces, tokens):
                hists.append((f"trace:{tname}", "test", rescale_trace(traces[tname], shape.e, shape.top_k, tokens, 2)))
            gs0 = jnp.asarray(hists[0][2], jnp.int32)
            arg_sets = lambda gs: [(x, w, gs) for w in ws]
            specs = [(lambda x, w, gs, c=c: gmm(x, w, gs, config=c), arg_sets(gs0), reps) for c in CANDIDATES.values()]
            built = compile_many(specs)
            for hname, split, counts in hists:
                gs = jnp.asarray(counts, jnp.int32)
                row = dict(shape=shape.name, n=shape.n, k=shape.k, e=shape.e, top_k=shape.top_k, tokens=tokens, m=m,
                           hist=hname, split=split, counts=counts.tolist(), **histogram_stats(counts), times={},
                           static=candidate_index(gmm_config(m, shape.n, shape.k, shape.e)))
                for name, b in zip(names, built):
                    if isinstance(b, Exception):
                        row["times"][name] = None
                        row.setdefault("errors", {})[name] = f"{type(b).__name__}: {str(b).splitlines()[0][:160]}"
                        continue
                    run, r = b
                    row["times"][name] = time_compiled(lambda run=run: run(arg_sets(gs)), r, trials=5)
                offs = torch.as_tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
                row["times"]["torch"] = time_torch(lambda w: torch._grouped_mm(tx, w.transpose(-2, -1), offs=offs),
                                                   [(w,) for w in tws], reps=reps)
                shape_rows.append(row)
            print(f"  {shape.name} T={tokens}: {len(hists)} histograms, {time.time() - t_start:5.0f} s", flush=True)
        # Fit this shape's table on its train rows, then time the selector on its test rows.
        choice = fit_table([r for r in shape_rows if r["split"] == "train"], shape, chainable)
        table = table_for(shape, choice, device, f"benchmarks.routed_gmm sweep {results['meta']['date']}")
        results["tables"][shape.name] = dict(shape=list(table.shape), choice=choice)
        for tokens in token_counts:
            rows_t = [r for r in shape_rows if r["tokens"] == tokens and r["split"] == "test"]
            m, x, reps = _rows(shape, tokens)
            gs0 = jnp.asarray(rows_t[0]["counts"], jnp.int32)
            sel = compile_many([(lambda x, w, gs: gmm(x, w, gs, config=table), [(x, w, gs0) for w in ws], reps)])[0]
            if isinstance(sel, Exception):
                raise sel
            run, r = sel
            pick = jax.jit(lambda gs: _selected(gs, m, table))
            auto = jax.jit(lambda x, w, gs: gmm(x, w, gs, config=table))
            for i, row in enumerate(rows_t):
                gs = jnp.asarray(row["counts"], jnp.int32)
                row["times"]["selector"] = time_compiled(lambda: run([(x, w, gs) for w in ws]), r, trials=5)
                row["selected"] = names[int(pick(gs))]
                if i < 2:  # the selector's output is the chosen candidate's, bit for bit, and near fp32's
                    y = auto(x, ws[0], gs)
                    y_static = gmm(x, ws[0], gs, config=CANDIDATES[row["selected"]])
                    row["selector_bitwise_static"] = bool(jnp.array_equal(y, y_static))
                    row["selector_rel_err_vs_fp32"] = _rel_err_vs_fp32(y, x, ws[0], row["counts"])
        _annotate(shape_rows, shape)
        results["rows"] += shape_rows
        results["summary"] = summarize(results["rows"], names)
        _write(args.json, results)
        print(json.dumps(results["summary"].get(shape.name, {}), indent=None), flush=True)
    print(report(results))


def _rel_err_vs_fp32(y, x, w, counts, groups: int = 4) -> float:
    """`moe_jax.testing.rel_err` of `y` on the rows of the first `groups` active groups against the
    fp32 product of those rows with their experts' weights (a dense matmul per group: XLA's
    grouped dot at the DeepSeek-V3 shape needs more memory than the GPU has)."""
    import jax.numpy as jnp

    from moe_jax.testing import rel_err

    offsets = np.concatenate([[0], np.cumsum(counts)])
    spans = [(int(offsets[g]), int(offsets[g + 1]), g) for g in range(len(counts)) if counts[g] > 0][:groups]
    got = jnp.concatenate([y[a:b] for a, b, _ in spans])
    want = jnp.concatenate([x[a:b].astype(jnp.float32) @ w[g].astype(jnp.float32).T for a, b, g in spans])
    return rel_err(got.astype(jnp.float32), want)


def _rows(shape: S.GemmShape, tokens: int):
    """`(M, x [M, K] bf16, reps)` of one token count: the same rows for every candidate and the selector."""
    import jax
    import jax.numpy as jnp

    m = tokens * shape.top_k
    x = jax.random.normal(jax.random.PRNGKey(tokens), (m, shape.k), jnp.bfloat16)
    return m, x, int(max(3, min(20, (2 << 30) // max(m * shape.n * 2 + m * shape.k * 2, 1))))


def _selected(gs, m, table):
    from moe_jax.ops.gmm.pallas_triton.selector import select

    return select(gs, m, table).candidate


def _annotate(rows, shape):
    """Per candidate: P, padding fraction, effective/physical TFLOP/s, active weight bytes."""
    from moe_jax.ops import CANDIDATES
    from moe_jax.padding import executed_rows

    for row in rows:
        counts = np.asarray(row["counts"])
        row["weight_bytes"] = int((counts > 0).sum()) * shape.n * shape.k * 2
        per = {}
        for name, c in CANDIDATES.items():
            p = int(executed_rows(counts, c.tiles.block_m).sum())
            t = row["times"].get(name)
            per[name] = dict(P=p, padding=(p - row["useful_rows"]) / p if p else 0.0,
                             tflops=None if not t else 2 * row["useful_rows"] * shape.n * shape.k / t / 1e12,
                             physical_tflops=None if not t else 2 * p * shape.n * shape.k / t / 1e12)
        row["per_candidate"] = per


def summarize(rows: list[dict], names: list[str]) -> dict:
    """Per shape and overall, on the `test` histograms: geomean speedups of the selector over the
    best single static candidate (chosen on all histograms of the shape), today's rule and torch,
    and the selector's fraction of the oracle."""
    out = {}
    groups = {}
    for r in rows:
        groups.setdefault(r["shape"], []).append(r)
    for shape, rs in list(groups.items()) + [("all", None)]:
        rs = rs if rs is not None else [r for g in groups.values() for r in g]
        valid = [r for r in rs if all(r["times"].get(n) for n in names)]
        if not valid:
            continue
        static_best = min(names, key=lambda n: sum(math.log(r["times"][n]) for r in valid))
        test = [r for r in valid if r["split"] == "test" and r["times"].get("selector")]
        if not test:
            continue
        oracle = lambda r: min(r["times"][n] for n in names)
        out[shape] = dict(
            histograms=len(test),
            best_static=static_best,
            selector_over_best_static=_geomean([r["times"][static_best] / r["times"]["selector"] for r in test]),
            selector_over_rule=_geomean([r["times"][names[r["static"]]] / r["times"]["selector"] for r in test]),
            selector_fraction_of_oracle=_geomean([oracle(r) / r["times"]["selector"] for r in test]),
            oracle_over_best_static=_geomean([r["times"][static_best] / oracle(r) for r in test]),
            selector_over_torch=_geomean([r["times"]["torch"] / r["times"]["selector"] for r in test]),
            selector_overhead_us=float(np.median([(r["times"]["selector"] - r["times"][r["selected"]]) * 1e6
                                                   for r in test])),
        )
    return out


def report(results: dict) -> str:
    """Markdown: the summary, then one line per test histogram."""
    lines = ["| shape | histograms | best static | selector / best static | selector / rule | selector / oracle | "
             "oracle / best static | selector / torch | selector overhead (us) |", "|" + "---|" * 9]
    for shape, s in results["summary"].items():
        lines.append(f"| {shape} | {s['histograms']} | {s['best_static']} | {s['selector_over_best_static']:.3f} | "
                     f"{s['selector_over_rule']:.3f} | {s['selector_fraction_of_oracle']:.3f} | "
                     f"{s['oracle_over_best_static']:.3f} | {s['selector_over_torch']:.3f} | "
                     f"{s['selector_overhead_us']:.1f} |")
    lines += ["", "| shape | T | histogram | U | active | E_eff | selected | oracle | selector us | oracle us | "
                  "best-static us | torch us |", "|" + "---|" * 12]
    for shape, s in results["summary"].items():
        if shape == "all":
            continue
        for r in results["rows"]:
            if r["shape"] != shape or r["split"] != "test" or not r["times"].get("selector"):
                continue
            cand = {n: t for n, t in r["times"].items() if n not in ("torch", "selector") and t}
            orc = min(cand, key=cand.get)
            lines.append(f"| {shape} | {r['tokens']} | {r['hist']} | {r['useful_rows']} | {r['active']} | "
                         f"{r['effective']:.1f} | {r['selected']} | {orc} | {r['times']['selector'] * 1e6:.1f} | "
                         f"{cand[orc] * 1e6:.1f} | {r['times'][s['best_static']] * 1e6:.1f} | "
                         f"{r['times']['torch'] * 1e6:.1f} |")
    return "\n".join(lines)


def score_tables(results: dict, tables) -> str:
    """Markdown: the shipped `tables` (`SelectorTable`s) scored on a sweep's `test` histograms,
    each histogram at the measured time of the candidate its table cell names (what `auto` runs
    when the cell holds one candidate), against the best single static candidate, today's rule,
    the oracle and torch."""
    from moe_jax.ops import CANDIDATES

    names = list(CANDIDATES)
    shapes = {s.name: s for s, _ in sweep_shapes(False)}
    lines = ["| shape | test histograms | best single static | table / best static | table / rule | table / oracle | "
             "oracle / best static | table / torch |", "|" + "---|" * 8]
    every: dict[str, list[float]] = {}
    for name in [n for n in shapes if any(r["shape"] == n for r in results["rows"])]:
        shape = shapes[name]
        table = next((t for t in tables if t.shape == (shape.n, shape.k, shape.e)), None)
        rows = [r for r in results["rows"] if r["shape"] == name and all(r["times"].get(n) for n in names)]
        if table is None or not rows:
            continue
        best = min(names, key=lambda n: sum(math.log(r["times"][n]) for r in rows))
        dims = table_dims(shape.e)
        ratios: dict[str, list[float]] = {k: [] for k in ("static", "rule", "oracle", "oracle_static", "torch")}
        for r in (r for r in rows if r["split"] == "test"):
            row, col = host_cell(r["m"], r["effective"], dims)
            t = r["times"][table.choice[row][col]]
            oracle = min(r["times"][n] for n in names)
            for key, value in (("static", r["times"][best] / t), ("rule", r["times"][names[r["static"]]] / t),
                               ("oracle", oracle / t), ("oracle_static", r["times"][best] / oracle),
                               ("torch", r["times"]["torch"] / t)):
                ratios[key].append(value)
                every.setdefault(key, []).append(value)
        lines.append(f"| {name} | {len(ratios['static'])} | {best} | " + " | ".join(
            f"{_geomean(ratios[k]):.3f}" for k in ("static", "rule", "oracle", "oracle_static", "torch")) + " |")
    if every:
        lines.append(f"| all | {len(every['static'])} | (per shape) | " + " | ".join(
            f"{_geomean(every[k]):.3f}" for k in ("static", "rule", "oracle", "oracle_static", "torch")) + " |")
    return "\n".join(lines)


def _meta(args, jax, torch) -> dict:
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, jax=jax.__version__, torch=torch.__version__,
                python=platform.python_version(), command="python -m benchmarks.routed_gmm " + " ".join(sys.argv[1:]))
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def _write(path, results):
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=None)


# ---------------------------------------------------------------------------------------------
# fit / report (CPU)


def render_tables(results: dict) -> str:
    """The tables module (`pallas_triton.tables`) for a sweep's fitted tables."""
    meta = results["meta"]
    dates = results.get("dates", {})
    out = ['"""Selector tables tuned offline (generated by `python -m benchmarks.routed_gmm fit`; do not edit).',
           "", f"Sweep: {meta['command']} on {meta['device']}, {', '.join(sorted(set(dates.values())) or [meta['date']])}, "
           f"jax {meta['jax']}, "
           f"triton {meta.get('triton', '?')}.", "Results: benchmarks/results/ (the sweep's JSON and its report).",
           '"""', "", "from moe_jax.ops.gmm.pallas_triton.selector import SelectorTable", "", "TABLES = ("]
    for name, t in results["tables"].items():
        out.append(f"    # {name}")
        out.append(f"    SelectorTable(shape={tuple(t['shape'])}, device={meta['device']!r}, "
                   f"source={'benchmarks.routed_gmm sweep ' + dates.get(name, meta['date'])!r}, choice=(")
        for row in t["choice"]:
            out.append("        (" + ", ".join(repr(c) for c in row) + ",),")
        out.append("    )),")
    out.append(")")
    return "\n".join(out) + "\n"


def load_results(paths: list[str]) -> dict:
    """One sweep's results from the JSON of one or more `sweep` runs (rows and tables merged)."""
    merged = None
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        # Each shape's table cites the sweep that measured it.
        dates = {r["shape"]: part["meta"]["date"] for r in part["rows"]}
        if merged is None:
            merged = part
            merged["dates"] = dates
        else:
            merged["dates"].update(dates)
            merged["rows"] += part["rows"]
            merged["tables"].update(part["tables"])
            merged["meta"]["command"] += " ; " + part["meta"]["command"]
    from moe_jax.ops import CANDIDATES

    merged["summary"] = summarize(merged["rows"], list(CANDIDATES))
    return merged


def cmd_fit(args):
    results = load_results(args.results)
    from moe_jax.ops import CANDIDATES

    names = [n for n, c in CANDIDATES.items() if c.family != "split_k"]  # tables chain gated launches
    shapes = {s.name: s for s, _ in sweep_shapes(False)}
    for name in sorted({r["shape"] for r in results["rows"]}):
        shape = shapes[name]
        results["tables"][name] = dict(shape=[shape.n, shape.k, shape.e], choice=fit_table(
            [r for r in results["rows"] if r["shape"] == name and r["split"] == "train"], shape, names))
    text = render_tables(results)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
        print(f"wrote {args.write}")
    else:
        print(text)


def cmd_report(args):
    print(report(load_results(args.results)))


def cmd_score(args):
    from moe_jax.ops.gmm.pallas_triton.tables import TABLES

    print(score_tables(load_results(args.results), TABLES))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("sweep")
    q.add_argument("--quick", action="store_true", help="the Qwen3 gate+up shape at five token counts only")
    q.add_argument("--shapes", default=None, help="comma-separated indices into the shape list (default all)")
    q.add_argument("--traces", default=None, help="an .npz of recorded expert-count histograms (name -> [E])")
    q.add_argument("--json", default=None, help="write the full results here (rewritten after each shape)")
    q = sub.add_parser("fit")
    q.add_argument("results", nargs="+")
    q.add_argument("--write", default=None, help="write the tables module here (default: print it)")
    q = sub.add_parser("report")
    q.add_argument("results", nargs="+")
    q = sub.add_parser("score", help="the shipped selector tables on the sweeps' test histograms")
    q.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "sweep":
        import jax

        if jax.default_backend() != "gpu":
            p.error("sweep needs a CUDA GPU (jax.default_backend() is %r)" % jax.default_backend())
    {"sweep": cmd_sweep, "fit": cmd_fit, "report": cmd_report, "score": cmd_score}[args.cmd](args)


if __name__ == "__main__":
    main()
