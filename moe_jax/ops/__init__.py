"""Array-in, array-out ops (no Flax, no mesh): the grouped GEMM, the row gather and EP's send plan."""

from moe_jax.ops.backends import BACKENDS, GemmBackend, resolve_backend
from moe_jax.ops.config import TileConfig, gmm_config, tgmm_config
from moe_jax.ops.grouped_linear import gmm, grouped_linear, tgmm
from moe_jax.ops.metadata import GroupMetadata, clamp_group_sizes, make_group_metadata, max_tiles
from moe_jax.ops.reference import gmm_reference, tgmm_reference
from moe_jax.ops.rows import gather_rows, gather_rows_reference
from moe_jax.ops.send_plan import SendPlan, plan_sends, plan_sends_reference

__all__ = [
    "BACKENDS",
    "GemmBackend",
    "GroupMetadata",
    "SendPlan",
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
    "plan_sends",
    "plan_sends_reference",
    "resolve_backend",
    "tgmm",
    "tgmm_config",
    "tgmm_reference",
]
