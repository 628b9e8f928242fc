"""Parity of the FP8 layer: `moe_jax`'s `GemmOptions(quantization=Fp8Blockwise())` against the
torch recipe of `parity.reference.fp8`, and that recipe against float64 oracles.

Legend (shape suffixes): T tokens, D model width, F routed-expert hidden width, E experts,
K experts per token (top-k); M packed rows, C contraction width, N output width (GEMM tests).

Widths are above 128 and not multiples of it, so every quantized axis has a full 128-wide tile
and a narrower last one. The layers are held to `layer_threshold` (`fp8_products_threshold` for
fp32, and for bf16 tensors of the FP8 products alone: 1e-3 on the reference path, 1e-2 where our
side runs the FP8 kernel; bf16's 1e-2 otherwise); what FP8 gives up (our FP8
layer against our unquantized one) to `[FP8_QUANTIZATION_FLOOR, FP8_QUANTIZATION_BOUND]`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from moe_jax.ops import fp8 as jfp8
from parity import harness
from parity.__main__ import main
from parity.reference import fp8 as tfp8

DTYPES = ["float32", "bfloat16"]

# Case name -> configuration; each runs in both dtypes.
LAYER_CASES = {
    "zipf": dict(tokens=32, d_model=160, d_ff=136, num_experts=4, top_k=2, skew="zipf"),
    # An expert without tokens, a latent width and a shared expert around the FP8 experts.
    "empty_latent_shared": dict(tokens=32, d_model=144, d_ff=200, num_experts=6, top_k=2, skew="empty",
                                latent_dim=136, shared_experts=1),
}


def fp8_config(**fields) -> harness.ParityConfig:
    return harness.ParityConfig(fp8=True, **fields)


def as_f32(a) -> np.ndarray:
    return a.detach().float().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, np.float32)


# ---------------------------------------------------------------------------------------------
# Quantization: both sides give the same e4m3 values and scales


def edge_rows(dtype: str) -> np.ndarray:
    """`[6, 200]` fp32 rows, already in `dtype`: normal values, an all-zero tile, NaN and inf in
    one tile each, magnitudes near fp32's limits (normal ones: XLA flushes subnormals to zero,
    torch on CPU keeps them, and the recipe says nothing of them), and small integer multiples of
    one value (their ratios to the tile's amax are short binary fractions, near e4m3 ties)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 200)).astype(np.float32)
    x[1, :128] = 0.0
    x[2, 5] = np.nan
    x[3, 140] = np.inf
    x[4, :128] *= np.float32(1e30)
    x[4, 128:] *= np.float32(1e-30)
    x[5] = np.float32(3.0) * rng.integers(-8, 9, 200)  # short binary fractions of the amax (24)
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x


def equal_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantization_is_the_same_on_both_sides(dtype):
    x_MC = edge_rows(dtype)
    ours = jfp8.quantize_rows(jnp.asarray(x_MC, dtype))
    theirs = tfp8.quantize_rows(torch.from_numpy(x_MC).to(getattr(torch, dtype)))
    assert equal_bits(as_f32(ours.values_MK), as_f32(theirs.values))
    assert equal_bits(np.asarray(ours.scale_MKb), theirs.scale.numpy())
    # The edges did what the recipe says: zero tile scale 1; NaN/inf poison their own tile only.
    scale = theirs.scale.numpy()
    assert scale[1, 0] == 1.0 and np.isnan(scale[2, 0]) and np.isfinite(scale[2, 1])
    assert np.isinf(scale[3, 1]) and np.isfinite(scale[3, 0])
    deq = tfp8.dequantize_rows(theirs).numpy()
    assert np.isnan(deq[2, :128]).all() and np.isfinite(deq[2, 128:]).all()

    # Two blocks both ways, the rows' edge values spread over them, but no NaN: XLA:CPU's max
    # reduction over a 128 x 128 block can drop a NaN (measured), so our block scale stays
    # finite where the recipe's is NaN (only the NaN element itself dequantizes to NaN).
    w_ENK = np.nan_to_num(np.resize(x_MC, (2, 136, 170)), nan=0.0, posinf=np.inf)
    w_ENK[1, :128, :128] = 0.0
    ours_w = jfp8.quantize_weights(jnp.asarray(w_ENK, dtype))
    theirs_w = tfp8.quantize_weights(torch.from_numpy(np.ascontiguousarray(w_ENK)).to(getattr(torch, dtype)))
    assert equal_bits(as_f32(ours_w.values_ENK), as_f32(theirs_w.values))
    assert equal_bits(np.asarray(ours_w.scale_ENbKb), theirs_w.scale.numpy())
    assert equal_bits(np.asarray(jfp8.dequantize_weights(ours_w)), tfp8.dequantize_weights(theirs_w).numpy())


# ---------------------------------------------------------------------------------------------
# The torch recipe against float64 oracles (no moe_jax)


def grouped_problem(gen: torch.Generator, counts: list[int], tail: int, c: int, n: int):
    m = sum(counts) + tail
    x_MC = torch.randn(m, c, generator=gen)
    x_MC[sum(counts):] = float("nan")  # rows past the groups are never read
    w_ENC = torch.randn(len(counts), n, c, generator=gen) / c**0.5
    offsets = torch.tensor([0, *np.cumsum(counts).tolist()])
    return x_MC, w_ENC, offsets


def loop64(a_MC: torch.Tensor, w_EOC: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """float64 `[M, O]`: row r of group e is `a[r] @ w[e]^T`; rows past the groups zero."""
    out = torch.zeros(a_MC.shape[0], w_EOC.shape[1], dtype=torch.float64)
    bounds = offsets.tolist()
    for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
        out[s:t] = a_MC[s:t].double() @ w_EOC[e].double().T
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def test_reference_recipe_gemm_and_gradients_match_float64_oracles():
    """fp32 per-step sums against the float64 product of the dequantized operands (products of
    e4m3 values are exact); the backward is the recipe's: dx from dy quantized along N, dw from the
    dequantized rows and the unquantized dy; an empty expert's dw is exactly zero."""
    gen = torch.Generator().manual_seed(0)
    counts, tail = [37, 0, 90, 3], 5
    x_MC, w_ENC, offsets = grouped_problem(gen, counts, tail, c=200, n=136)
    used = sum(counts)
    rows, wq = tfp8.quantize_rows(x_MC), tfp8.quantize_weights(w_ENC)
    deq_rows, deq_w = tfp8.dequantize_rows(rows), tfp8.dequantize_weights(wq)

    y = tfp8.fp8_grouped_mm(rows, wq, offsets)
    assert rel(y[:used], loop64(deq_rows, deq_w, offsets)[:used]) < 1e-6
    assert not y[used:].any()

    x = x_MC.clone().requires_grad_()
    w = w_ENC.clone().requires_grad_()
    y = tfp8.fp8_grouped_linear(x, w, offsets)
    dy = torch.randn(y.shape, generator=gen)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    dx_oracle = loop64(tfp8.dequantize_rows(tfp8.quantize_rows(dy)), deq_w.transpose(1, 2), offsets)
    assert rel(dx[:used], dx_oracle[:used]) < 1e-6 and not dx[used:].any()
    bounds = offsets.tolist()
    for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
        if s == t:
            assert not dw[e].any()
        else:
            assert rel(dw[e], dy[s:t].double().T @ deq_rows[s:t].double()) < 1e-6
    # The FP8 error itself: far from zero, within one e4m3 step.
    assert 1e-2 < rel(y[:used], loop64(x_MC, w_ENC, offsets)[:used]) < 2**-3


def test_reference_recipe_rejects_bad_arguments():
    x, w = torch.randn(4, 130), torch.randn(2, 8, 130)
    offsets = torch.tensor([0, 1, 4])
    with pytest.raises(TypeError, match="x: expected one of"):
        tfp8.fp8_grouped_linear(x.double(), w, offsets)
    with pytest.raises(ValueError, match="w: expected"):
        tfp8.fp8_grouped_linear(x, torch.randn(2, 8, 129), offsets)
    with pytest.raises(ValueError, match="offsets"):
        tfp8.fp8_grouped_linear(x, w, torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="x_MC: expected a 2-D tensor"):
        tfp8.quantize_rows(w)
    with pytest.raises(ValueError, match="does not contract"):
        tfp8.fp8_grouped_mm(tfp8.quantize_rows(x), tfp8.quantize_weights(w), offsets, contract_k=False)


# ---------------------------------------------------------------------------------------------
# The layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_fp8_layer_parity_and_what_fp8_gives_up(case, dtype):
    config = fp8_config(dtype=dtype, **LAYER_CASES[case])
    problem = harness.build_problem(config)
    ours = harness.run_ours(config, problem)
    theirs = harness.run_reference(config, problem)
    report = harness.compare_sides(config, ours, theirs)
    harness.check(report)
    if case == "zipf":  # only FP8 products: their threshold in bf16 too (the unquantized parts hold bf16's 1e-2)
        limit = harness.fp8_products_threshold(config)
        assert all(c.rel_fro < limit for c in report.comparisons), harness.format_table(report)

    unquantized = harness.run_ours(dataclasses.replace(config, fp8=False), problem)
    quantized = harness.compare_quantized(config, ours, unquantized)
    harness.check(quantized)
    for c in quantized.comparisons:  # every tensor, the shared experts' weight gradients included
        assert c.rel_fro > harness.FP8_QUANTIZATION_FLOOR, f"{c.tensor}: not quantized ({c.rel_fro:.2e})"

    idle = np.setdiff1d(np.arange(config.num_experts), problem.expert_idx_TK)
    assert idle.size or config.skew != "empty"
    for name in ("d_w_gate", "d_w_up", "d_w_down"):
        assert not as_f32(ours[name])[idle].any() and not as_f32(theirs[name])[idle].any(), name


def test_fp8_layer_parity_under_expert_parallelism():
    """Our FP8 layer on a 2-device mesh (forced host CPUs off a GPU) against the one-device torch
    recipe: the rows are exchanged unquantized and quantized by their owner, the same values."""
    harness.check(harness.compare_layer(fp8_config(ep_size=2, **LAYER_CASES["zipf"])))


def test_nan_input_stays_in_its_token_on_both_sides():
    """A token whose input is NaN poisons its own outputs, its own gradients and the weight
    gradients of the experts it went to, identically on both sides, and nothing else: every other
    entry stays finite and at parity."""
    config = fp8_config(**LAYER_CASES["zipf"])
    problem = harness.build_problem(config)
    poisoned = 3
    x_TD = problem.x_TD.copy()
    x_TD[poisoned] = np.nan
    problem = problem._replace(x_TD=x_TD)
    ours = harness.run_ours(config, problem)
    theirs = harness.run_reference(config, problem)
    hit = problem.expert_idx_TK[poisoned]
    for name in harness.layer_tensor_names(config):
        a, b = as_f32(ours[name]), as_f32(theirs[name])
        nan = np.zeros(a.shape, bool)
        if name.startswith("d_w_"):
            nan[hit] = True
        else:
            nan[poisoned] = True
        assert np.array_equal(np.isnan(a), nan) and np.array_equal(np.isnan(b), nan), name
        c = harness.compare_tensor(name, jnp.asarray(a[~nan]), torch.from_numpy(b[~nan]),
                                   harness.fp8_products_threshold(config))
        assert c.passed, c.summary()


# ---------------------------------------------------------------------------------------------
# Configuration and command line


def test_fp8_configuration_errors():
    with pytest.raises(ValueError, match="fp8=True needs fused_gate_up=False"):
        harness.ParityConfig(fp8=True, fused_gate_up=True)
    with pytest.raises(TypeError, match="fp8=1: must be a bool"):
        harness.ParityConfig(fp8=1)
    with pytest.raises(ValueError, match="compare_quantization measures an FP8 layer"):
        harness.compare_quantization(harness.ParityConfig())
    assert " fp8 " in harness.ParityConfig(fp8=True).describe()
    # The reference path's products are fp32 on every platform: the tight threshold holds there.
    assert harness.fp8_products_threshold(harness.ParityConfig(fp8=True, backend="xla")) == harness.FP8_THRESHOLD


@pytest.mark.parametrize("extra, message", [
    (["--fused-gate-up"], "fp8=True needs fused_gate_up=False"),
    (["--time"], "the torch FP8 reference (parity.reference.fp8) is an fp32 oracle"),
], ids=["fused", "time"])
def test_cli_fp8_rejects_unsupported_combinations(extra, message, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--fp8", *extra])
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_fp8_prints_parity_and_what_fp8_gives_up(capsys):
    rc = main(["--fp8", "--tokens", "16", "--d-model", "130", "--d-ff", "132", "--experts", "4", "--top-k", "2",
               "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "T=16 D=130 F=132 E=4 K=2 bfloat16" in out and " fp8 " in out
    assert "fp8_vs_unquantized.d_w_down" in out and "router.d_w_router" in out
    assert out.rstrip().endswith("PASS")
