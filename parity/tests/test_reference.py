"""Tests of the independent PyTorch/Triton reference (`parity.reference`).

The same bodies run on a CUDA GPU (kernels compiled, larger sizes) and on CPU (kernels under
Triton's interpreter, small sizes); `parity/conftest.py` selects the interpreter without a GPU.
Oracles are plain loops in float64; errors are relative Frobenius norms.
"""

from __future__ import annotations

import ast
import itertools
import math
import os
import pathlib

import pytest
import torch

from moe_jax import testing
from parity.reference import (
    ExpertPathCache,
    aux_loss,
    expert_counts,
    fuse_gate_up,
    grouped_linear,
    grouped_mm,
    grouped_mm_backward,
    grouped_mm_loop,
    grouped_weight_grad,
    grouped_weight_grad_loop,
    interpreting,
    make_contiguous_schedule,
    moe_experts_autograd,
    moe_experts_autograd_fused,
    moe_experts_loop,
    pack_by_expert,
    route_selected_softmax,
    route_sigmoid_grouped,
    route_softmax_topk,
    router_logits,
    selected_expert_path_backward,
    selected_expert_path_backward_fused,
    selected_expert_path_forward,
    selected_expert_path_forward_fused,
    selected_router_backward,
    split_gate_up,
    update_selection_bias,
    z_loss,
)

# The torch/Triton reference alone (Triton interpreted on CPU), independent of the JAX pin: the slow lane.
pytestmark = pytest.mark.slow

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# Per-expert row counts, chosen to hit: empty experts, one hot expert, counts that are not
# multiples of any tile, a single expert, and no rows at all. `tail` rows follow offsets[E].
if ON_GPU:
    GEMM_CASES = {
        "mixed": dict(counts=[70, 0, 301, 1, 0, 129, 16, 17], tail=37, k=200, n=136),
        "hot": dict(counts=[0, 0, 1000, 0, 3, 0], tail=0, k=192, n=320),
        "single": dict(counts=[257], tail=5, k=96, n=80),
        "all_empty": dict(counts=[0, 0, 0, 0], tail=9, k=64, n=48),
    }
    EXPERT_SIZES = dict(tokens=384, d_model=192, d_hidden=320, experts=16, top_k=4)
else:
    GEMM_CASES = {
        "mixed": dict(counts=[5, 0, 19, 1, 0, 7], tail=3, k=40, n=33),
        "hot": dict(counts=[0, 0, 37, 0], tail=0, k=24, n=20),
        "single": dict(counts=[17], tail=2, k=16, n=48),
        "all_empty": dict(counts=[0, 0, 0], tail=4, k=16, n=16),
    }
    EXPERT_SIZES = dict(tokens=12, d_model=24, d_hidden=40, experts=6, top_k=2)

BLOCKS = [dict(block_m=16, block_n=32, block_k=32), dict(block_m=32, block_n=16, block_k=16)]


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """The repository's tolerance check (`moe_jax.testing`) on torch tensors, in float64."""
    testing.assert_close(out.detach().double().cpu().numpy(), ref.detach().double().cpu().numpy(), dtype, what)


def make_offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=DEVICE)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=DEVICE, dtype=dtype)


def leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh autograd leaf holding a copy of `t` (never the caller's tensor itself)."""
    return t.detach().to(dtype or t.dtype, copy=True).requires_grad_()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------------------------------------
# Execution mode and independence


def test_kernels_run_in_the_expected_mode():
    expected = os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"}
    assert interpreting() == expected
    if not ON_GPU:
        assert interpreting(), "without CUDA the kernels must be interpreted"


def test_reference_never_imports_moe_jax():
    root = pathlib.Path(__file__).resolve().parents[1] / "reference"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "moe_jax" for n in names), f"{path} imports moe_jax"


# ---------------------------------------------------------------------------------------------
# Grouped GEMM


def test_contiguous_schedule():
    tile_expert, tile_m = make_contiguous_schedule(torch.tensor([4, 0, 3, 2, 0]), 2)
    assert tile_expert.tolist() == [0, 0, 2, 2, 3]
    assert tile_m.tolist() == [0, 1, 0, 1, 0]
    assert tile_expert.dtype == tile_m.dtype == torch.int32
    empty_e, empty_m = make_contiguous_schedule(torch.tensor([0, 0]), 16)
    assert empty_e.numel() == empty_m.numel() == 0


@pytest.mark.parametrize("blocks", BLOCKS, ids=["m16n32k32", "m32n16k16"])
@pytest.mark.parametrize("case", list(GEMM_CASES), ids=list(GEMM_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_grouped_mm_and_weight_grad_match_loops(dtype, case, blocks, gen):
    spec = GEMM_CASES[case]
    counts, tail, k, n = spec["counts"], spec["tail"], spec["k"], spec["n"]
    offsets = make_offsets(counts)
    rows = sum(counts) + tail
    a = randn(rows, k, dtype=dtype, gen=gen)
    b = randn(len(counts), n, k, dtype=dtype, gen=gen, scale=k ** -0.5)
    dc = randn(rows, n, dtype=dtype, gen=gen)
    # Poison: rows past offsets[E] belong to no expert and must never be read.
    a[sum(counts):] = float("nan")
    dc[sum(counts):] = float("nan")

    out = grouped_mm(a, b, offsets, **blocks)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert torch.all(out[sum(counts):] == 0), "rows past offsets[E] must come out zero"
    valid = slice(0, sum(counts))
    assert_close(out[valid], grouped_mm_loop(a.double(), b.double(), offsets)[valid], dtype, "grouped_mm")

    db = grouped_weight_grad(a, dc, offsets, **blocks)
    assert db.dtype == dtype and db.shape == (len(counts), n, k)
    ref = grouped_weight_grad_loop(a[valid].double(), dc[valid].double(), offsets)
    assert_close(db, ref, dtype, "grouped_weight_grad")
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.all(db[e] == 0), f"weight gradient of empty expert {e} must be exactly zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_grouped_mm_backward_reads_transposed_weights_in_place(dtype, gen):
    spec = GEMM_CASES["mixed"]
    offsets = make_offsets(spec["counts"])
    rows = sum(spec["counts"]) + spec["tail"]
    a = randn(rows, spec["k"], dtype=dtype, gen=gen)
    b = randn(len(spec["counts"]), spec["n"], spec["k"], dtype=dtype, gen=gen)
    dc = randn(rows, spec["n"], dtype=dtype, gen=gen)
    da, db = grouped_mm_backward(a, b, dc, offsets)
    # A strided (transposed) weight view must give bit-identical results to a contiguous copy.
    assert torch.equal(da, grouped_mm(dc, b.transpose(1, 2).contiguous(), offsets))
    assert torch.equal(db, grouped_weight_grad(a, dc, offsets))
    assert torch.all(da[sum(spec["counts"]):] == 0)


@pytest.mark.parametrize(
    "offsets, message",
    [([0, 6], "E \\+ 1"), ([0, 4, 3], "decrease"), ([0, 4, 7], "exceeds"), ([1, 4, 5], "must be 0"),
     ([0.0, 2.0, 5.0], "integer")],
    ids=["length", "decreasing", "past_rows", "nonzero_start", "float"],
)
def test_grouped_mm_rejects_bad_offsets(offsets, message):
    a = torch.zeros(6, 16, device=DEVICE)
    b = torch.zeros(2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        grouped_mm(a, b, torch.tensor(offsets, device=DEVICE))


def test_grouped_mm_rejects_bad_arguments():
    a = torch.zeros(6, 16, device=DEVICE)
    b = torch.zeros(2, 16, 16, device=DEVICE)
    good = torch.tensor([0, 2, 5], device=DEVICE)
    with pytest.raises(ValueError, match="reduction widths"):
        grouped_mm(a, torch.zeros(2, 16, 8, device=DEVICE), good)
    with pytest.raises(ValueError, match="dtype"):
        grouped_mm(a, b.double(), good)
    with pytest.raises(ValueError, match="power of two"):
        grouped_mm(a, b, good, block_m=24)
    with pytest.raises(ValueError, match="row counts"):
        grouped_weight_grad(a, torch.zeros(5, 16, device=DEVICE), good)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_grouped_linear_autograd_matches_loop_autograd(dtype, gen):
    spec = GEMM_CASES["mixed"]
    counts = spec["counts"]
    offsets = make_offsets(counts)
    rows = sum(counts) + spec["tail"]
    a = randn(rows, spec["k"], dtype=dtype, gen=gen)
    a[sum(counts):] = float("nan")
    b = randn(len(counts), spec["n"], spec["k"], dtype=dtype, gen=gen)
    dc = randn(rows, spec["n"], dtype=dtype, gen=gen)

    a1, b1 = leaf(a), leaf(b)
    out = grouped_linear(a1, b1, offsets)
    out.backward(dc)
    a2, b2 = leaf(a, torch.float64), leaf(b, torch.float64)
    ref = grouped_mm_loop(a2, b2, offsets)
    ref.backward(dc.double())

    valid = slice(0, sum(counts))
    assert_close(out[valid], ref[valid], dtype, "forward")
    assert a1.grad.dtype == b1.grad.dtype == dtype
    assert torch.all(a1.grad[sum(counts):] == 0)
    assert_close(a1.grad, a2.grad, dtype, "d_a")
    assert_close(b1.grad, b2.grad, dtype, "d_b")
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.all(b1.grad[e] == 0)


# ---------------------------------------------------------------------------------------------
# Expert path


def make_expert_problem(dtype: torch.dtype, gen: torch.Generator, unused_experts: int = 2):
    """Random expert path inputs; the last `unused_experts` experts receive no token and expert 0
    is in every token's choice (a hot expert)."""
    s = EXPERT_SIZES
    t, d, f, e, k = s["tokens"], s["d_model"], s["d_hidden"], s["experts"], s["top_k"]
    x = randn(t, d, dtype=dtype, gen=gen)
    w_gate = randn(e, f, d, dtype=dtype, gen=gen, scale=d ** -0.5)
    w_up = randn(e, f, d, dtype=dtype, gen=gen, scale=d ** -0.5)
    w_down = randn(e, d, f, dtype=dtype, gen=gen, scale=f ** -0.5)
    used = e - unused_experts
    others = torch.stack([torch.randperm(used - 1, generator=gen)[: k - 1] + 1 for _ in range(t)])
    selected_expert = torch.cat([torch.zeros(t, 1, dtype=torch.int64), others], dim=1)
    # Shuffle the slots so the hot expert is not always slot 0.
    selected_expert = torch.stack([row[torch.randperm(k, generator=gen)] for row in selected_expert])
    selected_weight = torch.softmax(torch.randn(t, k, generator=gen, dtype=torch.float64), dim=-1)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(
        x=x,
        selected_expert=selected_expert.to(DEVICE),
        selected_weight=selected_weight.to(device=DEVICE, dtype=weight_dtype),
        w_gate=w_gate,
        w_up=w_up,
        w_down=w_down,
    )


def loop_reference(p: dict, dout: torch.Tensor):
    """Float64 loop forward and its five autograd gradients."""
    leaves = {name: leaf(p[name], torch.float64) for name in ("x", "selected_weight", "w_gate", "w_up", "w_down")}
    out = moe_experts_loop(leaves["x"], p["selected_expert"], leaves["selected_weight"],
                           leaves["w_gate"], leaves["w_up"], leaves["w_down"])
    out.backward(dout.double())
    grads = tuple(leaves[name].grad for name in ("x", "selected_weight", "w_gate", "w_up", "w_down"))
    return out.detach(), grads


GRAD_NAMES = ("d_x", "d_selected_weight", "d_w_gate", "d_w_up", "d_w_down")


def test_pack_by_expert_orders_pairs_stably():
    packing = pack_by_expert(torch.tensor([[2, 0], [0, 2], [1, 0]], device=DEVICE), 4)
    assert packing.expert_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert packing.token_ids.tolist() == [0, 1, 2, 2, 0, 1]
    assert packing.order.tolist() == [1, 2, 5, 4, 0, 3]
    assert packing.offsets.tolist() == [0, 3, 4, 6, 6]
    with pytest.raises(ValueError):
        pack_by_expert(torch.tensor([[0, 4]], device=DEVICE), 4)


def test_expert_path_explicit_autograd_and_loop_agree_in_float64(gen):
    dtype = torch.float64
    p = make_expert_problem(dtype, gen)
    dout = randn(*p["x"].shape, dtype=dtype, gen=gen)
    ref_out, ref_grads = loop_reference(p, dout)

    out, cache = selected_expert_path_forward(**p)
    assert isinstance(cache, ExpertPathCache) and out.dtype == dtype
    assert_close(out, ref_out, dtype, "explicit forward vs loop")
    grads = selected_expert_path_backward(
        dout, cache, p["w_gate"], p["w_up"], p["w_down"], p["x"].shape, p["selected_expert"].shape,
    )

    leaves = {name: leaf(p[name]) for name in ("x", "selected_weight", "w_gate", "w_up", "w_down")}
    auto_out = moe_experts_autograd(leaves["x"], p["selected_expert"], leaves["selected_weight"],
                                    leaves["w_gate"], leaves["w_up"], leaves["w_down"])
    auto_out.backward(dout)
    auto_grads = tuple(leaves[name].grad for name in ("x", "selected_weight", "w_gate", "w_up", "w_down"))
    assert_close(auto_out, ref_out, dtype, "autograd forward vs loop")

    for name, g, g_auto, g_ref in zip(GRAD_NAMES, grads, auto_grads, ref_grads):
        assert g.shape == g_ref.shape, name
        assert_close(g, g_auto, dtype, f"{name}: explicit vs autograd")
        assert_close(g, g_ref, dtype, f"{name}: explicit vs loop")
    # Experts that received no token get exactly zero weight gradients.
    for g in grads[2:]:
        assert torch.all(g[-2:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_expert_path_low_precision_against_float64_loop(dtype, gen):
    p = make_expert_problem(dtype, gen)
    dout = randn(*p["x"].shape, dtype=dtype, gen=gen)
    ref_out, ref_grads = loop_reference(p, dout)

    out, cache = selected_expert_path_forward(**p)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "forward")
    grads = selected_expert_path_backward(
        dout, cache, p["w_gate"], p["w_up"], p["w_down"], p["x"].shape, p["selected_expert"].shape,
    )
    assert grads[0].dtype == dtype and grads[1].dtype == torch.float32
    for name, g, g_ref in zip(GRAD_NAMES, grads, ref_grads):
        assert_close(g, g_ref, dtype, name)

    leaves = {name: leaf(p[name]) for name in ("x", "selected_weight", "w_gate", "w_up", "w_down")}
    moe_experts_autograd(leaves["x"], p["selected_expert"], leaves["selected_weight"],
                         leaves["w_gate"], leaves["w_up"], leaves["w_down"]).backward(dout)
    for name, g, param in zip(GRAD_NAMES, grads, leaves.values()):
        assert_close(param.grad, g, dtype, f"{name}: autograd vs explicit")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_fused_gate_up_equals_separate(dtype, gen):
    p = make_expert_problem(dtype, gen)
    dout = randn(*p["x"].shape, dtype=dtype, gen=gen)
    w_gate_up = fuse_gate_up(p["w_gate"], p["w_up"])
    assert w_gate_up.shape[1] == 2 * p["w_gate"].shape[1]
    assert all(torch.equal(u, v) for u, v in zip(split_gate_up(w_gate_up), (p["w_gate"], p["w_up"])))

    out, cache = selected_expert_path_forward(**p)
    out_f, cache_f = selected_expert_path_forward_fused(
        p["x"], p["selected_expert"], p["selected_weight"], w_gate_up, p["w_down"],
    )
    # Same products; only accumulation order and rounding may differ between the two forms.
    assert_close(out_f, out, dtype, "forward fused vs separate")
    d_x, d_w, d_gate, d_up, d_down = selected_expert_path_backward(
        dout, cache, p["w_gate"], p["w_up"], p["w_down"], p["x"].shape, p["selected_expert"].shape,
    )
    d_x_f, d_w_f, d_gate_up_f, d_down_f = selected_expert_path_backward_fused(
        dout, cache_f, w_gate_up, p["w_down"], p["x"].shape, p["selected_expert"].shape,
    )
    assert_close(d_gate_up_f, torch.cat([d_gate, d_up], dim=1), dtype, "d_w_gate_up vs cat(d_w_gate, d_w_up)")
    assert_close(d_down_f, d_down, dtype, "d_w_down fused vs separate")
    assert_close(d_w_f, d_w, dtype, "d_selected_weight fused vs separate")
    # d_x sums the gate and up input gradients inside one GEMM instead of after two.
    assert_close(d_x_f, d_x, dtype, "d_x fused vs separate")

    w_leaf = leaf(w_gate_up)
    auto = moe_experts_autograd_fused(p["x"], p["selected_expert"], p["selected_weight"], w_leaf, p["w_down"])
    assert_close(auto, out_f, dtype, "autograd fused forward")
    auto.backward(dout)
    assert_close(w_leaf.grad, d_gate_up_f, dtype, "d_w_gate_up autograd vs explicit")


def test_expert_path_rejects_bad_shapes(gen):
    p = make_expert_problem(torch.float32, gen)
    with pytest.raises(ValueError, match="w_down"):
        selected_expert_path_forward(**{**p, "w_down": p["w_down"].transpose(1, 2)})
    with pytest.raises(ValueError, match="selected_weight"):
        selected_expert_path_forward(**{**p, "selected_weight": p["selected_weight"][:, :1]})
    with pytest.raises(ValueError, match="w_gate and w_up"):
        selected_expert_path_forward(**{**p, "w_up": p["w_up"][:, :-1]})
    with pytest.raises(ValueError, match="w_gate_up"):
        selected_expert_path_forward_fused(p["x"], p["selected_expert"], p["selected_weight"],
                                           p["w_gate"][:, :-1], p["w_down"])


# ---------------------------------------------------------------------------------------------
# Routers


def _logit(p: list[float]) -> torch.Tensor:
    q = torch.tensor(p, dtype=torch.float64)
    return torch.log(q / (1 - q)).float().to(DEVICE)[None, :]


def test_route_selected_softmax_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], device=DEVICE)
    idx, w, probs = route_selected_softmax(logits, 2)
    assert idx.dtype == torch.int64 and w.dtype == probs.dtype == torch.float32
    assert idx.tolist() == [[1, 2]]
    torch.testing.assert_close(w.cpu(), torch.tensor([[math.e / (1 + math.e), 1 / (1 + math.e)]]))
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1))
    # The bias picks expert 0 (6 > 3 > 2) but the weights use the raw logits 1 and 3.
    idx, w, _ = route_selected_softmax(logits, 2, selection_bias=torch.tensor([5.0, 0, 0, 0], device=DEVICE))
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w.cpu(), torch.softmax(torch.tensor([[1.0, 3.0]]), dim=-1))
    # Ties go to the lower expert index.
    idx, _, _ = route_selected_softmax(torch.zeros(1, 4, device=DEVICE), 2)
    assert idx.tolist() == [[0, 1]]


def test_route_softmax_topk_by_hand():
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    logits = torch.log(p).to(DEVICE)
    idx, w, probs = route_softmax_topk(logits, 2)
    assert idx.tolist() == [[1, 3]]
    torch.testing.assert_close(w.cpu(), torch.tensor([[0.4, 0.3]]))
    torch.testing.assert_close(probs.cpu(), p)
    _, w, _ = route_softmax_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w.cpu(), torch.tensor([[4 / 7, 3 / 7]]))
    # Biased scores 0.6 > 0.4 > 0.3 > 0.2 choose experts 0 and 1; weights stay unbiased.
    idx, w, _ = route_softmax_topk(logits, 2, selection_bias=torch.tensor([0.5, 0, 0, 0], device=DEVICE))
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w.cpu(), torch.tensor([[0.1, 0.4]]))


def test_route_sigmoid_grouped_by_hand():
    s = [0.9, 0.1, 0.6, 0.55, 0.8, 0.05, 0.3, 0.2]
    logits = _logit(s)
    # Group scores (top-2 sums): 1.0, 1.15, 0.85, 0.5 -> groups 1 and 0 stay, so expert 4 (0.8)
    # is out although it beats experts 2 and 3.
    idx, w, probs = route_sigmoid_grouped(logits, 3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert idx.tolist() == [[0, 2, 3]]
    torch.testing.assert_close(w.cpu(), torch.tensor([[0.9, 0.6, 0.55]]) / 2.05 * 2.5)
    torch.testing.assert_close(probs.cpu(), torch.tensor([s]) / sum(s))
    _, w, _ = route_sigmoid_grouped(logits, 3, n_group=4, topk_group=2, normalize=False,
                                    routed_scaling_factor=2.5)
    torch.testing.assert_close(w.cpu(), torch.tensor([[0.9, 0.6, 0.55]]) * 2.5)
    # A bias on experts 6 and 7 lifts group 3 (0.8 + 0.7) above group 0; weights stay unbiased.
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0.5, 0.5], device=DEVICE)
    idx, w, _ = route_sigmoid_grouped(logits, 3, n_group=4, topk_group=2, selection_bias=bias)
    assert idx.tolist() == [[6, 7, 2]]
    torch.testing.assert_close(w.cpu(), torch.tensor([[0.3, 0.2, 0.6]]) / 1.1)
    # One group: plain top-k on sigmoid scores.
    idx, _, _ = route_sigmoid_grouped(logits, 2)
    assert idx.tolist() == [[0, 4]]


def test_route_sigmoid_grouped_single_expert_groups_and_negative_bias():
    # Groups of one expert score that expert: groups 1 and 3 stay.
    idx, _, _ = route_sigmoid_grouped(_logit([0.2, 0.9, 0.4, 0.7]), 2, n_group=4, topk_group=2)
    assert idx.tolist() == [[1, 3]]
    # Group 0 wins (0.95 - 0.3 = 0.65 > 0.6); its expert 1 has a negative biased score (-0.3) and
    # must still beat the experts of the dropped group.
    bias = torch.tensor([0.0, -0.5, 0.0, 0.0], device=DEVICE)
    idx, w, _ = route_sigmoid_grouped(_logit([0.95, 0.2, 0.3, 0.3]), 2, n_group=2, topk_group=1,
                                      selection_bias=bias)
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w.cpu(), torch.tensor([[0.95, 0.2]]) / 1.15)


def test_routers_reject_bad_arguments():
    logits = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="top_k"):
        route_selected_softmax(logits, 9)
    with pytest.raises(ValueError, match="selection_bias"):
        route_softmax_topk(logits, 2, selection_bias=torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match="n_group"):
        route_sigmoid_grouped(logits, 2, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        route_sigmoid_grouped(logits, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="exceeds"):
        route_sigmoid_grouped(logits, 5, n_group=4, topk_group=2)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_selected_router_backward_matches_autograd(x_dtype, gen):
    t, d, e, k = 32, 24, 8, 3
    x = randn(t, d, dtype=x_dtype, gen=gen).requires_grad_()
    w_router = randn(e, d, dtype=torch.float32, gen=gen, scale=d ** -0.5).requires_grad_()
    d_selected = randn(t, k, dtype=torch.float32, gen=gen)

    idx, weights, _ = route_selected_softmax(router_logits(x, w_router), k)
    (weights * d_selected).sum().backward()
    d_x, d_w = selected_router_backward(x.detach(), w_router.detach(), idx, weights.detach(), d_selected)
    assert d_x.dtype == x_dtype and d_w.dtype == torch.float32
    assert_close(d_w, w_router.grad, torch.float32, "d_w_router")
    assert_close(d_x, x.grad, x_dtype, "d_x_router")


def test_aux_loss_is_one_under_uniform_routing_and_ignores_padding():
    t, e, k = 8, 4, 2
    probs = torch.full((t, e), 1.0 / e, device=DEVICE, requires_grad=True)
    expert_idx = torch.tensor([[i % e, (i + 1) % e] for i in range(t)], device=DEVICE)
    loss = aux_loss(probs, expert_idx)
    torch.testing.assert_close(loss.item(), 1.0)
    loss.backward()
    # f_e is held constant: dL/dprobs[t, e] = E * f_e / T.
    torch.testing.assert_close(probs.grad, torch.full((t, e), e * (1 / e) / t, device=DEVICE))

    # Padding tokens with skewed routing and probabilities change nothing.
    pad_probs = torch.tensor([[1.0, 0, 0, 0]] * 3, device=DEVICE)
    pad_idx = torch.zeros(3, k, dtype=torch.int64, device=DEVICE)
    mask = torch.tensor([True] * t + [False] * 3, device=DEVICE)
    padded = aux_loss(torch.cat([probs.detach(), pad_probs]), torch.cat([expert_idx, pad_idx]), mask)
    torch.testing.assert_close(padded.item(), 1.0)


def test_aux_loss_by_hand():
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]], device=DEVICE)
    idx = torch.tensor([[0], [0]], device=DEVICE)
    # f = [1, 0], Pbar = [0.7, 0.3]: 2 * 0.7.
    torch.testing.assert_close(aux_loss(probs, idx).item(), 1.4)
    torch.testing.assert_close(aux_loss(probs, idx, torch.zeros(2, dtype=torch.bool, device=DEVICE)).item(), 0.0)


def test_z_loss_and_counts_and_bias_update():
    logits = torch.zeros(3, 4, device=DEVICE)
    logits[2] = 100.0  # a padding token with huge logits
    mask = torch.tensor([1, 1, 0], device=DEVICE)
    torch.testing.assert_close(z_loss(logits, mask).item(), math.log(4) ** 2)
    torch.testing.assert_close(z_loss(logits[:2]).item(), math.log(4) ** 2)

    idx = torch.tensor([[0, 1], [0, 2], [3, 3]], device=DEVICE)
    assert expert_counts(idx, 4).tolist() == [2, 1, 1, 2]
    assert expert_counts(idx, 4, mask).tolist() == [2, 1, 1, 0]

    bias = torch.tensor([0.5, 0.0, 0.0, -0.5], device=DEVICE)
    counts = torch.tensor([4, 2, 2, 0], device=DEVICE)
    new = update_selection_bias(bias, counts, 0.1)
    torch.testing.assert_close(new.cpu(), torch.tensor([0.4, 0.0, 0.0, -0.4]))
    assert new.dtype == bias.dtype
