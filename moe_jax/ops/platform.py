"""Backends and platforms: the one registry that maps (op, backend) to an implementation.

Every op of moe_jax that has more than one implementation (`gmm`, `tgmm`, `gather_rows`, EP's
`plan_sends`) registers each under a backend name with `@register(op, backend)` and looks it up
with `implementation(op, backend)`. Backend names:

- `pallas_triton`: our Pallas kernels lowered through Triton; compiled on GPU, run with
  `interpret=True` elsewhere (see `interpret()`).
- `xla`: plain XLA (`jax.lax.ragged_dot_general`, `jnp` indexing).
- `auto`: `pallas_triton` when compiling for a GPU, else `xla`; logged once per platform.

The platform is the one being compiled for (`compile_platform`): the abstract mesh's device when
one is set (inside `shard_map`, or lowering ahead of time for a GPU from a CPU host), else JAX's
default backend. A mesh of CPU devices in a GPU process therefore counts as CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import jax

__all__ = [
    "BACKENDS",
    "BackendName",
    "GPU_PLATFORMS",
    "compile_platform",
    "implementation",
    "interpret",
    "on_gpu",
    "register",
    "resolve_backend",
]

BACKENDS = ("pallas_triton", "xla")
BackendName = Literal["auto", "pallas_triton", "xla"]
GPU_PLATFORMS = ("gpu", "cuda", "rocm")

_log = logging.getLogger("moe_jax")
_REGISTRY: dict[str, dict[str, Callable]] = {}
_announced: set[tuple[str, str]] = set()


def compile_platform() -> str:
    """The platform being compiled for (see the module docstring)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def on_gpu() -> bool:
    """Whether kernels compile for a GPU here."""
    return compile_platform() in GPU_PLATFORMS


def interpret() -> bool:
    """Whether Pallas kernels must run in interpret mode (off GPU)."""
    return not on_gpu()


def resolve_backend(backend: str) -> str:
    """The backend `backend` stands for: `auto` is `pallas_triton` on GPU, else `xla` (logged once
    per platform on the `moe_jax` logger, INFO); ValueError naming the choices otherwise."""
    if backend == "auto":
        platform = compile_platform()
        picked = "pallas_triton" if platform in GPU_PLATFORMS else "xla"
        if (platform, picked) not in _announced:
            _announced.add((platform, picked))
            _log.info("moe_jax: backend='auto' picked %r on platform %r", picked, platform)
        return picked
    if backend not in BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not a moe_jax backend; use one of 'auto', "
            + ", ".join(repr(b) for b in BACKENDS) + "."
        )
    return backend


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: record the function as `op`'s implementation on `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"register: backend={backend!r} is not one of {BACKENDS}.")

    def record(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[backend] = fn
        return fn

    return record


def implementation(op: str, backend: str) -> Callable:
    """`op`'s implementation on `backend` (`auto` resolved by `resolve_backend`)."""
    return _REGISTRY[op][resolve_backend(backend)]
