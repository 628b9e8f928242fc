"""The expert-parallel options that travel together from the layer to `ep_moe`."""

from __future__ import annotations

import dataclasses

from moe_jax.parallel.capacity import capacity_for, check_capacity_factor
from moe_jax.parallel.placement import Placement
from moe_jax.parallel.transports import Transport, check_strategy, check_transport

__all__ = ["EPOptions"]


@dataclasses.dataclass(frozen=True)
class EPOptions:
    """How an MoE layer exchanges rows when its mesh splits experts (ep > 1).

    strategy: `"padded"` (fixed-capacity blocks, every platform) or `"ragged"`
      (`ragged_all_to_all`, GPU only); see `moe_jax.parallel.transports`.
    capacity_factor: None for dropless dispatch, else C = `capacity_for(T, K, P, factor,
      local_experts=E/P)` rows per (source, destination) pair; routes past it are dropped and
      counted.
    transport: `"auto"` (the strategy's default), a transport name or a `Transport`.
    placement: None (expert e on rank e // (E/P), today's contiguous layout) or a
      `moe_jax.parallel.placement.Placement` of the layer's E experts on its P ep ranks: the
      routed experts' weights are then its R*S physical slots (replicas of hot experts), routes
      are dealt over the replicas on device and replicas' gradients are summed
      (`moe_jax.parallel.replicas`, docs/placement.md). Static: a new placement recompiles.
    """

    strategy: str = "padded"
    capacity_factor: float | None = None
    transport: str | Transport = "auto"
    placement: Placement | None = None

    def __post_init__(self):
        check_strategy(self.strategy)
        if self.capacity_factor is not None:
            object.__setattr__(self, "capacity_factor", check_capacity_factor(self.capacity_factor))
        check_transport(self.transport)
        if self.placement is not None and not isinstance(self.placement, Placement):
            raise TypeError(f"EPOptions(placement=...) must be a moe_jax.parallel.placement.Placement (e.g. from "
                            f"plan_placement) or None; got {type(self.placement).__name__}.")

    def capacity(self, tokens_per_rank: int, top_k: int, ep: int, local_experts: int) -> int | None:
        """C for one rank's `tokens_per_rank` tokens (None: dropless, or no routes to bound)."""
        if self.capacity_factor is None or tokens_per_rank * top_k == 0:
            return None
        return capacity_for(tokens_per_rank, top_k, ep, self.capacity_factor, local_experts=local_experts)
