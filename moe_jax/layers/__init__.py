"""Flax NNX layers: `MoE` (`moe`; its stored FP8 expert weights are `Fp8Stored` variables, made by
`stored_fp8`), its option groups `GemmOptions`, `SharedExperts` and `Fp8Blockwise` (`options`;
expert parallelism's `EPOptions` is re-exported here), its routed stage per mesh case (`routed`),
the token layout under Explicit mesh axes (`tokens`), the dense SwiGLU of the shared experts
(`SwiGLU`; `Fp8SwiGLU` with stored FP8 weights) and parameter helpers (`dense`), `MoEStats` (`stats`) and the configuration and argument checks
(`checks`)."""

from moe_jax.layers.dense import Fp8Stored, Fp8SwiGLU, SwiGLU
from moe_jax.layers.moe import Fp8LayerCopies, MoE, SelectionBias, stored_fp8
from moe_jax.layers.options import Fp8Blockwise, GemmOptions, SharedExperts
from moe_jax.layers.stats import MoEStats
from moe_jax.parallel import EPOptions

__all__ = ["EPOptions", "Fp8Blockwise", "Fp8LayerCopies", "Fp8Stored", "Fp8SwiGLU", "GemmOptions", "MoE", "MoEStats",
           "SelectionBias", "SharedExperts", "SwiGLU", "stored_fp8"]
