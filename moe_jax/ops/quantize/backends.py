"""The two backends of `quantize_master_weights`: `xla` (`fp8.quantize_weights`, and
`fp8.transpose_weights` for the transposed copy, which XLA fuses into the same loop) and
`pallas_triton` (`kernel.quantize_weights_pallas`).

Both take validated master weights `w_ENK` (bf16/fp16/fp32, E, N, K > 0) and `transposed`, and
return `(Fp8Weights, transposed Fp8Weights or None)`.
"""

from __future__ import annotations

from moe_jax.ops.fp8 import quantize_weights, transpose_weights
from moe_jax.ops.platform import interpret, register
from moe_jax.ops.quantize.kernel import quantize_weights_pallas

# Warps a program: with the transposed copy, whose store changes the block's layout through
# shared memory (16-32 KiB), 8 (0.66 against 0.69 ms at Qwen3's gate+up on an H100,
# docs/decisions.md); without it 4, already 0.87 of copy bandwidth.
NUM_WARPS = {False: 4, True: 8}


@register("quantize_master_weights", "xla")
def xla_quantize(w_ENK, transposed: bool):
    wq = quantize_weights(w_ENK)
    return wq, transpose_weights(wq) if transposed else None


@register("quantize_master_weights", "pallas_triton")
def pallas_quantize(w_ENK, transposed: bool):
    return quantize_weights_pallas(w_ENK, transposed=transposed, num_warps=NUM_WARPS[transposed], interpret=interpret())
