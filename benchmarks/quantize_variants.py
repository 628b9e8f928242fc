"""The FP8 weight quantizer kernel's variants on the H200 (division or reciprocal multiply, 4-16 warps, with and without the transposed layout) against XLA, and its bits against torch's division: `PYTHONPATH=. python benchmarks/quantize_variants.py`."""
import os, sys, time, json
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np, jax, jax.numpy as jnp, torch, triton, triton.language as tl
from moe_jax.ops.fp8 import quantize_weights, transpose_weights
from moe_jax.ops.gmm.fp8_api import quantize_pair_for_gemm, quantize_for_gemm
from moe_jax.ops.gmm.triton.launch import fp8_quantize_weights_torch
from moe_jax.ops.gmm.triton.kernels import _nan_max
from benchmarks.gmm import to_torch, measure_copy_tbps
from benchmarks.timing import compile_jax, time_compiled, time_torch

def bytes_(a): return np.asarray(a).view(np.uint8)

# 1. bits
rng = np.random.default_rng(3)
w = rng.standard_normal((3, 130, 200)).astype(np.float32) * rng.lognormal(0, 2, (3, 130, 1)).astype(np.float32)
w[1, :128, :128] = 0
for dt in (jnp.bfloat16, jnp.float32):
    jw = jnp.asarray(w).astype(dt)
    x = quantize_weights(jw)
    xj = jax.jit(quantize_weights)(jw)
    k = quantize_for_gemm(jw, backend="triton")
    tv, ts, _ = fp8_quantize_weights_torch(to_torch(jw), transposed=True)
    # what torch says: x / scale with torch, cast
    tw = to_torch(jw).float()
    sc = torch.from_numpy(np.asarray(xj.scale_ENbKb)).cuda()
    scf = sc.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :130, :200]
    q = (tw / scf).clamp(-448, 448)
    tq = q.to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy()
    for name, (v, s) in dict(xla_eager=(x.values_ENK, x.scale_ENbKb), xla_jit=(xj.values_ENK, xj.scale_ENbKb), jax_kernel=(k.values_ENK, k.scale_ENbKb), torch_kernel=(tv.cpu(), ts.cpu())).items():
        vb = bytes_(v) if not isinstance(v, torch.Tensor) else v.view(torch.uint8).numpy()
        sb = np.asarray(s) if not isinstance(s, torch.Tensor) else s.numpy()
        d = np.argwhere(vb != tq)
        print(dt.__name__ if hasattr(dt,'__name__') else dt, name, "values != torch-divide:", len(d), "scale==xla_jit:", np.array_equal(sb, np.asarray(xj.scale_ENbKb)), flush=True)
        for idx in d[:4]:
            e_, n_, k_ = idx
            print("   ", idx, "w", float(tw[e_, n_, k_]), "scale", float(scf[e_, n_, k_]), "q", float(q[e_, n_, k_]), "bytes", vb[tuple(idx)], tq[tuple(idx)], flush=True)

# 2. time variants on torch tensors
@triton.jit
def qvar(w_ptr, values_ptr, scale_ptr, values_t_ptr, N: tl.constexpr, K: tl.constexpr, N_BLOCKS: tl.constexpr,
         K_BLOCKS: tl.constexpr, SCALE_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
         TRANSPOSED: tl.constexpr, MUL: tl.constexpr):
    pid = tl.program_id(0)
    e = pid // (N_BLOCKS * K_BLOCKS)
    nb = (pid // K_BLOCKS) % N_BLOCKS
    kb = pid % K_BLOCKS
    ns = nb * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    ks = kb * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    ok = (ns < N)[:, None] & (ks < K)[None, :]
    base = e.to(tl.int64) * N * K
    w = tl.load(w_ptr + base + ns[:, None] * K + ks[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.reduce(tl.abs(w), 1, _nan_max), 0, _nan_max)
    scale = tl.where(amax == 0, 1.0, amax * INV_FP8_MAX)
    if MUL:
        q = w * tl.math.div_rn(1.0, scale)
    else:
        q = tl.math.div_rn(w, scale)
    q = tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(values_ptr.dtype.element_ty)
    tl.store(values_ptr + base + ns[:, None] * K + ks[None, :], q, mask=ok)
    if TRANSPOSED:
        tl.store(values_t_ptr + base + ks[:, None] * N + ns[None, :], tl.trans(q), mask=(ks < K)[:, None] & (ns < N)[None, :])
    tl.store(scale_ptr + pid, scale)

copy = measure_copy_tbps()
print("copy TB/s", round(copy, 2), flush=True)
rows = []
for (name, e, n, k) in [("qwen3 gate+up", 128, 1536, 2048), ("mixtral up", 8, 14336, 4096), ("dsv3 gate+up", 256, 4096, 7168)]:
    jw = (jax.random.normal(jax.random.key(0), (e, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
    tw = to_torch(jw)
    params = e * n * k
    reps = max(2, min(10, (24 << 30) // (5 * params)))
    res = {}
    for label, fn, nb in [("xla", quantize_weights, 3), ("xla+T", lambda v: (lambda q: (q, transpose_weights(q)))(quantize_weights(v)), 5),
                          ("jax kernel", lambda v: quantize_for_gemm(v, backend="triton"), 3), ("jax kernel pair", lambda v: quantize_pair_for_gemm(v, backend="triton"), 4)]:
        run, r = compile_jax(fn, [(jw,)], reps=reps)
        t = time_compiled(run, r, trials=3)
        res[label] = (t * 1e3, nb * params / t / 1e12 / copy)
    vals = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device="cuda")
    valt = torch.empty((e, k, n), dtype=torch.float8_e4m3fn, device="cuda")
    sc = torch.empty((e, -(-n // 128), -(-k // 128)), dtype=torch.float32, device="cuda")
    grid = (e * (-(-n // 128)) * (-(-k // 128)),)
    for mul in (False, True):
        for tr in (True, False):
            for warps in (4, 8, 16):
                f = lambda: qvar[grid](tw, vals, sc, valt, N=n, K=k, N_BLOCKS=-(-n // 128), K_BLOCKS=-(-k // 128), SCALE_BLOCK=128,
                                       FP8_MAX=448.0, INV_FP8_MAX=float(np.float32(1 / 448)), TRANSPOSED=tr, MUL=mul, num_warps=warps)
                t = time_torch(f, [()], reps=5, trials=3, graph=False)
                res[f"torch {'mul' if mul else 'div'} {'pair' if tr else 'fwd'} w{warps}"] = (t * 1e3, (4 if tr else 3) * params / t / 1e12 / copy)
    print(name, json.dumps({a: f"{b[0]:.3f} ms {b[1]:.2f}" for a, b in res.items()}), flush=True)
    del jw, tw, vals, valt
