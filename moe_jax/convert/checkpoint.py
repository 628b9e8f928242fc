"""MoE layers straight from a Hugging Face `save_pretrained` directory (safetensors).

Reads `config.json`, then only the requested MoE blocks' tensors: through
`model.safetensors.index.json` (name -> shard) when the checkpoint is sharded, else from
`model.safetensors`. Tensors are memory-mapped by `safetensors` and read one block at a time, so
host memory holds one layer's weights at once, not the model's. FP8 tensors (`F8_E4M3`,
`F8_E5M2`), which safetensors' NumPy reader cannot type, are read from the file's bytes as
`jnp.float8_e4m3fn` / `jnp.float8_e5m2` (the safetensors format: an 8-byte little-endian header
length, a JSON header of dtype, shape and byte offsets, then the data).
"""

from __future__ import annotations

import json
import os
import struct
from collections import defaultdict
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from moe_jax.convert import hf, specs
from moe_jax.layers import MoE
from moe_jax.validation import check_int

__all__ = ["from_checkpoint", "read_config"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_FLOAT8 = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2}


def read_config(path: str | os.PathLike) -> dict:
    """`config.json` of a checkpoint directory as a dict (FileNotFoundError naming the file)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} not found: from_checkpoint needs a save_pretrained directory "
                                "(config.json and safetensors weights).")
    with open(file) as f:
        return json.load(f)


def _weight_map(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it."""
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(path, shard) for name, shard in json.load(f)["weight_map"].items()}
    single = os.path.join(path, _SINGLE)
    if os.path.isfile(single):
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}
    found = sorted(os.listdir(path))
    raise FileNotFoundError(f"{path} has neither {_INDEX} nor {_SINGLE} (found: {found}); only safetensors "
                            "checkpoints are read (re-save others with save_pretrained).")


def _block_names(weight_map: dict[str, str], spec: specs.ModelSpec, hf_config: dict,
                 layer: int) -> tuple[str, list[str]]:
    """The block's prefix (fused `mlp.` or the per-expert module) and the tensor names under it."""
    router = spec.names.router
    for layout in ("per_expert", "fused"):
        prefix = specs.block_prefix(hf_config, layer, layout=layout)
        if prefix + router in weight_map:
            return prefix, [n for n in weight_map if n.startswith(prefix)]
    tried = sorted({specs.block_prefix(hf_config, layer, layout=lay) + router for lay in specs.LAYOUTS})
    near = [n for n in weight_map if n.startswith(f"model.layers.{layer}.")]
    raise ValueError(f"checkpoint has no MoE router for decoder layer {layer} (looked for {', '.join(tried)}); "
                     f"its tensors of that layer: {specs.listing(near)}.")


def _header(file: str) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data start."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def _read(weight_map: dict[str, str], names: list[str]) -> dict:
    """The tensors `names` as NumPy arrays (bfloat16 as `jnp.bfloat16`, FP8 as `jnp.float8_e4m3fn`
    or `jnp.float8_e5m2`), opening each shard once."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_file[weight_map[name]].append(name)
    out = {}
    for file, file_names in by_file.items():
        header, data = _header(file)
        fp8 = [n for n in file_names if header[n]["dtype"] in _FLOAT8]
        for name in fp8:
            entry = header[name]
            start, _ = entry["data_offsets"]
            out[name] = np.array(np.memmap(file, dtype=_FLOAT8[entry["dtype"]], mode="r", offset=data + start,
                                           shape=tuple(entry["shape"])))
        with safe_open(file, framework="numpy") as f:
            for name in file_names:
                if name not in out:
                    out[name] = f.get_tensor(name)
    return out


def from_checkpoint(path: str | os.PathLike, *, layers: Iterable[int] | None = None, **layer_kwargs) -> dict[int, MoE]:
    """`{decoder layer index: MoE}` for the MoE blocks of a HF checkpoint directory.

    path: a `save_pretrained` directory (`config.json`, `model.safetensors` or shards with
      `model.safetensors.index.json`) of a supported model type; blocks are read under
      `model.layers.{i}.mlp.` (or Mixtral's `block_sparse_moe.`), in either layout.
    layers: an iterable of decoder layer indices, e.g. `[3]` (default None: every MoE layer,
      `moe_layers`); anything else is a TypeError naming it; asking for a dense
      layer is a ValueError listing the MoE ones.
    layer_kwargs: passed to every `MoE` as in `from_state_dict`.
    """
    path = os.fspath(path)
    hf_config = read_config(path)
    spec, _ = specs.spec_for(hf_config)
    available = specs.moe_layers(hf_config)
    wanted = available if layers is None else _layer_indices(layers)
    dense = [i for i in wanted if i not in available]
    if dense:
        raise ValueError(f"layers {dense} of this {spec.model_type} checkpoint are not MoE layers; its MoE layers "
                         f"are {list(available)}.")
    weight_map = _weight_map(path)
    out = {}
    for layer in wanted:
        prefix, names = _block_names(weight_map, spec, hf_config, layer)
        out[layer] = hf.from_state_dict(_read(weight_map, names), hf_config, prefix=prefix, **layer_kwargs)
    return out


def _layer_indices(layers) -> tuple[int, ...]:
    """`layers` (an iterable of decoder layer indices) as a tuple of ints; TypeError naming it otherwise."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be an iterable of decoder layer indices (e.g. layers=[{layers!r}] for one "
                        f"layer) or None for every MoE layer; got {type(layers).__name__} {layers!r}.")
    return tuple(check_int(f"layers[{n}]", i, minimum=0) for n, i in enumerate(layers))
