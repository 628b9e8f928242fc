"""What every kernel of the `pallas_triton` backend shares: the launcher and in-kernel helpers.

Kernels take refs only; each op's launcher (in its own folder) builds the grid and calls `launch`,
which owns `pallas_call`, the compiler parameters, output aliasing and the varying-axes typing
inside `shard_map`. Blocks are powers of two (Triton's rule); `next_pow2` rounds a width up.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_jax.ops.sharding import varying_like

__all__ = ["cdiv", "int32_offsets_wrap", "launch", "masked_load", "next_pow2", "outer_and"]


def cdiv(a, b):
    """`ceil(a / b)` for ints and traced int32 values."""
    return (a + b - 1) // b


def next_pow2(x: int) -> int:
    """The smallest power of two `>= x` (1 for `x <= 1`)."""
    return 1 << max(int(x) - 1, 0).bit_length()


def int32_offsets_wrap(size: int, dtype) -> bool:
    """Whether a ref of `size` elements of `dtype` would be addressed past int32 in a kernel: JAX's
    Pallas Triton lowering offsets refs of at most 2**32 bytes in int32
    (`jax._src.pallas.triton.lowering._compute_offsets_from_indices`), which holds 2**31 elements
    of 2 bytes or more but not the more than 2**31 elements of a 1-byte array of 2-4 GiB (e4m3:
    DeepSeek-V3's gate, up or down expert weights, 3.8e9 values). `launch` refuses such arrays;
    callers route them to another path."""
    return jnp.dtype(dtype).itemsize * size <= 2**32 and size > 2**31


def outer_and(row_ok, col_ok, shape):
    """Block mask of `shape` from optional row and column masks (None: that edge needs no mask)."""
    if row_ok is None and col_ok is None:
        return None
    rows = jnp.ones((shape[0],), jnp.bool_) if row_ok is None else row_ok
    cols = jnp.ones((shape[1],), jnp.bool_) if col_ok is None else col_ok
    return rows[:, None] & cols[None, :]


def masked_load(ref, mask):
    """Load with zeros where `mask` is False; a plain (vectorizable) load when `mask` is None."""
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=jnp.zeros((), ref.dtype))


def launch(kernel, inputs, *, out_shape, grid, num_warps: int, num_stages: int, interpret: bool, name: str,
           out_init=None):
    """`pallas_call(kernel)(*inputs)` with the project's compiler parameters.

    `out_shape` may be a tuple (several outputs). `out_init`, if given (one array per output, a
    tuple where `out_shape` is one), is aliased as the output buffers, so elements the kernel does
    not store keep its values: tests pass NaN there to prove that every output element is written,
    and the row gather chains launches through it.
    """
    if out_init is None:
        call_kernel, aliases = kernel, {}
    else:
        several = isinstance(out_shape, tuple)
        inits, shapes = (out_init, out_shape) if several else ((out_init,), (out_shape,))
        if not isinstance(inits, tuple) or len(inits) != len(shapes) or any(
                i.shape != o.shape or i.dtype != o.dtype for i, o in zip(inits, shapes)):
            got = [(i.shape, i.dtype) for i in inits] if isinstance(inits, tuple) else out_init
            raise ValueError(f"out_init must be {out_shape}; got {got}.")
        inputs = (*inputs, *inits)
        first = len(inputs) - len(inits)
        aliases = {first + i: i for i in range(len(inits))}

        def call_kernel(*refs):
            return kernel(*refs[:first], *refs[len(inputs):])  # drop the aliased input refs

    outs = out_shape if isinstance(out_shape, tuple) else (out_shape,)
    for i, a in enumerate((*inputs, *outs)):
        if int32_offsets_wrap(math.prod(a.shape), a.dtype):
            what = f"input {i}" if i < len(inputs) else f"output {i - len(inputs)}"
            raise ValueError(f"{name}: {what} ({a.dtype} {tuple(a.shape)}) would be addressed past int32 by Pallas' "
                             "Triton lowering (int32_offsets_wrap); route such arrays to another backend.")
    context = jax.sharding.get_abstract_mesh()
    if interpret and context.manual_axes:
        # JAX's Pallas interpreter pads with mesh-invariant constants, which shard_map's varying
        # check rejects; compiled GPU kernels are fine there.
        raise ValueError(
            f"{name}: the Pallas interpreter (off GPU) cannot run inside shard_map; use "
            "backend='auto' or 'xla' on meshes of CPU devices."
        )
    if interpret and any(t == jax.sharding.AxisType.Explicit for t in context.axis_types):
        # Its discharged loops mix the mesh's shardings into the scratch buffers; compiled GPU
        # kernels lower fine under Explicit axes (tests lower them for an H200).
        raise ValueError(
            f"{name}: the Pallas interpreter (off GPU) cannot run under a mesh with Explicit axes; use "
            "backend='auto' or 'xla' on CPU devices."
        )
    out_shape, inputs = varying_like(out_shape, inputs)
    return pl.pallas_call(
        call_kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)
