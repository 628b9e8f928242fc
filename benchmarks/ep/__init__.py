"""Expert-parallel dispatch + combine benchmark on P GPUs (`--ranks`, default 2).

    python -m benchmarks.ep [--ranks P] [--skip-ragged] [--json PATH]  # the table (P GPUs)
    python -m benchmarks.ep [--ranks P] --cpu-smoke [--json PATH]      # the same at tiny sizes, P host devices
    python -m benchmarks.ep [--ranks P] --chunks 1,2,4 [...]            # plus the chunked-exchange rows

For each shape (prefill: T = 4096 and 16384 tokens per rank, D = 4096, top-2 of 64; decode:
T = 128, D = 7168, top-8 of 256; bf16) and routing (balanced: every expert gets exactly T*K/E
routes of each rank; zipf: expert popularity ~ rank^-1.2, hot experts scattered over the ranks)
it times one dispatch + combine (identity experts) of:

* ours, `moe_jax.parallel.ep_dispatch`/`ep_combine` on a `make_mesh(ep=P)` mesh, per strategy:
  `padded` dropless (C = T*K), `padded cf=1.25` (capacity 1.25x the balanced load; drops are
  reported), `padded cf=1.25 no-a2a` (the same with the row collective replaced by the identity,
  a `dataclasses.replace`d `Transport`: what our planning, gathers and combine cost around the
  collective), `padded cf=1.25 xla-ops` (the row gathers and the send plan through XLA instead of
  our Pallas kernels), `padded cf=1.25 fp8-dispatch` and `ragged fp8-dispatch` (the dispatch's rows
  as e4m3 values with fp32 tile scales, `fp8_dispatch=True`: about half the bytes, plus the
  quantization and dequantization around the collective; the combine stays bf16), `ragged`
  (`ragged_all_to_all`), and `ragged+decomp` (the same with
  `--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true`, in its own process since XLA
  reads flags once);
* xla, the bare collectives there and back and nothing else: `all_to_all` of the dropless padded
  buffers (P blocks of R rows), `all_to_all cf=1.25` of the capacity buffers (P blocks of C rows),
  `ppermute cf=1.25` (P = 2 only: the peer's C-row block, what our padded strategy moves at P = 2
  for blocks of `moe_jax.parallel.PAIR_MIN_BLOCK_BYTES` and more, i.e. at prefill here),
  `ragged_all_to_all` with this routing's exact block sizes, and `ragged_all_to_all+decomp` (the
  same under the decomposer flag);
* NCCL: two `torch.distributed.all_to_all_single` calls (P processes) with this routing's split
  sizes, i.e. the bytes a dropless exchange must move, and nothing else;
* torch-ref, the torch EP reference, `parity.reference.ep.ep_dispatch`/`ep_combine` (counts
  exchange, host sync, metadata and rows, regroup), on the same routing.

`--chunks 1,2,4` adds rows `padded gemm chunks=n` (and, with the ragged rows, `ragged gemm
chunks=n`): dropless `ep_moe(chunks=n)` with one grouped GEMM `[El, D, D]` per expert as the
experts (`moe_jax.ops.grouped_linear`, weights made on the device), so there is compute for the
exchange to overlap; n = 1 is the same work unchunked. Their time includes the GEMM, so their
GB/s and "x NCCL" figures are not exchange figures: compare the chunked rows with `chunks=1`.
Whether XLA overlaps the chunks depends on its flags (docs/expert-parallelism.md, "Chunked
exchange"): run once as is and once with
`XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true` to see the scheduler's share.

`--skip-ragged` times only the padded rows, `all_to_all` and `ppermute` (plus NCCL and
torch-ref): the ragged rows and the decomposer process take minutes.

Payload = rows delivered * D * bytes/elt, both directions (dispatch sends them, combine brings
them back), per GPU; GB/s = payload / time. Padding rows a strategy moves are not payload. The
"x NCCL" column is time / NCCL time for the same shape and routing (lower is better).

Rank tail (the slowest rank sets the layer's pace): every torch process times itself, the table
reports the slowest rank's median and, under `slow/mean`, its ratio to the mean over ranks; below
the table, each routing's received rows per rank, max / mean (the load the hottest rank must
take). Our JAX rows are one SPMD program whose wall time is already the slowest device's.

Timing: ours runs `reps` dispatch+combine iterations inside one jitted `fori_loop` (the output of
one iteration is the input of the next, and the routing passes an optimization barrier each
iteration, so the planning cannot be hoisted out of the loop; the identity experts sit behind a
barrier, so XLA cannot fuse dispatch's regroup into combine's un-regroup, which no real expert
stage allows; tables before 2026-11-30's breakdown-2 lacked that barrier); torch runs `reps` eager calls.
Both: median over trials of wall time / reps, after a warm-up, synchronised on the device.

`--cpu-smoke` runs everything at tiny sizes on P forced host devices and gloo: padded only
(XLA:CPU has no ragged_all_to_all), to exercise the code paths without a GPU.

Correctness of the same path (dispatch, SwiGLU experts, combine through `ep_moe`, outputs and
every gradient vs the single-device reference, both strategies) is `tests/test_ep_moe.py`;
whether `jax.grad` through a bare `ragged_all_to_all` is exact is
`docs/ragged-all-to-all-gradient.md`.

Modules: `routing` (shapes, routings, send counts), `jax_bench` (our rows and the bare
collectives), `torch_bench` (NCCL/gloo and torch-ref), `table` (formatting), `cli` (arguments,
worker processes, orchestration).

Legend: P ranks (ep size), T tokens per rank, D width, K top-k, E experts, El = E/P, R = T*K
routes per rank, C capacity.
"""
