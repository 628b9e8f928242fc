"""What each supported Hugging Face model type calls its MoE tensors, and how its config maps to `MoE`.

Legend (shape suffixes): D model width (`hidden_size`), F routed-expert hidden width, Fs shared
expert hidden width, E routed experts.

Everything here reads a config and returns names, sizes or a router; no tensor is touched. The
names are those of transformers 5.17 (`models/{mixtral,qwen3_moe,qwen2_moe,deepseek_v3}`), each
relative to the MoE block (`model.layers.{i}.mlp.` in memory):

* fused (the modules' own parameters in transformers >= 5): `experts.gate_up_proj [E, 2F, D]`
  (gate rows first: the experts run `linear(x, gate_up_proj[e]).chunk(2)` as gate, up) and
  `experts.down_proj [E, D, F]`;
* per expert (every checkpoint on the Hub, and what `save_pretrained` writes: transformers
  reverts its loading conversion on save): `experts.{e}.<gate>.weight [F, D]`,
  `experts.{e}.<up>.weight [F, D]`, `experts.{e}.<down>.weight [D, F]`; Mixtral's files put the
  block under `block_sparse_moe.` instead of `mlp.`.

Both layouts are torch `[out, in]`, like moe_jax's, so converting never transposes.

Hugging Face's blockwise FP8 checkpoints (`quantization_config` of `quant_method="fp8"`, read by
transformers' FineGrainedFP8 quantizer: DeepSeek-V3/R1, the Qwen3 FP8 releases) store a linear
layer's `weight` in e4m3 next to `weight_scale_inv`, the fp32 multiplier of each 128 x 128 block
(`fp8_quantization` checks the config; `scale_name` names the scale).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from moe_jax import routing
from moe_jax.layers.options import SharedExperts
from moe_jax.validation import check_int

__all__ = [
    "BlockNames",
    "ModelSpec",
    "SPECS",
    "SUPPORTED_MODEL_TYPES",
    "block_prefix",
    "check_layout",
    "listing",
    "FP8_QUANTIZATION_CONFIG",
    "config_dict",
    "converts_to_fp8",
    "fp8_quantization",
    "moe_config",
    "moe_layers",
    "scale_name",
    "spec_for",
]

# Keyword arguments of `MoE` that the HF config decides; a caller may not override them.
CONFIG_KWARGS = ("d_model", "d_ff", "num_experts", "top_k", "router", "shared_experts")


@dataclasses.dataclass(frozen=True)
class BlockNames:
    """HF tensor names inside one MoE block (relative to its prefix, e.g. `model.layers.3.mlp.`).

    router `[E, D]`; gate_up `[E, 2F, D]` and down `[E, D, F]` (fused layout); expert_gate,
    expert_up `[F, D]` and expert_down `[D, F]` (per-expert layout, with `{e}` the expert index);
    shared: the shared expert's module prefix (its `gate_proj`/`up_proj` `[Fs, D]` and `down_proj`
    `[D, Fs]`), or None; shared_gate `[1, D]` or None; bias `[E]` fp32 or None.
    """

    expert_gate: str
    expert_up: str
    expert_down: str
    router: str = "gate.weight"
    gate_up: str = "experts.gate_up_proj"
    down: str = "experts.down_proj"
    shared: str | None = None
    shared_gate: str | None = None
    bias: str | None = None

    def shared_names(self) -> tuple[str, str, str] | None:
        """`(gate, up, down)` names of the shared expert's weights, or None without one."""
        if self.shared is None:
            return None
        return tuple(f"{self.shared}{p}_proj.weight" for p in ("gate", "up", "down"))

    def modules(self) -> tuple[str, ...]:
        """Prefixes of every tensor this block owns: a name under one of them that is not
        recognised is an error (quantisation scales, biases), not something to skip."""
        owned = ["gate.", "experts."]
        owned += [self.shared] if self.shared else []
        owned += [self.shared_gate.removesuffix("weight")] if self.shared_gate else []
        return tuple(owned)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One supported `model_type`.

    num_experts: the config fields that may hold E, preferred first (transformers 5.17's
    attribute maps store Qwen3-MoE's `num_experts` as `num_local_experts`, so its own config.json
    says `num_local_experts` while the Hub's say `num_experts`). d_ff: the field holding F.
    per_expert_module: the decoder-layer
    attribute holding the block in per-expert checkpoints (`mlp`, or Mixtral's
    `block_sparse_moe`). defaults: transformers 5.17's defaults of the behaviour fields read here
    (a `config.json` may omit them). kwargs: config dict -> the `MoE` arguments beyond D, F, E, K.
    layers: config dict -> indices of the decoder layers whose MLP is this MoE block.
    """

    model_type: str
    names: BlockNames
    num_experts: tuple[str, ...]
    d_ff: str
    per_expert_module: str
    defaults: Mapping[str, Any]
    kwargs: Callable[[dict], dict]
    layers: Callable[[dict], tuple[int, ...]]


# ---------------------------------------------------------------------------------------------
# Config access


def config_dict(hf_config) -> dict:
    """A transformers config (anything with `to_dict()`) or a mapping (`config.json`) as a plain dict.

    `to_dict()` spells fields by their stored names (DeepSeek-V3's `n_routed_experts`, not the
    `num_local_experts` alias), which is also how `config.json` spells them.
    """
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise TypeError(f"hf_config must be a transformers config or a mapping (config.json); got "
                    f"{type(hf_config).__name__}.")


def _field(cfg: dict, spec: ModelSpec, name: str):
    """A config field; behaviour fields fall back to transformers' default, sizes must be there."""
    if cfg.get(name) is not None:
        return cfg[name]
    if name in spec.defaults:
        return spec.defaults[name]
    raise ValueError(f"{spec.model_type} config has no {name!r} (needed for the MoE layer); the config "
                     f"holds: {sorted(cfg)}.")


def _size(cfg: dict, spec: ModelSpec, name: str, minimum: int = 1) -> int:
    return check_int(f"{spec.model_type} config {name}", _field(cfg, spec, name), minimum=minimum)


def _num_experts(cfg: dict, spec: ModelSpec) -> int:
    """E, from the first of the spec's field names the config holds."""
    name = next((n for n in spec.num_experts if cfg.get(n) is not None), spec.num_experts[0])
    num_experts = _size(cfg, spec, name, minimum=0)
    if num_experts == 0:
        raise _unsupported(spec, name, 0, "the model has no MoE layers.")
    return num_experts


def _unsupported(spec: ModelSpec, field: str, value, why: str):
    return ValueError(f"{spec.model_type} config {field}={value!r}: {why}")


# ---------------------------------------------------------------------------------------------
# Per model type: routing, shared experts, which layers are MoE


def _all_layers(cfg: dict) -> tuple[int, ...]:
    return tuple(range(check_int("num_hidden_layers", cfg.get("num_hidden_layers"), minimum=0)))


def _qwen_layers(cfg: dict) -> tuple[int, ...]:
    # Qwen{2,3}MoeDecoderLayer: MoE unless listed in mlp_only_layers, and only every
    # decoder_sparse_step-th layer (counting from 1).
    step = check_int("decoder_sparse_step", cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in _all_layers(cfg) if i not in dense and (i + 1) % step == 0)


def _deepseek_layers(cfg: dict) -> tuple[int, ...]:
    # DeepseekV3DecoderLayer: MoE from layer first_k_dense_replace on. The multi-token-prediction
    # layers past num_hidden_layers (model.layers.61 in DeepSeek-V3) are not decoder layers of
    # the transformers model, which ignores them on load.
    first = check_int("first_k_dense_replace", cfg.get("first_k_dense_replace", 3) or 0, minimum=0)
    return tuple(i for i in _all_layers(cfg) if i >= first)


def _mixtral_kwargs(cfg: dict) -> dict:
    spec = SPECS["mixtral"]
    jitter = _field(cfg, spec, "router_jitter_noise")
    if jitter:
        raise _unsupported(spec, "router_jitter_noise", jitter,
                           "Mixtral multiplies the block's input by uniform noise while training; moe_jax has no "
                           "router jitter (convert a config with router_jitter_noise=0).")
    # Mixtral's router is softmax -> top-k -> renormalise, which equals a softmax over the selected
    # logits (the top-k by probability are the top-k by logit): moe_jax's SelectedSoftmax.
    return dict(router=routing.SelectedSoftmax(_size(cfg, spec, "num_experts_per_tok")))


def _qwen3_kwargs(cfg: dict) -> dict:
    spec = SPECS["qwen3_moe"]
    renormalize = bool(_field(cfg, spec, "norm_topk_prob"))
    return dict(router=routing.SoftmaxTopK(_size(cfg, spec, "num_experts_per_tok"), renormalize=renormalize))


def _qwen2_kwargs(cfg: dict) -> dict:
    spec = SPECS["qwen2_moe"]
    renormalize = bool(_field(cfg, spec, "norm_topk_prob"))
    shared = _size(cfg, spec, "shared_expert_intermediate_size", minimum=0)
    if shared == 0:
        # transformers still builds an empty shared expert and a [1, D] gate on it.
        raise _unsupported(spec, "shared_expert_intermediate_size", 0,
                           "a Qwen2-MoE block without a shared expert is not supported.")
    return dict(router=routing.SoftmaxTopK(_size(cfg, spec, "num_experts_per_tok"), renormalize=renormalize),
                shared_experts=SharedExperts(1, d_ff=shared, gate=True))


def _deepseek_kwargs(cfg: dict) -> dict:
    spec = SPECS["deepseek_v3"]
    # DeepSeek's own config.json carries fields transformers' DeepseekV3 ignores (it always runs
    # sigmoid scores, group-limited top-k with the correction bias, every layer from
    # first_k_dense_replace MoE). Values that ask for something else cannot be matched by both.
    for field, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if field in cfg and cfg[field] is not None and cfg[field] != expected:
            raise _unsupported(spec, field, cfg[field],
                               f"transformers' DeepseekV3 and moe_jax implement only {field}={expected!r}.")
    num_experts, top_k = _num_experts(cfg, spec), _size(cfg, spec, "num_experts_per_tok")
    # Omitted (or null) n_group/topk_group are transformers' defaults, 8 and 4, as DeepseekV3Config reads them.
    n_group, topk_group = _size(cfg, spec, "n_group"), _size(cfg, spec, "topk_group")
    if num_experts % n_group:
        raise _unsupported(spec, "n_group", n_group, f"must divide n_routed_experts={num_experts}.")
    if topk_group > n_group:
        raise _unsupported(spec, "topk_group", topk_group, f"must be <= n_group={n_group}.")
    if top_k > topk_group * (num_experts // n_group):
        raise _unsupported(spec, "num_experts_per_tok", top_k,
                           f"exceeds the {topk_group * (num_experts // n_group)} experts of the topk_group="
                           f"{topk_group} kept groups.")
    shared = _size(cfg, spec, "n_shared_experts", minimum=0)
    if shared == 0:
        raise _unsupported(spec, "n_shared_experts", 0, "a DeepSeek-V3 block without shared experts is not supported.")
    router = routing.SigmoidGroupedTopK(
        top_k, n_group=n_group, topk_group=topk_group, normalize=bool(_field(cfg, spec, "norm_topk_prob")),
        routed_scaling_factor=float(_field(cfg, spec, "routed_scaling_factor")),
    )
    shared_d_ff = shared * _size(cfg, spec, "moe_intermediate_size")
    return dict(router=router, shared_experts=SharedExperts(shared, d_ff=shared_d_ff))


_QWEN_EXPERT = dict(expert_gate="experts.{e}.gate_proj.weight", expert_up="experts.{e}.up_proj.weight",
                    expert_down="experts.{e}.down_proj.weight")

SPECS: dict[str, ModelSpec] = {
    "mixtral": ModelSpec(
        "mixtral",
        BlockNames(expert_gate="experts.{e}.w1.weight", expert_up="experts.{e}.w3.weight",
                   expert_down="experts.{e}.w2.weight"),
        num_experts=("num_local_experts", "num_experts"), d_ff="intermediate_size",
        per_expert_module="block_sparse_moe",
        defaults=dict(router_jitter_noise=0.0, hidden_act="silu"), kwargs=_mixtral_kwargs, layers=_all_layers,
    ),
    "qwen3_moe": ModelSpec(
        "qwen3_moe", BlockNames(**_QWEN_EXPERT),
        num_experts=("num_experts", "num_local_experts"), d_ff="moe_intermediate_size", per_expert_module="mlp",
        defaults=dict(norm_topk_prob=False, hidden_act="silu"), kwargs=_qwen3_kwargs, layers=_qwen_layers,
    ),
    "qwen2_moe": ModelSpec(
        "qwen2_moe", BlockNames(**_QWEN_EXPERT, shared="shared_expert.", shared_gate="shared_expert_gate.weight"),
        num_experts=("num_experts", "num_local_experts"), d_ff="moe_intermediate_size", per_expert_module="mlp",
        defaults=dict(norm_topk_prob=False, hidden_act="silu"), kwargs=_qwen2_kwargs, layers=_qwen_layers,
    ),
    "deepseek_v3": ModelSpec(
        "deepseek_v3", BlockNames(**_QWEN_EXPERT, shared="shared_experts.", bias="gate.e_score_correction_bias"),
        num_experts=("n_routed_experts", "num_local_experts"), d_ff="moe_intermediate_size", per_expert_module="mlp",
        defaults=dict(norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4, hidden_act="silu"),
        kwargs=_deepseek_kwargs, layers=_deepseek_layers,
    ),
}

SUPPORTED_MODEL_TYPES = tuple(SPECS)


def spec_for(hf_config) -> tuple[ModelSpec, dict]:
    """`(spec, config dict)` for a supported config; ValueError naming the supported model types,
    or the field, for anything else (a `quantization_config` other than blockwise FP8 included)."""
    cfg = config_dict(hf_config)
    model_type = cfg.get("model_type")
    if model_type not in SPECS:
        raise ValueError(f"unsupported model_type {model_type!r}: moe_jax.convert supports "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}.")
    fp8_quantization(cfg)
    return SPECS[model_type], cfg


# ---------------------------------------------------------------------------------------------
# Blockwise FP8 checkpoints

# The one quantization read and written: transformers' FineGrainedFP8 format as DeepSeek-V3's
# config.json spells it (Qwen3's FP8 releases omit `fmt`; e4m3 is what transformers reads then).
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                           "activation_scheme": "dynamic"}

# Field -> (transformers' value when the config omits it, the only value moe_jax runs).
_FP8_FIELDS = {
    "fmt": ("e4m3", "e4m3"),
    "weight_block_size": ((128, 128), (128, 128)),
    "activation_scheme": ("dynamic", "dynamic"),
    "scale_fmt": ("float", "float"),
}


def fp8_quantization(hf_config) -> dict | None:
    """The config's `quantization_config` when it is blockwise FP8 as moe_jax reads it (e4m3 weights,
    fp32 `weight_scale_inv` per 128 x 128 block, activations quantized dynamically), None without
    one; ValueError naming the field and what is supported for any other quantization."""
    cfg = config_dict(hf_config)
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    supported = (f"moe_jax.convert reads Hugging Face blockwise FP8 checkpoints only ({FP8_QUANTIZATION_CONFIG}, "
                 "as DeepSeek-V3/R1 and the Qwen3 FP8 releases are); convert an unquantized (bf16/fp32) checkpoint "
                 "otherwise.")
    if not isinstance(quant, Mapping):
        quant = config_dict(quant)  # a transformers QuantizationConfig object
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method={method!r}: {supported}")
    for field, (default, wanted) in _FP8_FIELDS.items():
        value = quant.get(field)
        value = default if value is None else value
        if (tuple(value) if isinstance(value, (list, tuple)) else value) != wanted:
            raise ValueError(f"quantization_config {field}={value!r}: {supported}")
    return dict(quant)


def scale_name(name: str) -> str:
    """The block-scale tensor of an FP8 weight, as transformers names it: `x.weight` ->
    `x.weight_scale_inv`, a fused expert stack `experts.gate_up_proj` -> `experts.gate_up_proj_scale_inv`."""
    return name + "_scale_inv"


def converts_to_fp8(quant: Mapping, module: str) -> bool:
    """Whether transformers' FineGrainedFP8 quantizes the linear module `module` (its full name,
    e.g. `model.layers.3.mlp.shared_experts.gate_proj`): yes unless a pattern of
    `modules_to_not_convert` (or its alias `ignored_layers`) names it as transformers matches them
    (the module or a parent by regex from the start, or a suffix of the name)."""
    patterns = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ()
    return not any(re.match(key, module) or module.endswith(key) for key in patterns)


def moe_config(hf_config) -> dict:
    """The `MoE` constructor arguments a HF config implies.

    Returns a dict with d_model, d_ff, num_experts, top_k, router and (when the block has them)
    shared_experts (a `SharedExperts`); everything else (dtype, gemm, mesh, ...)
    is the caller's. ValueError for an unsupported model type, a quantized checkpoint, or a config
    field whose behaviour moe_jax cannot reproduce (named in the message).
    """
    spec, cfg = spec_for(hf_config)
    act = _field(cfg, spec, "hidden_act")
    if act != "silu":
        raise _unsupported(spec, "hidden_act", act, "moe_jax's experts are SwiGLU (silu); no other activation.")
    num_experts = _num_experts(cfg, spec)
    top_k = _size(cfg, spec, "num_experts_per_tok")
    if top_k > num_experts:
        raise _unsupported(spec, "num_experts_per_tok", top_k, f"exceeds {spec.num_experts[0]}={num_experts}.")
    return dict(d_model=_size(cfg, spec, "hidden_size"), d_ff=_size(cfg, spec, spec.d_ff), num_experts=num_experts,
                top_k=top_k, **spec.kwargs(cfg))


def moe_layers(hf_config) -> tuple[int, ...]:
    """Indices of the decoder layers whose MLP is an MoE block (transformers 5.17's rule per model:
    every layer for Mixtral; `mlp_only_layers` and `decoder_sparse_step` for Qwen; layers from
    `first_k_dense_replace` on for DeepSeek-V3)."""
    spec, cfg = spec_for(hf_config)
    return spec.layers(cfg)


def block_prefix(hf_config, layer: int, *, layout: str = "fused") -> str:
    """The HF name prefix of decoder layer `layer`'s MoE block: `model.layers.{layer}.mlp.`, or
    for Mixtral's per-expert (checkpoint) layout `model.layers.{layer}.block_sparse_moe.`."""
    spec, _ = spec_for(hf_config)
    module = spec.per_expert_module if check_layout(layout) == "per_expert" else "mlp"
    return f"model.layers.{check_int('layer', layer, minimum=0)}.{module}."


LAYOUTS = ("fused", "per_expert")

# Listing every name in an error helps until it is a DeepSeek layer's 768 expert tensors.
_MAX_LISTED = 24


def listing(names) -> str:
    """Sorted names for an error message, the first few of a long list and a count of the rest."""
    names = sorted(names)
    if not names:
        return "nothing"
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {LAYOUTS} ('fused': experts.gate_up_proj / "
                         "experts.down_proj as transformers >= 5 modules hold them; 'per_expert': "
                         "experts.{e}.* as checkpoints store them).")
    return layout
