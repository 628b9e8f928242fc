"""The MoE layer a scale-out plan is made for: its widths, experts, top-k, tokens per rank, dtype.

Legend (shape suffixes throughout `moe_jax.scaleout`): T tokens per rank, D model width, F expert
hidden width, E experts, K top-k, R ranks, S slots per rank (physical experts), G groups of one
grouped GEMM (local experts or slots).
"""

from __future__ import annotations

import dataclasses

from moe_jax.ops.fp8 import row_bytes
from moe_jax.validation import check_bool, check_int

__all__ = ["LayerShape", "QWEN3_30B_A3B"]


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One routed MoE layer with SwiGLU experts (gate and up `[E, F, D]`, down `[E, D, F]`).

    d_model: D. d_ff: F, each expert's hidden width. num_experts: E. top_k: K.
    tokens_per_rank: T, the tokens each rank holds before the exchange (data split over all R
    ranks, so a step routes R*T*K rows). dtype_bytes: bytes per activation and weight element
    (2: bfloat16, 4: float32); rows move and multiply in this dtype. fp8: the routed experts in
    blockwise FP8 (`Fp8Blockwise`, as the layer runs them): their GEMMs run the FP8 kernel
    (`KernelCosts`' `*_fp8` rates, one byte per operand element) and the forward's dispatch
    all-to-all moves each row as e4m3 values with fp32 scales per 128 channels
    (`dispatch_row_bytes`); the combine, all-gathers and every backward exchange move `dtype_bytes`
    rows, and the experts read the received e4m3 rows as they arrived.
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    tokens_per_rank: int
    dtype_bytes: int = 2
    fp8: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fp8", check_bool("fp8", self.fp8))
        for name in ("d_model", "d_ff", "num_experts", "top_k", "tokens_per_rank", "dtype_bytes"):
            object.__setattr__(self, name, check_int(name, getattr(self, name)))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k = {self.top_k} exceeds num_experts = {self.num_experts}; "
                             "a token picks K distinct experts.")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes must be 2 (bfloat16) or 4 (float32); got {self.dtype_bytes}.")

    @property
    def routes_per_rank(self) -> int:
        """T*K: the rows one rank's tokens send to experts."""
        return self.tokens_per_rank * self.top_k

    @property
    def row_bytes(self) -> int:
        """D * dtype bytes: one token row on the wire or in memory."""
        return self.d_model * self.dtype_bytes

    @property
    def dispatch_row_bytes(self) -> int:
        """One row of the forward's dispatch all-to-all: `row_bytes`, or with `fp8` the e4m3 values
        and their scales (`moe_jax.ops.fp8.row_bytes(D)`: D + 4 * ceil(D / 128))."""
        return row_bytes(self.d_model) if self.fp8 else self.row_bytes

    @property
    def expert_bytes(self) -> int:
        """One expert's weights (gate, up and down: 3*D*F elements)."""
        return 3 * self.d_model * self.d_ff * self.dtype_bytes

    @property
    def dtype_name(self) -> str:
        return {2: "bfloat16", 4: "float32"}[self.dtype_bytes]

    def describe(self) -> str:
        return (f"D={self.d_model} F={self.d_ff} E={self.num_experts} top-{self.top_k} "
                f"T={self.tokens_per_rank}/rank {self.dtype_name}{' FP8 experts' if self.fp8 else ''}")


# The Qwen3-30B-A3B MoE block at 4096 tokens per rank: the shape of the committed H200 layer and
# kernel timings (benchmarks/results/2026-12-01-h200-gmm.md, ...-layer-timing.md).
QWEN3_30B_A3B = LayerShape(d_model=2048, d_ff=768, num_experts=128, top_k=8, tokens_per_rank=4096)
