"""The grouped GEMM's backends: for each name of `moe_jax.ops.platform.BACKENDS`, the `BACKEND`
(a `problem.GemmBackend`) of the module or folder of that name beside this file. Adding a backend is
its folder plus its name in `BACKENDS`."""

from __future__ import annotations

import importlib

from moe_jax.ops.gmm.problem import GemmBackend
from moe_jax.ops.platform import BACKENDS

__all__ = ["GEMM_BACKENDS"]

GEMM_BACKENDS: dict[str, GemmBackend] = {
    name: importlib.import_module(f"moe_jax.ops.gmm.{name}").BACKEND for name in BACKENDS
}
