"""The `mosaic_gpu` backend of the grouped GEMM: its plan and launch (`backend`), configuration,
shared-memory model and rule (`config`), and the kernel (`kernel`)."""

from moe_jax.ops.gmm.mosaic_gpu.backend import BACKEND
from moe_jax.ops.gmm.mosaic_gpu.config import MosaicConfig, mosaic_config, smem_bytes

__all__ = ["BACKEND", "MosaicConfig", "mosaic_config", "smem_bytes"]
