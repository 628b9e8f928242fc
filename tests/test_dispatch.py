"""EP dispatch/combine on forced CPU host devices (repo conftest: 8 devices).

Meshes come from `make_mesh` (EP 2 and 4, data 1 and 2); the functions under test run inside
`jax.shard_map` and are compared with single-device references on the full batch, computed
directly (per-token loop over k: w_tk * x_t @ W[e_tk]^T) and, for the layout, in numpy.
A mesh uses GPUs when the host has enough of them (compiled kernels; with 2 GPUs the ragged
strategy also runs on the real collective), else the forced host devices.

The padded strategy runs here. XLA:CPU has no ragged_all_to_all, so the ragged strategy is
(1) lowered for an H200 from this host, forward and backward, and (2) run numerically with
`jax.lax.ragged_all_to_all` replaced by an emulation built from all_gather (checked against the
example in JAX's docstring), which exercises its offsets, sizes and custom_vjp end to end. The
emulation can fill every row the collective does not write with NaN, so a receive buffer whose
padding is garbage must still give finite, correct outputs and gradients.

Legend: N global tokens (= devices * T), T tokens per rank, K top-k, D width, O expert output
width, E experts, El local experts, P ep size, C capacity, M packed rows.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec

from moe_jax.experts import swiglu_experts_fp8
from moe_jax.ops import grouped_linear
from moe_jax.ops.fp8 import dequantize_rows, quantize_rows
from moe_jax.parallel import (
    DATA_AXIS,
    EP_AXIS,
    activation_spec,
    capacity_for,
    check_mesh,
    dense_spec,
    ep_combine,
    ep_dispatch,
    ep_moe,
    expert_spec,
    make_mesh,
)
from moe_jax.parallel import (
    ALL_TO_ALL,
    PAIR_MIN_BLOCK_BYTES,
    PAIR_SWAP,
    RAGGED_ALL_TO_ALL,
    check_capacity_factor,
    select_transport,
)
from moe_jax.parallel.layout import invert_rows
from moe_jax.testing import assert_close
from tests.helpers import (
    ON_GPU,
    emulated_ragged_all_to_all,
    h200_mesh,
    lower_for_gpu,
    mesh_devices,
    poisoned_ragged,
    sharded_aval,
)

ACT = activation_spec()
T, D, O, E = 6, 8, 5, 8
HIGHEST = jax.lax.Precision.HIGHEST


HOST = jax.devices("cpu")  # 8 forced host devices on any machine


def _mesh(ep, data):
    return make_mesh(ep=ep, data=data, devices=mesh_devices(ep * data))


def _backend(mesh):
    """Compiled kernels on a GPU mesh; lax.ragged_dot on host devices (also on a GPU host, where
    "auto" would pick the GPU kernels)."""
    return "auto" if mesh.devices.flat[0].platform == "gpu" else "xla"


def _sharded(mesh, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def _exact_inputs(n, k, seed):
    """Integer x and dyadic weights: every product and K-term sum is exact in fp32, so results
    must match bit for bit whatever the summation order."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-8, 9, size=(n, D)).astype(np.float32)
    w = (rng.integers(1, 8, size=(n, k)) / 8).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w)


def _float_inputs(n, k, seed):
    kx, kw, kW, kc = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(kx, (n, D), jnp.float32)
    w = jax.random.uniform(kw, (n, k), jnp.float32, 0.1, 1.0)
    W = jax.random.normal(kW, (E, O, D), jnp.float32) / np.sqrt(D)
    cot = jax.random.normal(kc, (n, O), jnp.float32)
    return x, w, W, cot


def _routes(pattern, n, k, ep, seed):
    """Global expert ids [N, K] for a routing pattern (distinct experts per token)."""
    rng = np.random.default_rng(seed)
    el = E // ep
    allowed = [np.arange(E)] * n
    if pattern == "skewed":
        # Experts of rank 0 are hot: twice as likely as the rest.
        p = np.where(np.arange(E) < el, 2.0, 1.0)
        return np.stack([rng.choice(E, size=k, replace=False, p=p / p.sum()) for _ in range(n)]).astype(np.int32)
    if pattern == "one_expert":
        return np.full((n, k), E - 1, np.int32)
    if pattern == "starved":
        # Nobody uses expert 1 (a local expert with zero rows) or the last rank's experts (a rank
        # that receives nothing); ep rank 1's own tokens all go to other ranks.
        base = np.setdiff1d(np.arange(E), [1, *range(E - el, E)])
        allowed = []
        for t in range(n):
            ep_rank = (t // T) % ep
            allowed.append(base[base // el != 1] if ep_rank == 1 else base)
    return np.stack([rng.choice(a, size=k, replace=False) for a in allowed]).astype(np.int32)


def _np_dispatch(idx, ep, data, cap, mask=None):
    """Numpy model of the contract: keep mask (per source, per destination, token order, first C
    kept; masked tokens never sent), send counts per device, and each device's packed
    (token, slot) rows + group sizes."""
    n, k = idx.shape
    el = E // ep
    mask = np.ones(n, bool) if mask is None else mask
    keep = np.zeros((n, k), bool)
    send_counts = np.zeros((data * ep, ep), np.int32)
    for dev in range(data * ep):
        used = np.zeros(ep, int)
        for t in range(dev * T, (dev + 1) * T):
            if not mask[t]:
                continue
            for s in range(k):
                q = idx[t, s] // el
                send_counts[dev, q] += 1
                if used[q] < cap:
                    keep[t, s] = True
                    used[q] += 1
    packed = {}
    for d in range(data):
        for q in range(ep):
            rows, sizes = [], []
            for e in range(el):
                before = len(rows)
                for src in range(d * ep, (d + 1) * ep):
                    for t in range(src * T, (src + 1) * T):
                        rows += [(t, s) for s in range(k) if keep[t, s] and idx[t, s] == q * el + e]
                sizes.append(len(rows) - before)
            packed[d * ep + q] = (rows, sizes)
    return keep, send_counts, packed


def _reference(x, w, W, idx, keep):
    """Single-device math on the full batch: y_t = sum_k keep_tk w_tk x_t @ W[e_tk]^T."""
    y = 0.0
    for s in range(idx.shape[1]):
        h = jnp.einsum("td,tod->to", x, W[idx[:, s]], precision=HIGHEST)
        y = y + jnp.where(keep[:, s, None], w[:, s, None] * h, 0.0)
    return y


def _ep_linear(mesh, *, strategy="padded", transport="auto", capacity=None, poison=False, masked=False,
               fp8_dispatch=False):
    """Jitted (loss, stats), grads of sum(y * cot) through ep_moe with one linear per expert."""

    def body(x, idx, w, W, cot, mask):
        def expert_fn(px, gs):
            y = grouped_linear(px, W, gs, backend=_backend(mesh), precision=HIGHEST)
            if poison:  # whatever sits past the valid rows must never be read
                y = jnp.where((jnp.arange(px.shape[0]) < jnp.sum(gs))[:, None], y, jnp.nan)
            return y

        y, stats = ep_moe(
            x, idx, w, expert_fn, num_experts=E, strategy=strategy, capacity=capacity, mask_T=mask if masked else None,
            transport=transport, fp8_dispatch=fp8_dispatch,
        )
        loss = lax.psum(jnp.sum(y * cot), (DATA_AXIS, EP_AXIS))
        return loss, y, stats.dropped[None], stats.recv_rows[None], stats.send_counts_P[None]

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(ACT, ACT, ACT, expert_spec(), ACT, ACT),
        out_specs=(dense_spec(), ACT, ACT, ACT, ACT),
        check_vma=False,
    )

    def loss(x, w, W, idx, cot, mask):
        value, *aux = fn(x, idx, w, W, cot, mask)
        return value, aux

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _check_linear(mesh, pattern, *, k=2, capacity=None, strategy="padded", pair=False, poison=False, mask=None,
                  seed=0):
    ep, data = mesh.shape[EP_AXIS], mesh.shape[DATA_AXIS]
    n = ep * data * T
    x, w, W, cot = _float_inputs(n, k, seed)
    idx = _routes(pattern, n, k, ep, seed)
    cap = T * k if capacity is None else min(capacity, T * k)
    keep, send_counts, packed = _np_dispatch(idx, ep, data, cap, mask)
    real = np.ones(n, bool) if mask is None else mask

    fn = _ep_linear(mesh, strategy=strategy, transport=_transport(strategy, pair), capacity=capacity, poison=poison,
                    masked=mask is not None)
    (_, (y, dropped, recv_rows, got_counts)), grads = fn(x, w, W, jnp.asarray(idx), cot, jnp.asarray(real))
    ref = jax.value_and_grad(lambda x, w, W: jnp.sum(_reference(x, w, W, idx, keep) * cot), argnums=(0, 1, 2))
    _, ref_grads = ref(x, w, W)
    assert_close(y, _reference(x, w, W, idx, keep), jnp.float32, "y")
    for name, g, r in zip(("dx", "dweights", "dW"), grads, ref_grads):
        assert_close(g, r, jnp.float32, name)
    # Dropped routes get exactly zero weight gradient.
    assert np.all(np.asarray(grads[1])[~keep] == 0)
    group_drops = [(real[:, None] & ~keep)[d * ep * T : (d + 1) * ep * T].sum() for d in range(data)]
    np.testing.assert_array_equal(np.asarray(dropped), np.repeat(group_drops, ep))
    np.testing.assert_array_equal(np.asarray(recv_rows), [len(packed[r][0]) for r in range(ep * data)])
    np.testing.assert_array_equal(np.asarray(got_counts), send_counts)
    return keep, packed, (y, grads)


# ----------------------------------------------------------------------------- mesh


def test_make_mesh_and_specs():
    mesh = make_mesh(ep=4, devices=HOST)
    assert mesh.axis_names == (DATA_AXIS, EP_AXIS) and dict(mesh.shape) == {DATA_AXIS: 2, EP_AXIS: 4}
    assert dict(_mesh(2, 1).shape) == {DATA_AXIS: 1, EP_AXIS: 2}
    assert check_mesh(mesh, 8) == 4
    assert expert_spec() == PartitionSpec("ep")
    assert dense_spec() == PartitionSpec()
    assert activation_spec() == PartitionSpec(("data", "ep"))
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 devices"):
        make_mesh(ep=3, devices=HOST)
    with pytest.raises(ValueError, match="ep must be a positive int"):
        make_mesh(ep=0, devices=HOST)
    with pytest.raises(ValueError, match=r"data \* ep = 3 \* 2 = 6 but 8 devices"):
        make_mesh(ep=2, data=3, devices=HOST)


def test_check_mesh_errors():
    no_ep = jax.sharding.Mesh(np.array(HOST[:4]), (DATA_AXIS,))
    with pytest.raises(ValueError, match=r"axis rules name \['ep'\], which the mesh \(axes \('data',\)\) does not have"):
        check_mesh(no_ep, 8)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the 'ep' axis size 4"):
        check_mesh(make_mesh(ep=4, devices=HOST), 6)


# ----------------------------------------------------------------------------- dispatch layout


def _transport(strategy: str, pair: bool) -> str:
    """The ep = 2 padded exchange on the two-rank path (own routes local, the peer block swapped by
    a `ppermute`; `pair`) or on all_to_all, whatever "auto" would pick for the (small) test
    blocks; ragged: its one transport."""
    if strategy == "ragged":
        return "auto"
    return "pair_swap" if pair else "all_to_all"


@pytest.mark.parametrize("ep,data,strategy,pair", [
    (2, 1, "padded", False), (2, 1, "padded", True), (4, 1, "padded", False), (2, 2, "padded", False),
    (2, 2, "padded", True), (4, 2, "padded", False), (2, 2, "ragged", False)])
def test_dispatch_layout_and_identity_round_trip(ep, data, strategy, pair):
    """Packed rows are exactly the contract's layout with zero padding, and identity experts give
    back sum_k w_tk x_t bit for bit (ragged: emulated collective, unwritten rows NaN; pair: the
    ep = 2 path: own routes local, peer block ppermuted)."""
    if strategy == "ragged":
        with poisoned_ragged():
            return _check_layout_and_round_trip(ep, data, strategy, "auto")
    _check_layout_and_round_trip(ep, data, strategy, _transport(strategy, pair))


def _check_layout_and_round_trip(ep, data, strategy, transport):
    mesh = _mesh(ep, data)
    k, n = 2, ep * data * T
    x, w = _exact_inputs(n, k, seed=ep + data)
    idx = _routes("skewed", n, k, ep, seed=ep * data)

    def body(x, idx, w):
        packed_x, gs, plan = ep_dispatch(x, idx, num_experts=E, strategy=strategy, transport=transport)
        y = ep_combine(packed_x, w, plan)
        st = plan.stats()
        return packed_x, gs, y, st.dropped[None], st.send_counts_P[None], st.recv_rows[None]

    out = _sharded(mesh, body, (ACT, ACT, ACT), (ACT,) * 6)(x, jnp.asarray(idx), w)
    packed_x, gs, y, dropped, send_counts, recv_rows = map(np.asarray, out)

    keep, want_counts, packed = _np_dispatch(idx, ep, data, T * k)
    m = ep * T * k  # dropless: a destination may receive every route of every source
    assert packed_x.shape == (ep * data * m, D)
    for dev in range(ep * data):
        rows, sizes = packed[dev]
        got = packed_x[dev * m : (dev + 1) * m]
        np.testing.assert_array_equal(gs[dev * (E // ep) : (dev + 1) * (E // ep)], sizes)
        np.testing.assert_array_equal(got[: len(rows)], np.asarray(x)[[t for t, _ in rows]])
        np.testing.assert_array_equal(got[len(rows) :], 0.0)
    assert keep.all()
    np.testing.assert_array_equal(send_counts, want_counts)
    np.testing.assert_array_equal(recv_rows, [len(packed[r][0]) for r in range(ep * data)])
    np.testing.assert_array_equal(dropped, 0)
    np.testing.assert_array_equal(y, np.sum(np.asarray(x)[:, None, :] * np.asarray(w)[:, :, None], axis=1))


# ----------------------------------------------------------------------------- numerics vs single device


@pytest.mark.parametrize("ep,data,strategy,pair", [(2, 1, "padded", False), (4, 2, "padded", False),
                                                  (2, 1, "padded", True), (2, 2, "ragged", False)])
def test_fp8_dispatch_sends_quantized_rows_with_straight_through_gradients(ep, data, strategy, pair):
    """`fp8_dispatch=True`: a route's row arrives as its 1 x 128-tile FP8 quantization, dequantized
    (a pairwise transport's own routes never leave the rank and arrive as they are), the outputs
    are the single-device math on the arrived rows, and the gradients pass straight through the
    quantization (those of that math with the quantization's rounding held fixed). Ragged: the
    emulated collective, bytes no sender writes all-ones (NaN once decoded)."""
    if strategy == "ragged":
        with poisoned_ragged():
            return _check_fp8_dispatch(ep, data, strategy, pair)
    _check_fp8_dispatch(ep, data, strategy, pair)


def _check_fp8_dispatch(ep, data, strategy, pair):
    mesh = _mesh(ep, data)
    k, n = 2, ep * data * T
    x, w, W, cot = _float_inputs(n, k, seed=3)
    x = x * jnp.linspace(0.5, 40.0, D)  # channels of very different sizes share a tile's scale
    idx = _routes("skewed", n, k, ep, seed=1)
    keep, _, _ = _np_dispatch(idx, ep, data, T * k)
    fn = _ep_linear(mesh, strategy=strategy, transport=_transport(strategy, pair), fp8_dispatch=True)
    (_, (y, *_)), grads = fn(x, w, W, jnp.asarray(idx), cot, jnp.ones(n, bool))

    stays = (np.arange(n)[:, None] // T % ep == idx // (E // ep)) & pair  # own routes of the pairwise path

    def reference(x, w, W):
        arrived = x + lax.stop_gradient(dequantize_rows(quantize_rows(x)) - x)
        y = 0.0
        for s in range(k):
            rows = jnp.where(stays[:, s, None], x, arrived)
            h = jnp.einsum("td,tod->to", rows, W[idx[:, s]], precision=HIGHEST)
            y = y + jnp.where(keep[:, s, None], w[:, s, None] * h, 0.0)
        return y

    _, want_grads = jax.value_and_grad(lambda *a: jnp.sum(reference(*a) * cot), argnums=(0, 1, 2))(x, w, W)
    assert_close(y, reference(x, w, W), jnp.float32, "y")
    assert float(jnp.max(jnp.abs(y - _reference(x, w, W, idx, keep)))) > 1e-3  # the rows were quantized
    for name, g, r in zip(("dx", "dweights", "dW"), grads, want_grads):
        assert_close(g, r, jnp.float32, name)
    with pytest.raises(TypeError, match="fp8_dispatch"):
        _ep_linear(mesh, fp8_dispatch="yes")(x, w, W, jnp.asarray(idx), cot, jnp.ones(n, bool))


@pytest.mark.parametrize("ep,data,strategy,pair,fuse", [(2, 1, "padded", False, False), (2, 1, "padded", True, False),
                                                       (4, 2, "padded", False, True), (2, 2, "ragged", False, True)])
def test_fp8_rows_hand_experts_the_senders_e4m3_rows(ep, data, strategy, pair, fuse):
    """`ep_moe(fp8_dispatch=True, fp8_rows=True)`: `expert_fn` gets, row for row with its rows
    (the packed rows, or the receive buffer with `fuse_regroup`), the e4m3 rows and scales the
    sender quantized from bf16 tokens (a pairwise transport's own rows quantized where they stay);
    padding rows of the packed form are zero.
    Each expert returns its FP8 rows dequantized in fp32, so the output is exactly
    `sum_k w_tk * dequantize(quantize(x_t))`. Ragged: NaN in every byte no sender writes."""
    if strategy == "ragged":
        with poisoned_ragged():
            return _check_fp8_rows(ep, data, strategy, pair, fuse)
    _check_fp8_rows(ep, data, strategy, pair, fuse)


def _check_fp8_rows(ep, data, strategy, pair, fuse):
    mesh = _mesh(ep, data)
    k, n = 2, ep * data * T
    x, w, _, _ = _float_inputs(n, k, seed=5)
    x = (x * jnp.linspace(0.5, 40.0, D)).astype(jnp.bfloat16)
    idx = _routes("skewed", n, k, ep, seed=2)
    keep, _, _ = _np_dispatch(idx, ep, data, T * k)

    def body(x, idx, w):
        def expert_fn(px, gs, rows=None, *, fp8_rows):
            assert fp8_rows.values_MK.shape == px.shape and (rows is not None) == fuse
            arrived = dequantize_rows(fp8_rows)  # fp32
            if rows is None:
                padding = jnp.arange(px.shape[0]) >= jnp.sum(gs)
                arrived = jnp.where(padding[:, None], jnp.nan, arrived)  # nonzero padding poisons y
                return arrived + jnp.where(padding, jnp.sum(jnp.abs(fp8_rows.scale_MKb), axis=1), 0.0)[:, None]
            return arrived[jnp.maximum(rows.ids_M, 0)]

        y, _ = ep_moe(x, idx, w, expert_fn, num_experts=E, strategy=strategy, fuse_regroup=fuse,
                      transport=_transport(strategy, pair), fp8_dispatch=True, fp8_rows=True)
        return y

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(ACT, ACT, ACT), out_specs=ACT, check_vma=False))
    y = fn(x, jnp.asarray(idx), w)
    exact = dequantize_rows(quantize_rows(x))  # fp32: what the senders quantized, undisturbed
    want = jnp.sum(jnp.where(keep[:, :, None], exact[:, None, :] * w[:, :, None], 0.0), axis=1)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    # Not the bf16 rows that arrive: an expert reading those would give a bf16-rounded output.
    assert not np.array_equal(np.asarray(exact.astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(exact))


def test_fp8_rows_spare_the_receivers_quantization_for_gpu():
    """Lowered for two H200s (the forward, FP8 SwiGLU experts on `auto`, gather fused as the layer
    runs them): with `fp8_rows` the experts' products read the e4m3 rows that arrive, so the only
    rows-quantization kernel left is the down projection's input's; without, the received rows are
    quantized again first; the products' kernels are the same."""
    e, d, f, tokens, k = 8, 512, 512, 256, 2
    mesh = h200_mesh((1, 2), (DATA_AXIS, EP_AXIS))
    counts = {}
    for fp8_rows in (False, True):
        def body(x, idx, w, w_gate, w_up, w_down):
            weights = tuple(lax.pcast(a, (DATA_AXIS,), to="varying") for a in (w_gate, w_up, w_down))

            def experts(rows, sizes, gather, **quantized):
                return swiglu_experts_fp8(rows, sizes, *weights, backend="auto", rows=gather,
                                          quantized=quantized.get("fp8_rows"))

            return ep_moe(x, idx, w, experts, num_experts=e, fuse_regroup=True, fp8_dispatch=True,
                          fp8_rows=fp8_rows)[0]

        fn = jax.shard_map(body, mesh=mesh, in_specs=(ACT, ACT, ACT) + (expert_spec(),) * 3, out_specs=ACT)
        n = 2 * tokens
        avals = [sharded_aval(mesh, shape, dtype, ACT)
                 for shape, dtype in (((n, d), jnp.bfloat16), ((n, k), jnp.int32), ((n, k), jnp.float32))]
        avals += [sharded_aval(mesh, shape, jnp.bfloat16, expert_spec()) for shape in ((e, f, d), (e, f, d), (e, d, f))]
        text = lower_for_gpu(fn, *avals, mesh=mesh)
        counts[fp8_rows] = (text.count('name = "moe_jax_quantize_rows"'), text.count("stablehlo.custom_call @mosaic_gpu"))
    assert counts[False][0] == 2 and counts[True][0] == 1 and counts[False][1] == counts[True][1], counts


def test_fp8_rows_of_no_routes_and_without_fp8_dispatch():
    """No routes (T = 0 or K = 0): `expert_fn` gets empty FP8 rows and the output is zeros;
    `fp8_rows=True` without `fp8_dispatch=True` is a ValueError saying what to pass."""

    def run(x, idx, fp8_dispatch=True):
        def expert_fn(px, gs, *, fp8_rows):
            assert fp8_rows.values_MK.shape == px.shape
            return dequantize_rows(fp8_rows)

        def body(x, i, w):
            return ep_moe(x, i, w, expert_fn, num_experts=E, fp8_dispatch=fp8_dispatch, fp8_rows=True)[0]

        fn = jax.shard_map(body, mesh=_mesh(2, 1), in_specs=(ACT, ACT, ACT), out_specs=ACT, check_vma=False)
        return fn(x, idx, jnp.ones(idx.shape))

    for tokens, k in ((0, 2), (4, 0)):
        y = run(jnp.ones((tokens, D)), jnp.zeros((tokens, k), jnp.int32))
        assert y.shape == (tokens, D) and not np.any(np.asarray(y))
    with pytest.raises(ValueError, match="fp8_rows=True .* pass fp8_dispatch=True"):
        run(jnp.ones((4, D)), jnp.zeros((4, 1), jnp.int32), fp8_dispatch=False)


def test_fp8_dispatch_moves_bytes_and_lowers_for_gpu():
    """The dispatch's exchange moves one uint8 row of D + 4 ceil(D/128) bytes per route (ragged and
    padded, lowered for an H200 from this host); the combine and every reverse exchange move the
    compute dtype."""
    for strategy, op in (("ragged", "stablehlo.custom_call @ragged_all_to_all"), ("padded", "stablehlo.all_to_all")):
        text = _lower_ep_grad((2, 4), strategy=strategy, capacity=3, dtype=jnp.bfloat16, fp8_dispatch=True)
        calls = [line for line in text.splitlines() if op in line]
        assert len(calls) == 4, calls
        assert sum("xui8>" in line for line in calls) == 1, calls
        assert sum("xbf16>" in line for line in calls) == 3, calls



@pytest.mark.parametrize("ep,data,pair", [(4, 2, False), (2, 1, False), (2, 1, True)])
def test_linear_experts_match_single_device(ep, data, pair):
    _check_linear(_mesh(ep, data), "skewed", pair=pair)


@pytest.mark.parametrize("pattern,k", [("one_expert", 1), ("starved", 2)])
def test_degenerate_routing(pattern, k):
    """All routes to one expert; a rank whose tokens all leave it, a rank that receives nothing and
    a local expert with zero rows."""
    mesh = _mesh(4, 2)
    keep, packed, _ = _check_linear(mesh, pattern, k=k)
    assert keep.all()
    sizes = np.array([packed[dev][1] for dev in range(8)])  # [device, El]
    if pattern == "one_expert":
        assert sizes[:, -1].tolist() == [0, 0, 0, 4 * T] * 2 and sizes.sum() == 8 * T
    else:
        # Expert 1 (local 1 of ep rank 0) is empty; ep rank 3 receives nothing; both data replicas.
        assert (sizes[[0, 4], 1] == 0).all() and (sizes[[3, 7]] == 0).all() and (sizes[[0, 4], 0] > 0).all()


@pytest.mark.parametrize("ep,data,capacity,pair", [(4, 2, 2, False), (2, 1, 4, False), (2, 1, 4, True)])
def test_capacity_overflow_drops_exactly(ep, data, capacity, pair):
    mesh = _mesh(ep, data)
    # 12 routes per rank over the ep destinations, rank 0's experts hot: overflow is certain.
    keep, _, _ = _check_linear(mesh, "skewed", capacity=capacity, pair=pair, seed=3)
    assert 0 < (~keep).sum() < keep.size


@pytest.mark.parametrize("pair", [False, True])
def test_masked_routes_on_a_rank_that_receives_nothing(pair):
    """ep rank 1 receives no route ("starved"), so its whole expert output is NaN padding, and it
    has masked tokens and capacity drops whose routes have no row: they read nothing that leaks,
    on both exchanges (the two-rank path reads its own routes straight from that expert output)."""
    n = 2 * 2 * T
    mask = np.random.default_rng(3).random(n) < 0.6
    keep, packed, (y, (dx, dw, _)) = _check_linear(_mesh(2, 2), "starved", capacity=5, pair=pair, poison=True,
                                                   mask=mask, seed=3)
    assert all(len(packed[dev][0]) == 0 for dev in (1, 3)) and (~keep[mask]).any()
    for got in (y, dx, dw):
        assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_array_equal(np.asarray(y)[~mask], 0.0)


def test_masked_tokens_and_a_rank_without_tokens():
    """Device 1 (ep rank 1 of data replica 0) has no real token and others have some padding:
    masked routes are neither sent, counted nor dropped; their outputs and gradients are zero."""
    mesh = _mesh(4, 2)
    n = 8 * T
    mask = np.random.default_rng(7).random(n) < 0.7
    mask[T : 2 * T] = False
    keep, packed, (y, (dx, dw, _)) = _check_linear(mesh, "skewed", capacity=3, mask=mask, seed=7)
    assert not keep[~mask].any() and 0 < (~keep[mask]).sum()
    np.testing.assert_array_equal(np.asarray(y)[~mask], 0.0)
    np.testing.assert_array_equal(np.asarray(dx)[~mask], 0.0)
    np.testing.assert_array_equal(np.asarray(dw)[~mask], 0.0)


@pytest.mark.parametrize("pair", [False, True])
def test_nan_in_padding_rows_never_leaks(pair):
    """Expert outputs past sum(group_sizes) are NaN; outputs and all gradients stay finite and
    correct (combine's row gather reads delivered routes' rows only: dropped routes get zero rows
    without reading, never a multiply by a mask)."""
    keep, packed, _ = _check_linear(_mesh(2, 2), "skewed", pair=pair, poison=True, seed=5)
    # Dropless buffers: M = P*T*K rows per rank, far more than any rank receives here.
    assert all(len(packed[dev][0]) < 2 * T * 2 for dev in range(4))


# ----------------------------------------------------------------------------- errors


def test_errors():
    mesh = _mesh(4, 1)
    x = jnp.zeros((4 * T, D))
    idx = jnp.zeros((4 * T, 2), jnp.int32)

    def trace(**kwargs):
        idx_arg = kwargs.pop("idx", idx)
        body = lambda x, i: ep_dispatch(x, i, **{"num_experts": E, **kwargs})[0]
        return _sharded(mesh, body, (ACT, ACT), ACT).trace(x, idx_arg)

    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the ep axis size 4"):
        trace(num_experts=6)
    with pytest.raises(ValueError, match="capacity=0 is below one row per local expert"):
        trace(capacity=0)
    # El = 2 local experts per destination: one row per (source, destination) cannot serve both.
    with pytest.raises(ValueError, match=r"capacity=1 is below one row per local expert: .* capacity must be >= 2"):
        trace(capacity=1)
    with pytest.raises(ValueError, match=r"mask_T must be bool \[T\] = \(6,\)"):
        trace(mask_T=jnp.ones((5,), bool))
    with pytest.raises(ValueError, match="strategy='dense' is not an EP strategy"):
        trace(strategy="dense")
    with pytest.raises(ValueError, match="transport='nccl'"):
        trace(transport="nccl")
    with pytest.raises(ValueError, match="transport 'ragged_all_to_all' moves tight blocks.*strategy='ragged'"):
        trace(transport="ragged_all_to_all")
    with pytest.raises(ValueError, match="transport 'pair_swap' swaps the blocks of two ranks, but the ep axis has 4"):
        trace(transport="pair_swap")
    with pytest.raises(ValueError, match=r"expert_idx_TK must be \[T, K\] with T = x_TD.shape\[0\] = 6"):
        trace(idx=jnp.zeros((4 * T + 4, 2), jnp.int32))
    with pytest.raises(ValueError, match="is not bound: call EP dispatch/combine inside jax.shard_map"):
        ep_dispatch(x, idx, num_experts=E)


def test_auto_transport_choice():
    """"auto" swaps pairs at ep = 2 from PAIR_MIN_BLOCK_BYTES blocks on, all_to_all otherwise; an
    explicit transport is taken as given (a variant with another `move` too)."""
    assert select_transport("padded", "auto", ep=2, block_bytes=PAIR_MIN_BLOCK_BYTES) is PAIR_SWAP
    assert select_transport("padded", "auto", ep=2, block_bytes=PAIR_MIN_BLOCK_BYTES - 1) is ALL_TO_ALL
    assert select_transport("padded", "auto", ep=4, block_bytes=1 << 40) is ALL_TO_ALL
    assert select_transport("ragged", "auto", ep=2, block_bytes=1 << 40) is RAGGED_ALL_TO_ALL
    assert select_transport("padded", "all_to_all", ep=2, block_bytes=1 << 40) is ALL_TO_ALL
    local = dataclasses.replace(ALL_TO_ALL, name="local", move=lambda rows, ex, out_rows, axis_name: rows)
    assert select_transport("padded", local, ep=4, block_bytes=0) is local
    with pytest.raises(TypeError, match="transport must be 'auto'"):
        select_transport("padded", 3, ep=2, block_bytes=0)


def test_capacity_for():
    assert capacity_for(6, 2, 4, 1.0) == 3
    assert capacity_for(6, 2, 4, 1.25) == 4
    assert capacity_for(100, 1, 10, 1.1) == 11  # float noise does not round up to 12
    assert capacity_for(6, 2, 4, 100.0) == 12  # never above the dropless T*K
    assert capacity_for(1, 1, 64, 0.5) == 1  # never below one row
    with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
        capacity_for(6, 2, 4, 0.0)
    with pytest.raises(ValueError, match="ep_size must be a positive int"):
        capacity_for(6, 2, 0, 1.0)
    # Floor of one row per local expert: the balanced share ceil(0.25 * 16 / 2) = 2 rises to 4 ...
    assert capacity_for(8, 2, 2, 0.25, local_experts=4) == 4
    # ... but never above the dropless T*K = 2.
    assert capacity_for(1, 2, 2, 0.25, local_experts=8) == 2
    with pytest.raises(ValueError, match="local_experts must be a positive int"):
        capacity_for(6, 2, 4, 1.0, local_experts=0)
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
            check_capacity_factor(bad)
    with pytest.raises(TypeError, match="capacity_factor must be a number"):
        check_capacity_factor(True)
    assert check_capacity_factor(np.float32(1.25)) == 1.25 and capacity_for(np.int64(6), 2, 4, 1.0) == 3


# ----------------------------------------------------------------------------- ragged strategy


def test_ragged_emulation_matches_jax_docstring_example():
    mesh = _mesh(2, 1)

    def body(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        return emulated_ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=EP_AXIS
        )

    args = [
        [[1, 2, 2], [3, 4, 0]],
        [[0, 0, 0, 0], [0, 0, 0, 0]],
        [[0, 1], [0, 1]],
        [[1, 2], [1, 1]],
        [[0, 0], [1, 2]],
        [[1, 1], [2, 1]],
    ]
    args = [jnp.asarray(a, jnp.float32 if i < 2 else jnp.int32).reshape(-1) for i, a in enumerate(args)]
    spec = PartitionSpec(EP_AXIS)
    out = _sharded(mesh, body, (spec,) * 6, spec)(*args)
    np.testing.assert_array_equal(np.asarray(out), [1, 3, 0, 0, 2, 2, 4, 0])


# The 2-GPU cases of test_ragged_strategy_on_gpus: (pattern, capacity) on an ep = 2 mesh.
RAGGED_GPU_CASES = [("skewed", None), ("skewed", 4), ("starved", None)]


@pytest.mark.parametrize("pattern,capacity", RAGGED_GPU_CASES)
def test_ragged_strategy_gpu_cases_with_emulated_collective(pattern, capacity):
    """test_ragged_strategy_on_gpus's cases (ep = 2, outputs and every gradient) on CPU, through
    the emulated collective with NaN in every row it leaves unwritten."""
    with poisoned_ragged():
        _check_linear(_mesh(2, 1), pattern, capacity=capacity, strategy="ragged", poison=True, seed=4)


@pytest.mark.parametrize("pattern,capacity,empty_rank", [("skewed", 2, False), ("starved", None, True)])
def test_ragged_strategy_numerics_with_emulated_collective(pattern, capacity, empty_rank):
    """The ragged path's planning, offsets and reverse-exchange custom_vjp, run on CPU, with NaN in
    every receive-buffer row the collective leaves unwritten (forward and backward exchanges) and
    in the expert outputs past the valid rows. The second case has a rank that sends nothing
    (all its tokens masked) and one that receives nothing, so whole buffers stay NaN."""
    mask = None
    if empty_rank:
        mask = np.ones(8 * T, bool)
        mask[2 * T : 3 * T] = False
    with poisoned_ragged():
        _check_linear(_mesh(4, 2), pattern, capacity=capacity, strategy="ragged", poison=True, mask=mask, seed=3)


@pytest.mark.skipif(
    not ON_GPU or len(jax.devices()) < 2,
    reason="the real ragged_all_to_all needs 2 GPUs (XLA:CPU lacks it); on CPU the same cases run "
    "through the emulated collective in test_ragged_strategy_gpu_cases_with_emulated_collective",
)
@pytest.mark.parametrize("pattern,capacity", RAGGED_GPU_CASES)
def test_ragged_strategy_on_gpus(pattern, capacity):
    """The real collective (XLA:GPU), forward and custom_vjp backward, against the reference."""
    _check_linear(_mesh(2, 1), pattern, capacity=capacity, strategy="ragged", seed=4)


def _lower_ep_grad(mesh_shape, *, strategy, capacity, dtype, k=2, transport="auto", fp8_dispatch=False) -> str:
    """StableHLO of the gradient (w.r.t. x, the routing weights and the expert weights) of a linear
    EP layer on an H200 mesh of `mesh_shape` = (data, ep), under shard_map's check_vma as the
    MoE layer runs it."""
    mesh = h200_mesh(mesh_shape, (DATA_AXIS, EP_AXIS))
    n = mesh_shape[0] * mesh_shape[1] * T

    def body(x, idx, w, W):
        W = lax.pcast(W, (DATA_AXIS,), to="varying")  # per-device weight gradients, psum'd over data
        expert_fn = lambda px, gs: grouped_linear(px, W, gs, backend="xla")
        y, stats = ep_moe(x, idx, w, expert_fn, num_experts=E, strategy=strategy, capacity=capacity,
                          transport=transport, fp8_dispatch=fp8_dispatch)
        # stats.dropped is an ep-group total: sum the data replicas' groups for a replicated result.
        return lax.psum(jnp.sum(y), (DATA_AXIS, EP_AXIS)) + 0.0 * lax.psum(stats.dropped, DATA_AXIS)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(ACT, ACT, ACT, expert_spec()), out_specs=dense_spec())
    avals = (sharded_aval(mesh, (n, D), dtype, ACT), sharded_aval(mesh, (n, k), jnp.int32, ACT),
             sharded_aval(mesh, (n, k), jnp.float32, ACT), sharded_aval(mesh, (E, O, D), dtype, expert_spec()))
    return lower_for_gpu(jax.grad(fn, argnums=(0, 2, 3)), *avals, mesh=mesh)


def test_ragged_strategy_lowers_for_gpu():
    """Forward and backward of the ragged path lower for an H200 from this CPU host, with four
    ragged_all_to_all (dispatch, combine, and their reverse exchanges) and no JAX transpose, under
    shard_map's varying-axes checks (check_vma, as the MoE layer runs it)."""
    text = _lower_ep_grad((2, 4), strategy="ragged", capacity=3, dtype=jnp.float32)
    assert text.count("stablehlo.custom_call @ragged_all_to_all") == 4
    assert "stablehlo.all_to_all" not in text  # JAX's own transpose would add all_to_all of the offsets


def test_pairwise_padded_path_lowers_for_gpu():
    """The pair-swap transport (ep = 2) keeps its own routes local and ppermutes the peer block:
    forward and backward lower for an H200 under check_vma, with the Pallas row gather and
    collective_permutes (the dispatch and combine swaps and their reverse exchanges), and no
    all_to_all."""
    text = _lower_ep_grad((1, 2), strategy="padded", capacity=T * 2, dtype=jnp.bfloat16, transport="pair_swap")
    assert text.count("stablehlo.collective_permute") == 4
    assert "all_to_all" not in text
    # Forward: the peer send gather, the regroup from (x, peer block) as one launch per source, the
    # peer un-regroup, the combine's read of each route's row from (packed rows, returned peer
    # block) as one launch per source (6); neither the own block nor the returned pair is built.
    # Backward, through the inverses: the regroup's peer source, the peer un-regroup and the
    # combine's two sources (4); x's share of the regroup and of the peer send gather sum each
    # token's rows (XLA gathers, no scatter-add).
    assert text.count('name = "moe_jax_gather_rows"') == 10
    # The only scatters: two integer maps (packed row to receive slot; returned row to its route).
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if '"stablehlo.scatter"(' in line]
    result_types = [next(line for line in lines[i:] if line.lstrip().startswith("})")).split("->")[-1] for i in starts]
    assert len(result_types) == 2 and all("xi32>" in t for t in result_types), result_types


def test_invert_rows_maps_each_row_to_its_reader():
    """The inverse of an injective partial map: each row's reader, -1 for rows none reads; readers
    of no row (-1) change nothing, however many there are."""
    got = jax.jit(invert_rows, static_argnums=1)(jnp.asarray([3, -1, 0, -1, 5], jnp.int32), 6)
    np.testing.assert_array_equal(np.asarray(got), [2, -1, -1, 0, -1, 4])
    assert np.asarray(invert_rows(jnp.zeros((0,), jnp.int32), 3)).tolist() == [-1, -1, -1]
