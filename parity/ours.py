"""Our side of the parity harness: the problem through `moe_jax`.

Legend (shape suffixes): T tokens, D model width, F routed-expert hidden width, E experts,
K experts per token (top-k), L latent width (LatentMoE), Din routed-expert input width.

`make_layer` builds `moe_jax.layers.MoE` for the configuration and loads the problem's weights
through `nnx.state`/`nnx.update` (`load_state`); `make_our_step` / `run_ours` inject the routing
as a `moe_jax.routing.Routing` and differentiate with `jax.vjp` w.r.t. x, the routing weights and
every parameter; with `ep_size > 1` the layer runs expert-parallel on a mesh (`ep_mesh`).
`run_router_ours` runs the configuration's `moe_jax.routing` router on the problem's logits.

Precision: fp32 runs with `Precision.HIGHEST` passed to the layer; bf16 runs the layer in bf16
(params and activations). With `config.fp8` the routed experts run DeepSeek-V3's blockwise FP8
(`GemmOptions(quantization=Fp8Blockwise())`). jax runs on its default device, or on the mesh
`ep_mesh` picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax import routing as jrouting
from parity.config import ROUTED_SCALING_FACTOR, ParityConfig, router_groups
from parity.problem import ParityProblem, grad_name, layer_tensor_names


def jax_router(config: ParityConfig):
    """The `moe_jax.routing` router named by `config.router`."""
    k = config.top_k
    if config.router == "selected_softmax":
        return jrouting.SelectedSoftmax(k)
    if config.router == "softmax_topk":
        return jrouting.SoftmaxTopK(k, renormalize=True)
    n_group, topk_group = router_groups(config.num_experts, k)
    return jrouting.SigmoidGroupedTopK(
        k, n_group=n_group, topk_group=topk_group, normalize=True,
        routed_scaling_factor=ROUTED_SCALING_FACTOR,
    )


def jax_precision(config: ParityConfig):
    """HIGHEST for fp32 (no TF32 anywhere), the default for bf16."""
    return jax.lax.Precision.HIGHEST if config.dtype == "float32" else None


def _ep_devices(config: ParityConfig) -> list:
    """The first `config.ep_size` devices of the default platform, else of the host's CPU."""
    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= config.ep_size:
            return devices[: config.ep_size]
    raise ValueError(
        f"ep_size={config.ep_size} needs {config.ep_size} devices but jax sees {jax.device_count()} "
        f"{jax.default_backend()} and {len(jax.devices('cpu'))} CPU devices; set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={config.ep_size} before jax starts "
        "(python -m parity does so), or lower ep_size."
    )


def ep_mesh(config: ParityConfig, devices: list | None = None):
    """The `("data", "ep")` mesh of `config.ep_size` devices (data=1), or None for ep_size=1.

    Devices: `devices` when given, else the default platform's when it has ep_size of them, else
    the host's CPU devices (forced by XLA_FLAGS=--xla_force_host_platform_device_count, which the
    root conftest and `python -m parity` set), as tests/test_layers_parallel.py does: a one-GPU
    host then runs the EP layer on CPU, where backend "auto" picks XLA and only the "padded" exchange exists.
    Raises ValueError when there are too few devices, or when `ep_strategy="ragged"` would run on
    devices other than GPUs.
    """
    if config.ep_size == 1:
        return None
    from moe_jax.parallel import make_mesh

    devices = _ep_devices(config) if devices is None else list(devices)
    platform = devices[0].platform
    # XLA:CPU has no ragged_all_to_all: fail here, not with a JaxRuntimeError mid-compile.
    if config.ep_strategy == "ragged" and platform != "gpu":
        raise ValueError(
            f"ep_strategy='ragged' needs {config.ep_size} GPUs (ragged_all_to_all), but the EP mesh "
            f"would run on {platform}; use ep_strategy='padded' (--ep-strategy padded) or a host "
            f"with {config.ep_size} GPUs."
        )
    return make_mesh(ep=config.ep_size, data=1, devices=devices)


def _on_mesh_platform(mesh):
    """Context that puts arrays made without a sharding on `mesh`'s first device (jax's default
    device without a mesh): a CPU mesh in a GPU process (see `ep_mesh`) must get its inputs and
    its selection bias on the CPU, where the jitted step then moves them across the mesh."""
    return jax.default_device(None if mesh is None else mesh.devices.flat[0])


def make_layer(config: ParityConfig, params: dict[str, np.ndarray]):
    """A `moe_jax.layers.MoE` for `config` holding `params` (see `load_state`).

    Built abstractly (`nnx.eval_shape`): the random initialisation it skips would be overwritten
    anyway, and eagerly it costs seconds per layer on CPU.
    """
    from moe_jax.layers import EPOptions, Fp8Blockwise, GemmOptions, MoE, SharedExperts

    dtype = jnp.dtype(config.dtype)
    mesh = ep_mesh(config)
    model = nnx.eval_shape(lambda: MoE(
        config.d_model, config.d_ff, config.num_experts, config.top_k,
        router=jax_router(config),
        shared_experts=SharedExperts(config.shared_experts, d_ff=config.shared_d_ff) if config.shared_experts else None,
        latent_dim=config.latent_dim,
        dtype=dtype,
        param_dtype=dtype,
        gemm=GemmOptions(backend=config.backend, precision=jax_precision(config), fused_gate_up=config.fused_gate_up,
                         quantization=Fp8Blockwise() if config.fp8 else None),
        mesh=mesh,
        expert_parallel=EPOptions(strategy=config.ep_strategy),
        rngs=nnx.Rngs(config.seed),
    ))
    with _on_mesh_platform(mesh):
        load_state(model, params)
    return model


def _path_name(path) -> str:
    return ".".join(str(p) for p in path)


def load_state(model, params: dict[str, np.ndarray]) -> None:
    """Fill `model`'s variables: every nnx.Param from `params` (keys: paths joined by "."), in
    the parameter's dtype and mesh sharding; every other variable (the loss-free selection bias)
    with zeros, its initial value.

    Raises ValueError when the layer's parameter names or shapes differ from the problem's.
    """
    param_state, other_state = nnx.state(model, nnx.Param, nnx.Not(nnx.Param))
    flat = list(nnx.to_flat_state(param_state))
    names = {_path_name(path) for path, _ in flat}
    if names != set(params):
        raise ValueError(
            f"the layer's parameters {sorted(names)} differ from the harness's {sorted(params)}; "
            "align parity.problem.param_shapes with moe_jax.layers.MoE."
        )
    for path, var in flat:
        name, current = _path_name(path), var.get_value()  # an array or a ShapeDtypeStruct
        if tuple(current.shape) != params[name].shape:
            raise ValueError(
                f"parameter {name}: the layer has shape {tuple(current.shape)}, the harness "
                f"{params[name].shape}; align parity.problem.param_shapes with moe_jax.layers.MoE."
            )
        value = params[name].astype(current.dtype)
        sharding = getattr(current, "sharding", None)
        var.set_value(jnp.asarray(value) if sharding is None else jax.device_put(value, sharding))
    for _, var in nnx.to_flat_state(other_state):
        current = var.get_value()
        var.set_value(jnp.zeros(current.shape, current.dtype))
    nnx.update(model, param_state, other_state)


def make_our_step(config: ParityConfig, problem: ParityProblem):
    """`(step, args)`: `step(*args)` is a jitted forward + vjp of our layer on the problem.

    It returns `{name: array}` keyed like `layer_tensor_names`. Kept separate from `run_ours` so
    that timing can call the same compiled function repeatedly.
    """
    model = make_layer(config, problem.params)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    dtype = jnp.dtype(config.dtype)

    def step(params, x_TD, weights_TK, expert_idx_TK, probs_TE, dy_TD):
        def forward(params, x_TD, weights_TK):
            layer = nnx.merge(graphdef, params, rest)
            y_TD, _ = layer(x_TD, routing=jrouting.Routing(expert_idx_TK, weights_TK, probs_TE))
            return y_TD

        y_TD, vjp = jax.vjp(forward, params, x_TD, weights_TK)
        d_params, dx_TD, d_weights_TK = vjp(dy_TD.astype(y_TD.dtype))
        out = {"y": y_TD, "dx": dx_TD, "d_weights": d_weights_TK}
        for path, var in nnx.to_flat_state(d_params):
            out[grad_name(_path_name(path))] = var[...]
        return out

    with _on_mesh_platform(model.mesh):
        args = (
            params,
            jnp.asarray(problem.x_TD, dtype),
            jnp.asarray(problem.weights_TK),
            jnp.asarray(problem.expert_idx_TK),
            jnp.asarray(problem.probs_TE),
            jnp.asarray(problem.dy_TD, dtype),
        )
    return jax.jit(step), args


def run_ours(config: ParityConfig, problem: ParityProblem) -> dict[str, jax.Array]:
    """Our layer's output and gradients: `{name: jax array}` for `layer_tensor_names(config)`."""
    step, args = make_our_step(config, problem)
    out = step(*args)
    return {name: out[name] for name in layer_tensor_names(config)}


def run_router_ours(config: ParityConfig, problem: ParityProblem) -> dict[str, jax.Array]:
    """`moe_jax.routing` on `problem.logits_TE`: choice, weights, probs, losses, gradients.

    The gradients are those of `sum(weights * d_weights_TK) + sum(probs * d_probs_TE)`.
    """
    router = jax_router(config)
    d_weights_TK = jnp.asarray(problem.d_weights_TK)
    d_probs_TE = jnp.asarray(problem.d_probs_TE)

    def route(logits_TE):
        r = router.route(logits_TE)
        return jnp.sum(r.weights_TK * d_weights_TK) + jnp.sum(r.probs_TE * d_probs_TE), r

    logits_TE = jnp.asarray(problem.logits_TE)
    (_, r), d_logits_TE = jax.value_and_grad(route, has_aux=True)(logits_TE)
    x_TD = jnp.asarray(problem.x_TD, jnp.float32)
    return {
        "router.expert_idx": r.expert_idx_TK,
        "router.weights": r.weights_TK,
        "router.probs": r.probs_TE,
        "router.aux_loss": jrouting.aux_loss(r.probs_TE, r.expert_idx_TK),
        "router.z_loss": jrouting.z_loss(logits_TE),
        "router.d_logits": d_logits_TE,
        # logits = x W_router^T, so dL/dW_router = d_logits^T x.
        "router.d_w_router": jnp.matmul(d_logits_TE.T, x_TD, precision=jax.lax.Precision.HIGHEST),
    }
