"""Shardings the ops meet: varying manual axes inside `jax.shard_map`, and Explicit mesh axes.

Under `shard_map` with `check_vma=True` each value carries the set of mesh axes it varies over.
A value replicated over an axis (weights, tokens replicated over `ep`) combined with one that
varies over it must be cast to varying first (`jax.lax.pcast`), and the cast's transpose sums the
gradient over the added axes: exactly the sum over a replicated value's replicas. Outside
`shard_map` every set is empty and nothing here changes anything.

Under a mesh with Explicit axes (`jax.set_mesh`), shardings are part of the array types. The
grouped GEMM and the row gather read rows anywhere in their operands (the groups are global row
ranges), so they take replicated operands: `replicate_explicit` reshards any explicitly sharded
operand to replicated first (an all-gather, the data movement the op needs anyway); the
transpose of that reshard returns each cotangent to its operand's sharding.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

__all__ = ["explicit_out_sharding", "replicate_explicit", "vary_like", "vary_to_union", "varying_like",
           "varying_output"]


def _explicit_context() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.manual_axes and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def explicit_out_sharding() -> PartitionSpec | None:
    """`PartitionSpec()` (replicated) where an op that cannot infer its output sharding under
    Explicit axes needs one (`jax.lax.ragged_dot_general`), else None."""
    return PartitionSpec() if _explicit_context() else None


def _explicitly_sharded(a) -> bool:
    """Whether an Explicit mesh axis shards `a` (outside `shard_map`; False with no mesh, under
    Auto axes, or inside `shard_map`)."""
    if not _explicit_context():
        return False
    spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", ())
    return any(e is not None for e in spec)


def replicate_explicit(*arrays):
    """`arrays`, each resharded to replicated if an Explicit mesh axis shards it (outside
    `shard_map`); unchanged otherwise (no mesh, Auto axes, or inside `shard_map`)."""
    return tuple(jax.sharding.reshard(a, PartitionSpec()) if _explicitly_sharded(a) else a for a in arrays)


def vary_to_union(arrays: tuple, also: tuple = ()) -> tuple[frozenset, tuple]:
    """The union of the mesh axes `arrays` and `also` vary over, and `arrays` cast to vary over all of it."""
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in (*arrays, *also)))
    missing = [tuple(varying - jax.typeof(a).manual_axis_type.varying) for a in arrays]
    return varying, tuple(jax.lax.pcast(a, axes, to="varying") if axes else a for a, axes in zip(arrays, missing))


def vary_like(tree, also: tuple = ()):
    """`vary_to_union` on the arrays of the pytree `tree`: each cast to vary over the mesh axes any
    of them or of `also` vary over (inside `shard_map`; unchanged outside one)."""
    leaves, structure = jax.tree.flatten(tree)
    return jax.tree.unflatten(structure, vary_to_union(tuple(leaves), also)[1])


def varying_like(out_shape, inputs: tuple) -> tuple:
    """`(out_shape, inputs)` for a kernel that reads all `inputs` as one per-device program: the
    inputs cast to the union of their varying axes, and `out_shape` (a `ShapeDtypeStruct` or a
    pytree of them) declared to vary over that union (Pallas cannot infer it)."""
    varying, inputs = vary_to_union(inputs)
    if not varying:
        return out_shape, inputs
    mat = jax.sharding.ManualAxisType(varying=varying)
    return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=mat), out_shape), inputs


def varying_output(out, inputs: tuple):
    """`out`, the arrays a Mosaic GPU kernel or `jax_triton.triton_call` returned from `inputs`,
    cast to vary over the union of the axes `inputs` vary over: `plgpu.kernel` traces its body with
    shard_map's varying check off and `triton_call` builds its output types from shape and dtype
    alone, so both type their outputs as varying over nothing, whatever was declared."""
    leaves, tree = jax.tree.flatten(out)
    _, leaves = vary_to_union(tuple(leaves), inputs)
    return jax.tree.unflatten(tree, leaves)
