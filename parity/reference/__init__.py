"""Independent PyTorch/Triton reference of the MoE path (it never imports `moe_jax`).

Written from docs/reference-algorithm.md: routing -> packing by expert -> Triton grouped GEMM (NT
layout) -> SwiGLU -> grouped GEMM -> weighted combine, with the explicit backward of each step,
torch-autograd versions of the same graph, plain loop oracles, routers and balancing terms, and
DeepSeek-V3's blockwise FP8 recipe (`fp8`: quantization, the recipe's grouped GEMM, its autograd
layer) for the FP8 layer's parity.

Shape legend used throughout:
    T  tokens                        D  model width
    F  expert hidden width           E  experts
    K  experts per token (top-k)     P  = T*K packed token-expert pairs

`grouped_gemm` and `loops.grouped_*` use a GEMM's own legend instead: M rows, K reduction width,
N output width, E experts (groups).

Layouts: `w_gate[E, F, D]`, `w_up[E, F, D]`, fused `w_gate_up[E, 2F, D]` (gate rows first),
`w_down[E, D, F]`, router `w_router[E, D]`; grouped GEMM weights `b[E, N, K]` (`a_e @ b[e]^T`).

Execution: on a CUDA GPU the Triton kernels compile; without one, importing this package sets
`TRITON_INTERPRET=1` (unless the variable is already set) before the kernels are defined, and the
kernels then run under Triton's interpreter on CPU tensors.
"""

from parity.reference._triton_mode import prefer_interpreter_without_gpu

prefer_interpreter_without_gpu()

from parity.reference.experts import (  # noqa: E402  (the mode must be chosen first)
    ExpertPathCache,
    Packing,
    acc_dtype,
    expert_swiglu,
    fuse_gate_up,
    moe_experts_autograd,
    moe_experts_autograd_fused,
    pack_by_expert,
    selected_expert_path_backward,
    selected_expert_path_backward_fused,
    selected_expert_path_forward,
    selected_expert_path_forward_fused,
    split_gate_up,
    swiglu,
)
from parity.reference.fp8 import (  # noqa: E402
    Fp8GroupedLinear,
    Fp8Rows,
    Fp8Weights,
    dequantize_rows,
    dequantize_weights,
    fp8_grouped_linear,
    fp8_grouped_mm,
    quantize_rows,
    quantize_weights,
)
from parity.reference.grouped_gemm import (  # noqa: E402
    SUPPORTED_DTYPES,
    GroupedLinear,
    grouped_linear,
    grouped_mm,
    grouped_mm_backward,
    grouped_weight_grad,
    interpreting,
    make_contiguous_schedule,
)
from parity.reference.loops import (  # noqa: E402
    grouped_mm_loop,
    grouped_weight_grad_loop,
    moe_experts_loop,
    swiglu_expert,
)
from parity.reference.routers import (  # noqa: E402
    aux_loss,
    expert_counts,
    route_selected_softmax,
    route_sigmoid_grouped,
    route_softmax_topk,
    router_logits,
    selected_router_backward,
    update_selection_bias,
    z_loss,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "ExpertPathCache",
    "Fp8GroupedLinear",
    "Fp8Rows",
    "Fp8Weights",
    "GroupedLinear",
    "Packing",
    "acc_dtype",
    "aux_loss",
    "dequantize_rows",
    "dequantize_weights",
    "expert_counts",
    "expert_swiglu",
    "fp8_grouped_linear",
    "fp8_grouped_mm",
    "fuse_gate_up",
    "grouped_linear",
    "grouped_mm",
    "grouped_mm_backward",
    "grouped_mm_loop",
    "grouped_weight_grad",
    "grouped_weight_grad_loop",
    "interpreting",
    "make_contiguous_schedule",
    "moe_experts_autograd",
    "moe_experts_autograd_fused",
    "moe_experts_loop",
    "pack_by_expert",
    "prefer_interpreter_without_gpu",
    "quantize_rows",
    "quantize_weights",
    "route_selected_softmax",
    "route_sigmoid_grouped",
    "route_softmax_topk",
    "router_logits",
    "selected_expert_path_backward",
    "selected_expert_path_backward_fused",
    "selected_expert_path_forward",
    "selected_expert_path_forward_fused",
    "selected_router_backward",
    "split_gate_up",
    "swiglu",
    "swiglu_expert",
    "update_selection_bias",
    "z_loss",
]
