"""moe_jax.convert against transformers' own MoE blocks (Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V3).

Parity runs in fp32 on tiny random configs: our layer on XLA at HIGHEST precision, torch on CPU
without TF32, the same input and upstream gradient; outputs and the gradients of the input and of
every HF parameter (ours mapped to HF names through `to_state_dict`) must agree to the fp32
tolerance. Round trips HF -> moe_jax -> HF are bit for bit, in both layouts; checkpoints are the
ones `save_pretrained` writes (per-expert tensors, sharded with an index file or not).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from moe_jax import GemmOptions, MoE, SharedExperts, convert, routing
from moe_jax.parallel import AxisRules, EPOptions, make_mesh
from moe_jax.parallel.placement import Placement
from moe_jax.parallel.replicas import physical_weights
from moe_jax.testing import assert_close

_HI = jax.lax.Precision.HIGHEST
OURS = dict(gemm=GemmOptions(backend="xla", precision=_HI))
OURS_FUSED = dict(gemm=GemmOptions(backend="xla", precision=_HI, fused_gate_up=True))

# Tiny decoder settings every model shares (eager attention and experts: deterministic on CPU).
_COMMON = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
               attn_implementation="eager", experts_implementation="eager")

# model_type -> (config class, causal LM class, MoE block class, config fields, MoE decoder layers).
MODELS = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, MixtralSparseMoeBlock,
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2), (0, 1)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock,
                  dict(intermediate_size=40, moe_intermediate_size=12, num_experts=6, num_experts_per_tok=2,
                       norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]), (0, 2)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen2MoeSparseMoeBlock,
                  dict(intermediate_size=40, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=4,
                       decoder_sparse_step=2), (1, 3)),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3MoE,
                    dict(intermediate_size=40, moe_intermediate_size=12, n_routed_experts=8, n_group=4, topk_group=2,
                         num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=2.5, num_hidden_layers=3,
                         first_k_dense_replace=1, num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8,
                         qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4), (1, 2)),
}
MODEL_TYPES = list(MODELS)


def make_config(model_type: str, **overrides):
    config_cls, _, _, fields, _ = MODELS[model_type]
    return config_cls(**{**_COMMON, **fields, **overrides})


@contextlib.contextmanager
def exact_torch(seed: int):
    """fp32 torch at full precision (no TF32, deterministic kernels), seeded; settings restored."""
    flags = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]
    saved = [getattr(o, f) for o, f in flags], torch.are_deterministic_algorithms_enabled()
    for o, f in flags:
        setattr(o, f, False)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        for (o, f), v in zip(flags, saved[0]):
            setattr(o, f, v)
        torch.use_deterministic_algorithms(saved[1])


@torch.no_grad()
def randomize(block: torch.nn.Module) -> None:
    """Weights of unit-scale activations (empty/zero otherwise: the blocks are built uninitialised),
    a router with decisive logits, and DeepSeek's correction bias nonzero so the bias path runs."""
    for name, p in block.named_parameters():
        fan_in = p.shape[-1]
        p.normal_(std=(1.0 if name == "gate.weight" else 1.0 / fan_in**0.5))
    if hasattr(block.gate, "e_score_correction_bias"):
        block.gate.e_score_correction_bias.normal_(std=0.1)


def hf_block(model_type: str, seed: int = 0):
    config = make_config(model_type)
    with exact_torch(seed):
        block = MODELS[model_type][2](config).eval()
        randomize(block)
    return block, config


@functools.partial(jax.jit, static_argnums=0)
def _ours_value_and_grad(graphdef, params, rest, x, dy):
    def loss(params, x):
        y, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y * dy), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads


@functools.partial(jax.jit, static_argnums=0)
def _ours_forward(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)[0]


def ours_forward(moe: MoE, x: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(moe)
    return np.asarray(_ours_forward(graphdef, state, jnp.asarray(x)))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


# ---------------------------------------------------------------------------------------------
# Parity with transformers' blocks: output, input gradient, every weight gradient


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_parity_with_hf_block(model_type):
    block, config = hf_block(model_type)
    with exact_torch(1):
        x = torch.randn(2, 5, config.hidden_size, requires_grad=True)
        dy = torch.randn(2, 5, config.hidden_size)
        y = block(x)
        y = y[0] if isinstance(y, tuple) else y  # older blocks return (hidden, router_logits)
        (y * dy).sum().backward()

    moe = convert.from_hf(block, config, **OURS)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    y_ours, (d_params, dx_ours) = _ours_value_and_grad(graphdef, params, rest, jnp.asarray(_np(x)),
                                                       jnp.asarray(_np(dy)))
    assert_close(y_ours, _np(y), "float32", f"{model_type} y")
    assert_close(dx_ours, _np(x.grad), "float32", f"{model_type} dx")

    d_hf = convert.to_state_dict(nnx.merge(graphdef, d_params, rest), config)
    hf_params = dict(block.named_parameters())
    assert set(hf_params) <= set(d_hf)
    for name, p in hf_params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert_close(d_hf[name], _np(p.grad), "float32", f"{model_type} d[{name}]")
    if model_type == "deepseek_v3":  # the bias changed routing: without it the output differs
        moe.selection_bias[...] = jnp.zeros_like(moe.selection_bias[...])
        assert not np.allclose(ours_forward(moe, _np(x)), _np(y), atol=1e-4)


def test_deepseek_config_json_without_groups_reads_transformers_defaults():
    """A DeepSeek-V3 config.json that omits n_group/topk_group is transformers' 8/4 (DeepseekV3Config's
    defaults), not an ungrouped 1/1: the converted layer computes what the HF block computes."""
    fields = {k: v for k, v in MODELS["deepseek_v3"][3].items() if k not in ("n_group", "topk_group")}
    config = DeepseekV3Config(**{**_COMMON, **fields, "n_routed_experts": 16})
    assert (config.n_group, config.topk_group) == (8, 4)
    config_json = {k: v for k, v in config.to_dict().items() if k not in ("n_group", "topk_group")}
    assert convert.moe_config(config_json)["router"] == routing.SigmoidGroupedTopK(
        2, n_group=8, topk_group=4, normalize=True, routed_scaling_factor=2.5)
    with exact_torch(4):
        block = DeepseekV3MoE(config).eval()
        randomize(block)
        x = torch.randn(4, 8, config.hidden_size)
        y = block(x)
    moe = convert.from_state_dict(block.state_dict(), config_json, **OURS)
    assert_close(ours_forward(moe, _np(x)), _np(y[0] if isinstance(y, tuple) else y), "float32", "deepseek_v3 y")


def test_config_maps_to_routers():
    assert convert.moe_config(make_config("mixtral")) == dict(
        d_model=16, d_ff=24, num_experts=4, top_k=2, router=routing.SelectedSoftmax(2))
    assert convert.moe_config(make_config("qwen3_moe"))["router"] == routing.SoftmaxTopK(2, renormalize=True)
    assert convert.moe_config(make_config("qwen2_moe")) == dict(
        d_model=16, d_ff=12, num_experts=4, top_k=2, router=routing.SoftmaxTopK(2, renormalize=False),
        shared_experts=SharedExperts(1, d_ff=20, gate=True))
    assert convert.moe_config(make_config("deepseek_v3")) == dict(
        d_model=16, d_ff=12, num_experts=8, top_k=2, shared_experts=SharedExperts(2, d_ff=24),
        router=routing.SigmoidGroupedTopK(2, n_group=4, topk_group=2, normalize=True, routed_scaling_factor=2.5))
    # A config.json dict reads the same as the config object.
    for model_type in MODEL_TYPES:
        config = make_config(model_type)
        assert convert.moe_config(config.to_dict()) == convert.moe_config(config)
        assert convert.moe_layers(config) == MODELS[model_type][4]


# ---------------------------------------------------------------------------------------------
# Exact round trips


def _assert_same(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        assert np.array_equal(ours[name].view(np.uint8), np.ascontiguousarray(value).view(np.uint8)), name


@pytest.mark.parametrize("fused_gate_up", [False, True])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_round_trip_fused_layout(model_type, fused_gate_up):
    """The in-memory names of transformers >= 5 (experts.gate_up_proj / experts.down_proj)."""
    block, config = hf_block(model_type)
    sd = {k: v.numpy() for k, v in block.state_dict().items()}
    moe = convert.from_state_dict(sd, config, gemm=GemmOptions(fused_gate_up=fused_gate_up))
    _assert_same(convert.to_state_dict(moe, config), sd)
    # And a block loads it back (strict: every name, no extra).
    fresh = MODELS[model_type][2](config)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in convert.to_state_dict(moe, config).items()})


def test_round_trip_bfloat16_torch_tensors():
    block, config = hf_block("deepseek_v3")
    sd = {k: (v if "e_score" in k else v.bfloat16()) for k, v in block.state_dict().items()}
    want = {k: np.asarray(v.float().numpy(), jnp.bfloat16 if v.dtype == torch.bfloat16 else np.float32)
            for k, v in sd.items()}
    # bf16 parameters: bit for bit.
    moe = convert.from_state_dict(sd, config, param_dtype=jnp.bfloat16)
    assert moe.w_gate[...].dtype == jnp.bfloat16 and moe.selection_bias[...].dtype == jnp.float32
    _assert_same(convert.to_state_dict(moe, config), want)
    # fp32 parameters hold bf16 values exactly; casting back recovers them (the fp32 bias too).
    moe32 = convert.from_state_dict(sd, config)
    assert moe32.w_gate[...].dtype == jnp.float32
    back = convert.to_state_dict(moe32, config, dtype=jnp.bfloat16)
    _assert_same({k: (v.astype(np.float32) if "e_score" in k else v) for k, v in back.items()}, want)


def test_from_hf_reads_the_blocks_own_config():
    block, config = hf_block("qwen2_moe")
    moe = convert.from_hf(block)
    assert moe.num_experts == 4 and moe.shared_expert_gate and moe.router == routing.SoftmaxTopK(2)


def test_weights_land_on_the_mesh_layout():
    """With a mesh, experts are split over `ep` and the rest replicated, as `MoE` lays them out."""
    sd, config = _mixtral_sd()
    mesh = make_mesh(ep=2, data=1, devices=jax.devices("cpu")[:2])
    moe = convert.from_state_dict(sd, config, mesh=mesh, **OURS)
    assert moe.w_gate[...].sharding.spec == P("ep", None, None)
    assert moe.w_down[...].sharding.spec == P("ep", None, None)
    assert moe.w_router[...].sharding.spec == P(None, None)
    _assert_same(convert.to_state_dict(moe, config), sd)


@pytest.mark.parametrize("ours", [OURS, OURS_FUSED], ids=["separate", "fused"])
def test_weights_land_on_an_expert_tensor_mesh(ours):
    """Under EP x ETP the hidden dims split over "etp"; a fused gate/up is stored in per-shard
    blocks (each rank's rows are its [gate slice; up slice]); the round trip stays bit for bit."""
    sd, config = _mixtral_sd()
    mesh = make_mesh(ep=2, etp=2, data=1, devices=jax.devices("cpu")[:4])
    moe = convert.from_state_dict(sd, config, mesh=mesh, axis_rules=AxisRules(expert_tensor="etp"), **ours)
    assert moe.w_down[...].sharding.spec == P("ep", None, "etp")
    if moe.fused_gate_up:
        assert moe.w_gate_up[...].sharding.spec == P("ep", "etp", None)
        e, two_f, _ = sd["experts.gate_up_proj"].shape
        f = two_f // 2
        shard = next(s for s in moe.w_gate_up[...].addressable_shards if s.index[1].start == 0 and s.index[0].start == 0)
        np.testing.assert_array_equal(
            shard.data, np.concatenate([sd["experts.gate_up_proj"][: e // 2, : f // 2],
                                        sd["experts.gate_up_proj"][: e // 2, f: f + f // 2]], axis=1))
    _assert_same(convert.to_state_dict(moe, config), sd)


def test_placed_layer_holds_a_copy_per_slot_and_writes_logical_experts():
    """With `EPOptions(placement=...)` each physical slot gets its logical expert's tensors, the
    layer computes what the unplaced one does, and `to_state_dict` writes the logical experts."""
    sd, config = _mixtral_sd()
    placement = Placement(np.array([[0, 1, 2], [0, 3, 1]]), 4)  # experts 0 and 1 replicated
    mesh = make_mesh(ep=2, data=1, devices=jax.devices("cpu")[:2])
    moe = convert.from_state_dict(sd, config, mesh=mesh, expert_parallel=EPOptions(placement=placement), **OURS)
    plain = convert.from_state_dict(sd, config, **OURS)
    assert moe.w_gate[...].shape[0] == 6 and moe.w_gate[...].sharding.spec == P("ep", None, None)
    np.testing.assert_array_equal(moe.w_down[...], physical_weights(np.asarray(plain.w_down[...]), placement))
    _assert_same(convert.to_state_dict(moe, config), sd)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, moe.d_model))
    assert_close(moe(x)[0], plain(x)[0], jnp.float32, "placed vs plain")


# ---------------------------------------------------------------------------------------------
# save_pretrained checkpoints (per-expert tensors), layer by layer


@pytest.fixture(scope="module", params=MODEL_TYPES)
def saved_model(request, tmp_path_factory):
    """(model_type, causal LM, its config, checkpoint dir): random MoE weights, sharded with an index
    file for Mixtral and DeepSeek-V3, one model.safetensors for the Qwens."""
    model_type = request.param
    config = make_config(model_type)
    with exact_torch(2):
        model = MODELS[model_type][1](config).eval()
        for i in MODELS[model_type][4]:
            randomize(model.model.layers[i].mlp)
    path = tmp_path_factory.mktemp(model_type)
    sharded = model_type in ("mixtral", "deepseek_v3")
    model.save_pretrained(path, **(dict(max_shard_size="20KB") if sharded else {}))
    assert (path / "model.safetensors.index.json").exists() == sharded
    return model_type, model, config, path


def test_from_checkpoint_matches_each_block(saved_model):
    model_type, model, config, path = saved_model
    moes = convert.from_checkpoint(path, **(OURS_FUSED if model_type == "deepseek_v3" else OURS))
    assert sorted(moes) == list(MODELS[model_type][4])
    rng = np.random.default_rng(3)
    for layer, moe in moes.items():
        block = model.model.layers[layer].mlp
        assert isinstance(block, MODELS[model_type][2])
        x = rng.standard_normal((2, 4, config.hidden_size)).astype(np.float32)
        with exact_torch(0), torch.no_grad():
            y = block(torch.from_numpy(x))
        assert_close(ours_forward(moe, x), _np(y[0] if isinstance(y, tuple) else y), "float32",
                     f"{model_type} layer {layer}")
    # `layers=` reads just those.
    last = MODELS[model_type][4][-1]
    assert list(convert.from_checkpoint(path, layers=[last], **OURS)) == [last]


def test_round_trip_per_expert_layout(saved_model):
    """The names `save_pretrained` wrote (experts.{e}.*, Mixtral under block_sparse_moe.), bit for bit."""
    model_type, _, config, path = saved_model
    files = sorted(path.glob("*.safetensors"))
    on_disk = {k: v for f in files for k, v in load_file(f).items()}
    for layer in MODELS[model_type][4]:
        prefix = convert.block_prefix(config, layer, layout="per_expert")
        block_sd = {k: v for k, v in on_disk.items() if k.startswith(prefix)}
        assert f"{prefix}experts.0.{'w1' if model_type == 'mixtral' else 'gate_proj'}.weight" in block_sd
        moe = convert.from_state_dict(on_disk, config, prefix=prefix)
        _assert_same(convert.to_state_dict(moe, config, prefix=prefix, layout="per_expert"), block_sd)


# ---------------------------------------------------------------------------------------------
# Errors


def _mixtral_sd():
    block, config = hf_block("mixtral")
    return {k: v.numpy() for k, v in block.state_dict().items()}, config


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported model_type 'llama'.*mixtral, qwen3_moe, qwen2_moe, deepseek_v3"):
        convert.moe_config({"model_type": "llama", "hidden_size": 16})


def test_missing_tensor_is_named_with_what_was_found():
    sd, config = _mixtral_sd()
    del sd["experts.down_proj"]
    with pytest.raises(ValueError, match=r"missing tensor 'experts.down_proj'; found under prefix '': "
                                         r"experts.gate_up_proj, gate.weight"):
        convert.from_state_dict(sd, config)
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.mlp.gate.weight'.*found under prefix "
                                         r"'model.layers.0.mlp.': nothing"):
        convert.from_state_dict(sd, config, prefix="model.layers.0.mlp.")
    # Per expert: the first absent expert is named.
    per_expert = convert.to_state_dict(convert.from_state_dict(_mixtral_sd()[0], config), config, layout="per_expert")
    del per_expert["experts.3.w2.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'experts.3.w2.weight'"):
        convert.from_state_dict(per_expert, config)


def test_misshapen_tensor_names_expected_and_got():
    sd, config = _mixtral_sd()
    sd["gate.weight"] = np.zeros((4, 17), np.float32)
    with pytest.raises(ValueError, match=r"'gate.weight' has shape \(4, 17\), expected \(4, 16\)"):
        convert.from_state_dict(sd, config)
    sd, config = _mixtral_sd()
    sd["experts.gate_up_proj"] = sd["experts.gate_up_proj"][:, :24]  # gate only
    with pytest.raises(ValueError, match=r"'experts.gate_up_proj' has shape \(4, 24, 16\), expected \(4, 48, 16\)"):
        convert.from_state_dict(sd, config)


def test_unrecognised_and_mixed_tensors_are_refused():
    sd, config = _mixtral_sd()
    with pytest.raises(ValueError, match=r"unrecognised tensors under prefix '': experts.down_proj_scale_inv"):
        convert.from_state_dict({**sd, "experts.down_proj_scale_inv": np.ones(4, np.float32)}, config)
    per_expert = convert.to_state_dict(convert.from_state_dict(sd, config), config, layout="per_expert")
    with pytest.raises(ValueError, match="both 'experts.gate_up_proj' .* and 'experts.0.w1.weight'"):
        convert.from_state_dict({**sd, **per_expert}, config)
    # Tensors outside the block's modules (attention, norms of a whole layer) are not its business.
    convert.from_state_dict({**sd, "self_attn.q_proj.weight": np.ones((16, 16), np.float32)}, config)


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("mixtral", dict(router_jitter_noise=0.1), "mixtral config router_jitter_noise=0.1: .*no router jitter"),
        ("qwen3_moe", dict(hidden_act="gelu"), "qwen3_moe config hidden_act='gelu': .*SwiGLU"),
        ("deepseek_v3", dict(scoring_func="softmax"), "deepseek_v3 config scoring_func='softmax'"),
        ("deepseek_v3", dict(topk_method="greedy"), "deepseek_v3 config topk_method='greedy'"),
        ("deepseek_v3", dict(moe_layer_freq=2), "deepseek_v3 config moe_layer_freq=2"),
        ("deepseek_v3", dict(n_group=3), "deepseek_v3 config n_group=3: must divide n_routed_experts=8"),
        ("deepseek_v3", dict(topk_group=1, num_experts_per_tok=3), "num_experts_per_tok=3: exceeds the 2 experts"),
        ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
        ("mixtral", dict(quantization_config={"quant_method": "gptq"}),
         "quant_method='gptq': moe_jax.convert reads Hugging Face blockwise FP8 checkpoints only"),
    ],
    ids=["jitter", "activation", "scoring_func", "topk_method", "moe_layer_freq", "n_group", "kept_groups",
         "no_shared", "quantized"],
)
def test_inexpressible_config_names_the_field(model_type, overrides, message):
    config = {**make_config(model_type).to_dict(), **overrides}
    with pytest.raises(ValueError, match=message):
        convert.moe_config(config)


def test_non_float_tensor_is_refused_not_cast():
    sd, config = _mixtral_sd()
    sd["gate.weight"] = sd["gate.weight"].astype(np.int32)
    with pytest.raises(TypeError, match=r"tensor 'gate.weight' has dtype int32; MoE weights are floating point"):
        convert.from_state_dict(sd, config)


def test_layer_kwargs_cannot_override_the_config():
    sd, config = _mixtral_sd()
    with pytest.raises(TypeError, match="top_k: set by the HF config"):
        convert.from_state_dict(sd, config, top_k=1)


def test_to_state_dict_refuses_a_layer_the_config_would_not_rebuild():
    sd, config = _mixtral_sd()
    # Shapes only: the check runs before any value is read.
    other = nnx.eval_shape(lambda: MoE(16, 24, 4, 2, router=routing.SoftmaxTopK(2), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="router=SoftmaxTopK.*mixtral config implies SelectedSoftmax"):
        convert.to_state_dict(other, config)
    wider = nnx.eval_shape(lambda: MoE(16, 32, 4, 2, router=routing.SelectedSoftmax(2), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="d_ff=32 but the mixtral config implies 24"):
        convert.to_state_dict(wider, config)
    biased = convert.from_state_dict(sd, config)
    biased.selection_bias[...] = jnp.ones(4)
    with pytest.raises(ValueError, match="selection_bias is nonzero .* mixtral blocks have no routing bias"):
        convert.to_state_dict(biased, config)
    with pytest.raises(ValueError, match="layout='stacked'"):
        convert.to_state_dict(convert.from_state_dict(sd, config), config, layout="stacked")


def test_from_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        convert.from_checkpoint(tmp_path)
    config = make_config("deepseek_v3")
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"layers \[0\] .* are not MoE layers; its MoE layers are \[1, 2\]"):
        convert.from_checkpoint(tmp_path, layers=[0])
    with pytest.raises(TypeError, match=r"layers must be an iterable of decoder layer indices \(e.g. layers=\[1\]"):
        convert.from_checkpoint(tmp_path, layers=1)
    with pytest.raises(TypeError, match=r"layers\[1\] must be an int >= 0; got str '2'"):
        convert.from_checkpoint(tmp_path, layers=[1, "2"])
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
        convert.from_checkpoint(tmp_path)
