"""moe_jax: Mixture-of-Experts layers for JAX on GPUs."""

from moe_jax.layers import EPOptions, GemmOptions, MoE, MoEStats, SelectionBias, SharedExperts, SwiGLU

__version__ = "0.1.0"

__all__ = ["EPOptions", "GemmOptions", "MoE", "MoEStats", "SelectionBias", "SharedExperts", "SwiGLU"]
