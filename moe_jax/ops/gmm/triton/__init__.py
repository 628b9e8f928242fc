"""The `triton` backend of the grouped GEMM: official Triton kernels through jax_triton (`backend`),
their tile rules (`rules`), kernels (`kernels`) and launchers (`launch`)."""

from moe_jax.ops.gmm.triton.backend import BACKEND, have_jax_triton
from moe_jax.ops.gmm.triton.rules import gmm_tiles, tgmm_tiles

__all__ = ["BACKEND", "gmm_tiles", "have_jax_triton", "tgmm_tiles"]
