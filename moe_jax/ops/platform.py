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
- a `BackendTable`: `auto` with a per-kernel table of one's own for the grouped GEMMs (to run,
  say, one kernel on another backend while the rest stay as `auto` picks them); every other op
  reads it as `auto`.

The platform is the one being compiled for (`compile_platform`): the abstract mesh's device when
one is set (inside `shard_map`, or lowering ahead of time for a GPU from a CPU host), else JAX's
default backend. A mesh of CPU devices in a GPU process therefore counts as CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import jax

__all__ = [
    "BACKENDS",
    "BackendName",
    "BackendTable",
    "SHAPE_CLASSES",
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
SHAPE_CLASSES = ("decode", "prefill")

_log = logging.getLogger("moe_jax")
_REGISTRY: dict[str, dict[str, Callable]] = {}
_announced: set[tuple[str, str]] = set()


@dataclasses.dataclass(frozen=True)
class BackendTable(Mapping):
    """`backend="auto"` with its own table: for each `(kernel, shape class)` of the grouped GEMMs
    (kernels `gmm_nt`, `gmm_nn`, `tgmm`; classes `SHAPE_CLASSES`), the backends to try in order
    on a GPU (`moe_jax.ops.gmm.backend_table.gemm_backend` runs the first that runs the call).
    Pass it wherever a backend name goes (`MoE(backend=...)`, `gmm`, `tgmm`, `grouped_linear`);
    ops without per-kernel choices (row gathers, EP's send plan) and every op off GPU read it as
    `"auto"`. A read-only mapping, hashable (it sits in jit-static options); build it from a dict
    (`BackendTable.of`) or from another table (`replace`).
    """

    entries: tuple[tuple[tuple[str, str], tuple[str, ...]], ...]

    def __post_init__(self):
        for key, choices in self.entries:
            if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and key[1] in SHAPE_CLASSES):
                raise ValueError(f"BackendTable key {key!r}: use (kernel, shape class) with a class in {SHAPE_CLASSES}.")
            if not (isinstance(choices, tuple) and choices and all(c in BACKENDS for c in choices)):
                raise ValueError(f"BackendTable[{key!r}] = {choices!r}: use a non-empty tuple of backends from "
                                 f"{BACKENDS}.")
        if len({key for key, _ in self.entries}) != len(self.entries):
            raise ValueError("BackendTable: a (kernel, shape class) key appears twice.")
        # Key order carries no meaning: equal mappings are equal (and hash equal) tables.
        object.__setattr__(self, "entries", tuple(sorted(self.entries)))

    @classmethod
    def of(cls, table: Mapping) -> "BackendTable":
        """A table from a mapping `{(kernel, shape class): (backend, ...)}`."""
        return cls(tuple((tuple(k), tuple(v)) for k, v in table.items()))

    def replace(self, updates: Mapping) -> "BackendTable":
        """This table with the entries of `updates` added or replaced."""
        return BackendTable.of({**dict(self.entries), **{tuple(k): tuple(v) for k, v in updates.items()}})

    def __getitem__(self, key):
        for k, choices in self.entries:
            if k == key:
                return choices
        raise KeyError(key)

    def __iter__(self) -> Iterator:
        return (k for k, _ in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


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


def resolve_backend(backend: "str | BackendTable") -> str:
    """The backend `backend` stands for: `auto` (and a `BackendTable`) is `pallas_triton` on GPU,
    else `xla` (logged once per platform on the `moe_jax` logger, INFO); ValueError naming the
    choices otherwise, and for `triton` off GPU."""
    if isinstance(backend, BackendTable) or backend == "auto":
        platform = compile_platform()
        picked = "pallas_triton" if platform in GPU_PLATFORMS else "xla"
        if (platform, picked) not in _announced:
            _announced.add((platform, picked))
            _log.info("moe_jax: backend='auto' picked %r on platform %r", picked, platform)
        return picked
    if backend not in BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not a moe_jax backend; use one of 'auto', "
            + ", ".join(repr(b) for b in BACKENDS) + " or a BackendTable."
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
