"""The row gather, one room: the public op and its VJP (`api`), the Pallas kernel (`kernel`), the
two backends (`backends`) and the fp32 reference (`reference`)."""

from moe_jax.ops.gather.api import gather_rows, sum_of_readers
from moe_jax.ops.gather.reference import gather_rows_reference

__all__ = ["gather_rows", "gather_rows_reference", "sum_of_readers"]
