"""Platforms, device facts and the backend names: what every op of moe_jax asks before it runs.

Backend names (`BACKENDS`; the grouped GEMM finds each one's implementation in the folder or
module of that name under `moe_jax/ops/gmm/`, so adding a backend is that folder plus its name
here):

- `pallas_triton`: our Pallas kernels lowered through Triton; compiled on GPU, run with
  `interpret=True` elsewhere (see `interpret()`).
- `triton`: official Triton kernels (`triton.jit`) called through `jax_triton.triton_call`; GPU
  only (jax_triton imports only with a CUDA jaxlib). Ops without a Triton kernel (`gather_rows`,
  `plan_sends`) run their `pallas_triton` implementation there.
- `mosaic_gpu`: Pallas Mosaic GPU kernels (TMA, wgmma, warp specialization); compiled on GPU, run
  in Pallas's GPU interpret mode elsewhere.
- `xla`: plain XLA (`jax.lax.ragged_dot_general`, `jnp` indexing).
- `auto`: on a GPU, per grouped-GEMM kernel from a table (`moe_jax.ops.gmm.plan`), `pallas_triton`
  for the other ops; `xla` elsewhere.
- a `BackendTable`: `auto` with a per-kernel table of one's own for the grouped GEMMs; every other
  op reads it as `auto`.

Ops other than the grouped GEMM (the row gather, EP's send plan) register one function per backend
with `@register(op, backend)` and look it up with `implementation(op, backend)`.

The platform is the one being compiled for (`compile_platform`): the abstract mesh's device when
one is set (inside `shard_map`, or lowering ahead of time for a GPU from a CPU host), else the
default device a caller set (`jax.default_device`, where JAX places uncommitted arrays and their
computations), else JAX's default backend. A mesh of CPU devices in a GPU process therefore counts
as CPU, and so does code under `jax.default_device(cpu)` there: its kernels run in interpret mode
on the CPU arrays instead of failing to compile GPU kernels for them.

`device_facts()` gives the limits the kernels' resource models are checked against: shared memory
per block (the opt-in maximum of the CUDA C++ Programming Guide's table "Technical Specifications
per Compute Capability") and the multiprocessor count.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Literal, NamedTuple

import jax

__all__ = [
    "BACKENDS",
    "BackendName",
    "BackendTable",
    "DeviceFacts",
    "GPU_PLATFORMS",
    "SHAPE_CLASSES",
    "compile_platform",
    "device_facts",
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

# Shared memory per block, opt-in maximum, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"); sm_90 is 227 KiB.
_SMEM_PER_BLOCK = {(7, 0): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                   (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024, (10, 3): 227 * 1024,
                   (12, 0): 99 * 1024}
_SMEM_UNKNOWN = 99 * 1024  # the smallest of sm_80 and later: an unknown GPU gets configs that fit every one
# Device kinds whose compute capability an abstract device (lowering ahead of time) does not carry.
_KIND_CAPABILITY = {"NVIDIA H100": (9, 0), "NVIDIA H200": (9, 0), "NVIDIA GH200": (9, 0), "NVIDIA H800": (9, 0),
                    "NVIDIA A100": (8, 0), "NVIDIA A800": (8, 0), "NVIDIA A10": (8, 6), "NVIDIA L4": (8, 9),
                    "NVIDIA L40": (8, 9), "NVIDIA B200": (10, 0), "NVIDIA GB200": (10, 0)}
_H200_SMS = 132


class DeviceFacts(NamedTuple):
    """What the kernels' resource models are checked against, for the device compiled for."""

    kind: str  # device_kind, e.g. "NVIDIA H200"
    capability: tuple[int, int] | None  # CUDA compute capability, None when unknown
    smem_per_block: int  # bytes of shared memory one block may use (opt-in maximum)
    num_sms: int  # multiprocessors (CTAs of a persistent grid)


@dataclasses.dataclass(frozen=True)
class BackendTable(Mapping):
    """`backend="auto"` with its own table: for each `(kernel, shape class)` of the grouped GEMMs
    (kernels `gmm_nt`, `gmm_nn`, `tgmm`; classes `SHAPE_CLASSES`), the backends to try in order
    on a GPU (`moe_jax.ops.gmm.plan` runs the first that supports the call). Pass it wherever a
    backend name goes (`gmm`, `tgmm`, `grouped_linear`, `MoE(gemm=GemmOptions(backend=...))`); ops without
    per-kernel choices (row gathers, EP's send plan) and every op off GPU read it as `"auto"`. A
    read-only mapping, hashable (it sits in jit-static options); build it from a dict with
    `BackendTable.of` or from another table with `replace`.
    """

    entries: tuple[tuple[tuple[str, str], tuple[str, ...]], ...]

    def __post_init__(self):
        if isinstance(self.entries, Mapping) or not isinstance(self.entries, tuple):
            raise TypeError("BackendTable takes a tuple of ((kernel, shape class), backends) entries; build one from a "
                            "dict with BackendTable.of({...}).")
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
        if not isinstance(table, Mapping):
            raise TypeError(f"BackendTable.of takes a mapping {{(kernel, shape class): (backend, ...)}}; got "
                            f"{type(table).__name__}.")
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


def _compile_device():
    """The abstract mesh's device when one is set, else None (JAX's default backend)."""
    return jax.sharding.get_abstract_mesh().abstract_device


def compile_platform() -> str:
    """The platform being compiled for (see the module docstring)."""
    device = _compile_device()
    if device is not None:
        return device.platform
    default = jax.config.jax_default_device  # a Device, a platform name, or None (unset)
    if default is not None:
        return default if isinstance(default, str) else default.platform
    return jax.default_backend()


def on_gpu() -> bool:
    """Whether kernels compile for a GPU here."""
    return compile_platform() in GPU_PLATFORMS


def interpret() -> bool:
    """Whether Pallas kernels must run in interpret mode (off GPU)."""
    return not on_gpu()


def _capability(kind: str, local) -> tuple[int, int] | None:
    if local is not None and getattr(local, "compute_capability", None):
        major, minor = str(local.compute_capability).split(".")[:2]
        return int(major), int(minor)
    return next((cc for name, cc in sorted(_KIND_CAPABILITY.items(), key=lambda kv: -len(kv[0]))
                 if kind.startswith(name)), None)


def device_facts() -> DeviceFacts:
    """`DeviceFacts` of the device compiled for: an abstract mesh's device (lowering ahead of time;
    its kind gives the compute capability, its `num_cores` the SMs, else an H200's 132) or the
    first local device. Off GPU: an H200's limits, so that interpret mode runs the configurations
    an H200 would (and the resource checks say what would fit there)."""
    abstract = _compile_device()
    if not on_gpu():
        return DeviceFacts("cpu (modelled as an NVIDIA H200)", (9, 0), _SMEM_PER_BLOCK[(9, 0)], _H200_SMS)
    if abstract is not None:
        kind, local, sms = abstract.device_kind, None, getattr(abstract, "num_cores", None)
    else:
        local = jax.devices()[0]
        kind, sms = local.device_kind, getattr(local, "core_count", None)
    capability = _capability(kind, local)
    smem = _SMEM_PER_BLOCK.get(capability, _SMEM_UNKNOWN)
    return DeviceFacts(kind, capability, smem, sms or _H200_SMS)


def resolve_backend(backend: "str | BackendTable") -> str:
    """The backend a non-GEMM op runs for `backend`: `auto` (and a `BackendTable`) is
    `pallas_triton` on GPU, else `xla` (logged once per platform on the `moe_jax` logger, INFO);
    ValueError naming the choices otherwise, and for `triton` off GPU."""
    if isinstance(backend, BackendTable) or backend == "auto":
        platform = compile_platform()
        picked = "pallas_triton" if platform in GPU_PLATFORMS else "xla"
        if (platform, picked) not in _announced:
            _announced.add((platform, picked))
            _log.info("moe_jax: backend='auto' picked %r on platform %r", picked, platform)
        return picked
    if not isinstance(backend, str) or backend not in BACKENDS:
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
