"""Master-weight quantization (`moe_jax.ops.quantize.quantize_master_weights`): the fused kernel
equals the recipe's `quantize_weights` / `transpose_weights` bit for bit (bf16, fp16, fp32; N and
K not multiples of 128; one block; all-zero blocks; every output element written), NaN and inf
stay in their block, argument errors, the lowering for an H200 (and its Triton IR compiled for
sm_90: XLA's division and e4m3 conversion instructions, shared memory), and `fp8_grouped_linear`
on the fused path. Activation rows (`quantize_activations`): the rows kernel equals the recipe's
`quantize_rows` bit for bit (ragged M and K, zero rows, every output written), NaN and inf stay in
their tile, errors, the lowering for an H200 and its sm_90 instructions.

The same bodies run the Pallas kernel compiled on a GPU and interpreted on CPU.

Legend: E experts, N output width, K input width; Nb, Kb the 128-wide block counts.
"""

import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import fp8_linear
from moe_jax.ops.fp8 import FP8_DTYPE, quantize_rows, quantize_weights, transpose_weights
from moe_jax.ops.fp8_linear import fp8_grouped_linear
from moe_jax.ops.quantize import backends, quantize_activations, quantize_master_weights, quantize_master_weights_reference
from moe_jax.ops.quantize.kernel import quantize_rows_pallas, quantize_weights_pallas
from tests.helpers import ON_GPU, assert_same_bits, lower_for_gpu, triton_modules

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
KERNEL = 'name = "moe_jax_quantize_weights"'
ROWS_KERNEL = 'name = "moe_jax_quantize_rows"'


def _weights(shape, dtype, seed=0):
    """Normal weights with magnitudes spread over blocks (x 1e-3 .. 1e2), an all-zero block
    `[0, :128, :128]` when there are several blocks, and the dtype's rounding."""
    e, n, k = shape
    w = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
    w = w * jnp.logspace(-3, 2, e * n, dtype=jnp.float32).reshape(e, n, 1)
    if n > 128 or k > 128:
        w = w.at[0, :128, :128].set(0.0)
    return w.astype(dtype)


def _assert_same_weights(got, want):
    assert_same_bits(got.values_ENK, want.values_ENK)
    assert_same_bits(got.scale_ENbKb, want.scale_ENbKb)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 200, 136), (1, 128, 128), (2, 256, 100)], ids=["ragged", "one-block", "k-edge"])
def test_kernel_equals_the_recipe_bit_for_bit(dtype, shape):
    w = _weights(shape, dtype)
    wq, wq_t = quantize_master_weights(w, transposed=True, backend="pallas_triton")
    want = quantize_weights(w)
    _assert_same_weights(wq, want)
    _assert_same_weights(wq_t, transpose_weights(want))
    _assert_same_weights(quantize_master_weights(w, backend="pallas_triton"), want)
    if shape[1] > 128:  # the all-zero block: scale 1, zero values
        assert float(wq.scale_ENbKb[0, 0, 0]) == 1.0 and not np.any(np.asarray(wq.values_ENK[0, :128, :128], np.float32))


def test_xla_backend_is_the_reference():
    w = _weights((2, 130, 260), jnp.bfloat16)
    for transposed in (False, True):
        got = quantize_master_weights(w, transposed=transposed, backend="xla")
        want = quantize_master_weights_reference(w, transposed=transposed)
        for g, r in zip(got if transposed else (got,), want if transposed else (want,)):
            _assert_same_weights(g, r)


def test_every_output_element_is_written():
    """NaN in every output buffer must not survive: each element, edge blocks included, is stored."""
    w = _weights((2, 200, 136), jnp.bfloat16, seed=1)
    e, n, k = w.shape
    nan8 = lambda *s: jnp.full(s, jnp.nan, FP8_DTYPE)  # noqa: E731
    nan32 = lambda *s: jnp.full(s, jnp.nan, jnp.float32)  # noqa: E731
    wq, wq_t = quantize_weights_pallas(w, transposed=True, num_warps=4, interpret=not ON_GPU,
                                       out_init=(nan8(e, n, k), nan32(e, 2, 2), nan8(e, k, n), nan32(e, 2, 2)))
    want = quantize_weights(w)
    _assert_same_weights(wq, want)
    _assert_same_weights(wq_t, transpose_weights(want))


def test_nan_and_inf_stay_in_their_block():
    """A NaN makes its block's scale and values NaN (the recipe's contract; XLA:CPU's reference can
    drop it from the block's max, so that block is checked against the contract); an infinity gives
    its block scale inf (as the reference). Every other block is the reference's, bit for bit."""
    w = _weights((2, 200, 136), jnp.float32, seed=2).at[1, 150, 7].set(jnp.nan).at[0, 3, 131].set(-jnp.inf)
    wq, wq_t = quantize_master_weights(w, transposed=True, backend="pallas_triton")
    assert np.isnan(float(wq.scale_ENbKb[1, 1, 0])) and np.isnan(float(wq_t.scale_ENbKb[1, 0, 1]))
    assert np.all(np.isnan(np.asarray(wq.values_ENK[1, 128:, :128], np.float32)))
    assert float(wq.scale_ENbKb[0, 0, 1]) == np.inf
    want = quantize_weights(w)
    poisoned = np.zeros((2, 200, 136), bool)
    poisoned[1, 128:, :128] = True
    scales = np.ones((2, 2, 2), bool)
    scales[1, 1, 0] = False
    assert_same_bits(np.asarray(wq.values_ENK)[~poisoned], np.asarray(want.values_ENK)[~poisoned])
    assert_same_bits(np.asarray(wq.scale_ENbKb)[scales], np.asarray(want.scale_ENbKb)[scales])
    np.testing.assert_array_equal(np.asarray(wq_t.values_ENK).view(np.uint8),
                                  np.swapaxes(np.asarray(wq.values_ENK), 1, 2).view(np.uint8))


def test_errors():
    w = jnp.ones((2, 8, 8), jnp.float32)
    with pytest.raises(ValueError, match="backend='triton'.*one of"):
        quantize_master_weights(w, backend="triton")
    with pytest.raises(TypeError, match="w_ENK: expected bfloat16/float16/float32.*int32"):
        quantize_master_weights(jnp.ones((2, 8, 8), jnp.int32))
    with pytest.raises(TypeError, match="w_ENK: .*already quantized"):
        quantize_master_weights(w.astype(FP8_DTYPE))
    with pytest.raises(ValueError, match=r"w_ENK: expected \[E, N, K\]"):
        quantize_master_weights(jnp.ones((8, 8)))
    with pytest.raises(TypeError, match="transposed=1"):
        quantize_master_weights(w, transposed=1)
    with pytest.raises(ValueError, match="out_init must be"):
        quantize_weights_pallas(w, transposed=False, num_warps=4, interpret=not ON_GPU, out_init=(w,))
    # Empty experts: the XLA path's empty arrays on every backend.
    empty = quantize_master_weights(jnp.ones((0, 200, 136)), transposed=True, backend="pallas_triton")
    assert empty[0].scale_ENbKb.shape == (0, 2, 2) and empty[1].values_ENK.shape == (0, 136, 200)


def test_weights_past_int32_offsets_address_in_64_bits():
    """DeepSeek-V3's gate+up (7.5e9 elements, past int32 offsets) runs the kernel: Pallas' Triton
    lowering widens the block index to 64 bits before it multiplies it by the expert's stride, so
    every pointer into the values is offset in i64 (read off the Triton IR lowered for an H200)."""
    (module,) = triton_modules(
        lambda w: quantize_master_weights(w, transposed=True, backend="pallas_triton"),
        jax.ShapeDtypeStruct((256, 4096, 7168), jnp.bfloat16))
    value_ptrs = [line for line in module.splitlines() if "tt.addptr" in line and "x!tt.ptr<" in line]
    assert len(value_ptrs) == 3, value_ptrs  # the load and the two stores of values
    assert all(line.rstrip().endswith("tensor<128x128xi64>") for line in value_ptrs), value_ptrs
    assert "arith.constant 29360128 : i64" in module  # an expert's stride, N * K, multiplied in i64


@pytest.mark.parametrize("backend", ["auto", "pallas_triton"])
def test_weights_whose_e4m3_values_pallas_would_offset_in_int32_run_on_xla(backend):
    """JAX's Pallas Triton lowering offsets a ref of at most 2**32 bytes in int32, so e4m3 outputs
    of 2**31 to 2**32 values (DeepSeek-V3's gate experts, [256, 2048, 7168]) would wrap: no kernel
    is lowered for them, on either backend that would run it; at the band's lower edge the kernel's
    e4m3 pointers are offset in int32, which holds them."""
    def value_offsets(shape):
        modules = triton_modules(lambda w: quantize_master_weights(w, transposed=True, backend=backend),
                                  jax.ShapeDtypeStruct(shape, jnp.bfloat16))
        return [line.rstrip().rsplit("x", 1)[-1] for module in modules for line in module.splitlines()
                if "tt.addptr" in line and "x!tt.ptr<f8E4M3FN>" in line]

    from moe_jax.ops.pallas_triton import int32_offsets_wrap

    assert [int32_offsets_wrap(n, FP8_DTYPE) for n in (2**31, 2**31 + 1, 2**32, 2**32 + 1)] == [False, True, True, False]
    assert not int32_offsets_wrap(2**31 + 1, jnp.bfloat16)  # past 2**32 bytes: 64-bit offsets
    with pytest.raises(ValueError, match=r"output 0 \(float8_e4m3fn \(256, 2048, 7168\)\) would be addressed past int32"):
        jax.eval_shape(lambda w: quantize_weights_pallas(w, transposed=False, num_warps=4, interpret=False),
                       jax.ShapeDtypeStruct((256, 2048, 7168), jnp.bfloat16))  # the launcher's own guard
    assert value_offsets((256, 2048, 7168)) == []  # 3.76e9 values
    assert value_offsets((129, 2048, 8192)) == []  # 2**31 + 2**24 values
    assert value_offsets((128, 2048, 8192)) == ["i32>", "i32>"]  # 2**31 values: the last offset is 2**31 - 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_lowers_for_h200(dtype, transposed):
    """`auto` on an H200 is the kernel; it lowers through Pallas -> Triton with the verifier, at
    Qwen3-30B-A3B's gate+up weights and at a ragged shape."""
    for shape in [(128, 1536, 2048), (3, 200, 136)]:
        text = lower_for_gpu(lambda w: quantize_master_weights(w, transposed=transposed),
                             jax.ShapeDtypeStruct(shape, dtype))
        assert text.count(KERNEL) == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compiled_for_sm90(dtype):
    """The kernel's Triton IR compiled for sm_90 by the Triton wheel: the division and the e4m3
    cast are the instructions XLA's GPU backend emits for `quantize_weights` (`div.full.f32`, as
    XLA sets `-nvptx-prec-divf32=1`, not the correctly rounded `div.rn.f32`; the saturating
    round-to-nearest-even `cvt.rn.satfinite.e4m3x2.f32`), and the transposed store's shared memory
    fits an H200 with room to spare."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    (module,) = triton_modules(
        lambda w: quantize_weights_pallas(w, transposed=True, num_warps=backends.NUM_WARPS[True], interpret=False),
        jax.ShapeDtypeStruct((3, 200, 136), dtype))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "quantize.ttir")
        with open(path, "w") as fh:
            fh.write(module)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=backends.NUM_WARPS[True], num_stages=1))
    ptx = compiled.asm["ptx"]
    assert "div.full.f32" in ptx and "div.rn" not in ptx and "div.approx" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert 0 < compiled.metadata.shared <= 64 * 1024, compiled.metadata.shared


@pytest.mark.parametrize("input_gradient", ["fp8", "master"])
def test_layer_quantizes_on_the_fused_path(input_gradient):
    """`fp8_grouped_linear(backend="pallas_triton")` quantizes its master weights with the kernel
    (the `[E, K, N]` copy only for the FP8 input gradient) and gives the bits it gives with XLA's
    quantization, forward and backward."""
    kx, kw, kd = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(kx, (10, 136), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (3, 200, 136), jnp.float32) / 12).astype(jnp.bfloat16)
    gs = jnp.array([4, 0, 6], jnp.int32)
    dy = jax.random.normal(kd, (10, 200), jnp.float32).astype(jnp.bfloat16)

    def run():
        y, vjp = jax.vjp(lambda x, w: fp8_grouped_linear(x, w, gs, backend="pallas_triton",
                                                         input_gradient=input_gradient), x, w)
        return (y, *vjp(dy))

    calls = []

    def kernel(w_ENK, *, transposed, **kwargs):
        calls.append(transposed)
        return quantize_weights_pallas(w_ENK, transposed=transposed, **kwargs)

    with mock.patch.object(backends, "quantize_weights_pallas", kernel):
        got = run()
    assert calls == [input_gradient == "fp8"]

    def on_xla(w_ENK, *, transposed, backend):
        assert backend == "pallas_triton"
        return quantize_master_weights(w_ENK, transposed=transposed, backend="xla")

    with mock.patch.object(fp8_linear, "quantize_master_weights", on_xla):
        want = run()
    for g, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))


def test_layer_lowers_the_kernel_for_h200():
    """On a GPU, `auto` quantizes with the kernel: one launch per weight and call, the transposed
    copy written by that same launch when differentiated."""
    def loss(x, w):
        # Squared, so the gradients read the forward's output (a plain sum's would not, and XLA may
        # then drop the quantization from the differentiated program).
        y = fp8_grouped_linear(x, w, jnp.array([64, 64], jnp.int32), backend="auto")
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    avals = (jax.ShapeDtypeStruct((128, 256), jnp.bfloat16), jax.ShapeDtypeStruct((2, 384, 256), jnp.bfloat16))
    assert lower_for_gpu(loss, *avals).count(KERNEL) == 1
    assert lower_for_gpu(jax.grad(loss, argnums=(0, 1)), *avals).count(KERNEL) == 1


def test_benchmark_checks_the_kernels_bits_before_timing():
    """`benchmarks.fp8`'s quantize section compares the kernel's outputs with XLA's bit for bit
    (interpreted here) and times every way it lists."""
    from benchmarks import shapes as S
    from benchmarks.fp8 import quantize_records

    rec = quantize_records(S.GemmShape("ragged", 256, 2, 136, 200, 2), copy_tbps=1.0)
    assert rec["bit_equal"] == {"fused": True, "fused + transposed": True}
    assert sorted(rec["ms"]) == ["fused", "fused + transposed", "xla", "xla + transposed"]


def test_benchmark_refuses_an_unknown_section(capsys):
    """A section the benchmark does not have is an error naming it, not a run that times nothing."""
    from benchmarks.fp8 import main

    with pytest.raises(SystemExit):
        main(["--sections", "wgrad"])
    assert "unknown ['wgrad']" in capsys.readouterr().err


def test_explicitly_sharded_weights_lower_the_kernel_for_two_h200s():
    """On two H200s under an Explicit mesh the layer's quantization gathers the sharded weights and
    runs the kernel (before the gather, Pallas refused the sharded ref)."""
    from jax.sharding import AxisType, PartitionSpec

    from tests.helpers import h200_mesh, sharded_aval

    mesh = h200_mesh((2,), ("ep",), axis_types=(AxisType.Explicit,))

    def loss(x, w):
        y = fp8_grouped_linear(x, w, jnp.array([64, 64, 64, 64], jnp.int32), backend="auto")
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    text = lower_for_gpu(jax.grad(loss, argnums=(0, 1)),
                         sharded_aval(mesh, (256, 384), jnp.bfloat16, PartitionSpec()),
                         sharded_aval(mesh, (4, 256, 384), jnp.bfloat16, PartitionSpec("ep")), mesh=mesh)
    assert text.count(KERNEL) == 1


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("input_gradient", ["fp8", "master"])
@pytest.mark.parametrize("backend", ["auto", "mosaic_gpu"])
def test_kernel_lowers_inside_shard_map_for_two_h200s(backend, axis_type, input_gradient):
    """Expert parallelism runs the linear inside `shard_map` (check_vma) on each device's experts:
    forward and backward lower for two H200s with the kernel quantizing the local weights once
    and the rows kernel the local rows (and `dy` for the FP8 input gradient).
    The kernels' outputs (Mosaic's, and on a GPU host with jax_triton the Triton kernels') vary
    over the mesh axes their operands do: `plgpu.kernel` and `triton_call` type them invariant,
    and without the cast the backward failed its custom VJP's type check on an H100 and an H200."""
    from jax.sharding import AxisType, PartitionSpec

    from tests.helpers import h200_mesh, sharded_aval

    mesh = h200_mesh((2,), ("ep",), axis_types=(getattr(AxisType, axis_type),))
    ep = PartitionSpec("ep")
    local = jax.shard_map(lambda x, w, gs: fp8_grouped_linear(x, w, gs, backend=backend, input_gradient=input_gradient),
                          mesh=mesh, in_specs=(ep, ep, ep), out_specs=ep)

    def loss(x, w, gs):
        return jax.value_and_grad(lambda x, w: jnp.sum(jnp.square(local(x, w, gs).astype(jnp.float32))), (0, 1))(x, w)

    text = lower_for_gpu(loss, sharded_aval(mesh, (512, 256), jnp.bfloat16, ep),
                         sharded_aval(mesh, (4, 384, 256), jnp.bfloat16, ep), sharded_aval(mesh, (4,), jnp.int32, ep),
                         mesh=mesh)
    assert text.count(KERNEL) == 1
    assert text.count(ROWS_KERNEL) == (2 if input_gradient == "fp8" else 1)  # x's rows; dy's for the FP8 product
    if backend == "mosaic_gpu":  # the forward and the input gradient (FP8, or the 16-bit kernel's)
        assert text.count("mosaic_gpu") >= 2


def _rows(shape, dtype, seed=0):
    """Normal rows with magnitudes spread over rows (x 1e-3 .. 1e2), row 1 all zero, the dtype's rounding."""
    m, k = shape
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
    x = (x * jnp.logspace(-3, 2, m, dtype=jnp.float32).reshape(m, 1)).at[1].set(0.0)
    return x.astype(dtype)


def _assert_same_rows(got, want):
    assert_same_bits(got.values_MK, want.values_MK)
    assert_same_bits(got.scale_MKb, want.scale_MKb)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(70, 300), (32, 128), (5, 100)], ids=["ragged", "one-tile", "k-edge"])
def test_rows_kernel_equals_the_recipe_bit_for_bit(dtype, shape):
    x = _rows(shape, dtype)
    got = quantize_activations(x, backend="pallas_triton")
    _assert_same_rows(got, quantize_rows(x))
    _assert_same_rows(quantize_activations(x, backend="xla"), quantize_rows(x))
    assert np.all(np.asarray(got.scale_MKb[1]) == 1.0) and not np.any(np.asarray(got.values_MK[1], np.float32))


def test_rows_kernel_writes_every_output_element():
    x = _rows((70, 300), jnp.bfloat16, seed=1)
    got = quantize_rows_pallas(x, block_m=backends.ROWS_BLOCK_M, num_warps=backends.ROWS_NUM_WARPS, interpret=not ON_GPU,
                               out_init=(jnp.full((70, 300), jnp.nan, FP8_DTYPE), jnp.full((70, 3), jnp.nan, jnp.float32)))
    _assert_same_rows(got, quantize_rows(x))


def test_rows_nan_and_inf_stay_in_their_tile():
    """A NaN makes its tile's scale and values NaN (the contract; XLA:CPU's reference can drop it
    from the tile's max); an infinity gives its tile scale inf. Every other tile is the reference's."""
    x = _rows((40, 300), jnp.float32, seed=2).at[3, 130].set(jnp.nan).at[7, 5].set(-jnp.inf)
    got = quantize_activations(x, backend="pallas_triton")
    assert np.isnan(float(got.scale_MKb[3, 1])) and np.all(np.isnan(np.asarray(got.values_MK[3, 128:256], np.float32)))
    assert float(got.scale_MKb[7, 0]) == np.inf
    want = quantize_rows(x)
    poisoned = np.zeros((40, 300), bool)
    poisoned[3, 128:256] = True
    scales = np.ones((40, 3), bool)
    scales[3, 1] = False
    assert_same_bits(np.asarray(got.values_MK)[~poisoned], np.asarray(want.values_MK)[~poisoned])
    assert_same_bits(np.asarray(got.scale_MKb)[scales], np.asarray(want.scale_MKb)[scales])


def test_rows_errors_and_empty_rows():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="backend='triton'.*one of"):
        quantize_activations(x, backend="triton")
    with pytest.raises(TypeError, match="x_MK: expected bfloat16/float16/float32.*int32"):
        quantize_activations(jnp.ones((4, 8), jnp.int32))
    with pytest.raises(TypeError, match="x_MK: .*already quantized"):
        quantize_activations(x.astype(FP8_DTYPE))
    with pytest.raises(ValueError, match=r"x_MK: expected \[M, K\] rows"):
        quantize_activations(jnp.ones((2, 4, 8)))
    empty = quantize_activations(jnp.ones((0, 300)), backend="pallas_triton")
    assert empty.values_MK.shape == (0, 300) and empty.scale_MKb.shape == (0, 3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_kernel_lowers_for_h200(dtype):
    """`auto` on an H200 is the rows kernel, lowered through Pallas -> Triton with the verifier, at
    Qwen3-30B-A3B's packed rows and at a ragged shape."""
    for shape in [(32768, 2048), (70, 300)]:
        text = lower_for_gpu(quantize_activations, jax.ShapeDtypeStruct(shape, dtype))
        assert text.count(ROWS_KERNEL) == 1


def test_rows_kernel_compiled_for_sm90():
    """The rows kernel's Triton IR compiled for sm_90: XLA's division and e4m3 cast instructions
    (as the weights kernel's), in no shared memory beyond the row maxima's reduction."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    (module,) = triton_modules(
        lambda x: quantize_rows_pallas(x, block_m=backends.ROWS_BLOCK_M, num_warps=backends.ROWS_NUM_WARPS,
                                       interpret=False),
        jax.ShapeDtypeStruct((70, 300), jnp.bfloat16))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "quantize_rows.ttir")
        with open(path, "w") as fh:
            fh.write(module)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=backends.ROWS_NUM_WARPS, num_stages=1))
    ptx = compiled.asm["ptx"]
    assert "div.full.f32" in ptx and "div.rn" not in ptx and "div.approx" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert compiled.metadata.shared <= 16 * 1024, compiled.metadata.shared
