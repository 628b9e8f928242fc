"""Quantization for the FP8 recipe, one room: the public ops (`api`: master weights to blocks,
activation rows to tiles), the Pallas kernels (`kernel`), their two backends each (`backends`)
and the weights' reference (`reference`, the recipe's own `moe_jax.ops.fp8.quantize_weights`; the
rows' is `moe_jax.ops.fp8.quantize_rows`)."""

from moe_jax.ops.quantize.api import QUANTIZE_BACKENDS, quantize_activations, quantize_master_weights
from moe_jax.ops.quantize.reference import quantize_master_weights_reference

__all__ = ["QUANTIZE_BACKENDS", "quantize_activations", "quantize_master_weights", "quantize_master_weights_reference"]
