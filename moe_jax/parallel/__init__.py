"""Expert parallelism: the `("data", "ep")` mesh and the dispatch/combine exchanges.

`mesh` builds and checks meshes and gives the sharding rules; `exchange` holds the functions that
run inside `jax.shard_map` to move token rows to expert owners and back.
"""

from moe_jax.parallel.exchange import (
    STRATEGIES,
    BlockExchange,
    EPPlan,
    EPStats,
    capacity_for,
    ep_combine,
    ep_dispatch,
    ep_moe,
)
from moe_jax.parallel.mesh import (
    DATA_AXIS,
    DENSE_DP_AXES,
    EP_AXIS,
    EP_GROUP_AXES,
    EXPERT_DP_AXES,
    MESH_AXES,
    activation_spec,
    check_mesh,
    dense_spec,
    expert_spec,
    make_mesh,
)

__all__ = [
    "DATA_AXIS",
    "DENSE_DP_AXES",
    "EP_AXIS",
    "EP_GROUP_AXES",
    "EXPERT_DP_AXES",
    "MESH_AXES",
    "STRATEGIES",
    "BlockExchange",
    "EPPlan",
    "EPStats",
    "activation_spec",
    "capacity_for",
    "check_mesh",
    "dense_spec",
    "ep_combine",
    "ep_dispatch",
    "ep_moe",
    "expert_spec",
    "make_mesh",
]
