"""Parity between `moe_jax` and an independent PyTorch/Triton reference.

`parity.reference` is the independent side: PyTorch and Triton only, never `moe_jax`, written
from the seed specification (`shared/seeds/moe-routing-to-gpu-computation.txt`). The comparison
harness that feeds the same routing through both sides lives beside it.
"""
