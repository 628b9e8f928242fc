"""Padding under routing skew: the planner (`planner`) and its command line (`cli`,
`python -m moe_jax.padding --help`)."""

from moe_jax.padding.cli import main
from moe_jax.padding.planner import (
    CapacityPadding,
    CommPadding,
    PaddingStats,
    RankPadding,
    capacity_padding,
    communication_padding,
    executed_rows,
    per_rank_padding,
    tile_padding,
)

__all__ = [
    "CapacityPadding",
    "CommPadding",
    "PaddingStats",
    "RankPadding",
    "capacity_padding",
    "communication_padding",
    "executed_rows",
    "main",
    "per_rank_padding",
    "tile_padding",
]
