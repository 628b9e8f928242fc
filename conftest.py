"""Repository-wide pytest setup (tests/ and parity/)."""

import os

# Forced host devices for shard_map tests on CPU (EP x expert-DP up to 8); must precede the first
# jax import and is ignored by GPU backends.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# Triton picks compiled or interpreted kernels when `@triton.jit` runs, from TRITON_INTERPRET: off
# a CUDA GPU the kernels (moe_jax's `triton` backend, parity's reference) run interpreted on CPU
# tensors. Set before any test module imports triton; an explicit setting is left alone.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
