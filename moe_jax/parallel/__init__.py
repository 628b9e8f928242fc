"""Expert parallelism, one door: the mesh, capacity, the send plan, the layout of the exchanged
blocks, the transports that move them, and dispatch/combine (`ep_moe` runs the whole routed stage).

Module by module (dependencies point down the list): `mesh` (`AxisRules`, construction, sharding specs),
`capacity` (C from a capacity factor), `chunks` (a rank's tokens cut into chunks whose exchanges
can overlap), `options` (`EPOptions`, what the layer passes on), `send_plan/` (the sender's plan:
a Pallas kernel, an XLA backend, a reference), `layout` (block offsets and regroup maps from the exchanged counts),
`transports` (all_to_all, two-rank pair swap, ragged all_to_all, each with its VJP), `dispatch`
(`ep_dispatch`, `ep_combine`, `ep_moe`). Everything but `mesh` runs inside `jax.shard_map`.
Imported by their module path: `placement` (host-side planning of which expert each physical slot
holds, with replicas) and `replicas` (running a placement: routing to replicas, the replica
gradient sum, moving slots to a new placement).
"""

from moe_jax.parallel.capacity import capacity_for, check_capacity_factor
from moe_jax.parallel.chunks import token_chunks
from moe_jax.parallel.dispatch import EPPlan, EPStats, ep_combine, ep_dispatch, ep_moe
from moe_jax.parallel.layout import BlockExchange
from moe_jax.parallel.mesh import (
    DATA_AXIS,
    DENSE_DP_AXES,
    EP_AXIS,
    EP_GROUP_AXES,
    ETP_AXIS,
    EXPERT_DP_AXES,
    MESH_AXES,
    AxisRules,
    activation_spec,
    check_mesh,
    dense_spec,
    expert_spec,
    is_explicit,
    make_mesh,
)
from moe_jax.parallel.options import EPOptions
from moe_jax.parallel.send_plan import SendPlan, SendPlanTiles, plan_sends, plan_sends_reference
from moe_jax.parallel.transports import (
    ALL_TO_ALL,
    PAIR_MIN_BLOCK_BYTES,
    PAIR_SWAP,
    RAGGED_ALL_TO_ALL,
    STRATEGIES,
    TRANSPORTS,
    Transport,
    select_transport,
)

__all__ = [
    "ALL_TO_ALL",
    "DATA_AXIS",
    "DENSE_DP_AXES",
    "EP_AXIS",
    "EP_GROUP_AXES",
    "ETP_AXIS",
    "EXPERT_DP_AXES",
    "MESH_AXES",
    "PAIR_MIN_BLOCK_BYTES",
    "PAIR_SWAP",
    "RAGGED_ALL_TO_ALL",
    "STRATEGIES",
    "TRANSPORTS",
    "AxisRules",
    "BlockExchange",
    "EPOptions",
    "EPPlan",
    "EPStats",
    "SendPlan",
    "SendPlanTiles",
    "Transport",
    "activation_spec",
    "capacity_for",
    "check_capacity_factor",
    "check_mesh",
    "dense_spec",
    "ep_combine",
    "ep_dispatch",
    "ep_moe",
    "expert_spec",
    "is_explicit",
    "make_mesh",
    "plan_sends",
    "plan_sends_reference",
    "select_transport",
    "token_chunks",
]
