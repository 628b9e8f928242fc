"""The JAX rows of the EP benchmark: ours (`ep_dispatch` + `ep_combine`; with `--chunks`, also
`ep_moe` with one grouped GEMM as the experts, unchunked and chunked) and the bare XLA
collectives on the same buffers. Runs in a worker process (`cli.worker`), which sets the XLA
flags and the host-device count before JAX starts.

Legend: P ranks (ep size), T tokens per rank, D width, K top-k, R = T*K routes per rank, C capacity.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.ep.routing import CAPACITY_FACTOR, ROUTINGS, Shape, make_routing, reps_for, send_counts
from benchmarks.ep.table import progress
from benchmarks.timing import time_compiled
from moe_jax.ops import grouped_linear
from moe_jax.parallel import (
    EP_AXIS,
    PAIR_SWAP,
    activation_spec,
    capacity_for,
    ep_combine,
    ep_dispatch,
    ep_moe,
    make_mesh,
    select_transport,
)

__all__ = ["DECOMPOSER_VARIANTS", "PADDED_VARIANTS", "RAGGED_VARIANTS", "Variant", "chunk_variants", "ep_mesh",
           "jax_bench"]


class Variant(NamedTuple):
    """One kind of row; `label` is its name in the tables and JSON records.

    side: "ours" (`ep_dispatch` + `ep_combine`, `_ours_loop`) or "xla" (a bare collective there and
      back, `_collective_loop`).
    exchange: ours: the strategy, "padded" or "ragged"; xla: "all_to_all", "ppermute" or
      "ragged_all_to_all".
    capacity: capacity buffers, C = `capacity_for(..., CAPACITY_FACTOR)`, instead of dropless.
    no_a2a: ours, with the row collective replaced by the identity (the cost around it).
    xla_ops: ours, with the row gathers and the send plan through XLA instead of our Pallas kernels.
    decomposer: run in the process started with XLA's ragged_all_to_all decomposer flag.
    gemm_chunks: ours: 0 for identity experts (dispatch + combine only); n >= 1 for `ep_moe(chunks=n)`
      with one grouped GEMM `[El, D, D]` as the experts: compute the exchange may overlap with
      (`chunks=1` is the unchunked baseline of the same work).
    fp8: ours: the dispatch moves FP8 rows (`fp8_dispatch=True`: e4m3 values and fp32 tile scales,
      about half of bf16's bytes, dequantized on arrival); the combine moves bf16.
    """

    side: str
    exchange: str
    capacity: bool = False
    no_a2a: bool = False
    xla_ops: bool = False
    decomposer: bool = False
    gemm_chunks: int = 0
    fp8: bool = False

    @property
    def label(self) -> str:
        return (self.exchange + ("+decomp" if self.decomposer else "")
                + (f" cf={CAPACITY_FACTOR}" if self.capacity else "")
                + (" no-a2a" if self.no_a2a else "") + (" xla-ops" if self.xla_ops else "")
                + (f" gemm chunks={self.gemm_chunks}" if self.gemm_chunks else "") + (" fp8-dispatch" if self.fp8 else ""))


# The padded rows (every backend; the ppermute row at P = 2 only) and the ragged ones (GPU only).
PADDED_VARIANTS = (
    Variant("ours", "padded"),
    Variant("ours", "padded", capacity=True),
    Variant("ours", "padded", capacity=True, no_a2a=True),
    Variant("ours", "padded", capacity=True, xla_ops=True),
    Variant("ours", "padded", capacity=True, fp8=True),
    Variant("xla", "all_to_all"),
    Variant("xla", "all_to_all", capacity=True),
    Variant("xla", "ppermute", capacity=True),
)
RAGGED_VARIANTS = (Variant("ours", "ragged"), Variant("ours", "ragged", fp8=True), Variant("xla", "ragged_all_to_all"))
DECOMPOSER_VARIANTS = tuple(v._replace(decomposer=True) for v in RAGGED_VARIANTS)


def chunk_variants(chunks: tuple[int, ...], strategies: tuple[str, ...] = ("padded",)) -> tuple[Variant, ...]:
    """The `--chunks` rows: dropless `ep_moe` with a grouped GEMM as the experts, per strategy,
    its exchange in each of `chunks` chunks (include 1 for the unchunked baseline)."""
    return tuple(Variant("ours", strategy, gemm_chunks=n) for strategy in strategies for n in chunks)


def ep_mesh(ranks: int):
    """`make_mesh(ep=ranks)` over this process's first `ranks` devices."""
    devices = jax.devices()
    if len(devices) < ranks:
        raise ValueError(f"--ranks {ranks} needs {ranks} devices; this process sees {len(devices)} "
                         f"({devices[0].platform}): run on a machine with {ranks} GPUs, or add --cpu-smoke "
                         "for host devices.")
    return make_mesh(ep=ranks, data=1, devices=devices[:ranks])


def jax_bench(shapes, variants, smoke: bool, ranks: int) -> list[dict]:
    """Time every `Variant` on every shape and routing; one record per (shape, routing, variant).
    NCCL and torch-ref rows come from `torch_bench.torch_bench`."""
    mesh = ep_mesh(ranks)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, activation_spec()))  # noqa: E731
    records = []
    for shape in shapes:
        routes = shape.tokens * shape.top_k
        compiled = {}
        x = put(jax.random.normal(jax.random.PRNGKey(0), (ranks * shape.tokens, shape.d_model), jnp.bfloat16))
        for routing in ROUTINGS:
            idx, weights = make_routing(routing, ranks, shape.tokens, shape.experts, shape.top_k)
            counts_PP = send_counts(idx, shape.experts, ranks)
            inputs = dict(ours=(x, put(idx), put(weights)), xla=(x, put(counts_PP)))
            for variant in variants:
                record = dict(side=variant.side, strategy=variant.label, shape=shape.describe(),
                              d_model=shape.d_model, routing=routing)
                try:
                    if variant not in compiled:  # same shapes for every routing: compile once
                        build = _ours_loop if variant.side == "ours" else _collective_loop
                        compiled[variant] = build(mesh, shape, variant, smoke)
                    run, reps, delivered = compiled[variant]
                    args = inputs[variant.side]
                    kept = delivered(*args)  # outside the timed executable
                    seconds = time_compiled(lambda: run(*args), reps, trials=2 if smoke else 5)
                    record.update(seconds=seconds, rows_per_rank=kept / ranks, dropped=routes * ranks - kept,
                                  reps=reps)
                except Exception as err:  # a variant that cannot run is reported, not fatal
                    record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                records.append(record)
                progress(record)
    return records


def _ours_loop(mesh, shape: Shape, variant: Variant, smoke: bool):
    """`(run, reps, delivered)`: `run(x, idx, weights)` is `reps` dispatch+combine iterations
    (identity experts, or with `variant.gemm_chunks` the chunked `ep_moe` with one grouped GEMM
    as the experts) of our `variant` in one jitted fori_loop, returning x after the round trips;
    `delivered(x, idx, weights)` is the routes one iteration delivers (a separate executable, so
    the timed one runs nothing else)."""
    strategy = variant.exchange
    backend = "xla" if variant.xla_ops else "auto"
    ranks = mesh.shape[EP_AXIS]
    capacity = capacity_for(shape.tokens, shape.top_k, ranks, CAPACITY_FACTOR) if variant.capacity else None
    act = activation_spec()
    reps = reps_for(shape, smoke)
    # "no-a2a": the transport "auto" picks, with its collective replaced by the identity (same
    # buffer shape under "padded"): what our code costs around the collective.
    transport = "auto"
    if variant.no_a2a:
        block_bytes = (capacity or shape.tokens * shape.top_k) * shape.d_model * 2  # bf16 rows
        chosen = select_transport(strategy, "auto", ep=ranks, block_bytes=block_bytes)
        transport = dataclasses.replace(chosen, name=chosen.name + " (identity)",
                                        move=lambda rows, ex, out_rows, axis_name: rows)

    def body(x, idx, w):
        # This rank's El expert weights, made on the device; the barrier keeps XLA from folding a
        # constant into the GEMM. Scaled so that x keeps its magnitude over the iterations.
        local_w = lax.optimization_barrier(
            jnp.full((shape.experts // ranks, shape.d_model, shape.d_model), 1.0 / shape.d_model, x.dtype))

        def one(_, carry):
            x, idx, w = lax.optimization_barrier(carry)  # keep the planning inside the loop
            if variant.gemm_chunks:
                y, _ = ep_moe(x, idx, w, lambda rows, sizes: grouped_linear(rows, local_w, sizes, backend=backend),
                              num_experts=shape.experts, strategy=strategy, capacity=capacity, backend=backend,
                              transport=transport, chunks=variant.gemm_chunks, fp8_dispatch=variant.fp8)
                return y, idx, w
            packed, _, plan = ep_dispatch(x, idx, num_experts=shape.experts, strategy=strategy, capacity=capacity,
                                          backend=backend, transport=transport, fp8_dispatch=variant.fp8)
            # The identity experts sit behind a barrier, as a real expert stage would: otherwise
            # XLA fuses the regroup gather into combine's un-regroup and one row pass disappears.
            return ep_combine(lax.optimization_barrier(packed), w, plan, backend=backend), idx, w

        y, _, _ = lax.fori_loop(0, reps, one, (x, idx, w))
        return y

    def kept(x, idx, w):
        _, _, plan = ep_dispatch(x, idx, num_experts=shape.experts, strategy=strategy, capacity=capacity,
                                 backend=backend)
        return lax.psum(plan.keep_TK.sum(dtype="int32"), EP_AXIS)

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(act,) * 3, out_specs=act, check_vma=False))
    count = jax.jit(jax.shard_map(kept, mesh=mesh, in_specs=(act,) * 3, out_specs=PartitionSpec(),
                                  check_vma=False))
    return run, reps, lambda *args: int(count(*args))


def _collective_loop(mesh, shape: Shape, variant: Variant, smoke: bool):
    """The bare exchanges, there and back, `reps` times: `all_to_all` of the dropless padded
    buffer ([P*R, D] per rank, as our padded strategy moves; [P*C, D] with `variant.capacity`) or
    `ragged_all_to_all` with this routing's exact block sizes (counts_PP[src, dst], offsets from
    it), or `ppermute`, the swap of the peer's [C, D] block that our padded strategy does at P = 2
    (for blocks of `moe_jax.parallel.PAIR_MIN_BLOCK_BYTES` and more). Nothing else runs.
    `(run, reps, delivered)` as for `_ours_loop`, with `run(x, counts_PP)`."""
    routes = shape.tokens * shape.top_k
    reps = reps_for(shape, smoke)
    ranks = mesh.shape[EP_AXIS]
    ragged = variant.exchange == "ragged_all_to_all"
    pair = variant.exchange == "ppermute"
    # Capacity: blocks of our capacity C instead of the dropless R rows.
    block = capacity_for(shape.tokens, shape.top_k, ranks, CAPACITY_FACTOR) if variant.capacity else routes

    def body(x, counts):
        counts = counts.reshape(ranks, ranks)  # every rank sees the whole [src, dst] matrix
        me = lax.axis_index(EP_AXIS)
        send = jnp.repeat(x, shape.top_k, axis=0)  # R rows, one per route
        start_src = jnp.cumsum(counts, axis=1) - counts  # [src, dst]: dst's block in src's send buffer
        start_dst = jnp.cumsum(counts, axis=0) - counts  # [src, dst]: src's block in dst's receive buffer
        there = (start_src[me], counts[me], start_dst[me], counts[:, me])
        back = (start_dst[:, me], counts[:, me], start_src[:, me], counts[me])

        def one(_, buf):
            buf = lax.optimization_barrier(buf)
            if ragged:
                recv = lax.ragged_all_to_all(buf, jnp.zeros((ranks * routes,) + buf.shape[1:], buf.dtype), *there,
                                             axis_name=EP_AXIS)
                return lax.ragged_all_to_all(recv, jnp.zeros_like(buf), *back, axis_name=EP_AXIS)
            if pair:  # the library's own two-rank swap, there and back
                return PAIR_SWAP.move(PAIR_SWAP.move(buf, None, block, EP_AXIS), None, block, EP_AXIS)
            return lax.all_to_all(lax.all_to_all(buf, EP_AXIS, 0, 0, tiled=True), EP_AXIS, 0, 0, tiled=True)

        if pair:  # the peer's block only
            send = send[:block]
        elif not ragged:  # padded layout: P blocks of R rows (dropless) or C rows
            send = jnp.tile(send[:block], (ranks, 1))
        return lax.fori_loop(0, reps, one, send)[:1]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(activation_spec(), PartitionSpec()), out_specs=activation_spec(),
                       check_vma=False)
    return jax.jit(fn), reps, lambda *args: ranks * routes
