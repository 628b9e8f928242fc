"""The grouped GEMM, one room: the public ops (`api`), the one chooser (`plan`: `Problem` ->
`Plan`, `problem` holds the types and the backend interface), the backends, one folder or module
each, registered by name (`registry`: `pallas_triton/`, `triton/`, `mosaic_gpu/`, `xla`), what every
backend shares (`schedule`: group offsets and the in-kernel sizes vector; `tiles`: Triton tiles,
their shared-memory model and fallback), the fp32 references (`reference`) and the blockwise-FP8
grouped GEMM (`fp8_api`: `gmm_fp8`, its kernel in `triton/`)."""

from moe_jax.ops.gmm.api import SUPPORTED_DTYPES, RowGather, gmm, grouped_linear, tgmm
from moe_jax.ops.gmm.fp8_api import FP8_GEMM_BACKENDS, gmm_fp8
from moe_jax.ops.gmm.mosaic_gpu import MosaicConfig, mosaic_config
from moe_jax.ops.gmm.pallas_triton import (CANDIDATES, FAMILIES, Features, GmmConfig, Launches, Selection, SelectorTable,
                                           candidate_index, gmm_config, histogram_features, select, selector_table,
                                           tgmm_config)
from moe_jax.ops.gmm.plan import AUTO_FUSED_GATHER, H200_BACKENDS, LinearPlan, executed, plan, plan_linear
from moe_jax.ops.gmm.problem import KERNELS, Executed, Plan, Problem, resolved_problem
from moe_jax.ops.gmm.reference import gmm_fp8_reference, gmm_reference, tgmm_reference
from moe_jax.ops.gmm.registry import GEMM_BACKENDS
from moe_jax.ops.gmm.schedule import GroupMetadata, clamp_group_sizes, make_group_metadata, max_tiles
from moe_jax.ops.gmm.tiles import TileConfig, triton_smem_bytes

__all__ = [
    "AUTO_FUSED_GATHER",
    "CANDIDATES",
    "Executed",
    "FAMILIES",
    "FP8_GEMM_BACKENDS",
    "Features",
    "GEMM_BACKENDS",
    "GmmConfig",
    "GroupMetadata",
    "H200_BACKENDS",
    "KERNELS",
    "Launches",
    "LinearPlan",
    "MosaicConfig",
    "Plan",
    "Problem",
    "RowGather",
    "SUPPORTED_DTYPES",
    "Selection",
    "SelectorTable",
    "TileConfig",
    "candidate_index",
    "clamp_group_sizes",
    "executed",
    "gmm",
    "gmm_config",
    "gmm_fp8",
    "gmm_fp8_reference",
    "gmm_reference",
    "grouped_linear",
    "histogram_features",
    "make_group_metadata",
    "max_tiles",
    "mosaic_config",
    "plan",
    "plan_linear",
    "resolved_problem",
    "select",
    "selector_table",
    "tgmm",
    "tgmm_config",
    "tgmm_reference",
    "triton_smem_bytes",
]
