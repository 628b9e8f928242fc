"""Master-weight quantization for the FP8 recipe, one room: the public op (`api`), the Pallas
kernel (`kernel`), the two backends (`backends`) and the reference (`reference`, the recipe's
own `moe_jax.ops.fp8.quantize_weights`)."""

from moe_jax.ops.quantize.api import QUANTIZE_BACKENDS, quantize_master_weights
from moe_jax.ops.quantize.reference import quantize_master_weights_reference

__all__ = ["QUANTIZE_BACKENDS", "quantize_master_weights", "quantize_master_weights_reference"]
