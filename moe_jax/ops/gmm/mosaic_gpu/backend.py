"""The `mosaic_gpu` backend: the Pallas Mosaic GPU forward and input-gradient kernel (`kernel`).
It has no weight-gradient kernel (the one it had measured 0.66x `torch._grouped_mm` and was
removed, docs/decisions.md), so `tgmm` under `backend="mosaic_gpu"` runs on `auto`'s choice.

bf16/fp16 only; shapes as `config.shape_support` says; its configuration is a `MosaicConfig`
(`config=None` or `"auto"`: `mosaic_config`'s rule), whose shared memory (`config.smem_bytes`) must
fit the device. TMA copies boxes, so with row ids the rows are gathered first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.gather import gather_rows
from moe_jax.ops.gmm.mosaic_gpu.config import MosaicConfig, mosaic_config, shape_support, smem_bytes
from moe_jax.ops.gmm.mosaic_gpu.kernel import gmm_mosaic, group_tiles
from moe_jax.ops.gmm.problem import Executed, GemmBackend, Plan, Problem, useful_rows
from moe_jax.ops.platform import DeviceFacts, device_facts, interpret

__all__ = ["BACKEND", "MosaicGpu"]

INTERPRET_CTAS = 2  # interpret mode simulates every CTA: two still exercise the persistent loop


class MosaicGpu(GemmBackend):
    name = "mosaic_gpu"
    kernels = ("gmm_nt", "gmm_nn")

    def config_types(self, kernel: str) -> tuple[type, ...]:
        return (MosaicConfig,) if kernel in self.kernels else ()

    def _config(self, problem: Problem, config, device: DeviceFacts) -> MosaicConfig:
        if isinstance(config, MosaicConfig):
            return config
        return mosaic_config(problem.k, problem.dtype, problem.out_dtype, smem_limit=device.smem_per_block)

    def available(self) -> str | None:
        if interpret() and jax.config.jax_enable_x64:
            # JAX's Mosaic GPU interpreter lowers the kernel's pipelines at run time, where 64-bit
            # defaults make their loop carries disagree; compiled, the kernel is traced with 32-bit
            # defaults (`kernel.gmm_mosaic`).
            return "backend 'mosaic_gpu' in interpret mode (off GPU) does not run under jax_enable_x64"
        return None

    def supports(self, problem: Problem, device: DeviceFacts) -> str | None:
        config = self._config(problem, None, device)
        return shape_support(problem.m, problem.n, problem.k, problem.dtype, config) or self._fits(problem, config,
                                                                                                  device)

    def _fits(self, problem: Problem, config: MosaicConfig, device: DeviceFacts) -> str | None:
        need = smem_bytes(config, problem.dtype, problem.out_dtype)
        if need <= device.smem_per_block:
            return None
        return (f"{config} needs {need} B of shared memory for {problem.dtype.name} -> {problem.out_dtype.name}, over "
                f"the {device.smem_per_block} B per block of {device.kind}")

    def configure(self, problem: Problem, config, device: DeviceFacts):
        config = self._config(problem, config, device)
        reason = shape_support(problem.m, problem.n, problem.k, problem.dtype, config) or self._fits(problem, config,
                                                                                                   device)
        if reason:
            raise ValueError(f"{reason}. Use backend='auto', which runs such problems on another backend, or other "
                             "tiles.")
        return config, (smem_bytes(config, problem.dtype, problem.out_dtype),), ()

    def run(self, plan: Plan, lhs, rhs, group_sizes, row_ids):
        p = plan.problem
        if row_ids is not None:
            lhs = gather_rows(lhs, row_ids)
        num_ctas = INTERPRET_CTAS if interpret() else device_facts().num_sms
        return gmm_mosaic(lhs, rhs, group_sizes, transpose_rhs=p.kernel == "gmm_nt", out_dtype=p.out_dtype,
                          config=plan.config, num_ctas=num_ctas, interpret=interpret())

    def executed(self, plan: Plan, group_sizes) -> Executed:
        p, tile_m = plan.problem, plan.config.tile_m
        executed = tile_m * jnp.sum(group_tiles(group_sizes, num_rows=p.m, tile_m=tile_m)[:-1], dtype=jnp.int32)
        return Executed(executed, useful_rows(group_sizes, p.m), jnp.int32(-1))


BACKEND = MosaicGpu()
