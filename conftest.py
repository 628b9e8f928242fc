"""Repository-wide pytest setup (tests/ and parity/)."""

import os
import tempfile

import torch

_ON_GPU = torch.cuda.is_available()

# Forced host devices for shard_map tests on CPU (EP x expert-DP up to 8), set before the first jax
# import and ignored by GPU backends. Off a GPU, XLA:CPU's LLVM passes also run at level 0: the
# suite is compile-bound (thousands of small programs, each run once or twice), level 0 compiles
# about a sixth faster, and it changes no result (the tests compare values, not speed). Child
# processes (spawned ranks, the example's runs) inherit the flags.
_flags = ["--xla_force_host_platform_device_count=8"] + ([] if _ON_GPU else ["--xla_backend_optimization_level=0"])
for _flag in _flags:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# Off a GPU, compiled programs are also kept in JAX's persistent compilation cache (a directory
# shared by the xdist workers and the child processes): many tests compile the same small programs
# (one layer shape checked several ways), and a hit skips XLA:CPU's compile. The cache key holds the
# program, the flags and the jax/jaxlib versions, so a hit is the executable that compiling would
# give. An explicit setting is left alone.
if not _ON_GPU and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "moe_jax_tests_xla_cache")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Triton picks compiled or interpreted kernels when `@triton.jit` runs, from TRITON_INTERPRET: off
# a CUDA GPU the kernels (moe_jax's `triton` backend, parity's reference) run interpreted on CPU
# tensors. Set before any test module imports triton; an explicit setting is left alone.
if not _ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# On a GPU, JAX's client would otherwise reserve 75% of the device's memory when it starts: a second
# xdist worker (the README's `pytest -n 2`), or torch beside JAX in the parity tests, then runs out
# of memory. Set before any test initializes a JAX backend; an explicit setting is left alone.
if _ON_GPU:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
