"""Master weights to the FP8 recipe's blocks, as `fp8_grouped_linear` quantizes them in each call,
and activation rows to its 1 x 128 tiles.

Legend: E experts, N output width, K input width; Nb = ceil(N / 128), Kb = ceil(K / 128).

`quantize_master_weights(w_ENK)` is `moe_jax.ops.fp8.quantize_weights(w_ENK)` (e4m3 values, one
fp32 scale per 128 x 128 block), with `transposed=True` also `transpose_weights` of it (the
`[E, K, N]` layout the input gradient's FP8 product reads), bit for bit on every backend.
Backends (`backends`): `pallas_triton` (`kernel.quantize_weights_pallas`: one program per block
reads the weights once and writes every output) and `xla` (two passes over the weights: the block
amax, then the divide and cast). At Qwen3-30B-A3B's expert weights the XLA path reads about twice
the bytes the outputs need (docs/fp8.md, "Fused weight quantization").

`quantize_activations(x_MK)` is `moe_jax.ops.fp8.quantize_rows(x_MK)` bit for bit, on the same two
backends (`kernel.quantize_rows_pallas` reads the rows once; XLA takes the tiles' amax in one pass
and divides and casts in another).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.ops.fp8 import FP8_DTYPE, Fp8Rows, Fp8Weights
from moe_jax.ops.pallas_triton import int32_offsets_wrap
from moe_jax.ops.platform import BackendName, implementation
from moe_jax.ops.quantize import backends  # noqa: F401  (registers the two backends)
from moe_jax.ops.sharding import replicate_explicit

__all__ = ["QUANTIZE_BACKENDS", "quantize_activations", "quantize_master_weights"]

QUANTIZE_BACKENDS = ("auto", "pallas_triton", "xla")


def quantize_master_weights(
    w_ENK: jax.Array, *, transposed: bool = False, backend: BackendName = "auto",
) -> Fp8Weights | tuple[Fp8Weights, Fp8Weights]:
    """e4m3 blocks of master weights `w_ENK`, equal bit for bit to `quantize_weights(w_ENK)`.

    Args:
      w_ENK: `[E, N, K]` bfloat16/float16/float32 master weights (any E, N, K; edge blocks of an N
        or K that is not a multiple of 128 are narrower and scaled by their own elements).
      transposed: also return the same values as `[E, K, N]` with scales `[E, Kb, Nb]`
        (`transpose_weights` of the first result), written in the same pass.
      backend: `"auto"` (the kernel on a GPU, XLA elsewhere), `"pallas_triton"` (interpreted off
        GPU) or `"xla"`. Weights of more than 2**31 and at most 2**32 values (e.g. DeepSeek-V3's
        gate, up or down experts, 3.8e9) run on XLA on every backend: the kernel's e4m3 outputs
        would be offset in int32 there (`moe_jax.ops.pallas_triton.int32_offsets_wrap`). Weights an
        Explicit mesh axis shards are gathered first on every backend
        (`moe_jax.ops.sharding.replicate_explicit`), as the grouped GEMMs gather their operands.

    Returns `Fp8Weights(values_ENK [E, N, K] e4m3, scale_ENbKb [E, Nb, Kb] fp32)`, or with
    `transposed` the pair `(that, Fp8Weights(values [E, K, N], scales [E, Kb, Nb]))`. Not
    differentiable (the layer passes gradients straight through the quantization itself).
    """
    if not isinstance(transposed, bool):
        raise TypeError(f"transposed={transposed!r}: expected a bool (also return the [E, K, N] copy).")
    # Both backends read whole weights: the kernel indexes experts, XLA's blocks reshape every axis.
    w_ENK, backend = _checked("quantize_master_weights", backend, "w_ENK", w_ENK, "[E, N, K] expert weights",
                              "master weights")
    impl = implementation("quantize_master_weights", backend)
    wq, wq_t = impl(w_ENK, transposed)
    return (wq, wq_t) if transposed else wq


def quantize_activations(x_MK: jax.Array, *, backend: BackendName = "auto") -> Fp8Rows:
    """e4m3 rows of `x_MK` with one fp32 scale per 1 x 128 tile, equal bit for bit to
    `quantize_rows(x_MK)`.

    Args:
      x_MK: `[M, K]` bfloat16/float16/float32 rows (a ragged last tile is scaled by its own columns).
      backend: `"auto"` (the kernel on a GPU, XLA elsewhere), `"pallas_triton"` (interpreted off
        GPU) or `"xla"`. Rows of more than 2**31 values run on XLA (the kernel's e4m3 output would
        be offset in int32, `moe_jax.ops.pallas_triton.int32_offsets_wrap`); rows an Explicit mesh
        axis shards are gathered first, as for the weights.

    Returns `Fp8Rows(values_MK e4m3, scale_MKb [M, Kb] fp32)`. Not differentiable.
    """
    x_MK, backend = _checked("quantize_activations", backend, "x_MK", x_MK, "[M, K] rows", "rows")
    return implementation("quantize_activations", backend)(x_MK)


def _checked(op: str, backend: str, name: str, a, layout: str, what: str):
    """`(a, backend)` for `op`: `a` as a 16/32-bit float array of `layout`'s rank, gathered where an
    Explicit mesh axis shards it; `backend` validated, and `xla` where the kernel has no program to
    launch (empty) or its e4m3 output would be offset in int32."""
    if backend not in QUANTIZE_BACKENDS:
        raise ValueError(f"backend={backend!r}: {op} runs on one of {QUANTIZE_BACKENDS}.")
    a = jnp.asarray(a)
    if a.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise TypeError(f"{name}: expected bfloat16/float16/float32 {what}, got {a.dtype}"
                        + (" (already quantized)." if a.dtype == FP8_DTYPE else "."))
    ndim = layout.count(",") + 1
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {layout} ({ndim} dims), got shape {a.shape}.")
    (a,) = replicate_explicit(a)
    if a.size == 0 or int32_offsets_wrap(a.size, FP8_DTYPE):
        backend = "xla"
    return a, backend
