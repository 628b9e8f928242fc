"""The reference of `quantize_master_weights`, with its signature: the recipe's own
`moe_jax.ops.fp8.quantize_weights` and `transpose_weights`, which every backend equals bit for bit."""

from __future__ import annotations

import jax

from moe_jax.ops.fp8 import Fp8Weights, quantize_weights, transpose_weights
from moe_jax.ops.platform import BackendName

__all__ = ["quantize_master_weights_reference"]


def quantize_master_weights_reference(
    w_ENK: jax.Array, *, transposed: bool = False, backend: BackendName = "auto",
) -> Fp8Weights | tuple[Fp8Weights, Fp8Weights]:
    """`quantize_weights(w_ENK)`, with `transposed` also its `transpose_weights`; `backend` is
    accepted for the signature and ignored."""
    del backend
    wq = quantize_weights(w_ENK)
    return (wq, transpose_weights(wq)) if transposed else wq
