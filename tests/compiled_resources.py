"""Every kernel configuration the choosers can return, and the shared memory Triton compiles for it.

    python -m tests.compiled_resources [--sample] [--jobs N] > compiled.jsonl

`reachable()` plans, for an H200, every kernel of every backend at representative decode and
prefill shapes (the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B layers, the five layer shapes of
the GPU acceptance run, every row of every tuned selector table) for bf16, fp16 and fp32 operands
(fp32 at full precision and at TF32), with the static rule, the on-device selector and every
backend of the `auto` table. `tests/test_resources.py` checks that each fits.

Run as a program, it compiles each distinct configuration of the two Triton-compiled backends for
sm_90 on this host and prints one JSON line per configuration: the model's bytes
(`moe_jax.ops.gmm.tiles.triton_smem_bytes`) beside the compiled kernel's (`metadata.shared`).
`pallas_triton` kernels are lowered by JAX for an abstract H200 to the Triton IR that XLA compiles
on the GPU, and that IR is compiled here by the Triton wheel; the `triton` backend's kernels are
compiled from their source with the launch constants the GPU run uses. Run it in a process
without `TRITON_INTERPRET` (under it `triton.jit` gives interpreted functions).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp

from moe_jax.ops import GEMM_BACKENDS, KERNELS, device_facts, resolved_problem
from moe_jax.ops.gmm.pallas_triton import Launches
from moe_jax.ops.gmm.pallas_triton.tables import TABLES
from moe_jax.ops.gmm.tiles import TileConfig, triton_smem_bytes
from tests.helpers import h200_mesh

H200 = h200_mesh((1,), ("aot",))
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
PRECISIONS = (None, jax.lax.Precision.DEFAULT)  # fp32: full precision (the default) and TF32
# (M, N, K, E) of forward GEMMs: the model layers' gate/up and down projections at prefill and
# decode, and the acceptance run's layer shapes (T, D, F, E, k) -> M = T * k.
MODEL_LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8),
                "mixtral-8x7b": (4096, 14336, 8, 2)}
ACCEPTANCE_LAYERS = ((64, 256, 256, 16, 4), (512, 256, 256, 16, 4), (2048, 512, 512, 32, 4),
                     (8192, 1024, 512, 64, 8), (4096, 2048, 768, 128, 8))


def _gemm_shapes() -> list[tuple[int, int, int, int]]:
    shapes = []
    for d, f, e, k in MODEL_LAYERS.values():
        for tokens in (1, 8, 64, 4096, 8192):
            shapes += [(tokens * k, 2 * f, d, e), (tokens * k, f, d, e), (tokens * k, d, f, e)]
    for t, d, f, e, k in ACCEPTANCE_LAYERS:
        shapes += [(t * k, 2 * f, d, e), (t * k, f, d, e), (t * k, d, f, e)]
    for table in TABLES:  # every row of every tuned table
        n, k, e = table.shape
        shapes += [(2**r, n, k, e) for r in range(len(table.choice))]
    return sorted(set(shapes))


class Reached(NamedTuple):
    """One configuration a chooser returns: the backend, its problem, the configuration that
    runs and the model's bytes per launch."""

    backend: str
    problem: object
    config: object
    smem_bytes: tuple[int, ...]


def reachable() -> list[Reached]:
    """Every (backend, problem, config) the choosers return for an H200 at the shapes above (see
    the module docstring); configurations a backend refuses (`supports`) are not reachable."""
    out = []
    with jax.sharding.use_abstract_mesh(H200):
        facts = device_facts()
        for m, n, k, e in _gemm_shapes():
            for dtype in DTYPES:
                for precision in PRECISIONS if dtype == jnp.float32 else (None,):
                    for kernel in KERNELS:
                        dims = (n, k) if kernel != "gmm_nn" else (k, n)  # the input gradient of the same layer
                        problem = resolved_problem(kernel, m, *dims, e, dtype, precision=precision)
                        for name, backend in GEMM_BACKENDS.items():
                            if kernel not in backend.kernels or backend.supports(problem, facts):
                                continue
                            for config in (None, "auto"):
                                resolved, smem, _ = backend.configure(problem, config, facts)
                                out.append(Reached(name, problem, resolved, smem))
    return out


class Compile(NamedTuple):
    """A distinct compilation: backend, kernel code (`gmm_nt`/`gmm_nn` family or `tgmm`), tiles,
    operand dtype, full-precision fp32, rows read through ids."""

    backend: str
    kernel: str
    family: str
    tiles: TileConfig
    dtype: str
    ieee: bool
    gather: bool


def compilations(reached: list[Reached]) -> list[Compile]:
    """The distinct Triton compilations of `reached` (the two Triton-compiled backends; with the
    fused row gather where a kernel has one)."""
    out = set()
    for r in reached:
        p = r.problem
        dtype, ieee = p.dtype.name, p.ieee_fp32
        if r.backend == "pallas_triton":
            configs = [(c.family, c.tiles) for c in r.config.configs] if isinstance(r.config, Launches) else [
                ("wgrad", r.config)]
        elif r.backend == "triton":
            configs = [("row_tile" if p.kernel != "tgmm" else "wgrad", r.config)]
        else:
            continue
        for family, tiles in configs:
            gathers = (False, True) if family in ("row_tile", "wgrad") and p.kernel != "gmm_nn" else (False,)
            for gather in gathers:
                out.add(Compile(r.backend, p.kernel, family, tiles, dtype, ieee, gather))
    return sorted(out, key=lambda c: (c.backend, c.kernel, c.family, c.dtype, c.ieee, c.gather,
                                      tuple(getattr(c.tiles, f) for f in ("block_m", "block_n", "block_k",
                                                                          "num_warps", "num_stages", "group_m"))))


def model_bytes(c: Compile) -> int:
    return triton_smem_bytes(c.tiles, wgrad=c.kernel == "tgmm", dtype=c.dtype, ieee_fp32=c.ieee)


# Problem sizes of the compilations: large enough for every tile, not multiples of them.
M, T, N, K, E = 2000, 1000, 1000, 1000, 16


def _precision(c: Compile):
    return jax.lax.Precision.HIGHEST if c.ieee else jax.lax.Precision.DEFAULT


def _pallas_shared(c: Compile) -> list[int]:
    """Lower the `pallas_triton` kernel of `c` for an H200 and compile its Triton IR for sm_90."""
    import triton  # noqa: PLC0415
    from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    from moe_jax.ops.gmm.pallas_triton.group_major import gmm_group_major_pallas  # noqa: PLC0415
    from moe_jax.ops.gmm.pallas_triton.row_tile import gmm_row_tile_pallas  # noqa: PLC0415
    from moe_jax.ops.gmm.pallas_triton.wgrad import tgmm_pallas  # noqa: PLC0415
    from moe_jax.ops.gmm.schedule import clamp_group_sizes  # noqa: PLC0415

    dtype, prec, s = jnp.dtype(c.dtype), _precision(c), jax.ShapeDtypeStruct
    common = dict(out_dtype=dtype, precision=prec, interpret=False)
    lhs = s((T if c.gather else M, K), dtype)
    ids = (s((M,), jnp.int32),) if c.gather else ()
    if c.kernel == "tgmm":
        def f(x, d, sizes, *ids):
            return tgmm_pallas(x, d, clamp_group_sizes(sizes, M), tiles=c.tiles, row_ids=ids[0] if ids else None,
                               **common)
        avals = (lhs, s((M, N), dtype), s((E,), jnp.int32), *ids)
    else:
        nt = c.kernel == "gmm_nt"
        rhs = s((E, N, K) if nt else (E, K, N), dtype)
        if c.family == "row_tile":
            def f(x, w, sizes, *ids):
                return gmm_row_tile_pallas(x, w, sizes, transpose_rhs=nt, tiles=c.tiles,
                                           row_ids=ids[0] if ids else None, **common)
        else:
            splits = 4 if c.family == "split_k" else 1

            def f(x, w, sizes):
                return gmm_group_major_pallas(x, w, sizes, transpose_rhs=nt, tiles=c.tiles, splits=splits, **common)
        avals = (lhs, rhs, s((E,), jnp.int32), *ids)
    modules = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    with jax.sharding.use_abstract_mesh(H200), mock.patch.object(registration.lowering, "lower_jaxpr_to_triton_module",
                                                                 keep):
        jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",))
    shared = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(modules):
            path = os.path.join(tmp, f"kernel{i}.ttir")
            with open(path, "w") as fh:
                fh.write(text)
            compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=c.tiles.num_warps, num_stages=c.tiles.num_stages))
            shared.append(compiled.metadata.shared)
    return shared


def _triton_shared(c: Compile) -> list[int]:
    """Compile the `triton` backend's kernel of `c` for sm_90 with the GPU run's launch constants."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from moe_jax.ops.gmm.triton.kernels import gmm_kernel, tgmm_kernel  # noqa: PLC0415
    from moe_jax.ops.gmm.triton.launch import gmm_launch, tgmm_launch  # noqa: PLC0415

    ty = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[c.dtype]
    source = T if c.gather else None
    if c.kernel == "tgmm":
        launch = tgmm_launch(m=M, n=N, k=K, num_groups=E, tiles=c.tiles, dtype=jnp.dtype(c.dtype),
                             precision=_precision(c), interpret=False, source_rows=source)
        kernel, names = tgmm_kernel, ("sizes_ptr", "rows_ptr", "a_ptr", "d_ptr", "o_ptr")
    else:
        launch = gmm_launch(m=M, n=N, k=K, num_groups=E, transpose_rhs=c.kernel == "gmm_nt", source_rows=source,
                            tiles=c.tiles, dtype=jnp.dtype(c.dtype), precision=_precision(c), interpret=False)
        kernel, names = gmm_kernel, ("sizes_ptr", "rows_ptr", "a_ptr", "b_ptr", "c_ptr")
    kinds = ("i32", "i32", ty, ty, ty)
    signature = {n: f"*{k}" for n, k in zip(names, kinds)} | {n: "constexpr" for n in launch.constants}
    # 16-byte aligned pointers, as jax_triton passes JAX buffers (Triton then vectorizes and pipelines).
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=dict(launch.constants), attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    return [compiled.metadata.shared]


def sample(todo: list[Compile]) -> list[Compile]:
    """One compilation per kind (backend, kernel, family, operand width, full-precision fp32, row
    gather): the one the model gives the most bytes, where a loose or a short count matters most."""
    kinds = {}
    for c in todo:
        kind = (c.backend, c.kernel, c.family, jnp.dtype(c.dtype).itemsize, c.ieee, c.gather)
        if kind not in kinds or model_bytes(c) > model_bytes(kinds[kind]):
            kinds[kind] = c
    return list(kinds.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", action="store_true", help="one compilation per kind (`sample`), not all")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = parser.parse_args()
    todo = compilations(reachable())
    todo = sample(todo) if args.sample else todo
    if args.jobs > 1:
        import multiprocessing  # noqa: PLC0415

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for line in pool.imap(_record, todo):
                print(line, flush=True)
        return
    for c in todo:
        print(_record(c), flush=True)


def _record(c: Compile) -> str:
    shared = _pallas_shared(c) if c.backend == "pallas_triton" else _triton_shared(c)
    return json.dumps(dict(backend=c.backend, kernel=c.kernel, family=c.family, tiles=list(c.tiles.__dict__.values()),
                           dtype=c.dtype, ieee=c.ieee, gather=c.gather, model=model_bytes(c), compiled=max(shared)))


if __name__ == "__main__":
    main()
