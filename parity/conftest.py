"""pytest setup for parity/: the Triton kernels compile on a CUDA GPU and are interpreted on CPU.

Triton reads `TRITON_INTERPRET` when `@triton.jit` defines a kernel, so it is set here, before any
parity test module imports triton or `parity.reference`. An explicit setting is left alone.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
