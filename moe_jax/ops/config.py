"""Tile configurations for the grouped-GEMM kernels and the table the ops consult.

A `TileConfig` fixes everything the Triton compiler needs that is not a shape: block sizes, warps,
pipeline stages and the swizzle width. Configs are chosen per *shape class* from a small static
table (`gmm_config`, `tgmm_config`), never by autotuning at call time: the table was filled by
`python -m benchmarks.gmm tune` on an H200 (see `benchmarks/results/`).
"""

from __future__ import annotations

import dataclasses

_WARPS = (1, 2, 4, 8, 16)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Block shape and launch parameters of one grouped-GEMM kernel.

    For `gmm` (C = A B^T per group): `block_m` rows of A per program, `block_n` output columns,
    `block_k` reduction step. For `tgmm` (dB = dC^T A per group): the program owns a
    `block_n x block_k` tile of dB and walks its group's rows `block_m` at a time.

    `group_m` row tiles share one sweep over the output columns before the next group starts, so
    an expert's weight block and its activation rows are read from HBM about once (L2 reuse).
    Triton needs power-of-two blocks; tensor-core dots need every block >= 16.

    `by_group` (gmm only) launches one program per (active-group slot, column block), `min(E, M)`
    slots, that walks its group's row tiles (plus a few programs that zero the rows past the last
    group), instead of one program per row tile of an on-device schedule: no schedule is built
    before the kernel, which is what decode needs; under heavy skew it serialises a hot group.
    `group_m` is unused there.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    by_group: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or not _is_pow2(v) or v < 16:
                raise ValueError(
                    f"TileConfig.{name}={v!r}: must be a power of two >= 16 "
                    "(Triton blocks are powers of two; tensor-core dots need 16)."
                )
        if self.num_warps not in _WARPS:
            raise ValueError(f"TileConfig.num_warps={self.num_warps!r}: must be one of {_WARPS}.")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"TileConfig.num_stages={self.num_stages!r}: must be an int in [1, 8].")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"TileConfig.group_m={self.group_m!r}: must be a positive int.")
        if not isinstance(self.by_group, bool):
            raise ValueError(f"TileConfig.by_group={self.by_group!r}: must be a bool.")


def gmm_config(m: int, n: int, k: int, num_groups: int) -> TileConfig:
    """Forward/input-gradient config for `lhs[m,k] x rhs[num_groups, n, k]`.

    Shape classes by mean rows per group `m / num_groups` (H200 sweep of 2026-11-29 with
    `python -m benchmarks.gmm tune`):
    - decode (<= 16): bytes are weights; the group-major kernel needs no schedule kernels before
      it, and narrow column blocks give every SM weight blocks to stream: 32 columns while fewer
      than two rows per group (8 of 128 experts active at one token), 64 from there (H200 sweep of
      2026-11-30 over T = 1, 8, 32, 128 tokens at top-8 of 128 experts, both kernels).
    - small prefill (<= 64): 64-row tiles, so fewer rows are tile padding.
    - prefill: 128x256x64 tiles, 8 warps, 4 stages was best or within 3% of best on all four
      model shapes (Qwen3 gate+up and down, Mixtral, DeepSeek-V3), forward and input gradient.
    """
    rows = m / max(num_groups, 1)
    if rows <= 16:
        bn = 32 if rows < 2 else 64
        return TileConfig(block_m=16, block_n=bn, block_k=256, num_warps=4, num_stages=3, group_m=1, by_group=True)
    if rows <= 64:
        return TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, group_m=8)
    bn = 256 if n >= 1024 else 128
    return TileConfig(block_m=128, block_n=bn, block_k=64, num_warps=8, num_stages=4, group_m=8)


def tgmm_config(m: int, n: int, k: int, num_groups: int) -> TileConfig:
    """Weight-gradient config for `dB[num_groups, n, k] = dC[m, n]^T A[m, k]` per group.

    Each program owns a `block_n x block_k` tile of one group's gradient and walks that group's
    rows. Prefill (> 64 rows per group): 128x128 tiles, 32-row steps won for a few hundred rows
    per group (Qwen3, DeepSeek-V3), 64 for Mixtral's ~1000; smaller groups get 64x64 tiles.
    """
    rows = m / max(num_groups, 1)
    if rows <= 64:
        return TileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3, group_m=1)
    bm = 64 if rows >= 768 else 32
    return TileConfig(block_m=bm, block_n=128, block_k=128, num_warps=8, num_stages=3, group_m=1)
