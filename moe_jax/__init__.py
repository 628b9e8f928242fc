"""moe_jax: Mixture-of-Experts layers for JAX on GPUs."""

from moe_jax.layers import MoE, MoEStats, SelectionBias, SwiGLU

__version__ = "0.1.0"

__all__ = ["MoE", "MoEStats", "SelectionBias", "SwiGLU"]
