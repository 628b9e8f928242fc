"""Varying manual axes inside `jax.shard_map(check_vma=True)`: what every op that runs there needs.

Under `shard_map` with `check_vma=True` each value carries the set of mesh axes it varies over.
A value replicated over an axis (weights, tokens replicated over `ep`) combined with one that
varies over it must be cast to varying first (`jax.lax.pcast`), and the cast's transpose sums the
gradient over the added axes: exactly the sum over a replicated value's replicas. Outside
`shard_map` every set is empty and nothing here changes anything.
"""

from __future__ import annotations

import jax

__all__ = ["vary_to_union", "varying_like"]


def vary_to_union(arrays: tuple, also: tuple = ()) -> tuple[frozenset, tuple]:
    """The union of the mesh axes `arrays` and `also` vary over, and `arrays` cast to vary over all of it."""
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in (*arrays, *also)))
    missing = [tuple(varying - jax.typeof(a).manual_axis_type.varying) for a in arrays]
    return varying, tuple(jax.lax.pcast(a, axes, to="varying") if axes else a for a, axes in zip(arrays, missing))


def varying_like(out_shape, inputs: tuple) -> tuple:
    """`(out_shape, inputs)` for a kernel that reads all `inputs` as one per-device program: the
    inputs cast to the union of their varying axes, and `out_shape` (a `ShapeDtypeStruct` or a
    pytree of them) declared to vary over that union (Pallas cannot infer it)."""
    varying, inputs = vary_to_union(inputs)
    if not varying:
        return out_shape, inputs
    mat = jax.sharding.ManualAxisType(varying=varying)
    return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=mat), out_shape), inputs
