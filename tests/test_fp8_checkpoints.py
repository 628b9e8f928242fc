"""Blockwise FP8 checkpoints and stored FP8 expert weights.

Tiny DeepSeek-V3, Qwen3-MoE and Qwen2-MoE checkpoints in Hugging Face's blockwise FP8 format are built here
the way transformers' FineGrainedFP8 quantizer writes them (e4m3 `weight`, fp32 `weight_scale_inv`
per 128 x 128 block, `scale = 448 / amax`, `weight_scale_inv = 1 / scale`), with widths of at
least 128 that are not all multiples of 128 (ragged edge blocks). Checked: the layer's stored e4m3
bytes and scales are the file's (routed and shared experts); its output equals the FP8 recipe on
the file's weights (1e-5) and
is within the recipe's error (activations quantized too) of transformers' block run on the
dequantized weights (`weight.float() * weight_scale_inv` per block); round trips are bit for bit;
`stored_fp8` equals the master-weight FP8 layer and leaves nothing trainable; every error path.

Legend: T tokens, D model width, F expert hidden width, Fs shared-expert width, E experts, K top-k.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file
from transformers import DeepseekV3Config, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from moe_jax import convert
from moe_jax.experts import swiglu_experts_fp8
from moe_jax.layers import Fp8Blockwise, Fp8Stored, Fp8SwiGLU, GemmOptions, MoE, SharedExperts, stored_fp8
from moe_jax.ops import BackendTable
from moe_jax.ops.fp8 import Fp8Weights, dequantize_rows, dequantize_weights, quantize_rows
from moe_jax.parallel import AxisRules, make_mesh
from tests.helpers import lower_for_gpu
from tests.test_convert import exact_torch, randomize

HI = jax.lax.Precision.HIGHEST
STORED = dict(gemm=GemmOptions(backend="xla", quantization=Fp8Blockwise(weights="stored")))
FP8 = dict(convert.FP8_QUANTIZATION_CONFIG)
D, F = 160, 192  # both ragged: 2 blocks of 128 + 32 and 128 + 64

_TINY = dict(vocab_size=64, hidden_size=D, num_attention_heads=2, num_key_value_heads=2, hidden_act="silu",
             attn_implementation="eager", experts_implementation="eager")
CONFIGS = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3MoE, 1,
                    dict(moe_intermediate_size=F, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                         n_shared_experts=1, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=8,
                         kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)),
    # F a multiple of 128 (the fused FP8 layout needs whole gate and up blocks), D ragged.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeSparseMoeBlock, 0,
                  dict(moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                       num_hidden_layers=1)),
    # A shared expert of a ragged width of its own, and its gate [1, D] (unquantized in the file).
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeSparseMoeBlock, 0,
                  dict(moe_intermediate_size=F, shared_expert_intermediate_size=200, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=1)),
}


def hf_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' FineGrainedFP8 quantization of one `[N, K]` weight, on ceil-sized blocks:
    `(e4m3 weight, fp32 weight_scale_inv [ceil(N/128), ceil(K/128)])`."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.nn.functional.pad(w.float(), (0, kb * 128 - k, 0, nb * 128 - n)).reshape(nb, 128, kb, 128)
    amax = padded.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    q = torch.clamp(padded * scale[:, None, :, None], -448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(nb * 128, kb * 128)[:n, :k].contiguous(), (1.0 / scale).float()


def hf_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """`weight.float() * weight_scale_inv` with each scale expanded over its 128 x 128 block."""
    n, k = q.shape
    return q.float() * scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def fp8_checkpoint(model_type: str, seed: int = 0):
    """`(config dict, block state dict of per-expert FP8 tensors with prefix, the transformers block
    holding the dequantized weights, prefix)`: every routed and shared expert projection in e4m3,
    the router and DeepSeek's correction bias as they are."""
    config_cls, block_cls, layer, fields = CONFIGS[model_type]
    config = config_cls(**_TINY, **fields)
    with exact_torch(seed):
        block = block_cls(config).eval()
        randomize(block)
    prefix = f"model.layers.{layer}.mlp."
    sd, dequantized = {}, {}
    fused = block.state_dict()
    for name, value in fused.items():
        if name.startswith("experts."):
            continue
        if name.endswith("proj.weight"):  # the shared experts' linear layers
            sd[prefix + name], sd[prefix + name + "_scale_inv"] = hf_quantize(value)
            dequantized[name] = hf_dequantize(sd[prefix + name], sd[prefix + name + "_scale_inv"])
        else:
            sd[prefix + name] = dequantized[name] = value
    gate_up, down = [], []
    for e in range(fused["experts.gate_up_proj"].shape[0]):
        parts = {}
        for proj, w in (("gate_proj", fused["experts.gate_up_proj"][e, :config.moe_intermediate_size]),
                        ("up_proj", fused["experts.gate_up_proj"][e, config.moe_intermediate_size:]),
                        ("down_proj", fused["experts.down_proj"][e])):
            name = f"{prefix}experts.{e}.{proj}.weight"
            sd[name], sd[name + "_scale_inv"] = hf_quantize(w)
            parts[proj] = hf_dequantize(sd[name], sd[name + "_scale_inv"])
        gate_up.append(torch.cat([parts["gate_proj"], parts["up_proj"]]))
        down.append(parts["down_proj"])
    dequantized["experts.gate_up_proj"], dequantized["experts.down_proj"] = torch.stack(gate_up), torch.stack(down)
    block.load_state_dict(dequantized)
    # Qwen2-MoE's shared-expert gate, a [1, D] linear, left unquantized as a release would name it.
    quant = {**FP8, "modules_to_not_convert": ["shared_expert_gate"]}
    return {**config.to_dict(), "quantization_config": quant}, sd, block, prefix


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """A save_pretrained-style directory (config.json, model.safetensors) of one FP8 MoE block."""
    config, sd, block, prefix = fp8_checkpoint(request.param)
    path = tmp_path_factory.mktemp(request.param)
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return request.param, config, block, prefix, path


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _same_bits(ours: np.ndarray, theirs: np.ndarray, name: str) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (name, ours.dtype, theirs.dtype)
    assert np.array_equal(np.ascontiguousarray(ours).view(np.uint8), np.ascontiguousarray(theirs).view(np.uint8)), name


def _recipe(moe: MoE, x_TD, routing) -> np.ndarray:
    """The FP8 recipe on the layer's stored weights (routed and shared), token by token: rows
    quantized per 1 x 128 tile, dequantized weight blocks, the SwiGLU output quantized again."""

    def dequantized(module, lead):  # the three stored weights, fp32, `[E, N, K]` (`[1, N, K]`: shared)
        return [dequantize_weights(Fp8Weights(getattr(module, n)[...][lead], getattr(module, n + "_scale")[...][lead]))
                for n in ("w_gate", "w_up", "w_down")]

    def q(v):
        return dequantize_rows(quantize_rows(v[None]))[0]

    def expert(v_D, wg, wu, wd):
        h_F = jax.nn.silu(jnp.dot(wg, v_D, precision=HI)) * jnp.dot(wu, v_D, precision=HI)
        return jnp.dot(wd, q(h_F), precision=HI)

    wg, wu, wd = dequantized(moe, ...)
    outs_TKD = jax.vmap(lambda v, es: jax.vmap(lambda e: expert(q(v), wg[e], wu[e], wd[e]))(es))(
        x_TD, routing.expert_idx_TK)
    y_TD = jnp.sum(routing.weights_TK[:, :, None] * outs_TKD, axis=1)
    if moe.shared is not None:
        sg, su, sd = (w[0] for w in dequantized(moe.shared, None))
        shared_TD = jax.vmap(lambda v: expert(q(v), sg, su, sd))(x_TD)
        if moe.shared_expert_gate:  # Qwen2-MoE: sigmoid(x W_sg^T) per token, in fp32
            shared_TD = jax.nn.sigmoid(jnp.dot(x_TD, moe.w_shared_gate[...].T, precision=HI)) * shared_TD
        y_TD = y_TD + shared_TD
    return np.asarray(y_TD)


def _shared_prefix(model_type: str) -> str:
    """The shared expert's module prefix in the block (`shared_experts.` or `shared_expert.`)."""
    return convert.specs.SPECS[model_type].names.shared


# ---------------------------------------------------------------------------------------------
# Reading: bytes as stored, outputs by the recipe, close to transformers' block


def test_checkpoint_loads_bytes_and_computes_the_recipe(checkpoint):
    model_type, config, block, prefix, path = checkpoint
    (layer, moe), = convert.from_checkpoint(path, **STORED).items()
    assert prefix == f"model.layers.{layer}.mlp."
    sd = fp8_checkpoint(model_type)[1]
    for ours, proj in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        values, scale = np.asarray(getattr(moe, ours)[...]), np.asarray(getattr(moe, ours + "_scale")[...])
        assert isinstance(getattr(moe, ours), Fp8Stored) and values.dtype == jnp.float8_e4m3fn
        file_values = np.stack([convert.hf.host_array(sd[f"{prefix}experts.{e}.{proj}.weight"]) for e in range(4)])
        file_scale = np.stack([_np(sd[f"{prefix}experts.{e}.{proj}.weight_scale_inv"]) for e in range(4)])
        _same_bits(values, file_values, ours)
        _same_bits(scale, file_scale, ours + "_scale")
        if moe.shared is not None:  # the shared experts: stored FP8 too, the file's bytes
            assert isinstance(getattr(moe.shared, ours), Fp8Stored)
            _same_bits(np.asarray(getattr(moe.shared, ours)[...]),
                       convert.hf.host_array(sd[f"{prefix}{_shared_prefix(model_type)}{proj}.weight"]),
                       "shared." + ours)
            _same_bits(np.asarray(getattr(moe.shared, ours + "_scale")[...]),
                       _np(sd[f"{prefix}{_shared_prefix(model_type)}{proj}.weight_scale_inv"]), f"shared.{ours}_scale")
    np.testing.assert_array_equal(np.asarray(moe.w_router[...]), _np(sd[prefix + "gate.weight"]))

    x = np.random.default_rng(1).standard_normal((2, 6, D)).astype(np.float32)
    y, _, routing = moe(jnp.asarray(x), return_routing=True)
    want = _recipe(moe, jnp.asarray(x.reshape(-1, D)), routing).reshape(x.shape)
    assert _rel(y, want) < 1e-5, f"{model_type}: stored FP8 layer vs the recipe on the file's weights {_rel(y, want):.2e}"
    with exact_torch(0), torch.no_grad():
        y_hf = block(torch.from_numpy(x))
    rel = _rel(y, _np(y_hf[0] if isinstance(y_hf, tuple) else y_hf))
    # Weights identical (dequantized); the layer's rows are e4m3 too (inputs and SwiGLU outputs).
    assert rel < 0.06, f"{model_type}: stored FP8 layer vs transformers on the dequantized weights {rel:.4f}"


def test_master_weight_layer_reads_the_dequantized_weights(checkpoint):
    """Without stored weights the experts arrive dequantized (transformers' formula) as master weights."""
    model_type, config, block, prefix, path = checkpoint
    (_, moe), = convert.from_checkpoint(path, gemm=GemmOptions(backend="xla", precision=HI)).items()
    hf = block.state_dict()
    f = config["moe_intermediate_size"]
    np.testing.assert_array_equal(np.asarray(moe.w_gate[...]), _np(hf["experts.gate_up_proj"][:, :f]))
    np.testing.assert_array_equal(np.asarray(moe.w_down[...]), _np(hf["experts.down_proj"]))
    if moe.shared is not None:
        np.testing.assert_array_equal(np.asarray(moe.shared.w_down[...]),
                                      _np(hf[f"{_shared_prefix(model_type)}down_proj.weight"]))
    x = np.random.default_rng(2).standard_normal((1, 8, D)).astype(np.float32)
    with exact_torch(0), torch.no_grad():
        y_hf = block(torch.from_numpy(x))
    y_hf = _np(y_hf[0] if isinstance(y_hf, tuple) else y_hf)
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x))[0]), y_hf, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Writing: bit for bit


def test_round_trip_is_bit_for_bit(checkpoint):
    model_type, config, _, prefix, path = checkpoint
    sd = {k: convert.hf.host_array(v) for k, v in fp8_checkpoint(model_type)[1].items()}
    moe = convert.from_state_dict(sd, config, prefix=prefix, **STORED)
    written = convert.to_state_dict(moe, config, prefix=prefix, layout="per_expert")
    assert set(written) == set(sd)
    for name, value in written.items():  # routed and shared experts, router, bias: the file's bytes
        _same_bits(value, sd[name], name)
    # A master-weight layer: the shared experts dequantized on read, quantized again on write.
    master = convert.to_state_dict(convert.from_state_dict(sd, config, prefix=prefix,
                                                           gemm=GemmOptions(backend="xla")),
                                   config, prefix=prefix, layout="per_expert")
    shared = _shared_prefix(model_type) or "(none)"
    for name in (n for n in master if "." + shared in n and n.endswith("proj.weight")):
        _same_bits(master[name], sd[name], name)  # the same e4m3 values ...
        np.testing.assert_allclose(master[name + "_scale_inv"], sd[name + "_scale_inv"], rtol=3e-7, atol=0,
                                   err_msg=name)  # ... and scales to fp32 rounding (amax / 448 of w = q * s)
    # Through safetensors files (save_file of NumPy e4m3 writes F8_E4M3, which from_checkpoint reads).
    out = path.parent / f"{model_type}-written"
    out.mkdir(exist_ok=True)
    save_numpy(written, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    (_, again), = convert.from_checkpoint(out, **STORED).items()
    _same_bits(np.asarray(again.w_down[...]), np.asarray(moe.w_down[...]), "w_down")
    _same_bits(np.asarray(again.w_up_scale[...]), np.asarray(moe.w_up_scale[...]), "w_up_scale")


def test_fused_layout_round_trip_and_torch_tensors():
    """transformers' in-memory FP8 experts (`experts.gate_up_proj` with `gate_up_proj_scale_inv`,
    gate blocks first) when F is a multiple of 128; torch e4m3 tensors are read bit for bit."""
    config, sd, _, prefix = fp8_checkpoint("qwen3_moe")
    per_expert = convert.from_state_dict(sd, config, prefix=prefix, **STORED)
    fused = convert.to_state_dict(per_expert, config, layout="fused")
    assert fused["experts.gate_up_proj"].shape == (4, 256, D) and fused["experts.gate_up_proj_scale_inv"].shape == (4, 2, 2)
    moe = convert.from_state_dict({k: torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn)
                                   if v.dtype == jnp.float8_e4m3fn else torch.from_numpy(v) for k, v in fused.items()},
                                  config, **STORED)
    for name, value in convert.to_state_dict(moe, config, layout="fused").items():
        _same_bits(value, fused[name], name)


def test_bf16_checkpoint_into_stored_layer_and_fp8_export():
    """Serving an unquantized checkpoint in FP8: quantized once on read (as `stored_fp8` does), and
    written as an FP8 checkpoint under an FP8 config; a master-weight layer exports FP8 too."""
    config, _, block, _ = fp8_checkpoint("deepseek_v3")
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    sd = block.state_dict()
    stored = convert.from_state_dict(sd, plain, **STORED)
    master = convert.from_state_dict(sd, plain, gemm=GemmOptions(backend="xla"))
    quantized = stored_fp8(master)
    for name in ("w_gate", "w_gate_scale", "w_down", "w_down_scale"):
        _same_bits(np.asarray(getattr(stored, name)[...]), np.asarray(getattr(quantized, name)[...]), name)
        _same_bits(np.asarray(getattr(stored.shared, name)[...]), np.asarray(getattr(quantized.shared, name)[...]),
                   "shared." + name)
    written = convert.to_state_dict(master, config, layout="per_expert")
    assert written["experts.3.down_proj.weight"].dtype == jnp.float8_e4m3fn
    assert written["shared_experts.up_proj.weight_scale_inv"].shape == (2, 2)
    for name, value in convert.to_state_dict(stored, config, layout="per_expert").items():
        _same_bits(value, written[name], name)
    # modules_to_not_convert keeps a module unquantized, matched on the full name as transformers does.
    keep = {**config, "quantization_config": {**FP8, "modules_to_not_convert": ["model.layers.1.mlp.shared_experts"]}}
    kept = convert.to_state_dict(stored, keep, prefix="model.layers.1.mlp.", layout="per_expert")
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv" not in kept
    # The stored shared experts dequantized (`values * scale` in fp32), the master layer's unquantized.
    _same_bits(kept["model.layers.1.mlp.shared_experts.up_proj.weight"],
               np.asarray(dequantize_weights(Fp8Weights(stored.shared.w_up[...][None],
                                                        stored.shared.w_up_scale[...][None]))[0]), "up_proj")
    from_master = convert.to_state_dict(master, keep, prefix="model.layers.1.mlp.", layout="per_expert")
    _same_bits(from_master["model.layers.1.mlp.shared_experts.up_proj.weight"], np.asarray(master.shared.w_up[...]),
               "up_proj")
    assert kept["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == jnp.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# The stored-weight layer


def test_stored_fp8_equals_master_and_is_frozen():
    master = MoE(D, F, 4, 2, gemm=GemmOptions(backend="xla", quantization=Fp8Blockwise()), rngs=nnx.Rngs(0))
    stored = stored_fp8(master)
    assert stored.gemm.quantization == Fp8Blockwise(weights="stored") and master.fp8_stored is False
    assert stored.w_gate_scale[...].shape == (4, 2, 2) and stored.w_down_scale[...].shape == (4, 2, 2)
    params = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(stored, nnx.Param))}
    assert params == {"w_router"}  # the experts are Fp8Stored variables, not nnx.Param
    x = jax.random.normal(jax.random.key(1), (2, 12, D), jnp.float32)

    def loss(moe, x):
        return jnp.sum(moe(x)[0] ** 2)

    # Master weights quantized per call from fp32 are the stored blocks: same outputs, same dx.
    np.testing.assert_array_equal(np.asarray(stored(x)[0]), np.asarray(master(x)[0]))
    dx_stored = jax.grad(loss, argnums=1)(stored, x)
    np.testing.assert_array_equal(np.asarray(dx_stored), np.asarray(jax.grad(loss, argnums=1)(master, x)))
    assert np.any(np.asarray(dx_stored) != 0)
    grads = nnx.grad(loss)(stored, x)
    assert {".".join(map(str, k)) for k, _ in nnx.to_flat_state(grads)} == {"w_router"}
    # A fused master layer gives the same stored weights.
    fused = MoE(D, F, 4, 2, gemm=GemmOptions(backend="xla", fused_gate_up=True), rngs=nnx.Rngs(0))
    _same_bits(np.asarray(stored_fp8(fused).w_up[...]), np.asarray(stored.w_up[...]), "w_up")
    # Built directly: the random master weights quantized.
    direct = MoE(D, F, 4, 2, **STORED, rngs=nnx.Rngs(0))
    _same_bits(np.asarray(direct.w_down_scale[...]), np.asarray(stored.w_down_scale[...]), "w_down_scale")


def test_bf16_layer_quantizes_its_fp32_master_weights_as_stored_fp8_does():
    """bf16 compute over fp32 master weights (the layer's default `param_dtype`): each call
    quantizes the fp32 values themselves, as `stored_fp8` does once, so the training layer and its
    stored copy compute the same forward and input gradient (quantizing a bf16 cast of the weights
    first would round twice and differ)."""
    master = MoE(D, F, 4, 2, dtype=jnp.bfloat16, gemm=GemmOptions(backend="xla", quantization=Fp8Blockwise()),
                 rngs=nnx.Rngs(0))
    assert master.w_gate[...].dtype == jnp.float32
    stored = stored_fp8(master)
    x = jax.random.normal(jax.random.key(1), (2, 12, D), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(stored(x)[0]), np.asarray(master(x)[0]))

    def loss(moe, x):
        return jnp.sum(moe(x)[0].astype(jnp.float32) ** 2)

    np.testing.assert_array_equal(np.asarray(jax.grad(loss, argnums=1)(stored, x)),
                                  np.asarray(jax.grad(loss, argnums=1)(master, x)))
    g = nnx.grad(loss)(master, x)
    assert g.w_gate[...].dtype == jnp.float32 and bool(jnp.any(g.w_gate[...] != 0))


@pytest.mark.slow
def test_stored_expert_parallel_equals_one_device():
    """ep = 2 with stored routed and shared experts (the shared ones replicated, run on each
    device's tokens) equals one device, input gradient included."""
    kwargs = dict(shared_experts=SharedExperts(count=1, d_ff=F), **STORED)
    with jax.default_device(jax.devices("cpu")[0]):  # the mesh's kind of device (also in a GPU process)
        x = jax.random.normal(jax.random.key(2), (32, D), jnp.float32)
        one = MoE(D, 256, 4, 2, **kwargs, rngs=nnx.Rngs(0))
        mesh = make_mesh(ep=2, data=1, devices=jax.devices("cpu")[:2])
        ep = MoE(D, 256, 4, 2, **kwargs, mesh=mesh, rngs=nnx.Rngs(0))

        def dx(moe):
            return jax.grad(lambda x: jnp.sum(moe(x)[0] ** 2))(x)

        assert ep.w_gate_scale[...].sharding.spec == ep.w_gate[...].sharding.spec
        assert ep.shared.w_gate_scale[...].sharding.spec == P(None, None)
        assert _rel(ep(x)[0], one(x)[0]) < 1e-5
        # The input gradient quantizes fp32 sums whose order differs with the rows per device: an
        # element on an e4m3 rounding boundary moves by a whole step (as in tests/test_fp8_layer.py).
        assert _rel(dx(ep), dx(one)) < 1e-3


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("quant, message", [
    (dict(quant_method="awq"), "quant_method='awq': moe_jax.convert reads Hugging Face blockwise FP8"),
    ({**FP8, "weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\]: .*blockwise FP8 checkpoints only"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme='static'"),
    ({**FP8, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**FP8, "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
], ids=["awq", "block_size", "static", "e5m2", "ue8m0"])
def test_unsupported_quantization_names_what_is_supported(quant, message):
    config_cls, _, _, fields = CONFIGS["qwen3_moe"]
    config = {**config_cls(**_TINY, **fields).to_dict(), "quantization_config": quant}
    with pytest.raises(ValueError, match=message):
        convert.moe_config(config)


def test_checkpoint_tensor_errors():
    config, sd, _, prefix = fp8_checkpoint("qwen3_moe")
    sd = {k: convert.hf.host_array(v) for k, v in sd.items()}
    name = prefix + "experts.1.up_proj.weight"

    def read(**changes):
        convert.from_state_dict({k: v for k, v in {**sd, **changes}.items() if v is not None}, config, prefix=prefix,
                                **STORED)

    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.1.up_proj.weight' is e4m3 but its block scales "
                                         r"'model.layers.0.mlp.experts.1.up_proj.weight_scale_inv' are missing"):
        read(**{name + "_scale_inv": None})
    with pytest.raises(ValueError, match=r"up_proj.weight_scale_inv' has shape \(2, 2\), expected \(1, 2\)"):
        read(**{name + "_scale_inv": np.ones((2, 2), np.float32)})
    with pytest.raises(TypeError, match="have dtype bfloat16; blockwise FP8 checkpoints store them in float32"):
        read(**{name + "_scale_inv": sd[name + "_scale_inv"].astype(jnp.bfloat16)})
    with pytest.raises(TypeError, match="has dtype float8_e5m2; blockwise FP8 checkpoints store e4m3"):
        read(**{name: sd[name].astype(np.float32).astype(jnp.float8_e5m2)})
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.\{e\}.up_proj.weight' is e4m3 for experts "
                                         r"\[0, 2, 3\] only"):
        read(**{name: sd[name].astype(np.float32), name + "_scale_inv": None})
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with pytest.raises(TypeError, match="has dtype float8_e4m3fn but the config has no quantization_config"):
        convert.from_state_dict(sd, plain, prefix=prefix)
    # A scale beside an unquantized weight would be dropped silently: refused.
    gate = prefix + "gate.weight"
    with pytest.raises(ValueError, match="unrecognised tensors under prefix 'model.layers.0.mlp.': "
                                         "model.layers.0.mlp.gate.weight_scale_inv"):
        read(**{gate + "_scale_inv": np.ones((1, 2), np.float32)})


def test_layout_and_layer_errors():
    config, sd, _, prefix = fp8_checkpoint("deepseek_v3")  # F = 192: gate and up blocks straddle when fused
    moe = convert.from_state_dict(sd, config, prefix=prefix, **STORED)
    with pytest.raises(ValueError, match="layout='fused' FP8 experts with d_ff=192 .* write layout='per_expert'"):
        convert.to_state_dict(moe, config, layout="fused")
    # A fused FP8 stack of this F: its 3 row blocks of 128 mix gate (192 rows) and up rows.
    fused = {k: v for k, v in convert.to_state_dict(moe, config, layout="per_expert").items()
             if not k.startswith("experts.")}
    fused.update({"experts.gate_up_proj": np.zeros((4, 2 * F, D), jnp.float8_e4m3fn),
                  "experts.gate_up_proj_scale_inv": np.ones((4, 3, 2), np.float32),
                  "experts.down_proj": np.asarray(moe.w_down[...]),
                  "experts.down_proj_scale_inv": np.asarray(moe.w_down_scale[...])})
    with pytest.raises(ValueError, match="fused FP8 experts.gate_up_proj with d_ff=192 .* per-expert checkpoint layout"):
        convert.from_state_dict(fused, config, **STORED)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with pytest.raises(ValueError, match="holds stored FP8 expert weights .* no quantization_config; .*FP8_QUANTIZATION"):
        convert.to_state_dict(moe, plain)
    with pytest.raises(ValueError, match=r"Fp8Blockwise.weights='int8': use one of \('master', 'stored'\)"):
        Fp8Blockwise(weights="int8")
    with pytest.raises(ValueError, match=r"quantization=Fp8Blockwise\(weights='stored', input_gradient='fp8'\)\) needs separate gate and up"):
        GemmOptions(backend="xla", fused_gate_up=True, quantization=Fp8Blockwise(weights="stored"))
    with pytest.raises(TypeError, match="stored_fp8.moe.: moe must be a moe_jax.layers.MoE; got dict"):
        stored_fp8({})
    with pytest.raises(ValueError, match="already holds stored FP8 expert weights"):
        stored_fp8(moe)
    table = BackendTable.of({("gmm_nt", "decode"): ("xla",)})
    with pytest.raises(ValueError, match="does not run; use one of"):
        stored_fp8(MoE(D, F, 4, 2, gemm=GemmOptions(backend=table), rngs=nnx.Rngs(0)))
    mesh = make_mesh(ep=2, etp=2, data=1, devices=jax.devices("cpu")[:4])
    with pytest.raises(ValueError, match=r"expert tensor parallelism of size 2 needs d_ff=192 to be a multiple of "
                                         r"128 \* 2"):
        MoE(D, F, 4, 2, **STORED, mesh=mesh, axis_rules=AxisRules(expert_tensor="etp"), rngs=nnx.Rngs(0))
    w = Fp8Weights(moe.w_gate[...], moe.w_gate_scale[...])
    with pytest.raises(TypeError, match="must be all master weights or all Fp8Weights"):
        swiglu_experts_fp8(jnp.zeros((4, D)), jnp.array([4, 0, 0, 0]), w, moe.w_up[...].astype(jnp.float32), w)
    w_FD = jnp.zeros((F, D))
    with pytest.raises(ValueError, match=r"Fp8SwiGLU: w_down must be a 2-D weight matrix; got shape \(1, 160, 192\)"):
        Fp8SwiGLU(w_FD, w_FD, jnp.zeros((1, D, F)))
    with pytest.raises(ValueError, match=r"w_down_DF \(192, 160\) must be \[F, D\], \[F, D\] and \[D, F\]"):
        Fp8SwiGLU(w_FD, w_FD, w_FD)


def test_stored_layer_runs_every_projection_on_the_fp8_kernel_for_a_gpu():
    """Lowered for an H200 at a prefill shape on `auto`: the three routed and the three shared
    projections are FP8 kernels reading the stored weights (Mosaic GPU custom calls), and no weight
    is quantized in the call."""
    m = MoE(512, 384, 8, 2, shared_experts=SharedExperts(count=1, d_ff=256),
            gemm=GemmOptions(backend="auto", quantization=Fp8Blockwise(weights="stored")), rngs=nnx.Rngs(0))
    graph, state = nnx.split(m)
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    text = lower_for_gpu(lambda s, x: nnx.merge(graph, s)(x)[0], avals,
                         jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 6, text.count("stablehlo.custom_call @mosaic_gpu")
    assert 'name = "moe_jax_quantize_weights"' not in text
