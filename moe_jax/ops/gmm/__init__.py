"""The grouped GEMM, one room: public ops (`api`), candidates and tables (`config`), the on-device
tile schedule (`schedule`), the on-device kernel choice (`selector`, its tuned tables in
`selector_tables`), one file per kernel family (`row_tile`, `group_major`, `wgrad`, with
the shared in-kernel body in `tile`), the four backends (`backends`: `pallas_triton`, `triton` with
its kernels in `triton_kernels` launched from `triton_launch`, `mosaic_gpu` in `mosaic`, `xla`;
`auto`'s per-kernel choice in `backend_table`) and the fp32 references (`reference`)."""

from moe_jax.ops.gmm.api import SUPPORTED_DTYPES, RowGather, gmm, grouped_linear, tgmm
from moe_jax.ops.gmm.backend_table import AUTO_FUSED_GATHER, H200_BACKENDS, KERNELS, gemm_backend
from moe_jax.ops.gmm.config import (CANDIDATES, FAMILIES, GmmConfig, TileConfig, candidate_index, gmm_config, tgmm_config,
                                    triton_candidate, triton_tgmm_config)
from moe_jax.ops.gmm.reference import gmm_reference, tgmm_reference
from moe_jax.ops.gmm.schedule import GroupMetadata, clamp_group_sizes, make_group_metadata, max_tiles
from moe_jax.ops.gmm.selector import Features, Selection, SelectorTable, histogram_features, select, selector_table

__all__ = [
    "CANDIDATES",
    "AUTO_FUSED_GATHER",
    "H200_BACKENDS",
    "KERNELS",
    "RowGather",
    "gemm_backend",
    "Features",
    "Selection",
    "SelectorTable",
    "candidate_index",
    "histogram_features",
    "select",
    "selector_table",
    "FAMILIES",
    "GmmConfig",
    "GroupMetadata",
    "SUPPORTED_DTYPES",
    "TileConfig",
    "clamp_group_sizes",
    "gmm",
    "gmm_config",
    "gmm_reference",
    "grouped_linear",
    "make_group_metadata",
    "max_tiles",
    "tgmm",
    "tgmm_config",
    "tgmm_reference",
    "triton_candidate",
    "triton_tgmm_config",
]
