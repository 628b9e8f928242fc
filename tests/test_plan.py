"""The chooser (`moe_jax.ops.gmm.plan`): which backend and configuration run each grouped GEMM, the
fallback to tiles that fit, the errors for configurations a backend does not take or that do not
fit, and the contracts every backend keeps (x64 mode, unsigned and out-of-range traced sizes).

Backends are checked compiled on a GPU and interpreted on CPU; GPU choices are also planned from
this host under an abstract H200 (`h200_mesh`), where `triton` is not available (jax_triton needs
a CUDA jaxlib) unless the host has a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import (BACKENDS, GEMM_BACKENDS, H200_BACKENDS, KERNELS, BackendTable, GmmConfig, MosaicConfig,
                         TileConfig, device_facts, gmm, gmm_reference, grouped_linear, plan, plan_linear,
                         resolve_backend, resolved_problem, tgmm, tgmm_reference)
from moe_jax.ops.gmm.triton import have_jax_triton
from moe_jax.testing import assert_close
from tests.helpers import ON_GPU, h200_mesh

H200 = h200_mesh((1,), ("aot",))
BF16, FP32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
# Every backend this host runs: compiled on a GPU; interpreted (pallas_triton, mosaic_gpu) or plain (xla) on CPU.
RUNNABLE = ["pallas_triton", "xla", "mosaic_gpu"] + (["triton"] if ON_GPU and have_jax_triton() else [])


def _problem(kernel="gmm_nt", m=32768, n=1536, k=2048, e=128, dtype=BF16, **kw):
    return resolved_problem(kernel, m, n, k, e, dtype, **kw)


def test_the_registry_has_every_backend_name_and_the_table_every_kernel():
    assert set(GEMM_BACKENDS) == set(BACKENDS)
    assert {kernel for kernel, _ in H200_BACKENDS} == set(KERNELS)
    assert {cls for _, cls in H200_BACKENDS} == {"decode", "prefill"}
    assert H200_BACKENDS[("gmm_nt", "prefill")] == ("pallas_triton",)
    assert H200_BACKENDS[("gmm_nn", "prefill")] == ("triton", "pallas_triton")


def test_backend_resolution():
    assert resolve_backend("auto") == ("pallas_triton" if ON_GPU else "xla")
    assert resolve_backend("xla") == "xla"
    with pytest.raises(ValueError, match="backend='cutlass'"):
        resolve_backend("cutlass")
    if ON_GPU:
        assert resolve_backend("triton") == "triton"
    else:
        with pytest.raises(ValueError, match="backend='triton'.*needs a CUDA GPU"):
            resolve_backend("triton")


def test_auto_off_gpu_is_xla_and_says_a_config_is_not_used():
    cpu_mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("ep",))
    with jax.sharding.use_abstract_mesh(cpu_mesh.abstract_mesh):
        for kernel in KERNELS:
            assert plan(_problem(kernel)).backend == "xla"
        p = plan(_problem(), "auto", TileConfig(64, 64, 64, 4, 2, 8))
        assert p.backend == "xla" and "picks its own tiling" in p.why[0]


def test_auto_per_kernel_table_for_an_h200():
    """Compiling for an H200: the first of the table's choices that is available, has the kernel,
    takes the config and supports the problem; what was skipped is in the plan."""
    with jax.sharding.use_abstract_mesh(H200):
        for (kernel, cls), choices in H200_BACKENDS.items():
            rows = 64 * 128 if cls == "decode" else 64 * 128 + 8
            p = plan(_problem(kernel, m=rows))
            assert choices[-1] == "pallas_triton"
            if "triton" in choices and not have_jax_triton():
                assert p.backend == "pallas_triton" and "auto skipped triton" in p.why[0] and "jax_triton" in p.why[0]
            else:
                assert p.backend == choices[0]
        # A table preferring Mosaic for the input gradient: it runs where it takes the problem.
        table = H200_BACKENDS.replace({("gmm_nn", "prefill"): ("mosaic_gpu", "pallas_triton")})
        assert plan(_problem("gmm_nn"), table).backend == "mosaic_gpu"
        for p in (plan(_problem("gmm_nn", dtype=FP32), table), plan(_problem("gmm_nn", n=2000), table)):
            assert p.backend == "pallas_triton" and p.why[0].startswith("auto skipped mosaic_gpu: mosaic_gpu")
        assert plan(_problem("gmm_nn", m=4096), table).backend == "pallas_triton"  # decode: the table's own entry
        assert plan(_problem("gmm_nt"), table).backend == "pallas_triton"
        # An explicit configuration goes to the first backend that takes it.
        assert plan(_problem("gmm_nn"), table, GmmConfig("group_major", TileConfig(16, 64, 64, 4, 2, 1))).backend \
            == "pallas_triton"
        with pytest.raises(ValueError, match=r"no entry for \('tgmm', 'prefill'\)"):
            plan(_problem("tgmm"), BackendTable.of({("gmm_nt", "prefill"): ("pallas_triton",)}))


def test_backend_table_is_auto_with_a_table_of_its_own():
    """A `BackendTable` is `auto` with that table: every other op resolves it as `auto`; it is
    hashable (it sits in static options) and checked when built."""
    mosaic_dgrad = H200_BACKENDS.replace({("gmm_nn", "prefill"): ("mosaic_gpu", "triton", "pallas_triton")})
    assert mosaic_dgrad[("gmm_nn", "prefill")] == ("mosaic_gpu", "triton", "pallas_triton")
    assert {k: v for k, v in mosaic_dgrad.items() if k != ("gmm_nn", "prefill")} == {
        k: v for k, v in H200_BACKENDS.items() if k != ("gmm_nn", "prefill")}
    assert mosaic_dgrad == BackendTable.of(dict(mosaic_dgrad)) and hash(mosaic_dgrad) == hash(BackendTable.of(dict(mosaic_dgrad)))
    assert mosaic_dgrad != H200_BACKENDS
    reordered = BackendTable.of(dict(reversed(list(mosaic_dgrad.items()))))  # key order carries no meaning
    assert reordered == mosaic_dgrad and hash(reordered) == hash(mosaic_dgrad)
    assert resolve_backend(mosaic_dgrad) == ("pallas_triton" if ON_GPU else "xla")
    for table, message in [({("gmm_nt", "training"): ("xla",)}, r"key \('gmm_nt', 'training'\)"),
                           ({("gmm_nt", "decode"): ()}, r"non-empty tuple of backends"),
                           ({("gmm_nt", "decode"): ("auto",)}, r"non-empty tuple of backends"),
                           ({"gmm_nt": ("xla",)}, r"use \(kernel, shape class\)")]:
        with pytest.raises(ValueError, match=message):
            BackendTable.of(table)
    with pytest.raises(ValueError, match="appears twice"):
        BackendTable(((("gmm_nt", "decode"), ("xla",)), (("gmm_nt", "decode"), ("pallas_triton",))))
    with pytest.raises(TypeError, match=r"build one from a dict with BackendTable.of"):
        BackendTable({("gmm_nt", "decode"): ("xla",)})


def test_auto_follows_the_mesh_platform(monkeypatch):
    """In a GPU process, code traced for a mesh of CPU devices (a CPU EP mesh on a one-GPU host,
    as `parity/` builds) must not get Pallas: its interpreter cannot run inside shard_map."""
    from moe_jax.ops import platform

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_backend("auto") == "pallas_triton"
    cpu_mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("ep",))
    with jax.sharding.use_abstract_mesh(cpu_mesh.abstract_mesh):
        assert resolve_backend("auto") == "xla"
        assert not platform.on_gpu()
        assert plan(_problem()).backend == "xla"


def test_auto_follows_the_default_device(monkeypatch):
    """In a GPU process, code under `jax.default_device(cpu)` (its uncommitted arrays and their
    computations on the CPU) gets the CPU's kernels: interpret mode, never GPU kernels compiled for
    CPU arrays; a device or a platform name alike. A set mesh still decides first."""
    from moe_jax.ops import platform

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for default in (jax.devices("cpu")[0], "cpu"):
        with jax.default_device(default):
            assert platform.compile_platform() == "cpu" and resolve_backend("auto") == "xla"
            with jax.sharding.use_abstract_mesh(H200):
                assert platform.on_gpu()
    assert platform.on_gpu() and resolve_backend("auto") == "pallas_triton"


def test_device_facts_for_an_h200_and_off_gpu():
    with jax.sharding.use_abstract_mesh(H200):
        facts = device_facts()
        assert facts.kind == "NVIDIA H200" and facts.capability == (9, 0)
        assert facts.smem_per_block == 227 * 1024 and facts.num_sms == 132
    if not ON_GPU:
        assert device_facts().smem_per_block == 227 * 1024  # modelled as an H200 in interpret mode


def test_tuned_tiles_fall_back_to_tiles_that_fit_and_say_so():
    """fp32 operands need twice a bf16 tile's shared memory: the tuned 128x256x64 4-stage tile does
    not fit an H200 (294912 B > 232448 B, what the compiler asked for there); the plan runs the
    nearest tile that fits, keeps the rows per tile (so the candidate and its padding), and says so."""
    with jax.sharding.use_abstract_mesh(H200):
        bf16 = plan(_problem("gmm_nt", n=2048, k=1024), "pallas_triton")
        assert bf16.config.configs[0].tiles == TileConfig(128, 256, 64, 8, 4, 8) and not bf16.why
        assert bf16.smem_bytes == (196608,)  # 4 buffers of 128x64 + 64x256 bf16: what Triton compiles
        fp32 = plan(_problem("gmm_nt", n=2048, k=1024, dtype=FP32), "pallas_triton")
        assert fp32.config.names == bf16.config.names == ("rt128x256",)
        assert fp32.config.configs[0].tiles == TileConfig(128, 256, 64, 8, 3, 8)
        assert fp32.smem_bytes == (196608,)
        assert "needs 294912 B of shared memory for float32 operands, over the 232448 B per block" in fp32.why[0]
        # The selector's candidates are fitted one by one.
        auto = plan(_problem("gmm_nt", m=8192, n=1024, k=512, e=64, dtype=FP32), "pallas_triton", "auto")
        assert all(need <= 232448 for need in auto.smem_bytes) and auto.config.table is not None
        # TF32 (fp32 at DEFAULT precision) runs wgmma, which keeps one more buffer.
        tf32 = plan(_problem("gmm_nt", n=2048, k=1024, dtype=FP32, precision=jax.lax.Precision.DEFAULT),
                    "pallas_triton")
        assert tf32.config.configs[0].tiles.num_stages == 2


def test_an_explicit_config_that_cannot_fit_raises_before_launch():
    big = TileConfig(128, 256, 128, 8, 4, 8)
    with jax.sharding.use_abstract_mesh(H200):
        with pytest.raises(ValueError, match=r"config row_tile 128x256x128 w8 s4 needs \d+ B of shared memory for "
                                             r"bfloat16 operands, over the 232448 B per block of NVIDIA H200"):
            plan(_problem(), "pallas_triton", big)
        with pytest.raises(ValueError, match=r"128x256x128 w8 s4 \(weight gradient\) needs"):
            plan(_problem("tgmm"), "pallas_triton", big)
    # The same on any host, before anything runs (interpret mode models an H200).
    x, w = jnp.ones((64, 256), jnp.float32), jnp.ones((2, 512, 256), jnp.float32)
    with pytest.raises(ValueError, match=r"needs \d+ B of shared memory for float32 operands"):
        gmm(x, w, jnp.array([32, 32]), backend="pallas_triton", config=TileConfig(64, 256, 64, 8, 4, 8))


def test_a_config_the_backend_does_not_take_is_a_type_error():
    x, w, gs = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((2, 256, 64), jnp.bfloat16), jnp.array([4, 4])
    with pytest.raises(TypeError, match=r"backend='xla' takes no configuration for gmm_nt; got config=TileConfig"):
        gmm(x, w, gs, backend="xla", config=TileConfig())
    with pytest.raises(TypeError, match=r"backend='mosaic_gpu' takes MosaicConfig for gmm_nt; got config=TileConfig"):
        gmm(x, w, gs, backend="mosaic_gpu", config=TileConfig())
    with pytest.raises(TypeError, match=r"backend='pallas_triton' takes GmmConfig, TileConfig, SelectorTable"):
        gmm(x, w, gs, backend="pallas_triton", config=MosaicConfig())
    with pytest.raises(TypeError, match=r"is no configuration of a tgmm kernel"):
        tgmm(x, x, gs, backend="pallas_triton", config=MosaicConfig())


def test_a_plan_must_be_for_the_call():
    x, w, gs = jnp.ones((8, 64)), jnp.ones((2, 32, 64)), jnp.array([4, 4])
    p = plan(resolved_problem("gmm_nt", 8, 32, 64, 2, jnp.float32), "xla")
    assert_close(gmm(x, w, gs, plan=p), gmm_reference(x, w, gs), jnp.float32, "planned gmm")
    with pytest.raises(ValueError, match=r"plan is for gmm_nt M=8 N=32 K=64 E=2 float32->float32 but the call is "
                                         r"gmm_nt M=8 N=32 K=64 E=2 bfloat16->bfloat16"):
        gmm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gs, plan=p)
    with pytest.raises(TypeError, match="plan must be a moe_jax.ops.Plan"):
        gmm(x, w, gs, plan="xla")
    plans = plan_linear(8, (2, 32, 64), jnp.float32, backend="xla")
    assert [p.problem.kernel for p in plans] == ["gmm_nt", "gmm_nn", "tgmm"]
    assert plans.dgrad.problem.n == 64 and plans.dgrad.problem.k == 32
    assert_close(grouped_linear(x, w, gs, plans=plans), gmm_reference(x, w, gs), jnp.float32, "planned linear")


def _operands(backend, seed=0):
    """Small operands a backend takes (Mosaic GPU: bf16, N a multiple of 256, K of 64, M >= 128),
    sizes with an empty group, and interpreter-sized tiles for the Pallas Triton kernels off GPU."""
    dtype = jnp.bfloat16 if backend == "mosaic_gpu" else jnp.float32
    m, k, n = (256, 64, 256) if backend == "mosaic_gpu" else (40, 32, 24)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((4, n, k)) / np.sqrt(k), dtype)
    small = backend == "pallas_triton" and not ON_GPU
    tiles = (TileConfig(16, 16, 16, 4, 2, 2), TileConfig(16, 16, 16, 4, 2, 1)) if small else (None, None)
    return x, w, [m // 4, 0, m // 2, m // 8], tiles


@pytest.mark.parametrize("backend", RUNNABLE)
def test_x64_mode_on_every_backend(backend):
    """`jax_enable_x64=True` (64-bit Python ints in traced index math) on every backend, with
    int32 and int64 sizes: the same bits as without it; on the backends with all three kernels the
    forward and both gradients (the Mosaic GPU kernel, slow to interpret, the forward)."""
    x, w, sizes, (tiles, wtiles) = _operands(backend)
    ct = jax.random.normal(jax.random.PRNGKey(5), (x.shape[0], w.shape[1]), jnp.float32)
    cfg = dict(fwd_config=tiles, dgrad_config=tiles, wgrad_config=wtiles)

    def run(x, w, gs):
        if backend == "mosaic_gpu":
            return (gmm(x, w, gs, backend=backend),)
        return jax.grad(lambda x, w: jnp.sum(grouped_linear(x, w, gs, backend=backend, **cfg).astype(jnp.float32)
                                             * ct), (0, 1))(x, w)

    base = jax.jit(run)(x, w, jnp.asarray(sizes, jnp.int32))
    if backend == "mosaic_gpu" and not ON_GPU:
        # JAX's Mosaic GPU interpreter cannot run under x64: a clear error, before anything runs.
        with jax.enable_x64(True), pytest.raises(ValueError, match="does not run under jax_enable_x64"):
            run(x, w, jnp.asarray(sizes, jnp.int64))
        return
    with jax.enable_x64(True):
        for sizes_dtype in ((jnp.int64,) if backend == "mosaic_gpu" else (jnp.int32, jnp.int64)):
            got = jax.jit(run)(x, w, jnp.asarray(sizes, sizes_dtype))
            for a, b in zip(got, base):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("backend", RUNNABLE)
def test_unsigned_and_oversized_traced_sizes_are_clamped_alike(backend):
    """Traced sizes are clamped as the docs say on every backend: negative as zero, the running
    total at M; an unsigned size past 2**31 is a large size (all the rows), not a negative one."""
    x, w, _, (tiles, wtiles) = _operands(backend, seed=1)
    m, e = x.shape[0], w.shape[0]
    dy = jax.random.normal(jax.random.PRNGKey(2), (m, w.shape[1]), jnp.float32).astype(x.dtype)
    clamped = jnp.array([m] + [0] * (e - 1), jnp.int32)
    unsigned = jnp.array([2**32 - 1] + [3] * (e - 1), jnp.uint32)
    run = jax.jit(lambda s: gmm(x, w, s, backend=backend, config=tiles))
    assert_close(run(unsigned), gmm_reference(x, w, clamped), x.dtype, "unsigned sizes")
    if backend == "mosaic_gpu":  # no Mosaic weight gradient; the interpreter is slow: one case
        return
    np.testing.assert_array_equal(np.asarray(run(unsigned)), np.asarray(run(clamped)))
    np.testing.assert_array_equal(np.asarray(run(jnp.array([m + 5, 7, -3, 1], jnp.int32))), np.asarray(run(clamped)))
    wrun = jax.jit(lambda s: tgmm(x, dy, s, backend=backend, config=wtiles))
    np.testing.assert_array_equal(np.asarray(wrun(unsigned)), np.asarray(wrun(clamped)))
    assert_close(wrun(unsigned), tgmm_reference(x, dy, clamped), x.dtype, "unsigned sizes, weight gradient")
