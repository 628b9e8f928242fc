"""Hugging Face MoE block tensors <-> `moe_jax.layers.MoE`, exactly.

Legend (shape suffixes): D model width, F routed-expert hidden width, Fs shared-expert hidden
width, E experts.

Only renaming, stacking, concatenating and splitting happen (both sides store torch's
`[out, in]`), so a round trip is bit for bit; the one arithmetic step is the cast to the layer's
`param_dtype` (exact from bf16/fp16 to fp32; a tensor that is not floating point is refused,
never cast). Tensors arrive as NumPy, JAX or torch arrays; torch is duck-typed
(`.detach().cpu()`), never imported.
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
from moe_jax.parallel.replicas import logical_weights, physical_weights

__all__ = ["from_hf", "from_state_dict", "to_state_dict"]

# The routed experts' stacks: `[E, ...]` in a checkpoint, `[R*S, ...]` physical slots in a layer
# with `EPOptions(placement=...)`.
_ROUTED_EXPERTS = ("w_gate_up", "w_gate", "w_up", "w_down")

def host_array(value) -> np.ndarray:
    """A NumPy array of a NumPy, JAX or torch array (torch bfloat16 as `jnp.bfloat16`, exactly:
    NumPy has no bfloat16, so it goes through float32, which holds every bfloat16 value)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            return np.asarray(value.float().numpy(), dtype=jnp.bfloat16)
        return value.numpy()
    return np.asarray(value)


class _Reader:
    """Reads one block's tensors out of a state dict, checking names and shapes."""

    def __init__(self, state_dict: Mapping, prefix: str, model_type: str):
        self.sd, self.prefix, self.model_type = state_dict, prefix, model_type
        self.used: set[str] = set()

    def under_prefix(self) -> list[str]:
        return [k for k in self.sd if k.startswith(self.prefix)]

    def has(self, name: str) -> bool:
        return self.prefix + name in self.sd

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = self.prefix + name
        if key not in self.sd:
            raise ValueError(f"{self.model_type} MoE block: missing tensor {key!r}; found under prefix "
                             f"{self.prefix!r}: {specs.listing(self.under_prefix())}.")
        value = host_array(self.sd[key])
        if not jnp.issubdtype(value.dtype, jnp.floating):  # (jnp's knows NumPy's bfloat16)
            raise TypeError(f"{self.model_type} MoE block: tensor {key!r} has dtype {value.dtype}; MoE weights are "
                            "floating point (float32, bfloat16, float16), and casting would silently change them. An "
                            "integer tensor means a quantized or corrupted checkpoint: convert an unquantized one.")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{self.model_type} MoE block: tensor {key!r} has shape {tuple(value.shape)}, expected "
                             f"{tuple(shape)}.")
        self.used.add(key)
        return value

    def check_nothing_else(self, modules: tuple[str, ...]) -> None:
        """Tensors of this block that nothing read (quantisation scales, biases, a second layout)
        would be silently dropped: refuse them instead."""
        owned = tuple(self.prefix + m for m in modules)
        extra = [k for k in self.sd if k.startswith(owned) and k not in self.used]
        if extra:
            raise ValueError(f"{self.model_type} MoE block: unrecognised tensors under prefix {self.prefix!r}: "
                             f"{specs.listing(extra)} (quantized checkpoints, expert biases and mixed fused/per-expert "
                             "layouts are not supported).")


def _read_block(reader: _Reader, spec: specs.ModelSpec, kw: dict) -> dict[str, np.ndarray]:
    """The block's tensors under moe_jax's names, checked against the config: `w_gate_up [E, 2F, D]`
    from the fused layout, `w_gate`/`w_up [E, F, D]` from the per-expert one."""
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
            out[ours] = np.stack([reader.get(theirs.format(e=i), shape) for i in range(e)])
    else:  # fused, or neither: the fused names are then reported missing
        # transformers' experts take `.chunk(2, dim=-1)` of x @ gate_up^T as (gate, up): gate rows
        # first, as moe_jax's w_gate_up.
        out["w_gate_up"] = reader.get(names.gate_up, (e, 2 * f, d))
        out["w_down"] = reader.get(names.down, (e, d, f))
    shared = names.shared_names()
    if shared:
        fs = kw["shared_experts"].width(f)
        for ours, theirs, shape in zip(("shared.w_gate", "shared.w_up", "shared.w_down"), shared,
                                       ((fs, d), (fs, d), (d, fs))):
            out[ours] = reader.get(theirs, shape)
    if names.shared_gate:
        out["w_shared_gate"] = reader.get(names.shared_gate, (1, d))
    if names.bias:
        out["selection_bias"] = reader.get(names.bias, (e,))
    reader.check_nothing_else(names.modules())
    return out


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


def _build_moe(weights: dict[str, np.ndarray], kw: dict, layer_kwargs: dict) -> MoE:
    """An `MoE(**kw, **layer_kwargs)` holding `weights` (moe_jax names, gate/up fused or not), built
    abstractly: no random initialisation runs."""
    moe = nnx.eval_shape(lambda: MoE(**kw, **_layer_kwargs(layer_kwargs), rngs=nnx.Rngs(0)))
    weights = dict(weights)
    if "w_gate_up" in weights and (not moe.fused_gate_up or moe.etp > 1):
        weights["w_gate"], weights["w_up"] = split_gate_up(weights.pop("w_gate_up"))
    if moe.fused_gate_up and "w_gate_up" not in weights:
        # Under expert tensor parallelism the layer's fused rows are in per-shard blocks.
        weights["w_gate_up"] = fuse_gate_up(weights.pop("w_gate"), weights.pop("w_up"), shards=moe.etp)
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

    ValueError naming the tensor when one is missing (listing what the prefix holds), misshapen
    (expected and actual shapes) or unrecognised, and for configs `moe_config` rejects.
    """
    spec, _ = specs.spec_for(hf_config)
    kw = specs.moe_config(hf_config)
    weights = _read_block(_Reader(state_dict, prefix, spec.model_type), spec, kw)
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
    prefix: prepended to every name. dtype: cast every tensor to it (default: the layer's
      parameter dtype; bfloat16 comes back as NumPy arrays of `jnp.bfloat16`). DeepSeek-V3's
      `gate.e_score_correction_bias` is always fp32, as transformers keeps it.
    Returns host NumPy arrays. ValueError when the layer does not match the config (sizes, router,
    shared experts, a latent width) or holds a nonzero `selection_bias` the model type cannot store.
    """
    spec, _ = specs.spec_for(hf_config)
    kw = specs.moe_config(hf_config)
    specs.check_layout(layout)
    _check_matches(moe, kw, spec.model_type)
    names = spec.names
    bias_E = np.array(moe.selection_bias[...], np.float32)
    if names.bias is None and bias_E.any():
        raise ValueError(f"the MoE layer's selection_bias is nonzero (loss-free balancing) but {spec.model_type} "
                         "blocks have no routing bias, so it would be lost; zero it first if that is intended.")

    def get(path: str) -> np.ndarray:
        variable = moe
        for part in path.split("."):  # "shared.w_gate" -> moe.shared.w_gate
            variable = getattr(variable, part)
        # A writable host copy the caller owns (a view of a device buffer is read-only).
        value = np.array(variable[...])
        if path in _ROUTED_EXPERTS and moe.expert_parallel.placement is not None:
            value = logical_weights(value, moe.expert_parallel.placement)  # replicas are identical
        return value if dtype is None else value.astype(dtype)

    if moe.fused_gate_up and moe.etp == 1:
        w_gate_up_E2FD = get("w_gate_up")
        w_gate_EFD, w_up_EFD = split_gate_up(w_gate_up_E2FD)
    elif moe.fused_gate_up:
        # Per-shard blocks under expert tensor parallelism: back to gate rows first.
        w_gate_EFD, w_up_EFD = split_gate_up(get("w_gate_up"), shards=moe.etp)
        w_gate_up_E2FD = None
    else:
        w_gate_EFD, w_up_EFD = get("w_gate"), get("w_up")
        w_gate_up_E2FD = None
    w_down_EDF = get("w_down")
    out = {names.router: get("w_router")}
    if layout == "fused":
        if w_gate_up_E2FD is None:
            w_gate_up_E2FD = np.concatenate([w_gate_EFD, w_up_EFD], axis=1)
        out[names.gate_up] = w_gate_up_E2FD
        out[names.down] = w_down_EDF
    else:
        for e in range(moe.num_experts):
            out[names.expert_gate.format(e=e)] = np.ascontiguousarray(w_gate_EFD[e])
            out[names.expert_up.format(e=e)] = np.ascontiguousarray(w_up_EFD[e])
            out[names.expert_down.format(e=e)] = np.ascontiguousarray(w_down_EDF[e])
    shared = names.shared_names()
    if shared:
        for ours, theirs in zip(("shared.w_gate", "shared.w_up", "shared.w_down"), shared):
            out[theirs] = get(ours)
    if names.shared_gate:
        out[names.shared_gate] = get("w_shared_gate")
    if names.bias:
        out[names.bias] = bias_E
    return {prefix + k: v for k, v in out.items()}
