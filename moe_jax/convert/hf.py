"""Hugging Face MoE block tensors <-> `moe_jax.layers.MoE`, exactly.

Legend (shape suffixes): D model width, F routed-expert hidden width, Fs shared-expert hidden
width, E experts.

Only renaming, stacking, concatenating and splitting happen (both sides store torch's
`[out, in]`), so a round trip is bit for bit; the one arithmetic step is the cast to the layer's
`param_dtype` (exact from bf16/fp16 to fp32; a tensor that is not floating point is refused,
never cast). Tensors arrive as NumPy, JAX or torch arrays; torch is duck-typed
(`.detach().cpu()`), never imported.

Blockwise FP8 checkpoints (`specs.fp8_quantization`): an e4m3 `weight` comes with its fp32
`weight_scale_inv`, one per 128 x 128 block, which is the experts' `Fp8Weights` layout. A layer
with stored FP8 weights (`Fp8Blockwise(weights="stored")`) takes the routed and shared experts'
e4m3 bytes and scales as they are and writes them back so; a master-weight layer gets them
dequantized (`values * scale` in fp32, transformers' own dequantization). Every other FP8 tensor
(Qwen2-MoE's shared-expert gate) is dequantized into the layer's `param_dtype` and quantized
again by the recipe (`quantize_weights`) when an FP8 checkpoint is written.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.convert import specs
from moe_jax.experts import fuse_gate_up, split_gate_up
from moe_jax.layers import MoE
from moe_jax.layers.dense import SWIGLU_WEIGHTS
from moe_jax.ops.fp8 import BLOCK, FP8_DTYPE, Fp8Weights, dequantize_weights, quantize_weights
from moe_jax.parallel.replicas import logical_weights, physical_weights

__all__ = ["from_hf", "from_state_dict", "to_state_dict"]

# The routed experts' stacks: `[E, ...]` in a checkpoint, `[R*S, ...]` physical slots in a layer
# with `EPOptions(placement=...)`.
_ROUTED_EXPERTS = ("w_gate_up", "w_gate", "w_up", "w_down", "w_gate_scale", "w_up_scale", "w_down_scale")
_SHARED = tuple("shared." + name for name in SWIGLU_WEIGHTS)

# torch dtypes NumPy lacks -> their NumPy (ml_dtypes) equivalents, through JAX's names.
_TORCH_NARROW = {"torch.bfloat16": jnp.bfloat16, "torch.float8_e4m3fn": jnp.float8_e4m3fn,
                 "torch.float8_e5m2": jnp.float8_e5m2}


def host_array(value) -> np.ndarray:
    """A NumPy array of a NumPy, JAX or torch array (torch bfloat16 and float8 as `jnp.bfloat16`,
    `jnp.float8_e4m3fn`, `jnp.float8_e5m2`, exactly: NumPy has none of them, so they go through
    float32, which holds every one of their values)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu()
        if str(value.dtype) in _TORCH_NARROW:
            return np.asarray(value.float().numpy(), dtype=_TORCH_NARROW[str(value.dtype)])
        return value.numpy()
    return np.asarray(value)


def _is_fp8(dtype) -> bool:
    return np.dtype(dtype).name.startswith("float8")


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _dequantize(weights: Fp8Weights) -> np.ndarray:
    """fp32 `values * scale` block by block (`moe_jax.ops.fp8.dequantize_weights`), on the host."""
    return np.asarray(dequantize_weights(Fp8Weights(jnp.asarray(weights.values_ENK), jnp.asarray(weights.scale_ENbKb))))


def _quantize(w: np.ndarray) -> Fp8Weights:
    """e4m3 values and fp32 128 x 128 block scales of `[E, N, K]` weights (the recipe's
    `quantize_weights`), on the host."""
    values, scale = quantize_weights(jnp.asarray(w))
    return Fp8Weights(np.asarray(values), np.asarray(scale))


class _Reader:
    """Reads one block's tensors out of a state dict, checking names and shapes; `fp8`: the
    checkpoint is blockwise FP8 (e4m3 tensors come with their block scales)."""

    def __init__(self, state_dict: Mapping, prefix: str, model_type: str, fp8: bool):
        self.sd, self.prefix, self.model_type, self.fp8 = state_dict, prefix, model_type, fp8
        self.used: set[str] = set()

    def under_prefix(self) -> list[str]:
        return [k for k in self.sd if k.startswith(self.prefix)]

    def has(self, name: str) -> bool:
        return self.prefix + name in self.sd

    def _tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = self.prefix + name
        if key not in self.sd:
            raise ValueError(f"{self.model_type} MoE block: missing tensor {key!r}; found under prefix "
                             f"{self.prefix!r}: {specs.listing(self.under_prefix())}.")
        value = host_array(self.sd[key])
        if not jnp.issubdtype(value.dtype, jnp.floating):  # (jnp's knows NumPy's bfloat16 and float8)
            raise TypeError(f"{self.model_type} MoE block: tensor {key!r} has dtype {value.dtype}; MoE weights are "
                            "floating point (float32, bfloat16, float16, or e4m3 with block scales in a blockwise "
                            "FP8 checkpoint), and casting would silently change them. An integer tensor means a "
                            "quantized or corrupted checkpoint: convert an unquantized one.")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{self.model_type} MoE block: tensor {key!r} has shape {tuple(value.shape)}, expected "
                             f"{tuple(shape)}.")
        self.used.add(key)
        return value

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float tensor; an e4m3 one (of an FP8 checkpoint) dequantized to fp32 with its block scales."""
        value = self.get_fp8(name, shape)
        if not isinstance(value, Fp8Weights):
            return value
        return _dequantize(value).reshape(shape)

    def get_fp8(self, name: str, shape: tuple[int, ...]) -> np.ndarray | Fp8Weights:
        """A float tensor, or an e4m3 one `[..., N, K]` with its fp32 `weight_scale_inv`
        `[..., ceil(N/128), ceil(K/128)]` as an `Fp8Weights` (a 2-D weight as one expert), bytes as
        stored."""
        value = self._tensor(name, shape)
        if not _is_fp8(value.dtype):
            return value
        key = self.prefix + name
        if not self.fp8:
            raise TypeError(f"{self.model_type} MoE block: tensor {key!r} has dtype {value.dtype} but the config has "
                            "no quantization_config; FP8 tensors are read from blockwise FP8 checkpoints only (a "
                            f"config with quantization_config {specs.FP8_QUANTIZATION_CONFIG}).")
        if value.dtype != FP8_DTYPE:
            raise TypeError(f"{self.model_type} MoE block: tensor {key!r} has dtype {value.dtype}; blockwise FP8 "
                            "checkpoints store e4m3 (float8_e4m3fn) weights (quantization_config fmt='e4m3'), the "
                            "only FP8 format moe_jax reads.")
        scale_name = specs.scale_name(name)
        if not self.has(scale_name):
            raise ValueError(f"{self.model_type} MoE block: tensor {key!r} is e4m3 but its block scales "
                             f"{self.prefix + scale_name!r} are missing; a blockwise FP8 checkpoint stores every e4m3 "
                             "weight [N, K] with fp32 weight_scale_inv [ceil(N/128), ceil(K/128)].")
        scale = self._tensor(scale_name, tuple(shape[:-2]) + (_blocks(shape[-2]), _blocks(shape[-1])))
        if scale.dtype != np.float32:
            raise TypeError(f"{self.model_type} MoE block: block scales {self.prefix + scale_name!r} have dtype "
                            f"{scale.dtype}; blockwise FP8 checkpoints store them in float32 (quantization_config "
                            "scale_fmt='float').")
        return Fp8Weights(value, scale) if value.ndim == 3 else Fp8Weights(value[None], scale[None])

    def get_experts(self, name: str, num_experts: int, shape: tuple[int, ...]) -> np.ndarray | Fp8Weights:
        """The per-expert tensors `name.format(e=i)` stacked `[E, ...]`: floats, or e4m3 values and
        their block scales (all experts alike)."""
        parts = [self.get_fp8(name.format(e=i), shape) for i in range(num_experts)]
        fp8 = [isinstance(p, Fp8Weights) for p in parts]
        if all(fp8):
            return Fp8Weights(np.concatenate([p.values_ENK for p in parts]),
                              np.concatenate([p.scale_ENbKb for p in parts]))
        if any(fp8):
            raise ValueError(f"{self.model_type} MoE block: {self.prefix + name!r} is e4m3 for experts "
                             f"{[i for i, f in enumerate(fp8) if f]} only; one projection's experts must all be FP8 "
                             "or all unquantized.")
        return np.stack(parts)

    def check_nothing_else(self, modules: tuple[str, ...]) -> None:
        """Tensors of this block that nothing read (quantisation scales, biases, a second layout)
        would be silently dropped: refuse them instead."""
        owned = tuple(self.prefix + m for m in modules)
        extra = [k for k in self.sd if k.startswith(owned) and k not in self.used]
        if extra:
            raise ValueError(f"{self.model_type} MoE block: unrecognised tensors under prefix {self.prefix!r}: "
                             f"{specs.listing(extra)} (block scales of unquantized weights or in a checkpoint "
                             "without an FP8 quantization_config, expert biases and mixed fused/per-expert layouts "
                             "are not supported).")


def _read_block(reader: _Reader, spec: specs.ModelSpec, kw: dict) -> dict[str, np.ndarray | Fp8Weights]:
    """The block's tensors under moe_jax's names, checked against the config: `w_gate_up [E, 2F, D]`
    from the fused layout, `w_gate`/`w_up [E, F, D]` from the per-expert one; the routed and shared
    experts of an FP8 checkpoint as `Fp8Weights` (bytes as stored; a shared weight as one expert
    `[1, N, K]`), every other FP8 tensor dequantized."""
    names = spec.names
    d, f, e = kw["d_model"], kw["d_ff"], kw["num_experts"]
    out = {"w_router": reader.get(names.router, (e, d))}
    fused, per_expert = reader.has(names.gate_up), reader.has(names.expert_gate.format(e=0))
    if fused and per_expert:
        raise ValueError(f"{spec.model_type} MoE block: both {reader.prefix + names.gate_up!r} (fused) and "
                         f"{reader.prefix + names.expert_gate.format(e=0)!r} (per expert) are present; pass one "
                         "layout.")
    if per_expert:
        for ours, theirs, shape in (("w_gate", names.expert_gate, (f, d)), ("w_up", names.expert_up, (f, d)),
                                    ("w_down", names.expert_down, (d, f))):
            out[ours] = reader.get_experts(theirs, e, shape)
    else:  # fused, or neither: the fused names are then reported missing
        # transformers' experts take `.chunk(2, dim=-1)` of x @ gate_up^T as (gate, up): gate rows
        # first, as moe_jax's w_gate_up.
        out["w_gate_up"] = reader.get_fp8(names.gate_up, (e, 2 * f, d))
        out["w_down"] = reader.get_fp8(names.down, (e, d, f))
    shared = names.shared_names()
    if shared:
        fs = kw["shared_experts"].width(f)
        for ours, theirs, shape in zip(_SHARED, shared, ((fs, d), (fs, d), (d, fs))):
            out[ours] = reader.get_fp8(theirs, shape)
    if names.shared_gate:
        out["w_shared_gate"] = reader.get(names.shared_gate, (1, d))
    if names.bias:
        out["selection_bias"] = reader.get(names.bias, (e,))
    reader.check_nothing_else(names.modules())
    return out


def _split_fp8_gate_up(w_gate_up: Fp8Weights, d_ff: int) -> tuple[Fp8Weights, Fp8Weights]:
    """A fused FP8 `[E, 2F, D]` stack split into gate and up: whole blocks only (F % 128 == 0)."""
    if d_ff % BLOCK:
        raise ValueError(f"a fused FP8 experts.gate_up_proj with d_ff={d_ff} (not a multiple of {BLOCK}) has "
                         f"{BLOCK}-row blocks holding both gate and up rows, which separate stored gate and up weights "
                         "cannot keep; read the per-expert checkpoint layout (experts.{e}.*) instead.")
    values, scale = (split_gate_up(a) for a in w_gate_up)
    return Fp8Weights(values[0], scale[0]), Fp8Weights(values[1], scale[1])


def _expert_layout(weights: dict, moe: MoE, d_ff: int) -> dict[str, np.ndarray]:
    """The routed and shared experts as the layer holds them: e4m3 values and `_scale` block scales
    for stored FP8 weights (quantized here from a checkpoint that is not FP8); floats otherwise (an
    FP8 checkpoint's dequantized), the routed gate and up fused or not as the layer's
    `fused_gate_up` says."""
    weights = dict(weights)
    for name in [n for n in _SHARED if n in weights]:
        w = weights.pop(name)
        if moe.fp8_stored:  # `[N, K]` values, `[Nb, Kb]` scales
            weights[name], weights[name + "_scale"] = (a[0] for a in (w if isinstance(w, Fp8Weights)
                                                                       else _quantize(w[None])))
        else:
            weights[name] = _dequantize(w)[0] if isinstance(w, Fp8Weights) else w
    if moe.fp8_stored:
        if "w_gate_up" in weights:
            w_gate_up = weights.pop("w_gate_up")
            weights["w_gate"], weights["w_up"] = (_split_fp8_gate_up(w_gate_up, d_ff)
                                                  if isinstance(w_gate_up, Fp8Weights) else split_gate_up(w_gate_up))
        for name in SWIGLU_WEIGHTS:
            w = weights.pop(name)
            weights[name], weights[name + "_scale"] = w if isinstance(w, Fp8Weights) else _quantize(w)
        return weights
    weights = {k: _dequantize(v) if isinstance(v, Fp8Weights) else v for k, v in weights.items()}
    if "w_gate_up" in weights and (not moe.fused_gate_up or moe.etp > 1):
        weights["w_gate"], weights["w_up"] = split_gate_up(weights.pop("w_gate_up"))
    if moe.fused_gate_up and "w_gate_up" not in weights:
        # Under expert tensor parallelism the layer's fused rows are in per-shard blocks.
        weights["w_gate_up"] = fuse_gate_up(weights.pop("w_gate"), weights.pop("w_up"), shards=moe.etp)
    return weights


def _layer_kwargs(layer_kwargs: dict) -> dict:
    taken = sorted(set(layer_kwargs) & set(specs.CONFIG_KWARGS + ("latent_dim", "rngs")))
    if taken:
        raise TypeError(f"{', '.join(taken)}: set by the HF config (or meaningless for a converted layer); pass "
                        "only layout/execution arguments (dtype, param_dtype, gemm, mesh, axis_rules, "
                        "expert_parallel).")
    return layer_kwargs


def _place(variable: nnx.Variable, value: np.ndarray, mesh) -> None:
    """Set an abstract variable to `value` cast to its dtype, on its sharding when it has one (over
    the layer's concrete `mesh`: under Explicit axes `nnx.eval_shape` types it with the abstract one)."""
    target = variable.get_value()
    value = value.astype(target.dtype, copy=False)
    sharding = getattr(target, "sharding", None)
    if sharding is not None and mesh is not None:
        sharding = jax.sharding.NamedSharding(mesh, sharding.spec)
    variable.set_value(jnp.asarray(value) if sharding is None else jax.device_put(value, sharding))


def _build_moe(weights: dict[str, np.ndarray | Fp8Weights], kw: dict, layer_kwargs: dict) -> MoE:
    """An `MoE(**kw, **layer_kwargs)` holding `weights` (moe_jax names, gate/up fused or not, the
    routed experts FP8 or not), built abstractly: no random initialisation runs."""
    moe = nnx.eval_shape(lambda: MoE(**kw, **_layer_kwargs(layer_kwargs), rngs=nnx.Rngs(0)))
    weights = _expert_layout(weights, moe, kw["d_ff"])
    weights.setdefault("selection_bias", np.zeros((kw["num_experts"],), np.float32))
    placement = moe.expert_parallel.placement
    if placement is not None:  # checkpoints hold logical experts; every slot gets a copy of its expert's
        for name in _ROUTED_EXPERTS:
            if name in weights:
                weights[name] = physical_weights(weights[name], placement)
    for path, variable in nnx.to_flat_state(nnx.state(moe)):
        name = ".".join(map(str, path))
        if name not in weights:  # only reachable if MoE grows a variable this module does not know
            raise NotImplementedError(f"moe_jax.convert does not know how to fill MoE variable {name!r}.")
        _place(variable, weights[name], layer_kwargs.get("mesh"))
    return moe


def from_state_dict(state_dict: Mapping, hf_config, *, prefix: str = "", **layer_kwargs) -> MoE:
    """One `MoE` from a HF MoE block's tensors.

    state_dict: name -> array (NumPy, JAX or torch, any float dtype), either layout: fused
      (`experts.gate_up_proj [E, 2F, D]`, `experts.down_proj [E, D, F]`, what transformers >= 5
      modules hold) or per expert (`experts.{e}.*.weight`, what checkpoints store); plus
      `gate.weight [E, D]`, the shared expert(s) and gate where the model has them, and DeepSeek-V3's
      `gate.e_score_correction_bias [E]` (into `selection_bias`, fp32).
    hf_config: the model's transformers config or `config.json` dict (`moe_config`).
    prefix: prepended to every name (`"model.layers.3.mlp."` to read a whole model's state dict).
    layer_kwargs: passed to `MoE` (dtype, param_dtype, gemm, mesh, axis_rules, expert_parallel);
      not the arguments the config decides. Weights are cast to param_dtype
      and placed on the mesh's layout when a mesh is given. With
      `expert_parallel=EPOptions(placement=p)` every physical slot gets a copy of its logical
      expert's tensors (`to_state_dict` writes the logical experts back).

    Blockwise FP8 checkpoints (a config with an FP8 `quantization_config`, `specs.fp8_quantization`):
    each e4m3 tensor `name` comes with fp32 `name_scale_inv` (`experts.{e}.gate_proj.weight_scale_inv
    [ceil(F/128), ceil(D/128)]`, fused `experts.gate_up_proj_scale_inv`). With
    `gemm=GemmOptions(quantization=Fp8Blockwise(weights="stored"))` the routed and shared experts'
    e4m3 bytes and scales become the layer's stored weights as they are; otherwise they are
    dequantized (`values * scale` in fp32) into the master weights. Other FP8 tensors (a shared
    expert's gate) are dequantized into `param_dtype`. A stored-FP8 layer from an unquantized
    checkpoint gets its experts quantized once by the recipe (`quantize_weights`).

    ValueError naming the tensor when one is missing (listing what the prefix holds; an e4m3
    weight's scales included), misshapen (expected and actual shapes) or unrecognised, and for
    configs `moe_config` rejects (a quantization other than blockwise FP8); TypeError for a tensor
    that is not floating point, an FP8 one without an FP8 config, e5m2 weights and non-fp32 scales.
    """
    spec, _ = specs.spec_for(hf_config)
    kw = specs.moe_config(hf_config)
    fp8 = specs.fp8_quantization(hf_config) is not None
    weights = _read_block(_Reader(state_dict, prefix, spec.model_type, fp8), spec, kw)
    return _build_moe(weights, kw, layer_kwargs)


def from_hf(hf_block, hf_config=None, **layer_kwargs) -> MoE:
    """One `MoE` from a transformers MoE block module (e.g. `model.model.layers[3].mlp`), through its
    `state_dict()`. hf_config defaults to the config the block's experts were built with."""
    if hf_config is None:
        # DeepseekV3MoE keeps its config; every block's experts module does (transformers' experts wrapper).
        hf_config = getattr(hf_block, "config", None)
        if hf_config is None:
            hf_config = getattr(getattr(hf_block, "experts", None), "config", None)
        if hf_config is None:
            raise ValueError(f"{type(hf_block).__name__} does not carry its config: pass hf_config.")
    return from_state_dict(hf_block.state_dict(), hf_config, **layer_kwargs)


def _check_matches(moe: MoE, kw: dict, model_type: str) -> None:
    """Refuse to write a layer the config would not rebuild (its HF block would compute something else)."""
    shared_d_ff = moe.shared.w_gate.get_value().shape[0] if moe.shared is not None else None
    ours = dict(d_model=moe.d_model, d_ff=moe.d_ff, num_experts=moe.num_experts, top_k=moe.top_k, router=moe.router,
                shared_d_ff=shared_d_ff, shared_expert_gate=moe.shared_expert_gate)
    shared = kw.get("shared_experts")
    theirs = dict(kw, shared_d_ff=None if shared is None else shared.width(kw["d_ff"]),
                  shared_expert_gate=shared is not None and shared.gate)
    for name, value in ours.items():
        if value != theirs[name]:
            raise ValueError(f"the MoE layer's {name}={value!r} but the {model_type} config implies "
                             f"{theirs[name]!r}; it cannot be written as this model's block.")
    if moe.latent_dim is not None:
        raise ValueError(f"the MoE layer has latent_dim={moe.latent_dim} (LatentMoE); {model_type} has no latent "
                         "projections.")


def to_state_dict(moe: MoE, hf_config, *, prefix: str = "", layout: str = "fused", dtype=None) -> dict[str, np.ndarray]:
    """A `MoE` back to HF names: the inverse of `from_state_dict`.

    layout: "fused" (`experts.gate_up_proj [E, 2F, D]`, `experts.down_proj [E, D, F]`: what a
      transformers >= 5 block's `load_state_dict` takes) or "per_expert" (`experts.{e}.*.weight`:
      what checkpoints store; for Mixtral's files put it under `block_sparse_moe.`, see
      `block_prefix`).
    prefix: prepended to every name. dtype: cast every unquantized tensor to it (default: the
      layer's parameter dtype; bfloat16 comes back as NumPy arrays of `jnp.bfloat16`). DeepSeek-V3's
      `gate.e_score_correction_bias` is always fp32, as transformers keeps it.

    A config with an FP8 `quantization_config` (`specs.FP8_QUANTIZATION_CONFIG`) asks for a
    blockwise FP8 checkpoint: the routed experts as e4m3 `weight` (`jnp.float8_e4m3fn` arrays) with
    fp32 `weight_scale_inv` (a stored-FP8 layer's bytes as they are; master weights quantized by the
    recipe), the block's other linear weights (shared experts, Qwen2-MoE's shared-expert gate)
    likewise unless the config's `modules_to_not_convert` names them (matched against `prefix` +
    module name, as transformers does; stored shared experts are then dequantized), the router
    and bias unquantized. The fused layout then needs F % 128 == 0 (gate and up in blocks of their
    own).

    Returns host NumPy arrays. ValueError when the layer does not match the config (sizes, router,
    shared experts, a latent width), holds a nonzero `selection_bias` the model type cannot store,
    or holds stored FP8 weights and the config is not FP8.
    """
    spec, _ = specs.spec_for(hf_config)
    kw = specs.moe_config(hf_config)
    specs.check_layout(layout)
    _check_matches(moe, kw, spec.model_type)
    quant = specs.fp8_quantization(hf_config)
    if moe.fp8_stored and quant is None:
        raise ValueError(f"the MoE layer holds stored FP8 expert weights (Fp8Blockwise(weights='stored')) but the "
                         f"{spec.model_type} config has no quantization_config; write them as a blockwise FP8 "
                         "checkpoint, with the config's quantization_config set to "
                         f"moe_jax.convert.FP8_QUANTIZATION_CONFIG = {specs.FP8_QUANTIZATION_CONFIG}.")
    names = spec.names
    bias_E = np.array(moe.selection_bias[...], np.float32)
    if names.bias is None and bias_E.any():
        raise ValueError(f"the MoE layer's selection_bias is nonzero (loss-free balancing) but {spec.model_type} "
                         "blocks have no routing bias, so it would be lost; zero it first if that is intended.")

    def get(path: str, cast: bool = True) -> np.ndarray:
        variable = moe
        for part in path.split("."):  # "shared.w_gate" -> moe.shared.w_gate
            variable = getattr(variable, part)
        # A writable host copy the caller owns (a view of a device buffer is read-only).
        value = np.array(variable[...])
        if path in _ROUTED_EXPERTS and moe.expert_parallel.placement is not None:
            value = logical_weights(value, moe.expert_parallel.placement)  # replicas are identical
        return value if dtype is None or not cast else value.astype(dtype)

    if moe.fp8_stored:
        w_gate_EFD, w_up_EFD, w_down_EDF = (Fp8Weights(get(n, cast=False), get(n + "_scale", cast=False))
                                            for n in SWIGLU_WEIGHTS)
    else:
        if moe.fused_gate_up:
            # Per-shard blocks under expert tensor parallelism: back to gate rows first.
            w_gate_EFD, w_up_EFD = split_gate_up(get("w_gate_up"), shards=moe.etp)
        else:
            w_gate_EFD, w_up_EFD = get("w_gate"), get("w_up")
        w_down_EDF = get("w_down")
        if quant is not None:
            w_gate_EFD, w_up_EFD, w_down_EDF = (_quantize(w) for w in (w_gate_EFD, w_up_EFD, w_down_EDF))
    out = {names.router: get("w_router")}
    if layout == "fused":
        out.update(_fused_experts(names, w_gate_EFD, w_up_EFD, w_down_EDF, kw["d_ff"]))
    else:
        for e in range(moe.num_experts):
            for name, w in ((names.expert_gate, w_gate_EFD), (names.expert_up, w_up_EFD),
                            (names.expert_down, w_down_EDF)):
                out.update(_tensors(name.format(e=e), w, e))
    shared = names.shared_names()
    linears = []  # (HF name, value) of the block's other linear weights; stored FP8 as `[1, N, K]`
    if shared:
        linears += [(theirs, Fp8Weights(get(ours, cast=False)[None], get(ours + "_scale", cast=False)[None])
                     if moe.fp8_stored else get(ours)) for ours, theirs in zip(_SHARED, shared)]
    if names.shared_gate:
        linears.append((names.shared_gate, get("w_shared_gate")))
    for theirs, value in linears:
        fp8 = quant is not None and specs.converts_to_fp8(quant, prefix + theirs.removesuffix(".weight"))
        if isinstance(value, Fp8Weights) and fp8:  # stored, written as FP8: its bytes as they are
            out.update(_tensors(theirs, value, 0))
        elif isinstance(value, Fp8Weights):  # stored, written unquantized: dequantized
            value = _dequantize(value)[0]
            out[theirs] = value if dtype is None else value.astype(dtype)
        else:
            out.update(_tensors(theirs, _quantize(value[None]), 0) if fp8 else {theirs: value})
    if names.bias:
        out[names.bias] = bias_E
    return {prefix + k: v for k, v in out.items()}


def _tensors(name: str, w: np.ndarray | Fp8Weights, e: int) -> dict[str, np.ndarray]:
    """Expert `e` of a `[E, N, K]` stack under HF's `name`: the array, or e4m3 `name` with its
    block scales `name_scale_inv`."""
    if isinstance(w, Fp8Weights):
        return {name: np.ascontiguousarray(w.values_ENK[e]),
                specs.scale_name(name): np.ascontiguousarray(w.scale_ENbKb[e])}
    return {name: np.ascontiguousarray(w[e])}


def _fused_experts(names: specs.BlockNames, w_gate_EFD, w_up_EFD, w_down_EDF, d_ff: int) -> dict[str, np.ndarray]:
    """`experts.gate_up_proj [E, 2F, D]` (gate rows first) and `experts.down_proj`, with their
    block scales concatenated alike when FP8 (whole blocks only: F % 128 == 0)."""
    if not isinstance(w_down_EDF, Fp8Weights):
        return {names.gate_up: np.concatenate([w_gate_EFD, w_up_EFD], axis=1), names.down: w_down_EDF}
    if d_ff % BLOCK:
        raise ValueError(f"layout='fused' FP8 experts with d_ff={d_ff} (not a multiple of {BLOCK}): gate and up are "
                         f"quantized in blocks of their own, which a fused [E, 2F, D] stack of {BLOCK}-row blocks "
                         "cannot hold; write layout='per_expert' (what FP8 checkpoints store).")
    out = {}
    for name, parts in ((names.gate_up, (w_gate_EFD, w_up_EFD)), (names.down, (w_down_EDF,))):
        out[name] = np.concatenate([p.values_ENK for p in parts], axis=1)
        out[specs.scale_name(name)] = np.concatenate([p.scale_ENbKb for p in parts], axis=1)
    return out
