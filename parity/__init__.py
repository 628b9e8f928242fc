"""Parity between `moe_jax` and an independent PyTorch/Triton reference.

`parity.reference` is the independent side: PyTorch and Triton only, never `moe_jax`, written
from the algorithm in docs/reference-algorithm.md. The comparison
harness that feeds the same routing through both sides lives beside it.
"""
