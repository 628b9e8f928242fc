"""Compile the `triton` backend's kernels ahead of time for an H200 (sm_90) on any host, and print
what the compiled code uses, one JSON line per kernel variant: wgmma, cp.async, the deepest
`cp.async.wait_group` (0 when every load is waited for where it is issued, > 0 when loads run
ahead of their use: the loop is pipelined), shared memory.

    python -m tests.triton_aot

Run in a process without `TRITON_INTERPRET` (under it `triton.jit` gives interpreted functions,
which do not compile); `tests/test_triton_kernels.py` starts it so. The launch constants come from
`moe_jax.ops.gmm.triton.launch` (`gmm_launch`, `tgmm_launch`), as on the GPU; pointer arguments carry the 16-byte
divisibility that jax_triton passes for JAX buffers (without it Triton cannot vectorize the loads,
so it does not pipeline them).
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_jax.ops.fp8 import FP8_DTYPE
from moe_jax.ops.gmm.tiles import triton_smem_bytes
from moe_jax.ops.gmm.triton.kernels import fp8_gmm_kernel, gmm_kernel, tgmm_kernel
from moe_jax.ops.gmm.triton.launch import fp8_gmm_launch, gmm_launch, tgmm_launch
from moe_jax.ops.gmm.triton.rules import fp8_gmm_tiles, gmm_tiles, tgmm_tiles

H200 = GPUTarget("cuda", 90, 32)
# Qwen3-30B-A3B gate+up at prefill: 32768 packed rows of 4096 tokens, 128 experts.
M, T, N, K, E = 32768, 4096, 1536, 2048, 128


def _compile(kernel, pointers: list[str], launch) -> dict:
    signature = {name: f"*{kind}" for name, kind in pointers} | {name: "constexpr" for name in launch.constants}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=dict(launch.constants), attrs=attrs),
                              target=H200, options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    ptx = compiled.asm["ptx"]
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    return dict(wgmma="wgmma.mma_async" in ptx, cp_async="cp.async" in ptx, max_wait_group=max(waits, default=0),
                shared=compiled.metadata.shared, cubin=len(compiled.asm["cubin"]),
                e4m3_mma=bool(re.search(r"(wgmma\.mma_async|mma\.sync)\S*\.e4m3\.e4m3", ptx)),
                e4m3_widened="cvt.rn.f16x2.e4m3x2" in ptx)


def main() -> None:
    fwd = gmm_tiles(M, N, K, E)
    wgrad = tgmm_tiles(M, N, K, E)
    gmm_ptrs = [("sizes_ptr", "i32"), ("rows_ptr", "i32"), ("a_ptr", "bf16"), ("b_ptr", "bf16"), ("c_ptr", "bf16")]
    tgmm_ptrs = [("sizes_ptr", "i32"), ("rows_ptr", "i32"), ("a_ptr", "bf16"), ("d_ptr", "bf16"), ("o_ptr", "bf16")]
    for gather in (False, True):
        source = T if gather else None
        for transpose_rhs in (True, False):
            launch = gmm_launch(m=M, n=N, k=K, num_groups=E, transpose_rhs=transpose_rhs, source_rows=source,
                                tiles=fwd, dtype=jnp.bfloat16, precision=None, interpret=False)
            print(json.dumps(dict(kernel="gmm", gather=gather, transpose_rhs=transpose_rhs,
                                  **_compile(gmm_kernel, gmm_ptrs, launch))), flush=True)
        launch = tgmm_launch(m=M, n=N, k=K, num_groups=E, tiles=wgrad, dtype=jnp.bfloat16, precision=None,
                             interpret=False, source_rows=source)
        print(json.dumps(dict(kernel="tgmm", gather=gather, **_compile(tgmm_kernel, tgmm_ptrs, launch))), flush=True)
    # The FP8 kernel at the rule's prefill tiles (this shape) and decode tiles (8 rows per group).
    fp8_ptrs = [("sizes_ptr", "i32"), ("rows_ptr", "i32"), ("a_ptr", "fp8e4nv"), ("a_scale_ptr", "fp32"),
                ("b_ptr", "fp8e4nv"), ("b_scale_ptr", "fp32"), ("c_ptr", "bf16")]
    for m, source in ((M, T), (8 * E, 8 * E // 8)):
        tiles = fp8_gmm_tiles(m, N, K, E)
        for gather in (False, True):
            launch = fp8_gmm_launch(m=m, n=N, k=K, num_groups=E, source_rows=source if gather else None, tiles=tiles,
                                    interpret=False)
            model = triton_smem_bytes(tiles, wgrad=False, dtype=FP8_DTYPE, ieee_fp32=False)
            print(json.dumps(dict(kernel="fp8_gmm", gather=gather, block_m=tiles.block_m, model=model,
                                  **_compile(fp8_gmm_kernel, fp8_ptrs, launch))), flush=True)


if __name__ == "__main__":
    main()
