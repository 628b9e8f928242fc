"""Tiles of the kernels that Triton compiles (the `pallas_triton` and `triton` backends), their
shared-memory model, and the deterministic fallback to tiles that fit.

Legend: M packed rows, K reduction width, N output width; bm, bn, bk a tile's block sizes, S its
pipeline stages.

Shared memory. Both backends' kernels are loops of two masked block loads feeding one `dot`, which
Triton's software pipeliner turns into a ring of shared-memory buffers, and an fp32 accumulator
stored at the end. Per stage of the ring a forward (`gmm_nt`, `gmm_nn`) tile holds a `bm x bk`
block of `lhs` and a `bk x bn` block of `rhs`; a weight-gradient (`tgmm`) tile a `bm x bn` block of
`dout` and a `bm x bk` block of `lhs`. The ring has `S - 1` buffers, one more where the dot runs on
Hopper's asynchronous warpgroup MMA (wgmma: 16-bit operands, or fp32 at TF32, with an MMA M
dimension of at least 64, i.e. `bm` for the forward and `bn` for the weight gradient), which keeps
one MMA in flight; at least one. The epilogue converts the accumulator's layout through shared
memory once the ring is free. The FP8 kernel (`float8_e4m3fn` operands, one byte each) also loads
an fp32 scale per row and per column of each K step, counted in its stage (an upper bound: Triton
3.6 keeps at most part of them in shared memory). So the kernel needs

    max(buffers * stage bytes, MMA M x MMA N x 4)

`triton_smem_bytes` is this model. It was fitted to, and is checked against (`tests/test_resources.py`),
what Triton 3.6 compiles for sm_90: exact for every pipelined 16-bit and fp32 tile the tables
run, an upper bound elsewhere. Registers never stop a launch (Triton caps them to fit the block
and spills), so they are not modelled. Off sm_90 the wgmma buffer is always counted (an upper
bound there).

Fallback. A tuned tile that does not fit (fp32 operands need twice a bf16 tile's bytes) is
replaced by the first tile that fits in this order: fewer stages down to 2, then `block_k` halved
down to 16 at 2 stages (never for the FP8 kernel, whose K step is its scale block), then 1 stage,
then `block_n` halved down to 16. `block_m` never changes,
so the rows a kernel executes (its padding) and the candidate it is stay the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax.numpy as jnp

from moe_jax.ops.platform import DeviceFacts
from moe_jax.validation import check_int

__all__ = ["TileConfig", "fit_tiles", "tile_name", "triton_smem_bytes"]

_WARPS = (1, 2, 4, 8, 16)
WGMMA_MIN_M = 64


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Block shape and launch parameters of one grouped-GEMM kernel compiled by Triton.

    For `gmm` (C = A B^T per group): `block_m` rows of A per program, `block_n` output columns,
    `block_k` reduction step. For `tgmm` (dB = dC^T A per group): the program owns a
    `block_n x block_k` tile of dB and walks its group's rows `block_m` at a time.

    `group_m` row tiles share one sweep over the output columns before the next group starts, so
    an expert's weight block and its activation rows are read from HBM about once (L2 reuse;
    row-tile kernels only). Triton needs power-of-two blocks; tensor-core dots need every block
    >= 16.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = check_int(f"TileConfig.{name}", getattr(self, name), minimum=16)
            if v & (v - 1):
                raise ValueError(
                    f"TileConfig.{name}={v}: must be a power of two >= 16 "
                    "(Triton blocks are powers of two; tensor-core dots need 16)."
                )
            object.__setattr__(self, name, v)
        if self.num_warps not in _WARPS:
            raise ValueError(f"TileConfig.num_warps={self.num_warps!r}: must be one of {_WARPS}.")
        stages = check_int("TileConfig.num_stages", self.num_stages)
        if stages > 8:
            raise ValueError(f"TileConfig.num_stages={stages}: must be an int in [1, 8].")
        object.__setattr__(self, "num_stages", stages)
        object.__setattr__(self, "group_m", check_int("TileConfig.group_m", self.group_m))

    def __str__(self) -> str:
        return tile_name(self)


def tile_name(tiles: TileConfig) -> str:
    """E.g. `128x256x64 w8 s4` (block_m x block_n x block_k, warps, stages)."""
    return f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}"


def triton_smem_bytes(tiles: TileConfig, *, wgrad: bool, dtype, ieee_fp32: bool,
                      capability: tuple[int, int] | None = (9, 0)) -> int:
    """Shared memory (bytes) Triton allocates for one of our grouped-GEMM kernels at `tiles` with
    `dtype` operands (the module docstring's model). `wgrad`: the weight-gradient kernel (else a
    forward kernel). `ieee_fp32`: fp32 operands at full precision (no tensor cores)."""
    bm, bn, bk, stages = tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_stages
    mma_m, mma_n = (bn, bk) if wgrad else (bm, bn)
    stage = ((bm * bn + bm * bk) if wgrad else (bm * bk + bk * bn)) * jnp.dtype(dtype).itemsize
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        stage += (bm + bn) * 4  # the FP8 kernel's fp32 row and column-block scales of each K step
    wgmma = not ieee_fp32 and (mma_m >= WGMMA_MIN_M or capability != (9, 0))
    buffers = max(1, stages - 1 + int(wgmma))
    return max(buffers * stage, mma_m * mma_n * 4)


def _smaller(tiles: TileConfig, min_k: int) -> Iterator[TileConfig]:
    """The fallback order of the module docstring, nearest first, `block_k` kept >= `min_k`."""
    replace = dataclasses.replace
    for stages in range(tiles.num_stages - 1, 1, -1):
        yield replace(tiles, num_stages=stages)
    two = replace(tiles, num_stages=min(2, tiles.num_stages))
    bk = tiles.block_k
    while bk > min_k:
        bk //= 2
        yield replace(two, block_k=bk)
    one = replace(two, block_k=max(min_k, 16), num_stages=1)
    yield one
    bn = tiles.block_n
    while bn > 16:
        bn //= 2
        yield replace(one, block_n=bn)


def fit_tiles(tiles: TileConfig, *, wgrad: bool, dtype, ieee_fp32: bool, device: DeviceFacts,
              explicit: bool = False, what: str = "") -> tuple[TileConfig, int, tuple[str, ...]]:
    """`(tiles, bytes, notes)`: `tiles` where they fit `device`'s shared memory per block, else (a
    tuned choice) the first of the fallback order that does, said in `notes`. An `explicit`
    configuration (named `what` in the error) that does not fit raises ValueError naming the bytes
    and the limit."""
    def need(t):
        return triton_smem_bytes(t, wgrad=wgrad, dtype=dtype, ieee_fp32=ieee_fp32, capability=device.capability)

    limit, first = device.smem_per_block, need(tiles)
    if first <= limit:
        return tiles, first, ()
    if explicit:
        raise ValueError(
            f"config {what or tile_name(tiles)} needs {first} B of shared memory for {jnp.dtype(dtype).name} operands, "
            f"over the {limit} B per block of {device.kind}; pass smaller tiles (fewer stages or a smaller block_k), "
            "or config=None for the tuned choice, which falls back to tiles that fit.")
    # The FP8 kernel steps K one 128-wide scale block at a time: its block_k never shrinks.
    min_k = tiles.block_k if jnp.dtype(dtype) == jnp.float8_e4m3fn else 16
    smaller = next((t for t in _smaller(tiles, min_k) if need(t) <= limit), None)
    if smaller is None:
        raise ValueError(f"no tile from {tile_name(tiles)} down fits the {limit} B of shared memory per block of "
                         f"{device.kind}.")
    return smaller, need(smaller), (
        f"{tile_name(tiles)} needs {first} B of shared memory for {jnp.dtype(dtype).name} operands, over the "
        f"{limit} B per block of {device.kind}: runs {tile_name(smaller)} ({need(smaller)} B)",)
