"""Exact conversion between Hugging Face transformers MoE blocks and `moe_jax.layers.MoE`.

Supported model types: Mixtral (`mixtral`), Qwen3-MoE (`qwen3_moe`), Qwen2-MoE (`qwen2_moe`) and
DeepSeek-V3 (`deepseek_v3`), as transformers 5.17 implements them; both the fused expert tensors
of transformers >= 5 modules and the per-expert tensors of checkpoints. Only the MoE blocks are
converted (not attention, norms or embeddings). See docs/convert.md for the name mapping.

    moe_config(hf_config) -> dict                   # MoE(**moe_config(cfg), rngs=...) has the block's shape
    moe_layers(hf_config) -> tuple[int, ...]        # which decoder layers are MoE
    from_state_dict(sd, hf_config, prefix=..., **layer_kwargs) -> MoE
    from_hf(hf_block, hf_config=None, **layer_kwargs) -> MoE
    from_checkpoint(path, layers=None, **layer_kwargs) -> {layer: MoE}
    to_state_dict(moe, hf_config, prefix=..., layout="fused" | "per_expert") -> {name: np.ndarray}
    block_prefix(hf_config, layer, layout=...) -> "model.layers.{layer}.mlp."
    fp8_quantization(hf_config) -> dict | None      # the blockwise FP8 quantization_config, or None

Blockwise FP8 checkpoints (`quantization_config` = `FP8_QUANTIZATION_CONFIG`: DeepSeek-V3/R1, the
Qwen3 FP8 releases) are read and written with their e4m3 weights and fp32 `weight_scale_inv` block
scales; the routed and shared experts go into stored FP8 weights (`Fp8Blockwise(weights="stored")`)
bit for bit. See docs/fp8.md ("Checkpoints").

This package reads torch tensors when handed them but never imports torch or transformers.
"""

from moe_jax.convert.checkpoint import from_checkpoint, read_config
from moe_jax.convert.hf import from_hf, from_state_dict, to_state_dict
from moe_jax.convert.specs import (
    FP8_QUANTIZATION_CONFIG,
    SUPPORTED_MODEL_TYPES,
    block_prefix,
    fp8_quantization,
    moe_config,
    moe_layers,
)

__all__ = [
    "FP8_QUANTIZATION_CONFIG",
    "SUPPORTED_MODEL_TYPES",
    "block_prefix",
    "fp8_quantization",
    "from_checkpoint",
    "from_hf",
    "from_state_dict",
    "moe_config",
    "moe_layers",
    "read_config",
    "to_state_dict",
]
