"""Expert parallelism on `torch.distributed`: process groups, dispatch / combine, gradient sync.

Legend: T tokens on this rank, D model width, F expert hidden width, E experts (global),
K experts per token (top-k), P_ep ranks in an EP group, E_loc = E / P_ep experts per rank,
R rows this rank receives from its EP group (sum of its receive splits).

Layout (docs/reference-algorithm.md, "Expert parallelism in the reference"):

- Every EP group holds all E experts, partitioned into contiguous blocks: EP group rank `j` owns
  global experts `j*E_loc : (j+1)*E_loc` and stores them as a local stack `w_gate_local[E_loc, F,
  D]`, `w_up_local[E_loc, F, D]`, `w_down_local[E_loc, D, F]` (local expert `l` = global expert
  `j*E_loc + l`).
- EP groups are contiguous blocks of global ranks; ranks with the same slot in their EP group hold
  the same expert shard and form an expert-DP group; dense (router) parameters are replicated on
  every rank, so the dense-DP group is the world.

Forward: `ep_dispatch` packs each token-expert route by destination rank (then local expert),
exchanges counts, exchanges rows and integer metadata with `all_to_all_single`, and regroups the
received rows by local expert so that one grouped GEMM per projection serves every local expert.
The owner runs the SwiGLU experts (`experts.expert_swiglu`, Triton). `ep_combine` sends the outputs
back with the splits swapped and sums them into their tokens, weighted, in float32.

Backward: `AllToAllRows` is differentiable; its backward is the reverse exchange (splits swapped),
so gradients travel back along every route. Integer metadata uses the plain collective.
`reduce_gradients` then all-reduces expert gradients over the expert-DP group and dense gradients
over the dense-DP group.

Backends: the same code runs on NCCL (CUDA tensors, kernels compiled) and on gloo (CPU tensors,
kernels under Triton's interpreter). gloo in torch 2.11 implements `all_to_all_single` with
uneven splits (zero-row blocks included) for float, bfloat16 and integer tensors, so no
send/recv fallback is needed; it does not implement the list form `dist.all_to_all`, which this
module therefore never uses.

Every member of a group must make the same collective calls in the same order; all functions
here do so as long as every rank calls them with the same `num_experts` and group objects.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from parity.reference.experts import Packing, combine_pairs, expert_swiglu, pack_by_expert, sort_by_key

ProcessGroup = dist.ProcessGroup

# Columns of the integer route metadata that travels with every dispatched row.
META_LOCAL_EXPERT, META_SOURCE, META_TOKEN, META_SLOT = range(4)


class DispatchContext(NamedTuple):
    """What `ep_combine` needs from `ep_dispatch` (for one rank).

    send_splits[P_ep]  rows this rank sent to each EP group rank (list of int)
    recv_splits[P_ep]  rows this rank received from each EP group rank (list of int)
    route_order[T*K]   int64: packed send row i is the flat route `route_order[i]` = t*K + k
    expert_order[R]    int64: regrouped row i is received row `expert_order[i]`
    recv_meta[R, 4]    int64, regrouped order: (local expert, source EP group rank, source token,
                       source top-k slot) of each received row
    """

    send_splits: list[int]
    recv_splits: list[int]
    route_order: torch.Tensor
    expert_order: torch.Tensor
    recv_meta: torch.Tensor


# --------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first")


def make_parallel_groups(ep_size: int) -> tuple[ProcessGroup, ProcessGroup, ProcessGroup]:
    """Create the EP, expert-DP and dense-DP groups of this process: `(ep, expert_dp, dense_dp)`.

    With W = world size and `ep_size` dividing W, the EP groups are the contiguous blocks
    `[r*ep_size, (r+1)*ep_size)` (r = replica), the expert-DP groups are
    `{r*ep_size + slot : r}` for each EP slot, and the dense-DP group is the world.

    Collective contract: every process must call this with the same `ep_size`, at the same point
    of its program, because `dist.new_group` is itself collective and every process creates
    every group (also those it is not a member of) in the same order.
    """
    _require_initialized()
    world = dist.get_world_size()
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    if world % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the world size {world}")
    me = dist.get_rank()
    replicas = world // ep_size

    ep_group = expert_dp_group = None
    for replica in range(replicas):
        ranks = list(range(replica * ep_size, (replica + 1) * ep_size))
        group = dist.new_group(ranks=ranks)
        if me in ranks:
            ep_group = group
    for slot in range(ep_size):
        ranks = [replica * ep_size + slot for replica in range(replicas)]
        group = dist.new_group(ranks=ranks)
        if me in ranks:
            expert_dp_group = group
    # Dense (router) parameters are replicated on every rank in this layout.
    return ep_group, expert_dp_group, dist.group.WORLD


# --------------------------------------------------------------------------------------------
# Exchanges
# --------------------------------------------------------------------------------------------


def _check_splits(splits: Sequence[int], group_size: int, name: str) -> list[int]:
    splits = [int(s) for s in splits]
    if len(splits) != group_size:
        raise ValueError(f"{name} has {len(splits)} entries; the group has {group_size} ranks")
    if any(s < 0 for s in splits):
        raise ValueError(f"{name} must be non-negative, got {splits}")
    return splits


def exchange_counts(send_counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-to-all of one count per peer: `send_counts[P]` -> `recv_counts[P]` (same dtype/device).

    `send_counts[j]` is what this rank will send to group rank j; the result's entry i is what
    group rank i will send to this rank. Receivers need it to size their buffers before the row
    exchange. Collective over `group`.
    """
    size = dist.get_world_size(group)
    if send_counts.ndim != 1 or send_counts.numel() != size:
        raise ValueError(f"send_counts must be [P={size}], got {tuple(send_counts.shape)}")
    send_counts = send_counts.contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(
        recv_counts, send_counts,
        output_split_sizes=[1] * size, input_split_sizes=[1] * size, group=group,
    )
    return recv_counts


def all_to_all_rows(
    send: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: ProcessGroup,
) -> torch.Tensor:
    """Exchange row blocks: `send[sum(input_splits), ...]` -> `recv[sum(output_splits), ...]`.

    Rows `send[sum(input_splits[:j]) : sum(input_splits[:j+1])]` go to group rank j; the result
    holds the blocks received from group ranks 0..P-1 in that order, block i having
    `output_splits[i]` rows. The pairwise counts must agree across ranks (what rank i sends to j
    is what j expects from i). Not differentiable; see `AllToAllRows`. Collective over `group`.
    """
    size = dist.get_world_size(group)
    input_splits = _check_splits(input_splits, size, "input_splits")
    output_splits = _check_splits(output_splits, size, "output_splits")
    if send.ndim < 1 or send.shape[0] != sum(input_splits):
        raise ValueError(f"send has {send.shape[0] if send.ndim else 0} rows; input_splits sum to {sum(input_splits)}")
    recv = send.new_empty((sum(output_splits), *send.shape[1:]))
    # Both backends need dense row-major buffers: a split is a count of whole rows.
    dist.all_to_all_single(
        recv, send.contiguous(),
        output_split_sizes=output_splits, input_split_sizes=input_splits, group=group,
    )
    return recv


class AllToAllRows(torch.autograd.Function):
    """Differentiable `all_to_all_rows(send, output_splits, input_splits, group)`.

    A block sent from rank i to rank j in the forward receives its gradient from j back to i: the
    backward is the same exchange with the two split lists swapped.
    """

    @staticmethod
    def forward(ctx, send: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
        ctx.output_splits = list(output_splits)
        ctx.input_splits = list(input_splits)
        ctx.group = group
        return all_to_all_rows(send, ctx.output_splits, ctx.input_splits, group)

    @staticmethod
    def backward(ctx, grad_recv: torch.Tensor):
        # grad_recv has sum(output_splits) rows: it travels back with the split lists swapped.
        grad_send = all_to_all_rows(grad_recv, ctx.input_splits, ctx.output_splits, ctx.group)
        return grad_send, None, None, None


# --------------------------------------------------------------------------------------------
# Dispatch and combine
# --------------------------------------------------------------------------------------------


def _experts_per_rank(num_experts: int, ep_size: int) -> int:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {ep_size}")
    return num_experts // ep_size


def _check_routing(x: torch.Tensor, topk_idx: torch.Tensor) -> None:
    """Shape and device checks; `pack_by_expert` checks the dtype and the range of the ids."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    if topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx must be [T={x.shape[0]}, K], got {tuple(topk_idx.shape)}")
    if topk_idx.device != x.device:
        raise ValueError(f"x is on {x.device} but topk_idx on {topk_idx.device}")


def _route_meta(packing: Packing, experts_per_rank: int, ep_rank: int, top_k: int) -> torch.Tensor:
    """`meta[T*K, 4]` of the routes in packed (send) order: see the META_* columns."""
    local_expert = packing.expert_ids % experts_per_rank
    source = torch.full_like(local_expert, ep_rank)
    slot = packing.order % max(top_k, 1)
    return torch.stack([local_expert, source, packing.token_ids, slot], dim=1)


def ep_dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, ep_group: ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchContext]:
    """Send every (token, expert) route's input row to the expert's owner in `ep_group`.

    `x[T, D]`, `topk_idx[T, K]` (global expert ids in [0, E)) ->
    `(recv_x[R, D], recv_expert[R] int64, offsets[E_loc + 1] int32, context)`, where the R rows
    this rank received are grouped by local expert: local expert l owns rows
    `offsets[l]:offsets[l+1]` (in source-rank order, then source token order).
    `recv_x` is differentiable with respect to `x`. `context` feeds `ep_combine`.

    Collective over `ep_group` (three exchanges: counts, metadata, rows); every member must call
    it with the same `num_experts`. Raises ValueError when `num_experts` is not divisible by the
    EP group size or the routing is malformed.
    """
    ep_size = dist.get_world_size(ep_group)
    ep_rank = dist.get_rank(ep_group)
    experts_per_rank = _experts_per_rank(num_experts, ep_size)
    _check_routing(x, topk_idx)
    top_k = topk_idx.shape[1]

    # 1. Pack routes by global expert: since global expert = owner * E_loc + local expert, this
    #    orders them by destination rank, then local expert. The sort is stable, so the owner sees
    #    each expert's rows in global token order, as a single-process packing would.
    packing = pack_by_expert(topk_idx, num_experts)
    send_meta = _route_meta(packing, experts_per_rank, ep_rank, top_k)
    send_x = x[packing.token_ids]

    # 2. Receivers learn their counts before allocating buffers (a host sync: the variable-split
    #    API takes Python lists). Rank j owns global experts [j*E_loc, (j+1)*E_loc), so its count
    #    is a difference of the packing offsets.
    send_counts = packing.offsets[::experts_per_rank].diff().long()
    recv_counts = exchange_counts(send_counts, ep_group)
    send_splits = send_counts.cpu().tolist()
    recv_splits = recv_counts.cpu().tolist()

    # 3. Rows (differentiable) and their metadata (plain) with the same splits. The local expert
    #    rides in the metadata so that one integer exchange carries everything.
    recv_meta = all_to_all_rows(send_meta, recv_splits, send_splits, ep_group)
    recv_x = AllToAllRows.apply(send_x, recv_splits, send_splits, ep_group)

    # 4. The receive buffer is source-major; grouped GEMM needs each local expert contiguous.
    #    Stable, so one expert's rows stay in source-rank order, then source token order.
    regroup = sort_by_key(recv_meta[:, META_LOCAL_EXPERT], experts_per_rank)
    expert_order = regroup.order
    recv_x = recv_x[expert_order]
    recv_meta = recv_meta[expert_order]

    context = DispatchContext(send_splits, recv_splits, packing.order, expert_order, recv_meta)
    return recv_x, regroup.expert_ids, regroup.offsets, context


def ep_combine(
    packed_y: torch.Tensor,
    topk_weight: torch.Tensor,
    context: DispatchContext,
    num_tokens: int,
    ep_group: ProcessGroup,
) -> torch.Tensor:
    """Return expert outputs to their sources and form `out[t] = sum_k w[t, k] * y[t, k]`.

    `packed_y[R, D]` are the outputs of the rows `ep_dispatch` returned (same regrouped order),
    `topk_weight[T, K]` this rank's routing weights, `num_tokens` = T -> `out[T, D]` in the dtype
    of `packed_y`, accumulated in float32 (float64 for float64 data) and rounded once.
    Differentiable with respect to `packed_y` and `topk_weight`. Collective over `ep_group`.

    Every received route produces one output, so the reverse exchange reuses the dispatch splits
    swapped and needs no count exchange. Undoing the regroup permutation puts the outputs back in
    receive order; since each source packed its block in the order it sent it, the rows then come
    back to the source in exactly its send order, and `route_order` names each of them: no
    metadata has to travel back.
    """
    route_order = context.route_order
    if packed_y.ndim != 2 or packed_y.shape[0] != context.expert_order.numel():
        raise ValueError(
            f"packed_y must be [R={context.expert_order.numel()}, D] in dispatch order, got {tuple(packed_y.shape)}"
        )
    if topk_weight.ndim != 2 or topk_weight.shape[0] != num_tokens or topk_weight.numel() != route_order.numel():
        raise ValueError(
            f"topk_weight must be [T={num_tokens}, K] with T*K = {route_order.numel()} routes, "
            f"got {tuple(topk_weight.shape)}"
        )
    if not topk_weight.dtype.is_floating_point:
        raise ValueError(f"topk_weight must be floating point, got {topk_weight.dtype}")

    # Inverse of the regroup: receive-order row i is regrouped row inverse[i].
    inverse = torch.empty_like(context.expert_order)
    inverse[context.expert_order] = torch.arange(inverse.numel(), device=inverse.device)
    send_y = packed_y[inverse]
    returned_y = AllToAllRows.apply(send_y, context.send_splits, context.recv_splits, ep_group)

    top_k = topk_weight.shape[1]
    route_weight = topk_weight.reshape(-1)[route_order]
    return combine_pairs(returned_y, route_weight, route_order // max(top_k, 1), num_tokens)


# --------------------------------------------------------------------------------------------
# The expert-parallel MoE layer
# --------------------------------------------------------------------------------------------


def _check_local_weights(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, experts_per_rank: int,
) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    d = x.shape[1]
    if w_gate.ndim != 3 or w_gate.shape != w_up.shape:
        raise ValueError(
            f"w_gate_local and w_up_local must both be [E_loc, F, D], got {tuple(w_gate.shape)} and {tuple(w_up.shape)}"
        )
    e, f, d_w = w_gate.shape
    if e != experts_per_rank:
        raise ValueError(f"the local weights hold {e} experts; this rank owns E / P_ep = {experts_per_rank}")
    if d_w != d:
        raise ValueError(f"w_gate_local has model width {d_w}, x has {d}")
    if tuple(w_down.shape) != (e, d, f):
        raise ValueError(f"w_down_local must be [E_loc={e}, D={d}, F={f}], got {tuple(w_down.shape)}")


def ep_moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w_gate_local: torch.Tensor,
    w_up_local: torch.Tensor,
    w_down_local: torch.Tensor,
    num_experts: int,
    ep_group: ProcessGroup,
) -> torch.Tensor:
    """Expert-parallel SwiGLU MoE: this rank's tokens through experts spread over `ep_group`.

    `x[T, D]`, `topk_idx[T, K]` (global ids), `topk_weight[T, K]`, this rank's expert shard
    `w_gate_local/w_up_local[E_loc, F, D]`, `w_down_local[E_loc, D, F]` -> `out[T, D]` (dtype of
    x), equal to the single-process MoE of the whole group's tokens restricted to this rank's.
    Gradients reach `x`, `topk_weight` and the local weights (the local weight gradients cover
    every token of the EP group routed to them). Collective over `ep_group`, forward and backward:
    every member must run both, in the same order.
    """
    experts_per_rank = _experts_per_rank(num_experts, dist.get_world_size(ep_group))
    _check_local_weights(x, w_gate_local, w_up_local, w_down_local, experts_per_rank)
    recv_x, _, offsets, context = ep_dispatch(x, topk_idx, num_experts, ep_group)
    packed_y = expert_swiglu(recv_x, offsets, w_gate_local, w_up_local, w_down_local)
    return ep_combine(packed_y, topk_weight, context, x.shape[0], ep_group)


# --------------------------------------------------------------------------------------------
# Gradient synchronisation
# --------------------------------------------------------------------------------------------


def _all_reduce_grads(params: Iterable[torch.Tensor], group: ProcessGroup, average: bool, kind: str) -> None:
    size = dist.get_world_size(group)
    for i, p in enumerate(params):
        if p.grad is None:
            # Skipping it on one rank only would desynchronise the collectives: fail instead.
            raise ValueError(f"{kind} parameter {i} has no gradient; every rank must pass the same parameters, all with gradients")
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
        if average:
            p.grad.div_(size)


def reduce_gradients(
    expert_params: Iterable[torch.Tensor],
    dense_params: Iterable[torch.Tensor],
    expert_dp_group: ProcessGroup,
    dense_dp_group: ProcessGroup,
    *,
    average: bool,
) -> None:
    """All-reduce (SUM) `.grad` of expert parameters over `expert_dp_group` and of dense
    parameters (router, non-MoE layers) over `dense_dp_group`, in place.

    Expert shards are never reduced across their EP group: its ranks own different experts.
    `average=False` is right when each rank's loss is a sum over its tokens (or already carries
    the global normalisation): the SUM is then the gradient of the global loss. `average=True`
    divides by the group size, giving the equal-rank mean of per-rank mean losses.
    Collective: every rank passes the same parameters in the same order, all with gradients.
    """
    _all_reduce_grads(list(expert_params), expert_dp_group, average, "expert")
    _all_reduce_grads(list(dense_params), dense_dp_group, average, "dense")
