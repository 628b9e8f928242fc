"""Shared test helpers. Tests run the same bodies everywhere: compiled on a GPU, and with the
Pallas kernels interpreted (`interpret=True`) on CPU, which `moe_jax.ops` selects by itself."""


import contextlib
import functools
import os
import pathlib
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

ON_GPU = jax.default_backend() == "gpu"


def mesh_devices(n: int) -> list:
    """The first `n` GPUs when this process has that many, else the first `n` forced host CPU
    devices (the root conftest forces 8): meshes that run compiled where the hardware allows."""
    return (jax.devices() if ON_GPU and len(jax.devices()) >= n else jax.devices("cpu"))[:n]


MESH_DEVICES = mesh_devices(8)


@pytest.fixture(autouse=True)
def on_mesh_platform():
    """Autouse where imported: a test module's arrays on the platform of its meshes' devices
    (`MESH_DEVICES`), so single-device references and mesh runs compute on the same platform."""
    with jax.default_device(MESH_DEVICES[0]):
        yield


def masked_inputs(seed: int, shape: tuple[int, int, int]):
    """`(x, mask, cot)` for a layer test of `shape` (B, S, D): normal tokens, a padding mask that
    drops every token whose flat index times 7 is a multiple of 5, and an output cotangent zero on
    the masked tokens."""
    b, s, d = shape
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(k1, shape, jnp.float32)
    mask = (jnp.arange(b * s).reshape(b, s) * 7) % 5 != 0
    cot = jnp.where(mask[..., None], jax.random.normal(k2, shape, jnp.float32), 0.0)
    return x, mask, cot


def h200_mesh(shape: tuple[int, ...], names: tuple[str, ...], *, axis_types=None) -> jax.sharding.AbstractMesh:
    """Abstract mesh of `shape` over axes `names` on H200s: lowers for GPUs this host does not
    have (`axis_types` as `jax.sharding.AbstractMesh` takes them)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    return jax.sharding.AbstractMesh(shape, names, axis_types, abstract_device=device)


def sharded_aval(mesh, shape: tuple[int, ...], dtype, spec) -> jax.ShapeDtypeStruct:
    """An abstract argument for `lower_for_gpu`, laid out by `spec` over `mesh`."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))


def lower_for_gpu(fn, *avals, mesh: jax.sharding.AbstractMesh | None = None) -> str:
    """StableHLO text of `fn` lowered for a CUDA GPU from this (possibly CPU-only) host.

    `mesh` (from `h200_mesh`; default one H200) is the abstract mesh the lowering runs under; avals
    sharded over it need it. Pallas kernels go through the full Pallas -> Triton IR lowering and
    the MLIR verifier, so unsupported primitives, non-power-of-two blocks or bad indexing fail
    here, in CI, without a GPU.
    """
    return _lower_for_gpu(fn, avals, mesh, modules=None)


def triton_modules(fn, *avals) -> list[str]:
    """The Triton IR of every Pallas kernel of `fn` lowered for an H200 (each verified, as in
    `lower_for_gpu`). Pass a fresh `fn`: a function lowered before at the same avals is not
    lowered again."""
    modules = []
    _lower_for_gpu(fn, avals, None, modules=modules)
    return modules


def _lower_for_gpu(fn, avals, mesh, *, modules: list | None) -> str:
    mesh = h200_mesh((1,), ("aot",)) if mesh is None else mesh
    with jax.sharding.use_abstract_mesh(mesh), _verify_triton_modules(modules):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


@contextlib.contextmanager
def _verify_triton_modules(modules: list | None):
    """Run the MLIR verifier on every Triton module Pallas emits (XLA verifies only when it parses
    the module on the GPU host; this reaches through a private JAX module to do it here), keeping
    each module's text in `modules` when given."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError with the op and source line
        if modules is not None:
            modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    with mock.patch.object(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify):
        yield


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None, fill=None
):
    """`jax.lax.ragged_all_to_all`'s documented semantics from all_gather, for XLA:CPU. A broken
    contract (sizes that disagree with the senders', overlapping or out-of-range blocks) poisons
    the whole result with NaN instead of raising, since nothing can raise under jit. With `fill`,
    rows no sender writes hold `fill` instead of keeping `output`'s values. Integer rows (the FP8
    dispatch's bytes) are poisoned and filled with all-ones bytes, which decode to NaN."""
    assert axis_index_groups is None
    me = lax.axis_index(axis_name)
    operand_all = lax.all_gather(operand, axis_name)  # [P, N, ...]
    in_off, sizes, out_off = (lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(output.shape[0])
    hit_PM = (rows >= out_off[:, None]) & (rows < (out_off + sizes)[:, None])
    src = jnp.argmax(hit_PM, axis=0)
    read = in_off[src] + rows - out_off[src]
    if fill is not None and not jnp.issubdtype(output.dtype, jnp.floating):
        fill = jnp.iinfo(output.dtype).max  # byte rows (the FP8 dispatch): all-ones bytes decode to NaN
    result = jnp.where(
        jnp.any(hit_PM, axis=0).reshape((-1,) + (1,) * (operand.ndim - 1)),
        operand_all[src, jnp.clip(read, 0, operand.shape[0] - 1)],
        output if fill is None else jnp.full_like(output, fill),
    )
    ok = (
        jnp.all(sizes == recv_sizes)
        & jnp.all(hit_PM.sum(axis=0) <= 1)
        & jnp.all(in_off + sizes <= operand.shape[0])
        & jnp.all(out_off + sizes <= output.shape[0])
        & jnp.all((in_off >= 0) & (out_off >= 0) & (sizes >= 0))
    )
    poison = jnp.nan if jnp.issubdtype(output.dtype, jnp.floating) else jnp.iinfo(output.dtype).max
    return jnp.where(ok, result, jnp.array(poison, output.dtype))


def poisoned_ragged():
    """Patch ragged_all_to_all with the emulation, NaN in every row no sender writes."""
    return mock.patch.object(jax.lax, "ragged_all_to_all", functools.partial(emulated_ragged_all_to_all, fill=jnp.nan))


def scatter_lines(fn, *args) -> list[str]:
    """The `stablehlo.scatter` ops of `fn` lowered at `args` (here, for this host), one line each:
    tests read their attributes, e.g. `unique_indices = true`."""
    return [line for line in jax.jit(fn).lower(*args).as_text().splitlines() if '"stablehlo.scatter"' in line]


def assert_same_bits(got, want):
    """Equal bit for bit, except that any NaN matches any NaN (e4m3 has two NaN encodings)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(uint)[~nan], want.view(uint)[~nan])


# XLA:GPU removes f32 -> bf16 -> f32 round trips (`SimplifyFPConversions`, run under
# `xla_allow_excess_precision`, its default); XLA:CPU runs the same pass with this flag, which the
# backend reads when it starts.
ROUND_TRIPS_REMOVED = "--xla_cpu_experimental_onednn_custom_call=true"


def count_where_round_trips_removed(counter: str) -> int:
    """What `counter` ("module:function", a test module's count of mismatched elements) returns in
    a child Python on the CPU under `ROUND_TRIPS_REMOVED`, from the repository root (its tests
    importable); AssertionError with the child's stderr if it fails."""
    module, function = counter.split(":")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu", XLA_FLAGS=ROUND_TRIPS_REMOVED)
    code = f"from {module} import {function} as count; print('count', count())"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])
