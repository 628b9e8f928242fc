"""Where the MoE layer's tokens live under Explicit mesh axes, across its reshapes.

Legend: B batch, S sequence, T = B*S tokens, D width.

Under Explicit axes an array's sharding is part of its type, and `reshape` infers the result's
sharding only in simple cases (a merge whose minor part is unsharded; a split whose leading
dimension is filled exactly by a prefix of the axes). Whatever the input's sharding, the layer
therefore names every sharding across a reshape itself:

- `x [B, S, D] -> x_TD`: the T tokens split over x's batch axes, then its sequence axes (row-major
  flattening keeps each shard's tokens together), the width D gathered (`token_axes`, `to_tokens`);
  a layer with axis rules then moves them onto the rules' token axes.
- per-token arrays read back as `[B, S, ...]` (the sequence-wise statistics): on those axes when
  the split `T -> (B, S)` can carry them, else on the longest prefix that can (`split_axes`).
- `y_TD -> y`: x's own sharding (`unflatten`), so the output is laid out like the input.

Without an ambient Explicit mesh (no mesh, Auto axes, inside `shard_map`) these are plain reshapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.parallel import is_explicit

__all__ = ["explicit_mesh", "on_tokens", "split_axes", "to_tokens", "token_axes", "unflatten"]

Axes = tuple[str, ...]


def explicit_mesh():
    """The ambient (`jax.set_mesh`) abstract mesh when it has Explicit axes and no manual ones, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes or not is_explicit(mesh):
        return None
    return mesh


def _axes(entry) -> Axes:
    """A `PartitionSpec` entry as a tuple of mesh axis names."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(x) -> tuple:
    """x's sharding spec in its type, one entry per dimension."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def token_axes(x) -> Axes:
    """The mesh axes x's token dimensions (all but the last) are split over, major first."""
    spec = _spec(x)
    return tuple(a for entry in spec[:-1] for a in _axes(entry))


def _entry(axes: Axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def to_tokens(a, lead: int, axes: Axes | None):
    """`a` with its first `lead` dimensions merged into one token dimension T; under Explicit axes
    (`axes` not None) T is split over `axes` and every other dimension is whole."""
    shape = (math.prod(a.shape[:lead]),) + tuple(a.shape[lead:])
    if axes is None:
        return a.reshape(shape)
    spec = P(_entry(axes), *(None,) * (len(shape) - 1))
    return jnp.reshape(a, shape, out_sharding=spec)


def on_tokens(tree, axes: Axes | None):
    """Every `[T, ...]` array of `tree` with T split over `axes` (Explicit), the rest whole; as is
    when `axes` is None."""
    if axes is None:
        return tree
    return jax.tree.map(lambda a: jax.sharding.reshard(a, P(_entry(axes), *(None,) * (a.ndim - 1))), tree)


def split_axes(axes: Axes, seq_BS: tuple[int, int], mesh) -> Axes:
    """The longest prefix of `axes` that a `[T, ...] -> [B, S, ...]` reshape can carry (JAX fills B
    with the leading axes until it is exactly split, then S with the rest)."""
    for n in range(len(axes), -1, -1):
        if _splits(axes[:n], seq_BS, mesh):
            return axes[:n]
    return ()


def _splits(axes: Axes, sizes, mesh) -> bool:
    it = iter(axes)
    for size in sizes:
        while size > 1:
            axis = next(it, None)
            if axis is None:
                break
            size, rest = divmod(size, mesh.shape[axis])
            if rest:
                return False
    return next(it, None) is None


def unflatten(y_TD, x):
    """`y_TD` back to x's shape, laid out as x is under Explicit axes."""
    if explicit_mesh() is None:
        return y_TD.reshape(x.shape)
    return jnp.reshape(y_TD, x.shape, out_sharding=P(*_spec(x)))
