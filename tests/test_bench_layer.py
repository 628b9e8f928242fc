"""The layer benchmark's torch peers: the bf16 one computes the same layer as `MoE` (on CPU in fp32,
its output and every gradient equal ours, so the GPU timings compare like with like); the FP8 one
is that layer with its expert GEMMs in the rowwise-FP8 recipe, checked on CPU through an emulation
of `torch._scaled_grouped_mm` (which CUDA alone runs) and, on a GPU, that emulation against it."""

import glob
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from benchmarks.layer import (
    LayerShape,
    build_layer,
    grad_step,
    micro_batch_tokens,
    torch_fp8_grouped_linear,
    torch_layer,
    variant_layer,
)
from benchmarks.layer_profile import Kernel, compare, profile, table, trace_kernels
from benchmarks.layer_profile import main as layer_profile_main
from moe_jax.layers import GemmOptions, MoE
from moe_jax.routing import SoftmaxTopK
from moe_jax.testing import assert_close, rel_err


def test_torch_peer_matches_moe_forward_and_gradients():
    d, f, e, k, t = 32, 48, 8, 2, 40
    layer = MoE(d, f, e, k, router=SoftmaxTopK(k, renormalize=True), rngs=nnx.Rngs(0), gemm=GemmOptions(backend="xla"))
    x = jax.random.normal(jax.random.PRNGKey(1), (t, d), jnp.float32)
    graph, state = nnx.split(layer)

    def loss(state, x):
        y, _ = nnx.merge(graph, state)(x)
        return jnp.sum(y**2), y

    (_, y), (g_state, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
    names = ("w_router", "w_gate", "w_up", "w_down")
    params = {n: torch.tensor(np.asarray(getattr(layer, n)[...]), requires_grad=True) for n in names}
    tx = torch.tensor(np.asarray(x), requires_grad=True)
    ty, grads, _ = torch_layer(params, tx, k)
    assert_close(ty.detach().numpy(), y, jnp.float32, "output")
    assert_close(grads[0].numpy(), g_x, jnp.float32, "d x")
    for n, g in zip(names, grads[1:]):
        assert_close(g.numpy(), g_state[n][...], jnp.float32, f"d {n}")


def _emulated_scaled_grouped_mm(xq_MK, wq_EKN, sx_M, sw_EN, *, offs, out_dtype, use_fast_accum=False):
    """`torch._scaled_grouped_mm`'s rowwise product where it does not run (CPU): both operands
    dequantized to fp32 and multiplied group by group (fast accumulation has no counterpart here)."""
    x_MK, w_EKN = xq_MK.float() * sx_M[:, None], wq_EKN.float() * sw_EN[:, None, :]
    ends = offs.tolist()
    return torch.cat([x_MK[a:b] @ w_EKN[e] for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))]).to(out_dtype)


def _dequantized(a, dim):
    """`a` rounded to e4m3 with amax / 448 scales along `dim` and scaled back, in fp32 (an all-zero
    slice stays zero): the recipe written out independently of `benchmarks.fp8.torch_fp8_rowwise`."""
    scale = a.abs().amax(dim, keepdim=True) / 448
    return torch.where(scale > 0, (a / scale).to(torch.float8_e4m3fn).float() * scale, 0.0)


def _fp8_layer_params(seed=0, d=32, f=48, e=8, t=40):
    """fp32 params and tokens whose router never picks expert 3 (its logit is ~-15 below the rest)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    x[:, 0] = 3.0
    w_router = torch.randn(e, d, generator=g) * 0.3
    w_router[3, 0] = -5.0
    params = dict(w_router=w_router, w_gate=torch.randn(e, f, d, generator=g) / d**0.5,
                  w_up=torch.randn(e, f, d, generator=g) / d**0.5, w_down=torch.randn(e, d, f, generator=g) / f**0.5)
    return {n: p.requires_grad_(True) for n, p in params.items()}, x.requires_grad_(True)


def test_torch_fp8_peer_is_the_layer_within_fp8_error():
    """Output and every gradient of the torch FP8 layer are within e4m3's error of the unquantized
    layer's (measured 4-7e-2 over seeds), and not equal to them."""
    params, x = _fp8_layer_params()
    y, grads, idx = torch_layer(params, x, 2)
    fp8_linear = partial(torch_fp8_grouped_linear, scaled_mm=_emulated_scaled_grouped_mm)
    y8, grads8, idx8 = torch_layer(params, x, 2, fp8_linear)
    assert torch.equal(idx, idx8) and not (idx == 3).any()  # an empty expert is in the groups
    names = ("output", "d x", "d w_router", "d w_gate", "d w_up", "d w_down")
    for name, out, ref in zip(names, (y8, *grads8), (y, *grads)):
        err = rel_err(out.detach().numpy(), ref.detach().numpy())
        assert 1e-2 < err < 1e-1, f"{name}: rel error {err:.2e} to the unquantized layer"
    assert not any(g[3].any() for g in grads8[2:])  # nothing flows to the empty expert's weights


def test_torch_fp8_grouped_linear_is_the_recipe():
    """y and dx are the dequantized-e4m3 products (x and dy per row, w per (e, n) and per (e, k)), dw
    the unquantized dy^T xs per group; with an empty group and all-zero rows of xs and dy."""
    g = torch.Generator().manual_seed(0)
    m, k, n = 40, 32, 48
    offs = torch.tensor([10, 10, 25, 40], dtype=torch.int32)
    xs = torch.randn(m, k, generator=g)
    xs[0] = 0.0
    xs.requires_grad_(True)
    w = torch.randn(len(offs), n, k, generator=g).requires_grad_(True)
    dy = torch.randn(m, n, generator=g)
    dy[5] = 0.0
    y = torch_fp8_grouped_linear(xs, w, offs, scaled_mm=_emulated_scaled_grouped_mm)
    dx, dw = torch.autograd.grad(y, (xs, w), dy)
    xs, w = xs.detach(), w.detach()
    rows = [slice(a, b) for a, b in zip([0, *offs[:-1].tolist()], offs.tolist())]
    y_ref = torch.cat([_dequantized(xs[r], 1) @ _dequantized(w[e], 1).T for e, r in enumerate(rows)])
    dx_ref = torch.cat([_dequantized(dy[r], 1) @ _dequantized(w[e].T, 1).T for e, r in enumerate(rows)])
    dw_ref = torch.stack([dy[r].T @ xs[r] for r in rows])
    for name, out, ref in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert_close(out.detach().numpy(), ref.numpy(), "float32", name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_grouped_mm runs on CUDA only")
def test_emulated_scaled_grouped_mm_is_torchs():
    """On a GPU, the CPU tests' emulation is `torch._scaled_grouped_mm` (to bf16 output rounding and
    fast accumulation): the FP8 linear's output and both gradients, an empty group included."""
    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 256, 128, 64
    offs = torch.tensor([64, 64, 160, 256], dtype=torch.int32, device="cuda")
    xs = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    w = torch.randn(len(offs), n, k, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, generator=g, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, scaled_mm in (("torch", None), ("emulated", _emulated_scaled_grouped_mm)):
        y = torch_fp8_grouped_linear(xs, w, offs, scaled_mm=scaled_mm)
        out[name] = (y, *torch.autograd.grad(y, (xs, w), dy))
    for what, a, b in zip(("y", "dx", "dw"), out["torch"], out["emulated"]):
        assert_close(a.detach().float().cpu().numpy(), b.detach().float().cpu().numpy(), "bfloat16", what)


def test_grad_step_is_the_layers_forward_and_gradients():
    """`benchmarks.layer.grad_step` (what the layer benchmark times and the profile reads) gives the
    layer's output and the gradients of sum(y^2)."""
    shape = LayerShape("tiny", tokens=24, d_model=32, d_ff=48, experts=4, top_k=2)
    layer = build_layer(shape)
    x = jax.random.normal(jax.random.PRNGKey(1), (shape.tokens, shape.d_model), jnp.bfloat16)
    step, state = grad_step(layer)
    y, (g_state, g_x) = jax.jit(step)(state, x)
    assert_close(y, layer(x)[0], jnp.bfloat16, "y")
    want = jax.grad(lambda x: jnp.sum(layer(x)[0].astype(jnp.float32) ** 2))(x)
    assert_close(g_x, want, jnp.bfloat16, "dx")
    assert jax.tree.structure(g_state) == jax.tree.structure(state)


def test_layer_profile_reads_the_kernels_of_a_trace(tmp_path):
    f = jax.jit(jnp.sin)  # one op, so a GPU runs it alone (a product would fuse it in)
    a = jnp.ones((64, 64))
    jax.block_until_ready(f(a))
    with jax.profiler.trace(str(tmp_path)):
        jax.block_until_ready(f(a))
    (path,) = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)
    kernels = trace_kernels(path)
    assert kernels and all(k.duration_ns >= 0 for k in kernels)
    assert [k.start_ns for k in kernels] == sorted(k.start_ns for k in kernels)
    assert any("sine" in k.hlo_op + k.name for k in kernels), [(k.name, k.hlo_op) for k in kernels]


def test_layer_profile_table_groups_numbered_fusions():
    kernels = [Kernel("loop_convert_fusion_3", "convert.3", 0, 2_000_000), Kernel("loop_convert_fusion_12", "convert.12", 3e6, 1e6),
               Kernel("moe_jax_gmm", "custom-call.1", 4e6, 1e6)]
    out = table("tiny auto", kernels)
    assert out[0] == "## tiny auto: 4.000 ms in 3 kernels, span 5.000 ms"
    assert "| `loop_convert_fusion` | 3.000 | 2 | 75.0% | convert x2 |" in out
    with pytest.raises(ValueError, match="tiny fp8: the trace holds no kernels."):
        table("tiny fp8", [])


def test_fused_gate_up_variant_holds_the_base_layers_weights():
    shape = LayerShape("tiny", tokens=24, d_model=32, d_ff=48, experts=4, top_k=2)
    base = build_layer(shape)
    fused = variant_layer(base, shape, "fused-gate-up")
    assert fused.fused_gate_up and not base.fused_gate_up
    x = jax.random.normal(jax.random.PRNGKey(2), (shape.tokens, shape.d_model), jnp.bfloat16)
    assert_close(fused(x)[0], base(x)[0], jnp.bfloat16, "y")


def test_fp32_params_variant_holds_the_base_layers_values_in_fp32():
    """The layer's default parameters (fp32, bf16 compute): base's bf16 values exactly, the same
    output (the router's products are exact either way)."""
    shape = LayerShape("tiny", tokens=24, d_model=32, d_ff=48, experts=4, top_k=2)
    base = build_layer(shape)
    wide = variant_layer(base, shape, "fp32-params")
    for got, want in zip(jax.tree.leaves(nnx.state(wide, nnx.Param)), jax.tree.leaves(nnx.state(base, nnx.Param))):
        assert got.dtype == jnp.float32 and want.dtype == jnp.bfloat16
        assert bool(jnp.array_equal(got, want.astype(jnp.float32)))
    x = jax.random.normal(jax.random.PRNGKey(2), (shape.tokens, shape.d_model), jnp.bfloat16)
    assert_close(wide(x)[0], base(x)[0], jnp.bfloat16, "y")


def test_micro_batch_step_accumulates_each_pass():
    """`grad_step(layer, 3)`: the stacked outputs and x gradients are each micro-batch's own, and the
    variables' gradients their sum."""
    shape = LayerShape("tiny", tokens=24, d_model=32, d_ff=48, experts=4, top_k=2)
    layer = build_layer(shape)
    x = jax.random.normal(jax.random.PRNGKey(1), (shape.tokens, shape.d_model), jnp.bfloat16)
    xs = micro_batch_tokens(x, 3)
    assert xs.shape == (3, *x.shape) and bool(jnp.array_equal(xs[0], x))
    step, state = grad_step(layer)
    acc_step, _ = grad_step(layer, 3)
    ys, (acc, g_xs) = jax.jit(acc_step)(state, xs)
    singles = [jax.jit(step)(state, xs[i]) for i in range(3)]
    for i, (y, (_, g_x)) in enumerate(singles):
        assert_close(ys[i], y, jnp.bfloat16, f"y[{i}]")
        assert_close(g_xs[i], g_x, jnp.bfloat16, f"dx[{i}]")
    want = jax.tree.map(lambda *g: sum(a.astype(jnp.float32) for a in g), *(g for _, (g, _) in singles))
    for path_got, path_want in zip(jax.tree.leaves(acc), jax.tree.leaves(want)):
        assert_close(path_got, path_want, jnp.bfloat16, "accumulated gradient")


def test_micro_batch_step_quantized_once_equals_per_call():
    """`grad_step(fp8 layer, 2, quantize_once=True)` (the `fp8-once` variant) gives the per-call
    step's outputs and gradients bit for bit."""
    shape = LayerShape("tiny", tokens=24, d_model=32, d_ff=48, experts=4, top_k=2)
    base = build_layer(shape)
    layer = variant_layer(base, shape, "fp8-once")
    xs = micro_batch_tokens(jax.random.normal(jax.random.PRNGKey(1), (shape.tokens, shape.d_model), jnp.bfloat16), 2)
    once, state = grad_step(layer, 2, quantize_once=True)
    per_call, _ = grad_step(layer, 2)
    for got, want in zip(jax.tree.leaves(jax.jit(once)(state, xs)), jax.tree.leaves(jax.jit(per_call)(state, xs))):
        assert bool(jnp.array_equal(got, want))


def test_layer_profile_compare_lists_the_groups_that_changed(tmp_path):
    def record(kernels):
        return dict(shape="tiny", device="cpu", kernels=dict(auto=[k._asdict() for k in kernels]))

    a = record([Kernel("gmm_kernel", "a", 0, 2e6), Kernel("input_scatter_fusion_1", "s", 2e6, 1e6)])
    b = record([Kernel("gmm_kernel", "a", 0, 2e6), Kernel("loop_gather_fusion", "g", 2e6, 0.25e6)])
    out = compare(a, b)
    assert out[0] == "## tiny auto: kernels 3.000 -> 2.250 ms (0.750x), span 3.000 -> 2.250 ms"
    assert out[3] == "| `input_scatter_fusion` | 1.000 | 0.000 | -1.000 |"
    assert "| `gmm_kernel` | 2.000 | 2.000 | +0.000 |" in out
    with pytest.raises(ValueError, match="different shapes"):
        compare(a, dict(b, shape="other"))
    with pytest.raises(ValueError, match=r"different micro-batches \(1 and 4\)"):
        compare(a, dict(b, micro_batches=4))
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert layer_profile_main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0


def test_layer_profile_traces_a_micro_batched_step(tmp_path):
    """With micro-batches the traced step is the accumulating scan (on a CPU the kernels are the
    host's XLA thunks), labelled and recorded as such."""
    shape = LayerShape("tiny", tokens=24, d_model=32, d_ff=48, experts=4, top_k=2)
    lines = profile(shape, ["auto"], str(tmp_path), micro_batches=3)
    assert lines[0].startswith("## tiny auto x 3 micro-batches: ")
    rec = json.loads((tmp_path / "layer_profile.json").read_text())
    assert rec["micro_batches"] == 3 and rec["kernels"]["auto"]
    assert (tmp_path / "layer_profile.md").read_text().startswith(lines[0])
