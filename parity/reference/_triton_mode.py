"""How the reference's Triton kernels run: compiled on a CUDA GPU, interpreted on CPU.

Triton decides between compiling and interpreting a kernel when `@triton.jit` decorates it, by
reading the environment variable `TRITON_INTERPRET`. The variable therefore has to be set before
`parity.reference.grouped_gemm` is imported; `parity/reference/__init__.py` calls
`prefer_interpreter_without_gpu()` first for that reason.
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "on", "yes"}


def prefer_interpreter_without_gpu() -> bool:
    """Select Triton's interpreter when no CUDA GPU is visible and nobody chose a mode.

    An explicit `TRITON_INTERPRET` in the environment is respected either way (setting it to 0
    on a CPU machine is allowed; the launchers then refuse CPU tensors with a clear error).
    Returns whether the interpreter is selected.
    """
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE
