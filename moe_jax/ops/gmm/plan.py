"""The only place a grouped-GEMM choice is made: `plan(problem, backend, config) -> Plan`.

Legend: M packed rows, K reduction width, N output width, E groups.

- An explicit backend name runs that backend: TypeError for a configuration it does not take,
  ValueError where it is not available here or does not support the problem (the reason names the
  shape, dtype or limit). A backend without the kernel (`mosaic_gpu` has no weight gradient) hands
  the kernel to `auto`, and the plan says so.
- `auto` off GPU is `xla` (a configuration for the GPU backends is then not used; the plan says
  so). On a GPU it is the first backend in `table[(kernel, shape class)]` that is available, has
  the kernel, takes the configuration (when one is given) and supports the problem; the last
  resort is `pallas_triton`, which supports every problem. A `BackendTable` passed as the backend
  is `auto` with that table.
- The backend then resolves the configuration and fits it to the device's shared memory
  (`GemmBackend.configure`): the plan carries the configuration that runs, the bytes each launch
  needs and every fallback taken.

`H200_BACKENDS` comes from `python -m benchmarks.backends` on one H200 (docs/kernel-selection.md,
`benchmarks/results/2026-12-01-h200-backends.md`): on the prefill rows the official Triton kernels
(`triton`) beat the Pallas Triton ones on the input gradient and the weight gradient; the forward
stays on Pallas, where the on-device selector chooses among its candidates. `mosaic_gpu` is in no
entry: the whole layer with it was no faster (`2026-12-03-h200-backend-table-layer.md`: 3-7% faster
at Qwen3-30B-A3B, 5-9% slower at DeepSeek-V3). It is applied on every GPU (the only one measured);
the configurations it leads to are fitted to each device's limits.

`plan_linear` plans the three GEMMs of `grouped_linear` at once (`LinearPlan`); the layer makes one
per projection and reads its telemetry from the forward plan (`executed`).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax

from moe_jax.ops.gmm.problem import Executed, Plan, Problem, resolved_problem
from moe_jax.ops.gmm.registry import GEMM_BACKENDS
from moe_jax.ops.platform import BackendTable, DeviceFacts, device_facts, on_gpu, resolve_backend

__all__ = ["AUTO_FUSED_GATHER", "H200_BACKENDS", "LinearPlan", "executed", "plan", "plan_linear"]

H200_BACKENDS = BackendTable.of({
    ("gmm_nt", "decode"): ("pallas_triton",),
    ("gmm_nt", "prefill"): ("pallas_triton",),
    ("gmm_nn", "decode"): ("pallas_triton",),
    ("gmm_nn", "prefill"): ("triton", "pallas_triton"),
    ("tgmm", "decode"): ("pallas_triton",),
    ("tgmm", "prefill"): ("triton", "pallas_triton"),
})
# Backends on which the layer's `row_gather="auto"` fuses the row gather into the gate/up GEMM:
# where it measured faster than gathering first. None on the H200 (docs/backends.md, "Fused row
# gather").
AUTO_FUSED_GATHER: tuple[str, ...] = ()
LAST_RESORT = "pallas_triton"

_log = logging.getLogger("moe_jax")
_announced: set = set()


def _check_config(kernel: str, config) -> None:
    if config is None or (isinstance(config, str) and config == "auto"):
        return
    if isinstance(config, str):
        raise ValueError(f"config={config!r}: use None (the backend's static choice), 'auto' (its on-device choice) or "
                         "a configuration object.")
    takers = [name for name, b in GEMM_BACKENDS.items() if isinstance(config, b.config_types(kernel))]
    if not takers:
        raise TypeError(f"config={config!r} is no configuration of a {kernel} kernel; "
                        + "; ".join(f"{name} takes {', '.join(t.__name__ for t in b.config_types(kernel)) or 'none'}"
                                    for name, b in GEMM_BACKENDS.items()) + ".")


def _explicit(problem: Problem, name: str, config, device: DeviceFacts) -> Plan:
    backend = GEMM_BACKENDS[name]
    if config is not None and not isinstance(config, str) and not isinstance(config, backend.config_types(problem.kernel)):
        takes = ", ".join(t.__name__ for t in backend.config_types(problem.kernel)) or "no configuration"
        raise TypeError(f"backend={name!r} takes {takes} for {problem.kernel}; got config={config!r}. Pass one it "
                        "takes, None, or backend='auto'.")
    explicit = config is not None and not isinstance(config, str)
    # An explicit configuration is checked by `configure` (the shapes and bytes of that
    # configuration); `supports` answers for the backend's own choice.
    reason = backend.available() or (None if explicit else backend.supports(problem, device))
    if reason:
        raise ValueError(f"{reason}; use backend='auto', which runs {problem.describe()} on a backend that takes it.")
    return _configured(problem, name, config, device, ())


def _configured(problem: Problem, name: str, config, device: DeviceFacts, why: tuple[str, ...]) -> Plan:
    resolved, smem, notes = GEMM_BACKENDS[name].configure(problem, config, device)
    return Plan(problem, name, resolved, tuple(smem), why + tuple(notes))


def _auto(problem: Problem, config, table: BackendTable, device: DeviceFacts, gpu: bool,
          why: tuple[str, ...] = ()) -> Plan:
    explicit = config is not None and not isinstance(config, str)
    if not gpu:
        note = (f"config {config!r} is for the GPU backends; xla (auto off GPU) picks its own tiling",) if explicit else ()
        return _configured(problem, "xla", None, device, why + note)
    key = (problem.kernel, problem.shape_class)
    if key not in table:
        raise ValueError(f"the backend table has no entry for {key!r}; add one, e.g. start from "
                         f"H200_BACKENDS.replace({{...}}), which has every kernel and shape class.")
    skipped = []
    for name in (*table[key], LAST_RESORT):
        backend = GEMM_BACKENDS[name]
        if problem.kernel not in backend.kernels:
            reason = f"has no {problem.kernel} kernel"
        elif explicit and not isinstance(config, backend.config_types(problem.kernel)):
            reason = f"takes no {type(config).__name__}"
        else:
            reason = backend.available() or backend.supports(problem, device)
        if reason is None:
            if (key, name) not in _announced:
                _announced.add((key, name))
                _log.info("moe_jax: backend='auto' runs %s (%s) on %r", *key, name)
            return _configured(problem, name, config, device, why + tuple(f"auto skipped {s}" for s in skipped))
        skipped.append(f"{name}: {reason}")
    raise TypeError(f"no backend in auto's list for {key!r} takes config={config!r} ({'; '.join(skipped)}).")


def plan(problem: Problem, backend: str | BackendTable = "auto", config=None, *,
         table: BackendTable = H200_BACKENDS) -> Plan:
    """The `Plan` for `problem` on `backend` (a name, `"auto"` or a `BackendTable`) with `config`
    (None, `"auto"` or a backend's configuration object) on the device compiled for; see the module
    docstring. One decision per distinct call and device, made at trace time from static facts."""
    return _plan(problem, backend, config, table, device_facts(), on_gpu(), jax.config.jax_enable_x64)


@functools.cache
def _plan(problem: Problem, backend, config, table: BackendTable, device: DeviceFacts, gpu: bool, x64: bool) -> Plan:
    del x64  # a key only: what a backend can run may depend on it (`GemmBackend.available`)
    _check_config(problem.kernel, config)
    if isinstance(backend, BackendTable):
        return _auto(problem, config, backend, device, gpu)
    if backend == "auto":
        return _auto(problem, config, table, device, gpu)
    name = resolve_backend(backend)  # ValueError naming the choices (and for triton off GPU)
    if problem.kernel not in GEMM_BACKENDS[name].kernels:
        return _auto(problem, config, table, device, gpu, (f"{name} has no {problem.kernel} kernel: auto's choice runs it",))
    return _explicit(problem, name, config, device)


class LinearPlan(NamedTuple):
    """The three GEMMs of one `grouped_linear` `y = x @ w[e]^T`: forward (`gmm_nt`), input gradient
    (`gmm_nn`) and weight gradient (`tgmm`)."""

    fwd: Plan
    dgrad: Plan
    wgrad: Plan


def plan_linear(num_rows: int, w_shape: tuple[int, int, int], dtype, *, backend: str | BackendTable = "auto",
                precision: jax.lax.Precision | None = None, fwd_config=None, dgrad_config=None, wgrad_config=None,
                gather: bool = False, table: BackendTable = H200_BACKENDS) -> LinearPlan:
    """Plans of `grouped_linear(x, w, group_sizes)` for `num_rows` packed rows M, `w` `[E, N, K]`
    (`w_shape`) and `dtype` operands; `gather`: `x` is read through row ids (the forward and the
    weight gradient)."""
    e, n, k = w_shape
    make = functools.partial(resolved_problem, m=num_rows, num_groups=e, dtype=dtype, precision=precision)
    return LinearPlan(
        plan(make("gmm_nt", n=n, k=k, gather=gather), backend, fwd_config, table=table),
        plan(make("gmm_nn", n=k, k=n), backend, dgrad_config, table=table),
        plan(make("tgmm", n=n, k=k, gather=gather), backend, wgrad_config, table=table),
    )


def executed(gemm_plan: Plan, group_sizes: jax.Array) -> Executed:
    """The rows `gemm_plan`'s kernel executes on `group_sizes` (traced): its backend's rule."""
    return GEMM_BACKENDS[gemm_plan.backend].executed(gemm_plan, group_sizes)

