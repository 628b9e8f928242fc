"""Flax NNX layers: `MoE` (`moe`), its routed stage per mesh case (`routed`), the dense SwiGLU of
the shared experts and parameter helpers (`dense`), `MoEStats` (`stats`) and the configuration
and argument checks (`checks`)."""

from moe_jax.layers.dense import SwiGLU
from moe_jax.layers.moe import MoE, SelectionBias
from moe_jax.layers.stats import MoEStats
from moe_jax.parallel import EPOptions

__all__ = ["EPOptions", "MoE", "MoEStats", "SelectionBias", "SwiGLU"]
