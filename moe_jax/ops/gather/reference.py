"""fp32 reference of `gather_rows`, with its signature."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.platform import BackendName

__all__ = ["gather_rows_reference"]


def gather_rows_reference(
    x_ND: jax.Array | tuple[jax.Array, ...], rows_M: jax.Array, *,
    inverse_N: jax.Array | tuple[jax.Array | None, ...] | None = None, backend: BackendName = "auto",
) -> jax.Array:
    """fp32 `gather_rows` by one-hot matmul (memory `M*N`: tests and small shapes only);
    `inverse_N` and `backend` are accepted for the signature and ignored."""
    del inverse_N, backend
    xs = tuple(x_ND) if isinstance(x_ND, (tuple, list)) else (x_ND,)
    x_ND = jnp.concatenate([x.astype(jnp.float32) for x in xs])
    onehot_MN = (rows_M[:, None] == jnp.arange(x_ND.shape[0])[None, :]).astype(jnp.float32)
    return jnp.dot(onehot_MN, x_ND, precision=jax.lax.Precision.HIGHEST)
