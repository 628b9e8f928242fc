"""Tests of the parity harness: moe_jax's MoE layer against the torch/Triton reference.

The same bodies run on CPU (reference kernels under Triton's interpreter, our layer on XLA or
interpreted Pallas, tiny sizes) and on a GPU runner (both compiled, larger sizes); `SIZES` is
picked by device at import. Every case runs in float32 (thresholds 1e-5, HIGHEST / TF32
off) and bfloat16 (1e-2).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import harness, timing
from parity.__main__ import main
from parity.reference import grouped_mm

ON_GPU = timing.gpu_available()

if ON_GPU:
    SIZES = dict(tokens=512, d_model=256, d_ff=256, num_experts=16, top_k=4)
else:
    SIZES = dict(tokens=32, d_model=32, d_ff=32, num_experts=8, top_k=2)

# Case name -> overrides of the device's sizes.
LAYER_CASES = {
    "balanced": dict(skew="balanced"),
    "zipf": dict(skew="zipf"),
    "one_hot": dict(skew="one_hot"),
    "empty_experts": dict(skew="empty"),
    "top1": dict(top_k=1, skew="zipf"),
    "top8": dict(top_k=8, num_experts=max(16, SIZES["num_experts"]), skew="zipf"),
    "shared_experts": dict(shared_experts=2, skew="zipf"),
    "latent": dict(latent_dim=SIZES["d_model"] // 2, skew="one_hot"),
    "latent_shared_fused": dict(latent_dim=SIZES["d_model"] // 2, shared_experts=1, fused_gate_up=True, skew="empty"),
    # On CPU "auto" is XLA: this case runs our Pallas kernels (interpreted) once per dtype.
    "pallas_triton": dict(backend="pallas_triton", skew="empty"),
    # Our side on 4 devices: GPUs when jax has 4, else the forced host CPUs (`harness.ep_mesh`).
    "ep4": dict(ep_size=4, skew="zipf"),
}
DTYPES = ["float32", "bfloat16"]


def make_config(**overrides) -> harness.ParityConfig:
    """A configuration of this device's `SIZES` with `overrides` applied."""
    return harness.ParityConfig(**{**SIZES, **overrides})


def unused_experts(problem: harness.ParityProblem, num_experts: int) -> np.ndarray:
    return np.setdiff1d(np.arange(num_experts), problem.expert_idx_TK)


# ---------------------------------------------------------------------------------------------
# Layer parity: the case matrix


def _slow_but(*fast):
    """Parameters for `pytest.mark.parametrize`: the listed values run on every pin, the others
    (the reference's Triton kernels interpreted on CPU) in the slow lane."""
    def params(values):
        return [pytest.param(v, id=str(v), marks=[] if v in fast else [pytest.mark.slow]) for v in values]
    return params


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", _slow_but("balanced")(LAYER_CASES))
def test_layer_parity(case, dtype):
    config = make_config(dtype=dtype, **LAYER_CASES[case])
    problem = harness.build_problem(config)
    ours = harness.run_ours(config, problem)
    theirs = harness.run_reference(config, problem)
    report = harness.compare_sides(config, ours, theirs)
    harness.check(report)
    assert [c.tensor for c in report.comparisons] == list(harness.layer_tensor_names(config))

    # Experts that got no token: both sides' weight gradients are exactly zero there.
    idle = unused_experts(problem, config.num_experts)
    if config.skew == "empty":
        assert idle.size >= 1
    for name in ("d_w_gate", "d_w_up", "d_w_gate_up", "d_w_down"):
        if name in theirs and idle.size:
            assert not np.asarray(ours[name], np.float32)[idle].any(), f"{name}: ours nonzero on idle experts"
            assert not theirs[name][torch.as_tensor(idle)].any(), f"{name}: reference nonzero on idle experts"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("skew", _slow_but("balanced")(harness.SKEWS))
@pytest.mark.parametrize("router", harness.ROUTERS)
def test_router_parity(router, skew, dtype):
    config = make_config(router=router, skew=skew, dtype=dtype, top_k=min(8, SIZES["num_experts"] // 2))
    report = harness.compare_routers(config)
    harness.check(report)
    assert {c.tensor for c in report.comparisons} >= {
        "router.expert_idx", "router.weights", "router.d_logits", "router.d_w_router",
    }


def test_broken_side_fails_naming_tensor_config_and_figures():
    """A transposed w_down on our side (square, so shapes still agree) must fail the comparison."""
    config = make_config(d_ff=SIZES["d_model"], skew="zipf")
    problem = harness.build_problem(config)
    w_down = problem.params["w_down"]
    broken = problem._replace(params={**problem.params, "w_down": np.ascontiguousarray(w_down.swapaxes(1, 2))})
    report = harness.compare_sides(config, harness.run_ours(config, broken), harness.run_reference(config, problem))

    with pytest.raises(AssertionError) as excinfo:
        harness.check(report)
    message = str(excinfo.value)
    assert config.describe() in message
    # d_w_down = (weighted dY)^T hidden does not read w_down, so it still agrees; everything
    # downstream of the wrong product does not.
    failed = {c.tensor for c in report.failures}
    assert failed == {"y", "dx", "d_weights", "d_w_gate", "d_w_up"}
    y = next(c for c in report.comparisons if c.tensor == "y")
    assert f"y [{config.tokens}, {config.d_model}]: rel Frobenius error {y.rel_fro:.3e}" in message
    assert f"max abs error {y.max_abs:.3e}" in message and "threshold 1e-05" in message
    assert "FAIL" in harness.format_table(report)


def test_check_reports_every_failure_and_nan():
    config = harness.ParityConfig()
    ok = harness.Comparison("y", (4, 2), 1e-7, 1e-7, 1e-5)
    bad = harness.Comparison("d_w_up", (8, 32, 32), 0.5, 0.25, 1e-5)
    nan = harness.Comparison("dx", (4, 2), float("nan"), float("nan"), 1e-5)
    harness.check(harness.ParityReport(config, (ok,)))
    with pytest.raises(AssertionError) as excinfo:
        harness.check(harness.ParityReport(config, (ok, bad, nan)))
    message = str(excinfo.value)
    assert "d_w_up [8, 32, 32]: rel Frobenius error 2.500e-01 (threshold 1e-05)" in message
    assert "dx [4, 2]" in message and "y [4, 2]" not in message
    assert config.describe() in message


def test_compare_tensor_figures():
    ref = torch.tensor([3.0, 4.0])
    c = harness.compare_tensor("t", jnp.array([3.0, 4.5]), ref, 0.2)
    assert c.max_abs == pytest.approx(0.5) and c.rel_fro == pytest.approx(0.1) and c.passed
    idx = harness.compare_tensor("i", jnp.array([[0, 1], [2, 3]]), torch.tensor([[0, 1], [3, 2]]), 1.0)
    assert idx.rel_fro == 0.5 and idx.threshold == 0.0 and not idx.passed
    with pytest.raises(ValueError, match="t: our shape"):
        harness.compare_tensor("t", jnp.zeros(3), ref, 0.2)


def test_reference_bf16_rounds_to_nearest_like_compiled_kernels():
    """Regression: Triton's interpreter truncates fp32 -> bf16; the reference must round to nearest
    even on CPU as its compiled kernels do on GPU (else bf16 parity errors double). Small integer
    operands make the fp32 accumulation exact, so the expected bf16 result is unambiguous."""
    gen = torch.Generator().manual_seed(0)
    device = harness.torch_device()
    a = torch.randint(-8, 9, (48, 32), generator=gen).to(device, torch.bfloat16)
    b = torch.randint(-8, 9, (2, 40, 32), generator=gen).to(device, torch.bfloat16)
    offsets = torch.tensor([0, 20, 48], dtype=torch.int32, device=device)
    out = grouped_mm(a, b, offsets)
    exact = torch.cat([a[:20].float() @ b[0].float().T, a[20:].float() @ b[1].float().T])
    assert not torch.equal(exact.bfloat16().float(), exact), "operands must need rounding"
    assert torch.equal(out, exact.bfloat16())


# ---------------------------------------------------------------------------------------------
# Problem construction


@settings(derandomize=True, max_examples=25, deadline=None)
@given(
    skew=st.sampled_from(harness.SKEWS),
    tokens=st.integers(1, 200),
    num_experts=st.integers(2, 32),
    data=st.data(),
)
def test_injected_routing_follows_the_skew(skew, tokens, num_experts, data):
    top_k = data.draw(st.integers(1, num_experts - 1 if skew == "empty" else num_experts))
    seed = data.draw(st.integers(0, 2**16))
    config = harness.ParityConfig(tokens=tokens, num_experts=num_experts, top_k=top_k, skew=skew, seed=seed)
    rng = np.random.default_rng(seed)
    logp_E = harness.expert_popularity_logits(config, rng)
    idx_TK = harness.make_expert_idx(config, logp_E, rng)

    assert idx_TK.dtype == np.int32 and idx_TK.shape == (tokens, top_k)
    assert ((idx_TK >= 0) & (idx_TK < num_experts)).all()
    assert all(len(set(row)) == top_k for row in idx_TK.tolist()), "experts must be distinct per token"
    counts_E = np.bincount(idx_TK.ravel(), minlength=num_experts)
    if skew == "balanced":
        assert counts_E.max() - counts_E.min() <= 1
    if skew == "one_hot":
        hot = int(np.flatnonzero(np.isposinf(logp_E))[0])
        assert (idx_TK == hot).any(axis=1).all()
    if skew == "empty":
        empty_E = np.isneginf(logp_E)
        assert empty_E.any() and num_experts - empty_E.sum() >= top_k
        assert (counts_E[empty_E] == 0).all()


def test_zipf_skew_favours_popular_experts():
    config = harness.ParityConfig(tokens=4000, num_experts=16, top_k=2, skew="zipf")
    rng = np.random.default_rng(0)
    logp_E = harness.expert_popularity_logits(config, rng)
    counts_E = np.bincount(harness.make_expert_idx(config, logp_E, rng).ravel(), minlength=16)
    by_popularity = counts_E[np.argsort(-logp_E)]
    assert by_popularity[0] > 5 * by_popularity[-1]
    assert np.corrcoef(logp_E, np.log(counts_E + 1))[0, 1] > 0.9


def test_problem_is_deterministic_and_rounded_to_the_dtype():
    config = harness.ParityConfig(dtype="bfloat16", shared_experts=1, latent_dim=16, skew="one_hot")
    p1, p2 = harness.build_problem(config), harness.build_problem(config)
    assert all(np.array_equal(a, b) for a, b in zip(p1[:-1], p2[:-1]))
    assert p1.params.keys() == p2.params.keys() == harness.param_shapes(config).keys()
    for name, value in p1.params.items():
        assert value.shape == harness.param_shapes(config)[name]
        assert np.array_equal(harness.round_to_dtype(value, "bfloat16"), value), name
    np.testing.assert_allclose(p1.weights_TK.sum(axis=1), 1.0, rtol=1e-6)
    other = harness.build_problem(dataclasses.replace(config, seed=1))
    assert not np.array_equal(other.x_TD, p1.x_TD)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(top_k=9, num_experts=8), "top_k=9"),
        (dict(skew="empty", top_k=4, num_experts=4), "skew='empty'"),
        (dict(dtype="float16"), "dtype='float16'"),
        (dict(router="topk"), "router='topk'"),
        (dict(ep_size=3), "multiple of ep_size=3"),
        (dict(latent_dim=0), "latent_dim=0"),
        (dict(tokens=True), "tokens=True"),
    ],
    ids=["top_k", "empty_needs_spare_expert", "dtype", "router", "ep_divides", "latent", "bool_int"],
)
def test_config_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        harness.ParityConfig(**overrides)


def test_router_groups_fit():
    for e, k in [(4, 2), (8, 8), (16, 8), (128, 8), (6, 3), (7, 2)]:
        n_group, topk_group = harness.router_groups(e, k)
        assert e % n_group == 0 and 1 <= topk_group <= n_group
        assert topk_group * (e // n_group) >= k
    assert harness.router_groups(128, 8) == (8, 4)


def test_ragged_ep_off_gpus_is_a_clear_error():
    """XLA:CPU has no ragged_all_to_all: `ep_mesh` refuses a non-GPU mesh before compiling (the
    mesh is put on host CPU devices, so this runs on GPU hosts too)."""
    with pytest.raises(ValueError, match="ep_strategy='ragged' needs 2 GPUs"):
        harness.ep_mesh(make_config(ep_size=2, ep_strategy="ragged"), devices=jax.devices("cpu")[:2])


def test_time_ep_needs_ep_size_accelerators(monkeypatch):
    """With too few default-backend devices our EP side would be timed on host CPUs: refused."""
    monkeypatch.setattr(timing, "gpu_available", lambda: True)  # reach the EP check on CPU too
    ep_size = 2 * jax.device_count()
    config = harness.ParityConfig(tokens=4 * ep_size, num_experts=ep_size, top_k=2, ep_size=ep_size)
    with pytest.raises(ValueError, match=f"needs {ep_size} accelerators"):
        timing.time_layers(config)


# ---------------------------------------------------------------------------------------------
# Command line


@pytest.mark.slow  # a fresh interpreter
def test_cli_help_lists_the_options():
    out = subprocess.run(
        [sys.executable, "-m", "parity", "--help"], capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    for option in ("--tokens", "--d-model", "--d-ff", "--experts", "--top-k", "--dtype", "--skew",
                   "--router", "--shared-experts", "--latent-dim", "--ep-size", "--seed", "--time", "--json"):
        assert option in out


def test_cli_run_prints_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    rc = main(["--tokens", "16", "--d-model", "16", "--d-ff", "16", "--experts", "4", "--top-k", "2",
               "--skew", "one_hot", "--router", "selected_softmax", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "T=16 D=16 F=16 E=4 K=2 float32 skew=one_hot router=selected_softmax" in out
    assert "d_w_down" in out and "router.d_w_router" in out and out.rstrip().endswith(f"wrote {path}")
    payload = json.loads(path.read_text())
    assert payload["passed"] and payload["config"]["num_experts"] == 4
    assert {c["tensor"] for c in payload["comparisons"]} >= {"y", "dx", "d_weights", "router.weights"}


def test_cli_rejects_bad_configuration(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--experts", "4", "--top-k", "5"])
    assert excinfo.value.code == 2
    assert "top_k=5 exceeds num_experts=4" in capsys.readouterr().err


def test_cli_time(tmp_path, capsys):
    """GPU: a small timing run prints both sides and a ratio; CPU: a clear GPU-only error."""
    args = ["--time", "--tokens", "256", "--d-model", "128", "--d-ff", "128", "--experts", "8",
            "--top-k", "2", "--dtype", "bfloat16", "--iters", "3", "--warmup", "1"]
    if not ON_GPU:
        with pytest.raises(SystemExit) as excinfo:
            main(args)
        assert excinfo.value.code == 2
        assert "timing needs a CUDA GPU" in capsys.readouterr().err
        return
    path = tmp_path / "timing.json"
    assert main([*args, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torch reference" in out and "moe_jax" in out and "ratio torch/ours" in out
    payload = json.loads(path.read_text())
    assert payload["torch_ms"] > 0 and payload["ours_ms"] > 0
    assert payload["ratio_torch_over_ours"] == pytest.approx(payload["torch_ms"] / payload["ours_ms"])
