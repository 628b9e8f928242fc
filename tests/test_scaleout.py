"""The scale-out planner (`moe_jax.scaleout`): its EP rows against the real EP layer on a CPU
mesh (exactly), its properties, its errors, and its exchange model against the committed 2-GPU
measurements.

Legend: N global tokens, T tokens per rank, D width, F expert hidden, E experts, K top-k, R ranks
(ep x data), El = E/ep local experts.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import ops
from moe_jax.layers import MoE
from moe_jax.parallel import EPOptions, activation_spec, ep_moe, make_mesh
from moe_jax.routing import Routing
from moe_jax.scaleout import (
    Cluster,
    KernelCosts,
    LayerShape,
    Load,
    all_to_all,
    candidate_layouts,
    ep_work,
    epxetp_work,
    etp_work,
    evaluate,
    kernel_plan,
    kernel_tiles,
    plan_step,
    replication_work,
    ring,
    split_sources,
    step_counts,
    zipf_counts,
)
from moe_jax.scaleout.cli import main as cli_main
from moe_jax.parallel.placement import plan_placement, rank_loads
from tests.helpers import h200_mesh

D, F, E, K = 8, 8, 8, 2
EP, DATA = 4, 2
R = EP * DATA
T = 8  # tokens per rank
N = R * T
_CPU = jax.devices("cpu")


def _skewed_idx(seed: int = 0) -> np.ndarray:
    """`[N, K]` distinct experts per token, Zipf-like popularity (experts 0-1, on ep rank 0, hot)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** 1.3
    return np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(N)]).astype(np.int32)


def _counts_SE(idx: np.ndarray) -> np.ndarray:
    """Routes of each source device (token t on device t // T) to each expert."""
    return np.stack([np.bincount(rows.ravel(), minlength=E) for rows in idx.reshape(R, -1)])


def test_ep_rows_equal_the_layer_on_a_cpu_mesh():
    """Dropless EP on `make_mesh(ep=4)` (8 forced host devices: data 2 x ep 4) with an injected,
    skewed routing: the layer's `useful_rows_max` / `useful_rows` and `ep_moe`'s per-device
    group sizes and send counts equal the planner's EP work for the same counts, exactly."""
    idx = _skewed_idx()
    counts = _counts_SE(idx)
    shape = LayerShape(D, F, E, K, T, dtype_bytes=4)
    work = ep_work(shape, counts, EP, DATA)
    rows_R = work.group_sizes_RG.sum(axis=1)
    assert rows_R.max() > rows_R.mean() * 1.3  # the case is skewed

    mesh = make_mesh(ep=EP, devices=_CPU[:R])
    assert dict(mesh.shape) == {"data": DATA, "ep": EP}
    moe = MoE(D, F, E, K, mesh=mesh, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (N, D), jnp.float32)
    weights = jnp.full((N, K), 1.0 / K, jnp.float32)
    routing = Routing(jnp.asarray(idx), weights, jnp.full((N, E), 1.0 / E, jnp.float32))
    _, stats = nnx.jit(lambda m, x, r: m(x, routing=r))(moe, x, routing)
    assert int(stats.dropped) == 0
    assert int(stats.useful_rows) == int(rows_R.sum()) == N * K
    assert int(stats.useful_rows_max) == int(rows_R.max())

    # Per device: the rows of each local expert and the routes sent to each ep rank.
    def body(x, idx, w):
        _, st = ep_moe(x, idx, w, lambda rows, sizes, rows_ids=None: rows, num_experts=E)
        return st.group_sizes_El[None], st.send_counts_P[None]

    spec = activation_spec()
    sizes, sends = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec),
                                         check_vma=False))(x, routing.expert_idx_TK, weights)
    np.testing.assert_array_equal(np.asarray(sizes), work.group_sizes_RG)
    bytes_RR = work.dispatch[0].data
    model_sends = np.stack([bytes_RR[s, (s // EP) * EP:(s // EP + 1) * EP] for s in range(R)]) / shape.row_bytes
    np.testing.assert_array_equal(np.asarray(sends), model_sends)


def test_replication_rows_equal_the_placed_layer_on_a_cpu_mesh():
    """EP+replication: the planner's rows per rank (`dealt_rows`: each source deals an expert's
    routes over its replicas from an offset of its rank) equal the placed layer's on
    `make_mesh(ep=8)` (`EPOptions(placement=...)`, 2 slots per rank, 8 redundant slots), for the
    placement the planner makes from the same counts, exactly; and it lowers the busiest rank."""
    idx = _skewed_idx(1)
    counts = np.stack([np.bincount(rows.ravel(), minlength=E) for rows in idx.reshape(R, -1)])
    placement = plan_placement(counts.sum(axis=0), num_ranks=R, slots_per_rank=2)
    shape = LayerShape(D, F, E, K, T, dtype_bytes=4)
    rows_R = replication_work(shape, counts, placement).group_sizes_RG.sum(axis=1)
    assert rows_R.max() < ep_work(shape, counts, R).group_sizes_RG.sum(axis=1).max()

    moe = MoE(D, F, E, K, mesh=make_mesh(ep=R, devices=_CPU[:R]), expert_parallel=EPOptions(placement=placement),
              rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (N, D), jnp.float32)
    weights = jnp.full((N, K), 1.0 / K, jnp.float32)
    routing = Routing(jnp.asarray(idx), weights, jnp.full((N, E), 1.0 / E, jnp.float32))
    _, stats = nnx.jit(lambda m, x, r: m(x, routing=r))(moe, x, routing)
    assert int(stats.dropped) == 0
    assert int(stats.useful_rows) == N * K
    assert int(stats.useful_rows_max) == int(rows_R.max())


def test_padding_at_the_planned_tile_equals_ops_executed():
    """The model's executed rows per rank are `moe_jax.ops.executed` of the plan that runs each
    rank's GEMM on an H200 (`kernel_plan`: `ops.plan` under an abstract H200 mesh; the selector's
    single candidate at this size) on that rank's groups."""
    shape = LayerShape(2048, 768, 64, 8, 512)
    counts = step_counts(shape, Load.zipf(1.2), 8)
    work = ep_work(shape, counts, 8)
    plan, how = kernel_plan(work.gemm_rows, 768, 2048, 8)
    tiles = kernel_tiles(work.gemm_rows, 768, 2048, 8)
    assert (plan.backend, how) == ("pallas_triton", "selector") and tiles.block_m == 128
    with jax.sharding.use_abstract_mesh(h200_mesh((1,), ("aot",))):
        assert ops.plan(ops.resolved_problem("gmm_nt", work.gemm_rows, 768, 2048, 8, "bfloat16"),
                        config="auto") == plan
    result = evaluate(work, shape, Cluster(8), KernelCosts())
    assert result.padding_R.max() > 0
    for r in range(8):
        got = ops.executed(plan, jnp.asarray(work.group_sizes_RG[r], jnp.int32))
        assert int(got.executed_rows) == int(result.executed_R[r])
        assert int(got.useful_rows) == int(result.rows_R[r])


def test_zipf_counts_equal_the_benchmark_generator():
    from benchmarks.shapes import zipf_counts as bench_zipf

    for m, e, cap, s, seed in [(32768, 128, 4096, 1.2, 0), (1000, 16, 200, 2.0, 3), (64, 8, 8, 0.5, 1)]:
        np.testing.assert_array_equal(zipf_counts(m, e, cap=cap, s=s, seed=seed), bench_zipf(m, e, cap=cap, s=s, seed=seed))


def _loads():
    return [Load.zipf(0.0), Load.zipf(1.2), Load.zipf(2.0),
            Load.trace("benchmarks/data/expert_counts.npz", 0, 64), Load.trace("benchmarks/data/expert_counts.npz", 1, 64)]


SMALL = LayerShape(256, 128, 64, 4, 256)


@pytest.mark.parametrize("ranks", [4, 16, 64])
def test_rows_are_conserved_and_etp_rows_equal(ranks):
    for load in _loads():
        counts = step_counts(SMALL, load, ranks)
        assert counts.sum() == ranks * SMALL.routes_per_rank
        assert np.abs(counts.sum(axis=1) - SMALL.routes_per_rank).max() <= 1
        total = counts.sum()
        assert ep_work(SMALL, counts, ranks).group_sizes_RG.sum() == total
        placement = plan_placement(counts.sum(axis=0).astype(float), ranks, SMALL.num_experts // ranks + 1)
        assert replication_work(SMALL, counts, placement).group_sizes_RG.sum() == total
        etp = etp_work(SMALL, counts, ranks).group_sizes_RG.sum(axis=1)
        assert np.all(etp == total)
        tp = 2
        assert epxetp_work(SMALL, counts, ranks // tp, tp).group_sizes_RG.sum() == tp * total


@pytest.mark.parametrize("ranks", [4, 8, 16, 32, 64])
def test_replication_is_never_worse_than_ep_in_slowest_rank_rows(ranks):
    """In the placement's load model (an expert's rows split evenly over its replicas) the
    replicated layout's slowest rank never carries more than EP's; in whole rows, dealt
    round-robin, it may carry up to one row more per slot (a uniform load at R = 64, S = 3 does:
    1026 against 1024; docs/scaleout.md)."""
    for load in _loads():
        counts = step_counts(SMALL, load, ranks)
        ep_max = ep_work(SMALL, counts, ranks).group_sizes_RG.sum(axis=1).max()
        for extra in (1, 2):
            s = SMALL.num_experts // ranks + extra
            placement = plan_placement(counts.sum(axis=0).astype(float), ranks, s)
            assert rank_loads(placement, counts.sum(axis=0)).max() <= ep_max + 1e-9, (load.name, ranks, extra)
            rep_max = replication_work(SMALL, counts, placement).group_sizes_RG.sum(axis=1).max()
            assert rep_max <= ep_max + s, (load.name, ranks, extra)


def test_exchange_bytes_grow_with_tokens():
    cluster = Cluster(16)
    for load in _loads():
        last = None
        for tokens in (64, 128, 256, 512):
            shape = LayerShape(256, 128, 64, 4, tokens)
            counts = step_counts(shape, load, 16)
            placement = plan_placement(counts.sum(axis=0).astype(float), 16, 5)
            works = [ep_work(shape, counts, 16), etp_work(shape, counts, 16), epxetp_work(shape, counts, 8, 2),
                     replication_work(shape, counts, placement)]
            now = []
            for w in works:
                res = evaluate(w, shape, cluster, KernelCosts())
                now.append((res.send_bytes_R.sum(), np.maximum(res.send_bytes_R, res.recv_bytes_R).max()))
            if last is not None:
                for (s0, m0), (s1, m1) in zip(last, now):
                    assert s1 > s0 and m1 > m0
            last = now


def test_collective_model_by_hand():
    cluster = Cluster(16, ranks_per_node=8, nvlink_GBps=400, internode_GBps=40, intra_latency_us=5,
                      inter_latency_us=20)
    m = np.zeros((16, 16))
    m[0, 1] = 4e8  # same node: 1 ms at 400 GB/s
    m[0, 9] = 4e7  # other node: 1 ms at 40 GB/s
    t = all_to_all(m, np.zeros(16), cluster)
    assert t.seconds_R[0] == pytest.approx(20e-6 + 1e-3)
    assert t.nvlink_bytes_R[1] == 4e8 and t.network_bytes_R[9] == 4e7 and t.send_bytes_R[0] == 4.4e8
    # A ring all-gather of 1 MB pieces inside each node: 7 MB over NVLink, nothing over the network.
    t = ring(np.full(16, 1e6), np.arange(16) // 8, cluster)
    assert np.allclose(t.nvlink_bytes_R, 7e6) and not t.network_bytes_R.any()
    assert t.seconds_R[0] == pytest.approx(5e-6 + 7e6 / 400e9)
    # Over both nodes: 15 MB through NVLink, 15/8 MB per network port.
    t = ring(np.full(16, 1e6), np.zeros(16), cluster)
    assert np.allclose(t.network_bytes_R, 15e6 / 8)
    assert t.seconds_R[0] == pytest.approx(20e-6 + max(15e6 / 400e9, 15e6 / 8 / 40e9))


def test_split_sources_deals_evenly():
    counts = np.array([7, 0, 13, 5, 1])
    out = split_sources(counts, 4)
    np.testing.assert_array_equal(out.sum(axis=0), counts)
    assert out.sum(axis=1).max() - out.sum(axis=1).min() <= 1


def test_default_costs_are_the_committed_benchmark():
    got = KernelCosts.from_gmm_json("benchmarks/results/2026-12-01-h200-gmm.json")
    want = KernelCosts()
    for name in ("gate_up_tflops", "down_tflops", "gate_up_train_tflops", "down_train_tflops", "copy_TBps"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), abs=0.6), name


def test_plan_step_names_a_winner_with_its_reason():
    shape = LayerShape(512, 256, 32, 4, 256)
    plan = plan_step(shape, Load.zipf(1.2), Cluster(16), KernelCosts())
    assert set(plan.results) == {"EP", "ETP", "EPxETP", "EP+replication"}
    best = min(plan.results.values(), key=lambda r: r.layer_s)
    assert plan.winner == best.layout.kind and plan.reason.startswith(plan.winner)
    for res in plan.results.values():
        assert res.layer_s >= res.mean_s - 1e-12
    # R > E: EP only as EP groups of E ranks x data replicas; replication has one slot per rank.
    layouts = candidate_layouts(shape, 64)
    assert layouts["EP"][0].ep == 32 and layouts["EP"][0].data == 2
    assert layouts["EP+replication"][0].groups == 1


@pytest.mark.parametrize("train", [False, True])
def test_fp8_experts_move_fp8_rows_in_the_forward_dispatch_and_run_fp8_rates(train):
    """`LayerShape(fp8=True)`: the forward's dispatch all-to-all at `row_bytes(D)` a row (e4m3
    values and fp32 scales per 128 channels), its backward and the combine in the dtype's rows;
    the expert GEMMs at the `*_fp8` rates on one-byte operands; rows and tiles unchanged."""
    from moe_jax.ops.fp8 import row_bytes

    shape = LayerShape(1024, 256, 32, 4, 256)
    fp8 = dataclasses.replace(shape, fp8=True)
    assert fp8.dispatch_row_bytes == row_bytes(1024) == 1024 + 4 * 8 and shape.dispatch_row_bytes == 2048
    counts = step_counts(shape, Load.zipf(1.2), 8)
    costs, cluster = KernelCosts(), Cluster(8)
    for work in (ep_work(shape, counts, 8), epxetp_work(shape, counts, 4, 2)):
        base = evaluate(work, shape, cluster, costs, train=train)
        got = evaluate(work, fp8, cluster, costs, train=train)
        # Bytes leaving a rank: the all-to-alls' off-diagonal (own rows stay local).
        a2a = sum(np.asarray(c.data).sum() - np.trace(c.data) for c in work.dispatch if c.kind == "all_to_all")
        saved = a2a * (1 - fp8.dispatch_row_bytes / shape.row_bytes)  # once: only the forward's dispatch
        assert got.send_bytes_R.sum() == pytest.approx(base.send_bytes_R.sum() - saved)
        np.testing.assert_allclose(got.phase_seconds["combine"], base.phase_seconds["combine"])
        assert np.all(got.phase_seconds["dispatch"] <= base.phase_seconds["dispatch"])
        np.testing.assert_array_equal(got.executed_R, base.executed_R)
        sizes = work.group_sizes_RG
        (n_gu, k_gu), (n_dn, k_dn) = work.gate_up_nk, work.down_nk
        want = (2 * costs.gemm_seconds("gate_up_fp8", sizes, n_gu, k_gu, got.tiles_gate_up, 1, train)
                + costs.gemm_seconds("down_fp8", sizes, n_dn, k_dn, got.tiles_down, 1, train))
        np.testing.assert_allclose(got.phase_seconds["experts"], want)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        LayerShape(8, 8, 4, 2, 16, fp8=1)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="top_k"):
        LayerShape(8, 8, 4, 5, 16)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Cluster(12, ranks_per_node=8)
    with pytest.raises(ValueError, match="nvlink_GBps"):
        Cluster(8, nvlink_GBps=0)
    counts = step_counts(SMALL, Load.zipf(1.2), 8)
    with pytest.raises(ValueError, match="ep = 3"):
        ep_work(SMALL, np.zeros((3, 64), np.int64), 3)
    with pytest.raises(ValueError, match="d_ff"):
        etp_work(SMALL, step_counts(SMALL, Load.zipf(1.2), 6), 6)
    with pytest.raises(ValueError, match="counts_SE"):
        ep_work(SMALL, counts[:4], 8)
    with pytest.raises(ValueError, match="launch_us"):
        KernelCosts(launch_us=-1)
    with pytest.raises(ValueError, match="layer 7"):
        Load.trace("benchmarks/data/expert_counts.npz", 7, 64)
    with pytest.raises(ValueError, match="num_experts = 60"):
        Load.trace("benchmarks/data/expert_counts.npz", 0, 60)
    with pytest.raises(ValueError, match="exactly one"):
        Load("x")
    with pytest.raises(SystemExit):
        cli_main(["--layouts", "EP,XYZ"])


def test_cli_prints_the_table_and_json(capsys):
    args = ["--zipf", "1.2", "--ranks", "8,16", "--experts", "32", "--tokens", "128", "--d-model", "256",
            "--d-ff", "128"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "model, not measured" in out and "| 16 | EP+replication" in out and "wins" in out
    assert cli_main(args + ["--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["ranks"] for p in data["plans"]] == [8, 16]
    ep = data["plans"][1]["layouts"]["EP"]
    assert len(ep["per_rank"]["rows"]) == 16 and sum(ep["per_rank"]["rows"]) == 16 * 128 * 8
    assert cli_main(args + ["--fp8"]) == 0
    assert "FP8 experts" in capsys.readouterr().out


def test_exchange_model_against_the_committed_2_gpu_measurement():
    """Every NCCL record of the committed 2 x H200 exchange benchmark (both runs) replayed through
    the model with the benchmark's own routings: the model is optimistic, by at most 2x
    (docs/scaleout.md reports the ratios)."""
    from benchmarks.scaleout import exchange_check

    rows = [r for r in exchange_check() if r["impl"] == "nccl"]
    assert len(rows) == 12
    for r in rows:
        assert 1.0 <= r["ratio"] <= 2.0, r
