"""The `xla` backend: XLA's grouped dot (`jax.lax.ragged_dot_general`), which picks its own tiling,
so it takes no tile configuration and claims no tile padding. Runs everywhere; `auto` off GPU.
With row ids the rows are gathered first (`gather_rows` on XLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.gather import gather_rows
from moe_jax.ops.gmm.problem import GemmBackend, Plan, Problem
from moe_jax.ops.gmm.schedule import clamp_group_sizes
from moe_jax.ops.platform import DeviceFacts
from moe_jax.ops.sharding import explicit_out_sharding

__all__ = ["BACKEND", "Xla"]


def _clamped_sizes(group_sizes, num_rows):
    offsets = clamp_group_sizes(group_sizes, num_rows)
    return offsets[1:] - offsets[:-1]


class Xla(GemmBackend):
    name = "xla"

    def configure(self, problem: Problem, config, device: DeviceFacts):
        return None, (), ()

    def run(self, plan: Plan, lhs, rhs, group_sizes, row_ids):
        p = plan.problem
        if row_ids is not None:
            lhs = gather_rows(lhs, row_ids, backend="xla")
        if p.kernel == "tgmm":
            dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
            operands = (rhs, lhs)  # dout^T lhs per group
        else:
            contract = 2 if p.kernel == "gmm_nt" else 1
            dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [contract]), ([], [])),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
            operands = (lhs, rhs)
        out = jax.lax.ragged_dot_general(*operands, _clamped_sizes(group_sizes, p.m), dims, precision=p.precision,
                                         preferred_element_type=jnp.float32, out_sharding=explicit_out_sharding())
        return out.astype(p.out_dtype)


BACKEND = Xla()
