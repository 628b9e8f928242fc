"""moe_jax: Mixture-of-Experts layers for JAX on GPUs."""

__version__ = "0.1.0"
