"""The layer benchmark's torch peer computes the same layer as `MoE`: on CPU in fp32, its output
and every gradient equal ours (so the GPU timings compare like with like)."""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from benchmarks.layer import torch_layer
from moe_jax.layers import GemmOptions, MoE
from moe_jax.routing import SoftmaxTopK
from moe_jax.testing import assert_close


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
