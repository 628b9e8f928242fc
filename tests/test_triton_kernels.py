"""The `triton` backend's kernels against the fp32 references, on torch tensors.

Off GPU jax_triton cannot import (it needs a CUDA jaxlib), so the kernels themselves are checked
here: interpreted by Triton on CPU tensors (the repository's conftest sets `TRITON_INTERPRET`),
compiled on CUDA tensors on a GPU, and on any host compiled ahead of time for an H200
(`tests/triton_aot.py`). The same launch parameters (`gmm_launch`, `tgmm_launch`) feed the
jax_triton path, which `tests/test_gmm.py` runs on a GPU through `gmm(backend="triton")`.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moe_jax.ops import TileConfig, gmm_reference, tgmm_reference
from moe_jax.ops.fp8 import quantize_rows, quantize_weights
from moe_jax.ops.gmm.reference import gmm_fp8_reference
from moe_jax.ops.gmm.triton.launch import fp8_gmm_launch, fp8_gmm_torch, gmm_launch, gmm_torch, tgmm_launch, tgmm_torch
from moe_jax.testing import assert_close
from tests.helpers import ON_GPU

DEVICE = "cuda" if ON_GPU else "cpu"
HI = jax.lax.Precision.HIGHEST
TILES = [
    TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, group_m=1),
    TileConfig(block_m=32, block_n=16, block_k=32, num_warps=4, num_stages=2, group_m=3),
]
SIZES = [(0, 17, 30, 0, 13), (60, 0, 0, 0, 0), (0, 0, 0, 0, 0), (12, 12, 12, 12, 12), (1, 0, 1, 0, 1)]


def _ragged_on_every_pin(sizes, ids):
    """Parameters of `sizes`: the ragged grouping runs on every pin, the others (Triton's interpreter
    on CPU, the same kernels) in the slow lane."""
    return [pytest.param(s, id=i, marks=[] if i == "ragged" else [pytest.mark.slow]) for s, i in zip(sizes, ids)]


def _t(a, dtype=None):
    t = torch.from_numpy(np.array(jnp.asarray(a, jnp.float32))).to(DEVICE)
    return t if dtype is None else t.to(dtype)


def _inputs(seed, m, k, n, e, transpose_rhs=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((e, n, k) if transpose_rhs else (e, k, n)) / np.sqrt(k)).astype(np.float32)
    return x, w


@pytest.mark.parametrize("tiles", TILES, ids=["tiles16", "tiles32-swizzle3"])
@pytest.mark.parametrize("sizes", _ragged_on_every_pin(SIZES, ["ragged", "one-hot", "all-empty", "even", "singletons"]))
@pytest.mark.parametrize("transpose_rhs", [True, False], ids=["nt", "nn"])
def test_gmm_kernel_matches_reference_and_writes_every_row(tiles, sizes, transpose_rhs):
    """fp32 (IEEE products): every row written (NaN-poisoned output), rows past the groups zero;
    K, N and the groups not multiples of the tiles."""
    m, k, n = 70, 40, 24
    x, w = _inputs(0, m, k, n, len(sizes), transpose_rhs)
    gs = np.asarray(sizes, np.int32)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    y = gmm_torch(_t(x), _t(w), torch.from_numpy(gs).to(DEVICE), transpose_rhs=transpose_rhs, tiles=tiles,
                  precision=HI, out=out)
    want = gmm_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(gs), transpose_rhs=transpose_rhs)
    assert_close(y.cpu().numpy(), want, jnp.float32, "gmm_kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gmm_kernel_gathers_rows(dtype):
    """With row ids, packed row r is `x[ids[r]]` (repeats and unused rows allowed; ids outside
    `[0, T)` read zeros): equal to the kernel on the gathered rows, bit for bit, and to the
    reference."""
    t, m, k, n, tiles = 33, 64, 48, 40, TILES[1]
    x, w = _inputs(1, t, k, n, 5)
    ids = np.random.default_rng(2).integers(0, t, m).astype(np.int32)
    ids[[3, 40]], ids[17] = -1, t + 5
    gs = torch.tensor([9, 0, 30, 20, 0], dtype=torch.int32, device=DEVICE)
    xt, wt = _t(x, dtype), _t(w, dtype)
    fused = gmm_torch(xt, wt, gs, transpose_rhs=True, tiles=tiles, precision=HI,
                      row_ids=torch.from_numpy(ids).to(DEVICE))
    valid = torch.from_numpy((ids >= 0) & (ids < t)).to(DEVICE)[:, None]
    rows = torch.where(valid, xt[torch.from_numpy(np.clip(ids, 0, t - 1)).long().to(DEVICE)], 0)
    packed = gmm_torch(rows, wt, gs, transpose_rhs=True, tiles=tiles, precision=HI)
    assert torch.equal(fused, packed)
    want = gmm_reference(jnp.asarray(rows.float().cpu().numpy()), jnp.asarray(wt.float().cpu().numpy()),
                         jnp.asarray(gs.cpu().numpy()))
    assert_close(fused.float().cpu().numpy(), want, jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32,
                 "gathered gmm_kernel")


def test_tgmm_kernel_gathers_rows():
    """The weight-gradient kernel with row ids (repeats, ids outside `[0, T)` reading zeros)
    equals it on the gathered rows, bit for bit."""
    t, m, k, n, tiles = 21, 48, 40, 24, TILES[0]
    x, _ = _inputs(4, t, k, 8, 1)
    ids = np.random.default_rng(5).integers(0, t, m).astype(np.int32)
    ids[[0, 30]], ids[11] = -1, t
    d = np.random.default_rng(6).standard_normal((m, n)).astype(np.float32)
    gs = torch.tensor([10, 0, 25, 13], dtype=torch.int32, device=DEVICE)
    xt, dt = _t(x), _t(d)
    fused = tgmm_torch(xt, dt, gs, tiles=tiles, precision=HI, row_ids=torch.from_numpy(ids).to(DEVICE))
    valid = torch.from_numpy((ids >= 0) & (ids < t)).to(DEVICE)[:, None]
    rows = torch.where(valid, xt[torch.from_numpy(np.clip(ids, 0, t - 1)).long().to(DEVICE)], 0)
    assert torch.equal(fused, tgmm_torch(rows, dt, gs, tiles=tiles, precision=HI))
    assert (fused[1] == 0).all()


def test_tgmm_kernel_clamps_sizes_in_the_program():
    """The kernel computes its group's rows from the raw sizes: negative sizes are empty, and
    sizes past the rows end at `M`, as `schedule.clamp_group_sizes` (and the reference) clamp."""
    m, k, n = 40, 24, 16
    x, _ = _inputs(4, m, k, n, 1)
    d = np.random.default_rng(7).standard_normal((m, n)).astype(np.float32)
    sizes = (15, -4, 30, 9, 2)
    got = tgmm_torch(_t(x), _t(d), torch.tensor(sizes, dtype=torch.int32, device=DEVICE), tiles=TILES[1],
                     precision=HI).cpu().numpy()
    assert (got[1] == 0).all() and (got[3:] == 0).all()
    assert_close(got, tgmm_reference(jnp.asarray(x), jnp.asarray(d), jnp.asarray(sizes)), jnp.float32, "clamped")


def test_gmm_kernel_bf16_rounds_like_the_reference():
    m, k, n = 50, 64, 32
    x, w = _inputs(3, m, k, n, 3)
    gs = torch.tensor([20, 0, 25], dtype=torch.int32, device=DEVICE)
    y = gmm_torch(_t(x, torch.bfloat16), _t(w, torch.bfloat16), gs, transpose_rhs=True, tiles=TILES[0])
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    wb = jnp.asarray(w).astype(jnp.bfloat16)
    assert y.dtype == torch.bfloat16
    assert_close(y.float().cpu().numpy(), gmm_reference(xb, wb, jnp.asarray([20, 0, 25])), jnp.bfloat16, "bf16")


@pytest.mark.parametrize("sizes", _ragged_on_every_pin(SIZES[:4], ["ragged", "one-hot", "all-empty", "even"]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tgmm_kernel_matches_reference(sizes, dtype):
    """Weight gradient: every element written (NaN-poisoned output), empty groups exactly zero, the
    rows past the groups (NaN here) never read, and two runs equal bit for bit."""
    m, k, n = 70, 40, 24
    x, _ = _inputs(4, m, k, n, 1)
    d = np.random.default_rng(5).standard_normal((m, n)).astype(np.float32)
    total = sum(sizes)
    x[total:] = np.nan
    d[total:] = np.nan
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(sizes), n, k), float("nan"), device=DEVICE, dtype=dtype)
    dw = tgmm_torch(_t(x, dtype), _t(d, dtype), gs, tiles=TILES[1], precision=HI, out=out)
    again = tgmm_torch(_t(x, dtype), _t(d, dtype), gs, tiles=TILES[1], precision=HI)
    assert torch.equal(dw, again)
    xq = jnp.asarray(_t(x, dtype).float().cpu().numpy())
    dq = jnp.asarray(_t(d, dtype).float().cpu().numpy())
    want = tgmm_reference(jnp.nan_to_num(xq), jnp.nan_to_num(dq), jnp.asarray(sizes))
    got = dw.float().cpu().numpy()
    assert np.isfinite(got).all()
    for e, s in enumerate(sizes):
        if s == 0:
            assert (got[e] == 0).all()
    assert_close(got, want, jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32, "tgmm_kernel")


def test_tgmm_launch_sizes_the_grid_by_tiles():
    launch = tgmm_launch(m=70, n=24, k=40, num_groups=5, tiles=TILES[0], dtype=np.float32, precision=HI,
                         interpret=True)
    assert launch.grid == (5 * 2 * 3,)
    assert (launch.constants["M"], launch.constants["E"], launch.constants["E_LANES"]) == (70, 5, 16)


def test_gmm_launch_refuses_int32_overflow_and_sizes_the_grid():
    tiles = TILES[0]
    launch = gmm_launch(m=70, n=24, k=40, num_groups=5, transpose_rhs=True, source_rows=None, tiles=tiles,
                        dtype=np.float32, precision=HI, interpret=True)
    # max_tiles(70, 5, 16) = 6 + 64 // 16 = 10 row tiles, times 2 column blocks.
    assert launch.grid == (20,)
    assert launch.constants["E_LANES"] == 16 and launch.constants["PRECISION"] == "ieee"
    with pytest.raises(ValueError, match="2\\*\\*31"):
        gmm_launch(m=2**28, n=8, k=8, num_groups=8, transpose_rhs=True, source_rows=None, tiles=tiles,
                   dtype=np.float32, precision=HI, interpret=True)


@pytest.mark.parametrize("fails", [False, True], ids=["imports", "import-error"])
def test_importing_jax_triton_keeps_the_triton_cache_dir(tmp_path, monkeypatch, fails):
    """jax_triton 0.3.1 blanks TRITON_CACHE_DIR when imported, which breaks every later Triton
    launch in the process; the backend's import puts the variable back, whether the import
    succeeds or (off GPU) raises. A stand-in module with jax_triton's import-time behaviour."""
    from moe_jax.ops.gmm.triton.launch import import_jax_triton

    (tmp_path / "jax_triton.py").write_text(
        "import os\nos.environ['TRITON_CACHE_DIR'] = ''\n" + ("raise ImportError('needs a CUDA jaxlib')\n" if fails else ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    real = sys.modules.pop("jax_triton", None)  # the real module, where this process has it
    try:
        if fails:
            with pytest.raises(ImportError, match="CUDA jaxlib"):
                import_jax_triton()
        else:
            assert import_jax_triton().__file__ == str(tmp_path / "jax_triton.py")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache")
    finally:
        sys.modules.pop("jax_triton", None)
        if real is not None:
            sys.modules["jax_triton"] = real


@pytest.mark.slow  # a subprocess compiling for sm_90
def test_kernels_compile_for_h200_with_wgmma_and_pipelined_loads():
    """The kernels, with and without the row gather,
    at the tiles the tables give them, compile ahead of time for sm_90 to a cubin (on any host:
    Triton ships its own ptxas), use Hopper's wgmma, pipeline their loads (cp.async, waited for
    with loads still in flight; the gathered weight gradients as deep as the packed ones) and fit in
    shared memory. A fresh process, because this one may have made the kernels interpreted."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.triton_aot"], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 10, out.stdout
    for rec in records:
        # The FP8 kernel's decode tiles (16 rows) are below wgmma's 64-row M: there Triton widens the
        # e4m3 tiles it loaded to fp16 (exactly) for mma.sync; the bytes read stay one per value.
        decode_fp8 = rec["kernel"] == "fp8_gmm" and rec["block_m"] < 64
        assert (rec["wgmma"] or decode_fp8) and rec["cp_async"] and rec["max_wait_group"] > 0 and rec["cubin"] > 0, rec
        assert rec["shared"] <= 227 * 1024, rec
        if rec["kernel"] == "fp8_gmm":  # e4m3 operands on the tensor cores, within the resource model
            assert (rec["e4m3_widened"] if decode_fp8 else rec["e4m3_mma"]) and rec["shared"] <= rec["model"], rec
    # The gathered weight gradients pipeline as deep as the packed ones, with their shared buffers:
    # their row ids are carried a step ahead, not loaded in the step that reads the rows.
    plain = next(rec for rec in records if rec["kernel"] == "tgmm" and not rec["gather"])
    for rec in records:
        if rec["kernel"] == "tgmm" and rec["gather"]:
            assert rec["max_wait_group"] == plain["max_wait_group"], (rec, plain)
            assert rec["shared"] >= plain["shared"], (rec, plain)


def _fp8(x, w, dtype=None):
    """Blockwise-FP8 operands (`moe_jax.ops.fp8`) of fp32 `x` `[M, K]` and `w` `[E, N, K]`: the JAX
    quantization, and the same bytes as torch tensors for the kernel."""
    rows, wq = quantize_rows(jnp.asarray(x)), quantize_weights(jnp.asarray(w))

    def t8(v):
        return torch.from_numpy(np.asarray(v).view(np.uint8).copy()).view(torch.float8_e4m3fn).to(DEVICE)

    return rows, wq, (t8(rows.values_MK), _t(rows.scale_MKb), t8(wq.values_ENK), _t(wq.scale_ENbKb))


FP8_TILES = TileConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=2, group_m=3)
# Columns spanning two weight blocks: the per-column scale vector instead of one scale per step.
FP8_WIDE_TILES = TileConfig(block_m=16, block_n=256, block_k=128, num_warps=4, num_stages=2, group_m=1)


@pytest.mark.parametrize("tiles", [FP8_TILES, FP8_WIDE_TILES], ids=["narrow", "wide"])
@pytest.mark.parametrize("k", [200, 256], ids=["k-partial-block", "k-whole-blocks"])
@pytest.mark.parametrize("sizes", _ragged_on_every_pin(SIZES[:3], ["ragged", "one-hot", "all-empty"]))
def test_fp8_gmm_kernel_matches_the_recipe_and_writes_every_row(sizes, k, tiles):
    """The FP8 kernel against the recipe's fp32 reference: K a multiple of the 128-wide scale
    blocks or not, N not a multiple of them nor of the tile, column tiles within one weight block
    or across two, empty groups, every row written (NaN-poisoned output), rows past the groups
    zero."""
    m, n = 70, 150
    x, w = _inputs(3, m, k, n, len(sizes))
    x[5, :128] *= 300.0  # one tile far larger than its neighbours: its own scale, no effect on them
    rows, wq, args = _fp8(x, w)
    gs = np.asarray(sizes, np.int32)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    y = fp8_gmm_torch(*args, torch.from_numpy(gs).to(DEVICE), tiles=tiles, out=out)
    want = gmm_fp8_reference(rows, wq, jnp.asarray(gs))
    assert_close(y.cpu().numpy(), want, jnp.float32, "fp8_gmm_kernel")


def test_fp8_gmm_kernel_gathers_rows_and_rounds_once():
    """With row ids, packed row r is source row `ids[r]` (its values and scales; ids outside
    `[0, T)` read zeros): equal to the kernel on the gathered rows, bit for bit; a bf16 output is the
    fp32 result rounded once."""
    t, m, k, n = 33, 64, 256, 40
    x, w = _inputs(4, t, k, n, 5)
    rows, wq, (a, a_s, b, b_s) = _fp8(x, w)
    ids = np.random.default_rng(5).integers(0, t, m).astype(np.int32)
    ids[[3, 40]], ids[17] = -1, t + 5
    gs = torch.tensor([9, 0, 30, 20, 0], dtype=torch.int32, device=DEVICE)
    tid = torch.from_numpy(ids).to(DEVICE)
    fused = fp8_gmm_torch(a, a_s, b, b_s, gs, tiles=FP8_TILES, row_ids=tid)
    valid = torch.from_numpy((ids >= 0) & (ids < t)).to(DEVICE)
    src = torch.from_numpy(np.clip(ids, 0, t - 1)).long().to(DEVICE)
    packed_a = torch.where(valid[:, None], a[src].view(torch.uint8), 0).view(torch.float8_e4m3fn)
    packed = fp8_gmm_torch(packed_a, torch.where(valid[:, None], a_s[src], 1.0), b, b_s, gs, tiles=FP8_TILES)
    assert torch.equal(fused, packed)
    bf16 = fp8_gmm_torch(a, a_s, b, b_s, gs, tiles=FP8_TILES, row_ids=tid,
                         out=torch.empty((m, n), dtype=torch.bfloat16, device=DEVICE))
    assert torch.equal(bf16, fused.to(torch.bfloat16))


def test_fp8_gmm_launch_takes_only_the_scale_block_as_its_k_step():
    with pytest.raises(ValueError, match="block_k=128"):
        fp8_gmm_launch(m=64, n=64, k=256, num_groups=2, source_rows=None, tiles=TILES[1], interpret=True)
    launch = fp8_gmm_launch(m=64, n=300, k=256, num_groups=2, source_rows=None, tiles=FP8_TILES, interpret=True)
    assert launch.constants["K_BLOCKS"] == 2 and launch.constants["N_BLOCKS"] == 3
