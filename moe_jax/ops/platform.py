"""Backends and platforms: the one registry that maps (op, backend) to an implementation.

Every op of moe_jax that has more than one implementation (`gmm`, `tgmm`, `gather_rows`, EP's
`plan_sends`) registers each under a backend name with `@register(op, backend)` and looks it up
with `implementation(op, backend)`. Backend names:

- `pallas_triton`: our Pallas kernels lowered through Triton; compiled on GPU, run with
  `interpret=True` elsewhere (see `interpret()`).
- `triton`: official Triton kernels (`triton.jit`) called through `jax_triton.triton_call`; GPU
  only (jax_triton imports only with a CUDA jaxlib). Implemented for `gmm` and `tgmm`; ops without
  a Triton kernel (`gather_rows`, `plan_sends`) run their `pallas_triton` implementation there.
- `mosaic_gpu`: Pallas Mosaic GPU kernels (TMA, wgmma, warp specialization) for `gmm` and `tgmm`;
  compiled on GPU, run in Pallas's GPU interpret mode elsewhere. Ops without a Mosaic GPU kernel
  (`gather_rows`, `plan_sends`) run their `pallas_triton` implementation there.
- `xla`: plain XLA (`jax.lax.ragged_dot_general`, `jnp` indexing).
- `auto`: `pallas_triton` when compiling for a GPU, else `xla`; logged once per platform. The
  grouped GEMMs refine it per kernel on a GPU (`moe_jax.ops.gmm.backend_table`).

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

BACKENDS = ("pallas_triton", "triton", "mosaic_gpu", "xla")
BackendName = Literal["auto", "pallas_triton", "triton", "mosaic_gpu", "xla"]
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
    per platform on the `moe_jax` logger, INFO); ValueError naming the choices otherwise, and for
    `triton` off GPU."""
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
    if backend == "triton" and not on_gpu():
        raise ValueError(
            f"backend='triton' runs official Triton kernels through jax_triton, which needs a CUDA GPU; "
            f"compiling for {compile_platform()!r}, use backend='auto', 'pallas_triton' (interpret mode) or 'xla'."
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
    """`op`'s implementation on `backend` (`auto` resolved by `resolve_backend`); an op with no
    `triton` or `mosaic_gpu` kernel runs its `pallas_triton` one on that backend."""
    impls = _REGISTRY[op]
    name = resolve_backend(backend)
    return impls[name] if name in impls or name == "xla" else impls["pallas_triton"]
