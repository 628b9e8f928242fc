"""The resource gate: every configuration a chooser can return fits the device it is planned for,
and the shared-memory model it is checked with bounds what the compiler allocates.

`tests.compiled_resources.reachable()` plans every kernel of every backend, for an H200, at the
model layers' decode and prefill shapes, the acceptance run's layer shapes and every row of every
tuned selector table, for bf16, fp16 and fp32 (full precision and TF32), with the static rules,
the on-device selector and each backend of the `auto` table. The model is checked against Triton's
compiler for sm_90 here (the Triton wheel carries ptxas), one compilation per kind of kernel; the
GPU acceptance run compiles every one and reads the Pallas kernels' shared memory off the H200.
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from moe_jax.ops.gmm.pallas_triton import Launches
from moe_jax.ops.gmm.tiles import triton_smem_bytes
from tests.compiled_resources import reachable

H200_SMEM = 227 * 1024


@pytest.fixture(scope="module")
def reached():
    return reachable()


def test_every_reachable_config_fits_an_h200(reached):
    assert len({r.backend for r in reached}) == 4
    assert {r.problem.dtype for r in reached} == {jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)}
    for r in reached:
        assert (r.smem_bytes or r.backend == "xla") and all(0 < b <= H200_SMEM for b in r.smem_bytes), r
        if r.backend in ("pallas_triton", "triton"):  # the plan's bytes are the model's for the tiles that run
            p = r.problem
            tiles = [c.tiles for c in r.config.configs] if isinstance(r.config, Launches) else [r.config]
            assert list(r.smem_bytes) == [triton_smem_bytes(t, wgrad=p.kernel == "tgmm", dtype=p.dtype,
                                                            ieee_fp32=p.ieee_fp32) for t in tiles], r


def test_tuned_16_bit_choices_run_as_tuned(reached):
    """The tables were tuned in bf16 on an H200 and every one of their tiles fits there: the model
    never makes a bf16/fp16 choice fall back (only fp32 does)."""
    from moe_jax.ops import GEMM_BACKENDS, device_facts
    from tests.helpers import h200_mesh

    import jax

    with jax.sharding.use_abstract_mesh(h200_mesh((1,), ("aot",))):
        facts = device_facts()
        fell_back = set()
        for r in reached:
            _, _, notes = GEMM_BACKENDS[r.backend].configure(r.problem, None, facts)
            if notes:
                fell_back.add(r.problem.dtype.name)
    assert fell_back == {"float32"}


@pytest.mark.slow  # a subprocess compiling a kernel of each kind with Triton for sm_90
def test_the_model_bounds_the_compiled_kernels():
    """One compilation of each kind of kernel (backend, kernel, family, operand width, fp32 at full
    precision or TF32, row gather), the one the model gives the most bytes: Triton's compiler never
    allocates more than the model says, and the model is never more than twice the compiler's
    figure. A fresh process without `TRITON_INTERPRET` (under it `triton.jit` interprets)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.compiled_resources", "--sample"], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len({r["backend"] for r in records}) == 2 and len(records) >= 30, out.stdout
    for r in records:
        assert r["compiled"] <= r["model"] <= 2 * r["compiled"], r
    exact = sum(r["compiled"] == r["model"] for r in records)
    assert exact >= len(records) * 3 // 4, records
