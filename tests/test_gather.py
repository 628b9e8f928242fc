"""Row gather (`moe_jax.ops.gather_rows`): values, edge rows, gradients both ways, lowering.

The same bodies run the Pallas kernel compiled on a GPU and interpreted on CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops import gather_rows, gather_rows_reference
from moe_jax.ops.gather.kernel import gather_rows_pallas
from moe_jax.testing import assert_close
from tests.helpers import ON_GPU, h200_mesh, lower_for_gpu, mesh_devices, sharded_aval

BACKENDS = ["pallas_triton", "xla"]
# Widths: a multiple of the 512-column block, a partial block, a width below one block.
WIDTHS = [1024, 700, 24] if ON_GPU else [1024, 40, 24]


def _rows(seed, m, n, invalid=0.2):
    """Random source rows with about `invalid` of them -1 or past N (zero rows)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, n, m)
    bad = rng.random(m) < invalid
    rows[bad] = rng.choice([-1, -7, n, n + 3], bad.sum())
    return jnp.asarray(rows, jnp.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", WIDTHS)
def test_gather_rows_matches_reference(backend, dtype, d):
    n, m = 37, 53  # M not a multiple of the 8-row program
    x = jax.random.normal(jax.random.PRNGKey(0), (n, d), jnp.float32).astype(dtype)
    rows = _rows(0, m, n)
    out = gather_rows(x, rows, backend=backend)
    assert out.shape == (m, d) and out.dtype == dtype
    # A copy: exact, whatever the dtype.
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(gather_rows_reference(x, rows)))


def _inverse_of(rows, n):
    """`inverse[rows[i]] = i` over `[n]` source rows, -1 where no output reads a row."""
    return jnp.full((n,), -1, jnp.int32).at[jnp.where(rows >= 0, rows, n)].set(
        jnp.arange(rows.shape[0], dtype=jnp.int32), mode="drop")


def _readers_of(rows, n, k):
    """`[n, k]`: the output rows reading each source row (in output order), -1 padded."""
    readers = np.full((n, k), -1, np.int32)
    filled = np.zeros(n, int)
    for i, row in enumerate(np.asarray(rows)):
        if 0 <= row < n:
            readers[row, filled[row]] = i
            filled[row] += 1
    return jnp.asarray(readers)


def _check_sources(xs, rows, inverse, backend, key):
    """Forward equals the fp32 reference exactly; every source's gradient matches it."""
    out = gather_rows(xs, rows, inverse_N=inverse, backend=backend)
    np.testing.assert_array_equal(out, gather_rows_reference(xs, rows))
    cot = jax.random.normal(key, out.shape)
    got = jax.grad(lambda xs: jnp.sum(gather_rows(xs, rows, inverse_N=inverse, backend=backend) * cot))(xs)
    want = jax.grad(lambda xs: jnp.sum(gather_rows_reference(xs, rows) * cot))(xs)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_inverse", [False, True])
def test_gather_rows_from_several_sources(backend, with_inverse):
    """A tuple of sources reads as their concatenation, forward and backward (each source gets
    its own gradient), including a source no row reads and an empty source."""
    d = 40
    keys = jax.random.split(jax.random.PRNGKey(6), 4)
    xs = (jax.random.normal(keys[0], (13, d)), jnp.zeros((0, d)), jax.random.normal(keys[1], (9, d)),
          jax.random.normal(keys[2], (5, d)))
    n = sum(x.shape[0] for x in xs)
    perm = np.random.default_rng(7).permutation(18)  # rows 18.. (the last source) are never read
    perm[::4] = -1
    rows = jnp.asarray(perm, jnp.int32)
    _check_sources(xs, rows, _inverse_of(rows, n) if with_inverse else None, backend, keys[3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_rows_edge_cases(backend):
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3)
    # Zero output rows, zero width, every row invalid, one row read many times.
    assert gather_rows(x, jnp.zeros((0,), jnp.int32), backend=backend).shape == (0, 3)
    assert gather_rows(jnp.zeros((4, 0)), jnp.arange(2), backend=backend).shape == (2, 0)
    np.testing.assert_array_equal(gather_rows(x, jnp.full((5,), -1), backend=backend), np.zeros((5, 3)))
    np.testing.assert_array_equal(gather_rows(x, jnp.full((9,), 2), backend=backend), np.tile(x[2], (9, 1)))
    # An empty source gives zero rows on both backends (XLA's indexing of it raised a TypeError),
    # and shifts no offsets among several.
    empty = jnp.zeros((0, 3), jnp.float32)
    np.testing.assert_array_equal(gather_rows(empty, jnp.arange(3), backend=backend), np.zeros((3, 3)))
    np.testing.assert_array_equal(gather_rows((empty, x), jnp.array([1, -1]), backend=backend),
                                  np.stack([x[1], np.zeros(3)]))


@pytest.mark.parametrize("splits", [(), (8,), (3, 11)])
def test_every_output_element_is_written(splits):
    """NaN in the output buffer and in the rows nobody reads must not survive, also when the
    sources are written by one launch each (every launch leaves the other sources' rows alone)."""
    n, m, d = 20, 29, 40
    x = jax.random.normal(jax.random.PRNGKey(1), (n, d)).at[5].set(jnp.nan)
    rows = _rows(1, m, n)
    rows = jnp.where(rows == 5, -1, rows)
    block_d = 16 if not ON_GPU else 32  # a partial last column block
    out = gather_rows_pallas(tuple(jnp.split(x, splits)), rows, block_rows=8, block_d=block_d, num_warps=2,
                                     interpret=not ON_GPU, out_init=jnp.full((m, d), jnp.nan, jnp.float32))
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(out, gather_rows_reference(x.at[5].set(0.0), rows))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_inverse", [False, True])
def test_gather_rows_gradient(backend, with_inverse):
    m, d = 24, 40
    if with_inverse:  # an injective gather: a partial permutation with holes on both sides
        n = 30
        perm = np.random.default_rng(4).permutation(n)[:m]
        perm[::5] = -1
        rows = jnp.asarray(perm, jnp.int32)
        inverse = _inverse_of(rows, n)
    else:  # rows read several times must collect every contribution; ids past N are dropped
        n = 7
        rows, inverse = _rows(5, m, n), None
    x = jax.random.normal(jax.random.PRNGKey(2), (n, d))
    _check_sources((x,), rows, inverse, backend, jax.random.PRNGKey(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_rows_inverse_per_source(backend):
    """Inverses given per source: a source read several times (None, scatter-add backward) next to
    one read at most once (gather backward), as EP's regroup reads (tokens, peer block)."""
    d = 24
    keys = jax.random.split(jax.random.PRNGKey(8), 3)
    xs = (jax.random.normal(keys[0], (6, d)), jax.random.normal(keys[1], (7, d)))
    # Token rows 0..5 read up to three times each, peer rows 6..12 at most once, -1 holes.
    rows = jnp.asarray([0, 6, 3, 0, -1, 12, 8, 3, 5, 0, 9, -1, 7], jnp.int32)
    inverse_peer = _inverse_of(rows - 6, 7)
    _check_sources(xs, rows, (None, inverse_peer), backend, keys[2])
    with pytest.raises(ValueError, match="one entry .* per source: 2 sources, got 1"):
        gather_rows(xs, rows, inverse_N=(inverse_peer,), backend=backend)
    with pytest.raises(ValueError, match=r"inverse_N\[1\] must be an int array \[N\] = \(7,\) or \[N, K\]"):
        gather_rows(xs, rows, inverse_N=(None, inverse_peer[:5]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_rows_readers_inverse(backend):
    """An `[N, K]` inverse (the output rows reading each source row) gives the scatter-add's
    gradient; in bf16 it is the float32 sum rounded once, whatever the order of the rows."""
    n, m, d = 9, 31, 40
    rows = _rows(11, m, n)
    k = int(np.bincount(np.asarray(rows)[(rows >= 0) & (rows < n)], minlength=n).max()) + 1  # a spare column
    readers = _readers_of(rows, n, k)
    x = jax.random.normal(jax.random.PRNGKey(4), (n, d))
    _check_sources((x,), rows, readers, backend, jax.random.PRNGKey(5))
    # Two sources, the first read several times through its readers, the second once.
    xs = (x, jax.random.normal(jax.random.PRNGKey(6), (4, d)))
    own = np.where((rows >= 0) & (rows < n), rows, -1)  # ids past 8 would read xs[1] now
    two = jnp.asarray(np.r_[own, [9, 12, -1, 10]], jnp.int32)
    _check_sources(xs, two, (_readers_of(two, n, k), _inverse_of(two - n, 4)), backend, jax.random.PRNGKey(7))

    cot = jax.random.normal(jax.random.PRNGKey(8), (m, d)).astype(jnp.bfloat16)
    xb = x.astype(jnp.bfloat16)
    got = jax.vjp(lambda x: gather_rows(x, rows, inverse_N=readers, backend=backend), xb)[1](cot)[0]
    onehot = np.asarray(rows)[None, :] == np.arange(n)[:, None]
    want = (onehot.astype(np.float32) @ np.asarray(cot, np.float32)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match=r"inverse_N must be an int array \[N\] = \(9,\) or \[N, K\]"):
        gather_rows(x, rows, inverse_N=readers[:, :, None])


def test_gather_rows_bad_input():
    x = jnp.zeros((4, 3))
    with pytest.raises(ValueError, match=r"x_ND must be \[N, D\]"):
        gather_rows(jnp.zeros((4,)), jnp.arange(2))
    with pytest.raises(ValueError, match="rows_M must be"):
        gather_rows(x, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(TypeError, match="rows_M must hold integer"):
        gather_rows(x, jnp.zeros((2,)))
    with pytest.raises(ValueError, match=r"inverse_N must be an int array \[N\]"):
        gather_rows(x, jnp.arange(2), inverse_N=jnp.arange(3))
    with pytest.raises(ValueError, match="share the width D and the dtype"):
        gather_rows((x, jnp.zeros((4, 2))), jnp.arange(2))
    with pytest.raises(ValueError, match="non-empty tuple"):
        gather_rows((), jnp.arange(2))
    with pytest.raises(ValueError, match="backend="):
        gather_rows(x, jnp.arange(2), backend="cuda")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d", [4096, 7168, 700])
def test_gather_kernel_lowers_for_h200_inside_shard_map(dtype, d):
    """The kernel compiles for an H200 where EP runs it: inside shard_map, forward and backward."""
    mesh = h200_mesh((2,), ("ep",))
    spec = jax.sharding.PartitionSpec("ep")

    def loss(x, rows, inverse):
        def body(x, rows, inverse):
            return jnp.sum(gather_rows(x, rows, inverse_N=inverse).astype(jnp.float32) ** 2)[None]
        return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(x, rows, inverse))

    avals = (sharded_aval(mesh, (2 * 96, d), dtype, spec), sharded_aval(mesh, (2 * 80,), jnp.int32, spec),
             sharded_aval(mesh, (2 * 96,), jnp.int32, spec))
    text = lower_for_gpu(jax.grad(loss), *avals, mesh=mesh)
    assert text.count('name = "moe_jax_gather_rows"') == 2  # forward and the inverse-gather backward


def test_gradient_of_a_source_replicated_over_the_mesh():
    """Inside shard_map (check_vma), a source replicated over the axis the row ids vary over gets
    the sum of every device's gradient, and a sharded source its own."""
    mesh = jax.make_mesh((2,), ("ep",), devices=mesh_devices(2))
    spec, repl = jax.sharding.PartitionSpec("ep"), jax.sharding.PartitionSpec()
    n, m, d = 6, 5, 40
    keys = jax.random.split(jax.random.PRNGKey(8), 3)
    sharded, replicated = jax.random.normal(keys[0], (2 * n, d)), jax.random.normal(keys[1], (n, d))
    rows = jnp.asarray(np.random.default_rng(9).integers(-1, 2 * n, 2 * m), jnp.int32)
    put = lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s))  # noqa: E731
    args = put(sharded, spec), put(replicated, repl)
    rows_on_mesh = put(rows, spec)

    def loss(sharded, replicated):
        def body(a, b, r):
            return jnp.sum(gather_rows((a, b), r) ** 2)[None]
        f = jax.shard_map(body, mesh=mesh, in_specs=(spec, repl, spec), out_specs=spec)
        return jnp.sum(f(sharded, replicated, rows_on_mesh))

    def reference(sharded, replicated):
        parts = [gather_rows_reference((sharded[i * n:(i + 1) * n], replicated), rows[i * m:(i + 1) * m])
                 for i in range(2)]
        return sum(jnp.sum(p ** 2) for p in parts)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
    want = jax.grad(reference, argnums=(0, 1))(sharded, replicated)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32, "d source")


def test_interpreted_kernel_inside_shard_map_is_a_clear_error():
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2])
    spec = jax.sharding.PartitionSpec("ep")
    f = jax.shard_map(lambda x, r: gather_rows(x, r, backend="pallas_triton"), mesh=mesh, in_specs=(spec, spec),
                      out_specs=spec)
    x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(mesh, spec))
    r = jax.device_put(jnp.zeros((4,), jnp.int32), jax.sharding.NamedSharding(mesh, spec))
    with pytest.raises(ValueError, match="use backend='auto' or 'xla' on meshes of CPU devices"):
        f(x, r)
