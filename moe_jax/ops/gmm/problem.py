"""What a grouped-GEMM call is (`Problem`), what was decided for it (`Plan`), and what every
backend answers about it (`GemmBackend`).

Legend: M packed rows, K reduction width, N output width, E groups (experts).

Kernels (`KERNELS`): `gmm_nt` (the forward, `rhs [E, N, K]`), `gmm_nn` (the input gradient, `rhs`
read as `[E, K, N]`) and `tgmm` (the weight gradient, `[E, N, K]` from `lhs [M, K]` and
`dout [M, N]`). Shape classes: `decode` (at most `DECODE_ROWS_PER_GROUP` rows per group on
average) and `prefill`.

A backend (one folder or module under `moe_jax/ops/gmm/`) is a `GemmBackend`: it says which
kernels it has, which explicit configurations it takes, whether it supports a problem on the
device compiled for (shapes, dtypes, availability, and a resource model of the configuration it
would run against the device's shared memory), resolves a configuration into one that fits, runs
a `Plan`, and says which rows a plan executes. `moe_jax.ops.gmm.plan` is the only place a choice
among backends is made; nothing else re-derives it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.ops.platform import DeviceFacts

__all__ = ["DECODE_ROWS_PER_GROUP", "Executed", "GemmBackend", "KERNELS", "Plan", "Problem", "default_precision",
           "resolved_problem", "useful_rows"]

KERNELS = ("gmm_nt", "gmm_nn", "tgmm")
DECODE_ROWS_PER_GROUP = 64


def default_precision(dtype, precision) -> jax.lax.Precision:
    """The dot precision of a call: `precision`, else HIGHEST (full fp32 products) for fp32 and
    DEFAULT for 16-bit inputs."""
    if precision is not None:
        return precision
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


@dataclasses.dataclass(frozen=True)
class Problem:
    """One grouped GEMM, as far as choosing and checking its kernel goes (static facts only).

    `m`: packed rows M (with `gather`, the row ids' count; the source rows may differ). For `tgmm`
    the gradient is `[E, n, k]` (n the `dout` width, k the `lhs` width). `precision` is resolved
    (`default_precision`). `gather`: `lhs` is read through row ids.
    """

    kernel: str
    m: int
    n: int
    k: int
    num_groups: int
    dtype: np.dtype
    out_dtype: np.dtype
    precision: jax.lax.Precision
    gather: bool = False

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: use one of {KERNELS}.")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))

    @property
    def shape_class(self) -> str:
        """`decode` at <= `DECODE_ROWS_PER_GROUP` rows per group on average, else `prefill`."""
        return "decode" if self.m <= DECODE_ROWS_PER_GROUP * max(self.num_groups, 1) else "prefill"

    @property
    def rows_per_group(self) -> float:
        return self.m / max(self.num_groups, 1)

    @property
    def ieee_fp32(self) -> bool:
        """fp32 operands multiplied in full fp32 (`Precision.HIGHEST`), not TF32."""
        return self.dtype == jnp.float32 and self.precision == jax.lax.Precision.HIGHEST

    def describe(self) -> str:
        return (f"{self.kernel} M={self.m} N={self.n} K={self.k} E={self.num_groups} {self.dtype.name}->"
                f"{self.out_dtype.name}{' gather' if self.gather else ''}")


def resolved_problem(kernel: str, m: int, n: int, k: int, num_groups: int, dtype, out_dtype=None, precision=None,
                     gather: bool = False) -> Problem:
    """A `Problem` with the output dtype (default: the input's) and precision resolved."""
    return Problem(kernel, int(m), int(n), int(k), int(num_groups), jnp.dtype(dtype), jnp.dtype(out_dtype or dtype),
                   default_precision(dtype, precision), bool(gather))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs for a `Problem`: the backend, its resolved configuration (the backend's own type:
    tiles, a candidate, a selector with its candidates; already fitted to the device), the shared
    memory each of its launches needs (the resource model's figure), and why it was chosen
    (fallbacks included). Hashable: it travels as a static argument."""

    problem: Problem
    backend: str
    config: Any
    smem_bytes: tuple[int, ...] = ()
    why: tuple[str, ...] = ()

    def describe(self) -> str:
        notes = "; ".join(self.why)
        return f"{self.problem.describe()}: {self.backend} {self.config}" + (f" ({notes})" if notes else "")


class Executed(NamedTuple):
    """The rows a plan's kernel executes on one histogram (traced int32 scalars)."""

    executed_rows: jax.Array  # P: rows multiplied, padding of the tiles included
    useful_rows: jax.Array  # U: rows in groups, after the clamp
    candidate: jax.Array  # index of the candidate that ran in the backend's candidate list, -1 for none


def useful_rows(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """U: rows in groups after the kernels' clamp (negative sizes as zero, at most `num_rows`):
    the clipped sizes' int32 sum, capped, where it cannot overflow (E * M < 2**31), else the
    exact clamp's total."""
    if group_sizes.shape[0] * num_rows < 2**31:
        clipped = jnp.clip(group_sizes, 0, num_rows).astype(jnp.int32)  # clip first: unsigned sizes stay large
        return jnp.minimum(jnp.sum(clipped, dtype=jnp.int32), num_rows)
    from moe_jax.ops.gmm.schedule import clamp_group_sizes  # noqa: PLC0415

    return clamp_group_sizes(group_sizes, num_rows)[-1]


class GemmBackend(abc.ABC):
    """The interface every grouped-GEMM backend implements (one instance, `BACKEND`, per backend
    module). The chooser calls `available`, `supports` and `configure`; the ops call `run`; the
    layer's telemetry calls `executed`."""

    name: str = ""
    kernels: tuple[str, ...] = KERNELS  # the kernels it has; others run on `auto`'s choice
    fuses_gather: bool = False  # reads `lhs` rows through row ids inside its kernels

    def config_types(self, kernel: str) -> tuple[type, ...]:
        """The explicit configurations it takes for `kernel` (besides None and `"auto"`)."""
        return ()

    def available(self) -> str | None:
        """None where it can run in this process, else why not (a missing package, no GPU)."""
        return None

    def supports(self, problem: Problem, device: DeviceFacts) -> str | None:
        """None where it can run `problem` on `device` with some configuration that fits, else
        why not (a sentence naming the shape, dtype or limit)."""
        return None

    @abc.abstractmethod
    def configure(self, problem: Problem, config, device: DeviceFacts) -> tuple[Any, tuple[int, ...], tuple[str, ...]]:
        """`(resolved config, shared memory per launch, notes)` for `config`: None (the backend's
        static choice), `"auto"` (its on-device choice where it has one) or one of
        `config_types(problem.kernel)`. Tuned choices that do not fit `device` fall back to the nearest that does
        (said in the notes); an explicit configuration that does not fit raises ValueError naming
        it, the bytes and the limit."""

    @abc.abstractmethod
    def run(self, plan: Plan, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
            row_ids: jax.Array | None) -> jax.Array:
        """The kernel of `plan` on validated operands (`M, N, K > 0`); `rhs` is `dout` for tgmm."""

    def executed(self, plan: Plan, group_sizes: jax.Array) -> Executed:
        """`Executed` of `plan` on `group_sizes` (traced): by default the useful rows alone (a
        backend whose tiling is its own claims no padding)."""
        useful = useful_rows(group_sizes, plan.problem.m)
        return Executed(useful, useful, jnp.int32(-1))
