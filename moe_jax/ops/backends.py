"""The GEMM-backend seam: one place that maps a backend name to its `gmm`/`tgmm` implementations.

Every backend receives validated arguments (see `grouped_linear`) with `M, N, K > 0` and returns
the documented result, including zero rows past `sum(group_sizes)` and exact zeros for the
weight gradient of an empty group.

- `pallas_triton`: our Pallas kernels, compiled by Triton on GPU, `interpret=True` elsewhere.
- `xla`: `jax.lax.ragged_dot_general`, XLA's grouped dot (reference and fallback).
"""

from __future__ import annotations

import logging
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.ops import kernels as _kernels
from moe_jax.ops.config import TileConfig, gmm_config, tgmm_config
from moe_jax.ops.metadata import clamp_group_sizes, make_group_metadata

BackendName = Literal["auto", "pallas_triton", "xla"]

_log = logging.getLogger("moe_jax")


class GemmBackend(NamedTuple):
    """`gmm(lhs, rhs, group_sizes, *, transpose_rhs, config, out_dtype, precision)` and
    `tgmm(lhs, dout, group_sizes, *, config, out_dtype, precision)`."""

    gmm: Callable[..., jax.Array]
    tgmm: Callable[..., jax.Array]


def _platform() -> str:
    """The platform we are compiling for: the abstract mesh's device when one is set (inside
    `shard_map`, or AOT lowering for a GPU from a CPU host), else the default backend. A mesh of
    CPU devices in a GPU process therefore counts as CPU."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _on_gpu() -> bool:
    """Whether kernels compile for a GPU; elsewhere they interpret."""
    return _platform() in _GPU_PLATFORMS


def _pallas_gmm(lhs, rhs, group_sizes, *, transpose_rhs, config: TileConfig | None, out_dtype, precision):
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    config = config or gmm_config(m, n, k, rhs.shape[0])
    if config.by_group:
        return _kernels.gmm_by_group_pallas(
            lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, config=config, out_dtype=out_dtype,
            precision=precision, interpret=not _on_gpu(),
        )
    meta = make_group_metadata(group_sizes, num_rows=m, block_m=config.block_m)
    return _kernels.gmm_pallas(
        lhs, rhs, meta, transpose_rhs=transpose_rhs, config=config, out_dtype=out_dtype,
        precision=precision, interpret=not _on_gpu(),
    )


def _pallas_tgmm(lhs, dout, group_sizes, *, config: TileConfig | None, out_dtype, precision):
    m, k = lhs.shape
    n = dout.shape[1]
    config = config or tgmm_config(m, n, k, group_sizes.shape[0])
    offsets = clamp_group_sizes(group_sizes, m)
    return _kernels.tgmm_pallas(
        lhs, dout, offsets, config=config, out_dtype=out_dtype, precision=precision,
        interpret=not _on_gpu(),
    )


def _clamped_sizes(group_sizes, num_rows):
    offsets = clamp_group_sizes(group_sizes, num_rows)
    return offsets[1:] - offsets[:-1]


def _xla_gmm(lhs, rhs, group_sizes, *, transpose_rhs, config, out_dtype, precision):
    del config  # XLA picks its own tiling.
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out = jax.lax.ragged_dot_general(
        lhs, rhs, _clamped_sizes(group_sizes, lhs.shape[0]), dims,
        precision=precision, preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)


def _xla_tgmm(lhs, dout, group_sizes, *, config, out_dtype, precision):
    del config
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(
        dout, lhs, _clamped_sizes(group_sizes, lhs.shape[0]), dims,
        precision=precision, preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)


BACKENDS: dict[str, GemmBackend] = {
    "pallas_triton": GemmBackend(gmm=_pallas_gmm, tgmm=_pallas_tgmm),
    "xla": GemmBackend(gmm=_xla_gmm, tgmm=_xla_tgmm),
}

_announced: set[tuple[str, str]] = set()


def resolve_backend(backend: str) -> str:
    """Name of the backend `backend` stands for; `auto` is `pallas_triton` on GPU, else `xla`.

    The platform is the one being compiled for (see `_platform`): inside `shard_map` over CPU
    devices of a GPU process, `auto` is `xla`. `auto` logs its pick once per platform on the
    `moe_jax` logger (INFO).
    """
    if backend == "auto":
        platform = _platform()
        picked = "pallas_triton" if platform in _GPU_PLATFORMS else "xla"
        if (platform, picked) not in _announced:
            _announced.add((platform, picked))
            _log.info("moe_jax: backend='auto' picked %r on platform %r", picked, platform)
        return picked
    if backend not in BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not a GEMM backend; use one of 'auto', "
            + ", ".join(repr(b) for b in BACKENDS)
            + "."
        )
    return backend


def get_backend(backend: str) -> GemmBackend:
    return BACKENDS[resolve_backend(backend)]
