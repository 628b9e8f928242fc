"""The expert-parallel options that travel together from the layer to `ep_moe`."""

from __future__ import annotations

import dataclasses

from moe_jax.parallel.capacity import capacity_for, check_capacity_factor
from moe_jax.parallel.chunks import check_chunks, token_chunks
from moe_jax.parallel.placement import Placement
from moe_jax.parallel.transports import Transport, check_strategy, check_transport

__all__ = ["EPOptions"]


@dataclasses.dataclass(frozen=True)
class EPOptions:
    """How an MoE layer exchanges rows when its mesh splits experts (ep > 1).

    strategy: `"padded"` (fixed-capacity blocks, every platform) or `"ragged"`
      (`ragged_all_to_all`, GPU only); see `moe_jax.parallel.transports`.
    capacity_factor: None for dropless dispatch, else C = `capacity_for(Tc, K, P, factor,
      local_experts=E/P)` rows per (source, destination) pair and chunk, Tc the largest chunk's
      tokens (T with `chunks=1`); routes past it are dropped and counted.
    transport: `"auto"` (the strategy's default), a transport name or a `Transport`.
    chunks: n >= 1. With n > 1 each rank's T tokens are cut into min(n, T) contiguous chunks
      (`moe_jax.parallel.chunks.token_chunks`: sizes differ by at most one) that are dispatched,
      run through the experts and combined independently, so XLA may overlap one chunk's exchange
      with another's expert GEMMs (docs/expert-parallelism.md, "Chunked exchange"). Dropless
      results equal `chunks=1`; with a capacity factor each chunk has its own C, so which routes
      drop can differ from `chunks=1` (drops are counted either way).
    placement: None (expert e on rank e // (E/P), today's contiguous layout) or a
      `moe_jax.parallel.placement.Placement` of the layer's E experts on its P ep ranks: the
      routed experts' weights are then its R*S physical slots (replicas of hot experts), routes
      are dealt over the replicas on device and replicas' gradients are summed
      (`moe_jax.parallel.replicas`, docs/placement.md). Static: a new placement recompiles.
    """

    strategy: str = "padded"
    capacity_factor: float | None = None
    transport: str | Transport = "auto"
    chunks: int = 1
    placement: Placement | None = None

    def __post_init__(self):
        check_strategy(self.strategy)
        if self.capacity_factor is not None:
            object.__setattr__(self, "capacity_factor", check_capacity_factor(self.capacity_factor))
        check_transport(self.transport)
        object.__setattr__(self, "chunks", check_chunks(self.chunks))
        if self.placement is not None and not isinstance(self.placement, Placement):
            raise TypeError(f"EPOptions(placement=...) must be a moe_jax.parallel.placement.Placement (e.g. from "
                            f"plan_placement) or None; got {type(self.placement).__name__}.")

    def capacity(self, tokens_per_rank: int, top_k: int, ep: int, local_experts: int) -> int | None:
        """C of each chunk of one rank's `tokens_per_rank` tokens (None: dropless, or no routes to
        bound): the capacity factor times the balanced load of the largest chunk, the same C for
        every chunk (`ep_moe` clamps it to a smaller chunk's routes)."""
        largest = max(stop - start for start, stop in token_chunks(tokens_per_rank, self.chunks))
        if self.capacity_factor is None or largest * top_k == 0:
            return None
        return capacity_for(largest, top_k, ep, self.capacity_factor, local_experts=local_experts)
