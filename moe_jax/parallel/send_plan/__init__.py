"""EP dispatch's send plan, one room: the op, its XLA backend and limits (`api`), the Pallas kernel
(`kernel`) and the sort-based reference (`reference`)."""

from moe_jax.parallel.send_plan.api import PALLAS_MAX_RANKS, PALLAS_MAX_ROUTES, SendPlan, SendPlanTiles, plan_sends
from moe_jax.parallel.send_plan.reference import plan_sends_reference

__all__ = ["PALLAS_MAX_RANKS", "PALLAS_MAX_ROUTES", "SendPlan", "SendPlanTiles", "plan_sends", "plan_sends_reference"]
