"""The `triton` backend: official Triton kernels (`kernels`) called through jax_triton (`launch`).
GPU only, and only where jax_triton imports (`pip install -e '.[jax-triton]'`).

It has the row-tile forward/input-gradient kernel and the weight-gradient kernel, no on-device
selector: `config=None` or `"auto"` runs its tile rules (`rules`); a `TileConfig` runs those
tiles. Tiles are fitted to the device's shared memory as the
`pallas_triton` backend's are (`moe_jax.ops.gmm.tiles`: the same compiler, the same model).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from moe_jax.ops.gmm.problem import Executed, GemmBackend, Plan, Problem, useful_rows
from moe_jax.ops.gmm.schedule import executed_at
from moe_jax.ops.gmm.tiles import TileConfig, fit_tiles, tile_name
from moe_jax.ops.gmm.triton.launch import gmm_triton, import_jax_triton, tgmm_triton
from moe_jax.ops.gmm.triton.rules import gmm_tiles, tgmm_tiles
from moe_jax.ops.platform import DeviceFacts, compile_platform, on_gpu

__all__ = ["BACKEND", "Triton", "have_jax_triton"]


@functools.cache
def have_jax_triton() -> bool:
    """Whether jax_triton imports here (it needs a CUDA jaxlib)."""
    try:
        import_jax_triton()
    except ImportError:
        return False
    return True


class Triton(GemmBackend):
    name = "triton"
    fuses_gather = True

    def config_types(self, kernel: str) -> tuple[type, ...]:
        return (TileConfig,)

    def available(self) -> str | None:
        if not on_gpu():
            return (f"backend 'triton' runs official Triton kernels through jax_triton, which needs a CUDA GPU "
                    f"(compiling for {compile_platform()!r})")
        if not have_jax_triton():
            return "backend 'triton' needs jax_triton: pip install -e '.[jax-triton]'"
        return None

    def supports(self, problem: Problem, device: DeviceFacts) -> str | None:
        if problem.kernel != "tgmm" and problem.num_groups * problem.m >= 2**31:
            return f"backend 'triton' needs E * M < 2**31; got E={problem.num_groups}, M={problem.m}"
        return None

    def configure(self, problem: Problem, config, device: DeviceFacts):
        p = problem
        wgrad = p.kernel == "tgmm"
        explicit = isinstance(config, TileConfig)
        rule = tgmm_tiles if wgrad else gmm_tiles
        tiles = config if explicit else rule(p.m, p.n, p.k, p.num_groups)
        fitted, need, notes = fit_tiles(tiles, wgrad=wgrad, dtype=p.dtype, ieee_fp32=p.ieee_fp32, device=device,
                                        explicit=explicit, what=tile_name(tiles))
        return fitted, (need,), notes

    def run(self, plan: Plan, lhs, rhs, group_sizes, row_ids):
        p = plan.problem
        if p.kernel == "tgmm":
            return tgmm_triton(lhs, rhs, group_sizes, tiles=plan.config, out_dtype=p.out_dtype, precision=p.precision,
                               row_ids=row_ids)
        return gmm_triton(lhs, rhs, group_sizes, transpose_rhs=p.kernel == "gmm_nt", tiles=plan.config,
                          out_dtype=p.out_dtype, precision=p.precision, row_ids=row_ids)

    def executed(self, plan: Plan, group_sizes) -> Executed:
        p = plan.problem
        if p.kernel == "tgmm":
            return super().executed(plan, group_sizes)
        return Executed(executed_at(group_sizes, p.m, plan.config.block_m), useful_rows(group_sizes, p.m),
                        jnp.int32(-1))


BACKEND = Triton()
