"""Checks of the MoE layer's configuration and call arguments (shared by its modules).

Everything here is static: it reads shapes, dtypes and Python configuration, never traced values
(an injected routing's expert ids are read only where they are concrete host-readable arrays).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from moe_jax import routing as routing_lib
from moe_jax.ops import SUPPORTED_DTYPES
from moe_jax.parallel import AxisRules

__all__ = ["ROUTERS", "check_axis_rules", "check_input", "check_layer_mesh", "check_mask", "check_placement",
           "check_router", "check_routing", "check_token_split", "compute_dtype", "float_dtype"]

ROUTERS = (routing_lib.SelectedSoftmax, routing_lib.SoftmaxTopK, routing_lib.SigmoidGroupedTopK)


def float_dtype(name: str, dtype, *, allow_none: bool = False, compute: bool = False):
    """`dtype` as a floating `jnp.dtype` (None passes when `allow_none`); TypeError otherwise.
    With `compute`, only the dtypes the grouped GEMMs run in (bfloat16, float16, float32)."""
    if dtype is None and allow_none:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{name}={dtype!r} is not a dtype; use e.g. jnp.float32 or jnp.bfloat16.") from exc
    if not jnp.issubdtype(dt, jnp.floating) or (compute and dt not in SUPPORTED_DTYPES):
        allowed = "bfloat16, float16 or float32" if compute else "a floating dtype (float32, bfloat16, ...)"
        raise TypeError(f"{name}={dt.name} is not supported; use {allowed}.")
    return dt


def check_router(router, top_k: int, num_experts: int):
    """The layer's router: `router`, or `SoftmaxTopK(top_k, renormalize=True)` for None."""
    if router is None:
        return routing_lib.SoftmaxTopK(top_k, renormalize=True)
    if not isinstance(router, ROUTERS):
        raise TypeError(
            f"router={router!r}: must be a moe_jax.routing router (SelectedSoftmax, SoftmaxTopK or SigmoidGroupedTopK)."
        )
    if router.top_k != top_k:
        raise ValueError(f"router.top_k={router.top_k} differs from top_k={top_k}; build the router with top_k={top_k}.")
    # The router checks itself against E (e.g. n_group must divide E) when it sees logits;
    # tracing it abstractly runs those checks now, at construction.
    jax.eval_shape(lambda: router.route(jnp.zeros((1, num_experts), jnp.float32)))
    return router


def check_axis_rules(axis_rules) -> AxisRules | None:
    """`axis_rules` if it is None or an `AxisRules`, else TypeError."""
    if axis_rules is not None and not isinstance(axis_rules, AxisRules):
        raise TypeError(f"axis_rules must be a moe_jax.parallel.AxisRules or None; got {type(axis_rules).__name__}.")
    return axis_rules


def check_layer_mesh(mesh, rules: AxisRules, num_experts: int, d_ff: int, backend: str) -> tuple[int, int]:
    """The ep and etp sizes of the layer's `mesh` under `rules` (1, 1 without a mesh)."""
    if mesh is None:
        return 1, 1
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r}: must be a jax.sharding.Mesh (e.g. from moe_jax.parallel.make_mesh).")
    ep = rules.check(mesh, num_experts)
    etp = rules.check_expert_tensor(mesh, d_ff)
    if backend in ("pallas_triton", "mosaic_gpu") and mesh.devices.flat[0].platform != "gpu":
        # JAX's Pallas interpreters pad with mesh-invariant constants, which shard_map's
        # varying-axis check rejects; compiled GPU kernels are fine.
        raise ValueError(
            f"backend={backend!r} on a mesh of CPU devices would run the kernels in interpret "
            "mode inside shard_map, which JAX cannot do; use backend='auto' or 'xla' on CPU meshes."
        )
    return ep, etp


def check_placement(placement, mesh, rules: AxisRules, num_experts: int) -> int:
    """The rows of the routed experts' weight stacks: E without a placement, else its R*S slots,
    after checking that `placement` (from `EPOptions(placement=...)`) fits the layer: the layer has
    a mesh whose expert axis has size R > 1, and the placement places its E experts."""
    if placement is None:
        return num_experts
    axis = rules.experts
    ep = dict(mesh.shape).get(axis, 1) if isinstance(mesh, Mesh) and axis is not None else 1
    if ep == 1:
        raise ValueError(
            f"expert_parallel=EPOptions(placement=...) needs expert parallelism: build the layer with mesh= a "
            f"jax.sharding.Mesh whose expert axis (axis_rules.experts = {axis!r}) has the placement's "
            f"{placement.num_ranks} ranks (e.g. make_mesh(ep={placement.num_ranks})), or drop the placement."
        )
    if placement.num_ranks != ep:
        raise ValueError(
            f"expert_parallel=EPOptions(placement=...) has {placement.num_ranks} ranks but the mesh's {axis!r} axis has "
            f"size {ep}; plan it with num_ranks={ep} (plan_placement(load_E, {ep}, slots_per_rank))."
        )
    if placement.num_experts != num_experts:
        raise ValueError(
            f"expert_parallel=EPOptions(placement=...) places {placement.num_experts} experts but num_experts="
            f"{num_experts}; plan it from a load of the layer's {num_experts} experts."
        )
    return placement.num_slots


def check_input(x, d_model: int):
    """The layer's `x` as a JAX array `[B, S, D]` or `[T, D]` of a float dtype.

    NumPy arrays are converted as JAX converts them (float64 becomes float32 unless x64 is on);
    anything else that is not an array (a list, a torch tensor) is a TypeError.
    """
    if isinstance(x, np.ndarray):
        x = jnp.asarray(x)
    elif not isinstance(x, jax.Array):
        raise TypeError(f"x must be a JAX or NumPy array [B, S, D] or [T, D]; got {type(x).__name__}. Convert it "
                        "first, e.g. jnp.asarray(x).")
    if x.ndim not in (2, 3) or x.shape[-1] != d_model:
        raise ValueError(f"x must be [B, S, D] or [T, D] with D = d_model = {d_model}; got shape {tuple(x.shape)}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x.dtype={jnp.dtype(x.dtype).name}: the layer's input must be a float array.")
    return x


def check_mask(mask, lead_shape: tuple[int, ...]):
    """`mask` (None, or bool with the leading shape of `x`) as a JAX array."""
    if mask is None:
        return None
    if not isinstance(mask, (jax.Array, np.ndarray)):
        raise TypeError(f"mask must be a bool JAX or NumPy array of shape {tuple(lead_shape)} (True = real token); "
                        f"got {type(mask).__name__}. Convert it first, e.g. jnp.asarray(mask).")
    mask = jnp.asarray(mask)
    if mask.shape != tuple(lead_shape):
        raise ValueError(f"mask must have shape {tuple(lead_shape)} (x without its last axis); got {tuple(mask.shape)}.")
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be a bool array (True = real token); got dtype {mask.dtype}. Pass "
                        "mask.astype(bool) if nonzero means real.")
    return mask


def compute_dtype(x, dtype):
    """The layer's compute dtype: `dtype`, or x's when None (one the grouped GEMMs run in)."""
    if dtype is None:
        dtype = float_dtype("x.dtype (the compute dtype when dtype=None)", x.dtype, compute=True)
    return dtype


def check_token_split(num_tokens: int, mesh, rules: AxisRules) -> None:
    """ValueError unless the T tokens split evenly over the rules' token axes of `mesh`."""
    shards = rules.token_shards(mesh)
    if num_tokens % shards:
        raise ValueError(
            f"{num_tokens} tokens cannot be split over the {shards} devices of the mesh axes {rules.tokens}; pad "
            f"the batch to a multiple of {shards} tokens (mask the padding)."
        )


def check_routing(routing, num_tokens: int, top_k: int, num_experts: int) -> None:
    """TypeError or ValueError unless an injected `routing` is a `Routing` with the shapes and dtypes
    of the layer's T tokens, and (where its values are concrete) expert ids in `[0, E)`."""
    if not isinstance(routing, routing_lib.Routing):
        raise TypeError(f"routing must be a moe_jax.routing.Routing(expert_idx_TK, weights_TK, probs_TE); got "
                        f"{type(routing).__name__}. Wrap the three arrays: Routing(*routing).")
    expected = {
        "expert_idx_TK": (num_tokens, top_k),
        "weights_TK": (num_tokens, top_k),
        "probs_TE": (num_tokens, num_experts),
    }
    for name, shape in expected.items():
        value = getattr(routing, name)
        if not isinstance(value, (jax.Array, np.ndarray)):
            raise TypeError(f"routing.{name} must be a JAX or NumPy array; got {type(value).__name__}.")
        got = tuple(value.shape)
        if got != shape:
            raise ValueError(f"routing.{name} must have shape {shape} for {num_tokens} tokens; got {got}.")
    if not jnp.issubdtype(routing.expert_idx_TK.dtype, jnp.integer):
        raise TypeError(f"routing.expert_idx_TK must hold integer expert ids; got dtype {routing.expert_idx_TK.dtype}.")
    for name in ("weights_TK", "probs_TE"):
        if not jnp.issubdtype(getattr(routing, name).dtype, jnp.floating):
            raise TypeError(f"routing.{name} must be a float array; got dtype {getattr(routing, name).dtype}.")
    idx = routing.expert_idx_TK
    concrete = not isinstance(idx, jax.core.Tracer) and getattr(idx, "is_fully_addressable", True)
    if concrete and idx.size:
        # Concrete ids are checked here; traced ones cannot be (no host round trip under jit): those
        # outside [0, E) reach no expert and count in MoEStats.dropped (see MoE.__call__).
        idx = np.asarray(idx)
        bad = (idx < 0) | (idx >= num_experts)
        if bad.any():
            t, k = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"routing.expert_idx_TK holds {int(bad.sum())} expert id(s) outside [0, num_experts={num_experts}), "
                f"first at [{t}, {k}] = {int(idx[t, k])}; every route must name one of the layer's experts (mask "
                "the token instead of giving it an invalid id)."
            )
