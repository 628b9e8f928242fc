"""Array-in, array-out ops (no Flax, no mesh, nothing above them): the grouped GEMM (`ops.gmm`)
and the row gather (`ops.gather`), each with its kernels, backends and fp32 reference;
`ops.platform` holds the one backend registry and the platform detection."""

from moe_jax.ops.gather import gather_rows, gather_rows_reference
from moe_jax.ops.gmm import (
    CANDIDATES,
    SelectorTable,
    candidate_index,
    select,
    selector_table,
    FAMILIES,
    GmmConfig,
    SUPPORTED_DTYPES,
    GroupMetadata,
    TileConfig,
    clamp_group_sizes,
    gmm,
    gmm_config,
    gmm_reference,
    grouped_linear,
    make_group_metadata,
    max_tiles,
    tgmm,
    tgmm_config,
    tgmm_reference,
)
from moe_jax.ops.platform import BACKENDS, BackendName, resolve_backend

__all__ = [
    "CANDIDATES",
    "SelectorTable",
    "candidate_index",
    "select",
    "selector_table",
    "BACKENDS",
    "FAMILIES",
    "BackendName",
    "GmmConfig",
    "GroupMetadata",
    "SUPPORTED_DTYPES",
    "TileConfig",
    "clamp_group_sizes",
    "gather_rows",
    "gather_rows_reference",
    "gmm",
    "gmm_config",
    "gmm_reference",
    "grouped_linear",
    "make_group_metadata",
    "max_tiles",
    "resolve_backend",
    "tgmm",
    "tgmm_config",
    "tgmm_reference",
]
