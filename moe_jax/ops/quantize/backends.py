"""The two backends of `quantize_master_weights`: `xla` (`fp8.quantize_weights`, and
`fp8.transpose_weights` for the transposed copy, which XLA fuses into the same loop) and
`pallas_triton` (`kernel.quantize_weights_pallas`). Both take validated master weights `w_ENK`
(bf16/fp16/fp32, E, N, K > 0) and `transposed`, and return `(Fp8Weights, transposed Fp8Weights or
None)`.

And the two of `quantize_activations`: `xla` (`fp8.quantize_rows`) and `pallas_triton`
(`kernel.quantize_rows_pallas`), on validated rows `x_MK` (M, K > 0), returning `Fp8Rows`.
"""

from __future__ import annotations

from moe_jax.ops.fp8 import quantize_rows, quantize_weights, transpose_weights
from moe_jax.ops.platform import interpret, register
from moe_jax.ops.quantize.kernel import quantize_rows_pallas, quantize_weights_pallas

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


# Rows a program: 32 x 128 tiles (8 KiB of bf16 in, 4 KiB of e4m3 out) with 4 warps.
ROWS_BLOCK_M, ROWS_NUM_WARPS = 32, 4


@register("quantize_activations", "xla")
def xla_quantize_rows(x_MK):
    return quantize_rows(x_MK)


@register("quantize_activations", "pallas_triton")
def pallas_quantize_rows(x_MK):
    return quantize_rows_pallas(x_MK, block_m=ROWS_BLOCK_M, num_warps=ROWS_NUM_WARPS, interpret=interpret())
