"""Transports of expert-parallel dispatch and combine: how row blocks move between the P ranks.

Runs inside `jax.shard_map`. A `Transport` names one way to move the blocks a `BlockExchange`
describes, the buffer layout it needs (`layout.LAYOUTS`) and whether it keeps this rank's own
routes local. Three are provided:

- `ALL_TO_ALL` (layout `padded`): `jax.lax.all_to_all` of `[P*C, D]` buffers, block p at p*C
  on both sides; runs on every backend and platform.
- `PAIR_SWAP` (layout `padded`, two ranks): the own block never leaves the rank (dispatch's
  regroup reads it straight from `x_TD`, combine straight from the expert output); only the peer
  block is gathered and swapped by one `jax.lax.ppermute`.
- `RAGGED_ALL_TO_ALL` (layout `tight`): `jax.lax.ragged_all_to_all` of tightly packed blocks;
  GPU only (XLA:CPU does not implement it).

Each exchange is differentiable through its own `jax.custom_vjp` whose backward is the reverse
exchange (sizes and offsets swapped; the row permutation's transpose is its inverse), not JAX's
built-in transpose of the collective. `Transport.exchange(fp8=True)` moves the rows as e4m3
values with fp32 scales per 1 x 128 tile, one byte row each, and dequantizes them on arrival (the
FP8 dispatch; docs/expert-parallelism.md); `Transport.exchange_fp8` also returns the e4m3 rows as
they arrived, for experts that compute on them. A `Transport` is a frozen value: tests and benchmarks pass
one (or a variant made with `dataclasses.replace`, e.g. with an identity `move` to time what
surrounds the collective) wherever a transport name is accepted.

`select_transport` turns a strategy (`"padded"`, `"ragged"`) and a transport choice (`"auto"`,
a name or a `Transport`) into the transport to run: with `"auto"`, `"padded"` swaps pairs at
P = 2 for blocks of `PAIR_MIN_BLOCK_BYTES` and more and uses the all_to_all otherwise (below that
size the extra launches cost more than the halved traffic saves; docs/decisions.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax.ops.fp8 import Fp8Rows, dequantize_rows, quantize_rows, rows_from_bytes, rows_to_bytes
from moe_jax.parallel.layout import LAYOUTS, BlockExchange

__all__ = [
    "ALL_TO_ALL",
    "PAIR_MIN_BLOCK_BYTES",
    "PAIR_SWAP",
    "RAGGED_ALL_TO_ALL",
    "STRATEGIES",
    "TRANSPORTS",
    "Transport",
    "check_strategy",
    "check_transport",
    "select_transport",
]

# Strategies of the MoE layer and of ep_dispatch: the layout family, with the transport "auto" picks.
STRATEGIES = ("padded", "ragged")
_LAYOUT_OF = {"padded": "padded", "ragged": "tight"}
# Smallest [C, D] block for which "auto" swaps pairs at P = 2 (docs/decisions.md).
PAIR_MIN_BLOCK_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Transport:
    """One way to move row blocks between the ranks of the ep axis.

    name: what tables and errors call it.
    layout: `"padded"` or `"tight"` (see `moe_jax.parallel.layout`).
    pairwise: two ranks only; just the peer's block moves (its own block never leaves the rank).
    move: `move(rows_ND, ex, out_rows, axis_name) -> [out_rows, D]`, one direction without
      autodiff: rows of block p go to rank p as `ex` describes (a pairwise `move` receives only
      the peer block and returns the peer's). `exchange` makes it differentiable.
    """

    name: str
    layout: str
    pairwise: bool
    move: Callable[[jax.Array, BlockExchange, int, object], jax.Array]

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Transport.layout={self.layout!r}: use one of {LAYOUTS}.")

    def exchange(self, rows_ND: jax.Array, ex: BlockExchange, *, out_rows: int, axis_name,
                 fp8: bool = False) -> jax.Array:
        """Differentiable `move`: the cotangent of a received block goes back to its sender through
        the reverse exchange (`ex.reversed()`).

        `fp8=True`: the rows travel as DeepSeek-V3 dispatches them (arXiv:2412.19437, section
        3.3): e4m3 values with one fp32 scale per 1 x 128 tile of each row (`moe_jax.ops.fp8`),
        one byte row each (`rows_to_bytes`: D + 4 ceil(D/128) bytes, about half of bf16's 2D),
        dequantized to the rows' dtype on arrival. The cotangent returns in the rows' dtype, straight
        through the quantization."""
        if fp8:
            return self.exchange_fp8(rows_ND, ex, out_rows=out_rows, axis_name=axis_name)[0]
        return self._exchange(rows_ND, ex, out_rows, axis_name, fp8=False)[0]

    def exchange_fp8(self, rows_ND: jax.Array, ex: BlockExchange, *, out_rows: int,
                     axis_name) -> tuple[jax.Array, Fp8Rows]:
        """`exchange(fp8=True)` that also returns the e4m3 rows as they arrived: `(rows [out_rows, D]
        dequantized to the rows' dtype, differentiable as `exchange`'s; their `Fp8Rows`, not
        differentiated)`, for experts that compute on the FP8 rows themselves instead of
        quantizing the dequantized rows again."""
        rows, moved = self._exchange(rows_ND, ex, out_rows, axis_name, fp8=True)
        return rows, rows_from_bytes(moved, rows_ND.shape[1])

    def _exchange(self, rows_ND, ex, out_rows, axis_name, *, fp8: bool):
        """`(received rows, their bytes as moved or None)`, differentiable in the rows."""
        in_rows, width, dtype = rows_ND.shape[0], rows_ND.shape[1], rows_ND.dtype

        @jax.custom_vjp
        def exchange(rows, ex):
            if not fp8:
                return self.move(rows, ex, out_rows, axis_name), None
            moved = self.move(rows_to_bytes(quantize_rows(rows)), ex, out_rows, axis_name)
            return dequantize_rows(rows_from_bytes(moved, width)).astype(dtype), moved

        def forward(rows, ex):
            return exchange(rows, ex), ex

        def backward(ex, grads):
            return self.move(grads[0], ex.reversed(), in_rows, axis_name), None  # the bytes: integers, no gradient

        exchange.defvjp(forward, backward)
        return exchange(rows_ND, ex)


def _all_to_all(rows_ND, ex, out_rows, axis_name):
    del ex, out_rows  # slots are p*C on both sides: a tiled all_to_all over [P*C] rows is the exchange
    return lax.all_to_all(rows_ND, axis_name, 0, 0, tiled=True)


def _swap(rows_ND, ex, out_rows, axis_name):
    del ex, out_rows
    return lax.ppermute(rows_ND, axis_name, [(0, 1), (1, 0)])


def _ragged(rows_ND, ex, out_rows, axis_name):
    # The collective's result takes the type of its output buffer, so under shard_map's check_vma
    # the buffer must vary over the same mesh axes as the rows (zeros_like keeps them); custom_vjp
    # rejects a backward whose result does not.
    out = jnp.zeros_like(rows_ND, shape=(out_rows,) + rows_ND.shape[1:])
    return lax.ragged_all_to_all(rows_ND, out, ex.send_offsets_P, ex.send_sizes_P, ex.peer_recv_offsets_P,
                                 ex.recv_sizes_P, axis_name=axis_name)


ALL_TO_ALL = Transport("all_to_all", "padded", pairwise=False, move=_all_to_all)
PAIR_SWAP = Transport("pair_swap", "padded", pairwise=True, move=_swap)
RAGGED_ALL_TO_ALL = Transport("ragged_all_to_all", "tight", pairwise=False, move=_ragged)
TRANSPORTS = {t.name: t for t in (ALL_TO_ALL, PAIR_SWAP, RAGGED_ALL_TO_ALL)}


def check_strategy(strategy, name: str = "strategy") -> str:
    """`strategy` if it is one of `STRATEGIES`, else ValueError naming the argument (`name`) and the choices."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"{name}={strategy!r} is not an EP strategy; use 'padded' (fixed-capacity blocks, any "
            "platform) or 'ragged' (ragged_all_to_all, GPU only)."
        )
    return strategy


def check_transport(transport) -> str | Transport:
    """`transport` if it is `"auto"`, a name in `TRANSPORTS` or a `Transport`, else ValueError/TypeError."""
    if isinstance(transport, Transport) or transport == "auto" or transport in TRANSPORTS:
        return transport
    if not isinstance(transport, str):
        raise TypeError(f"transport must be 'auto', a transport name or a Transport; got {type(transport).__name__}.")
    raise ValueError(f"transport={transport!r}: use 'auto' or one of {tuple(TRANSPORTS)} (or a Transport).")


def select_transport(strategy: str, transport: str | Transport, *, ep: int, block_bytes: int) -> Transport:
    """The transport an exchange of `[C, D]` blocks of `block_bytes` bytes over `ep` ranks runs.

    `transport="auto"` picks by strategy (module docstring); a name or a `Transport` must fit the
    strategy's layout (ValueError otherwise), and a pairwise one needs `ep == 2`.
    """
    check_strategy(strategy)
    check_transport(transport)
    if transport == "auto":
        if strategy == "ragged":
            return RAGGED_ALL_TO_ALL
        return PAIR_SWAP if ep == 2 and block_bytes >= PAIR_MIN_BLOCK_BYTES else ALL_TO_ALL
    chosen = TRANSPORTS[transport] if isinstance(transport, str) else transport
    if chosen.layout != _LAYOUT_OF[strategy]:
        fits = [s for s, layout in _LAYOUT_OF.items() if layout == chosen.layout]
        raise ValueError(
            f"transport {chosen.name!r} moves {chosen.layout} blocks, but strategy={strategy!r} lays them out "
            f"{_LAYOUT_OF[strategy]}; pass strategy={fits[0]!r} or transport='auto'."
        )
    if chosen.pairwise and ep != 2:
        raise ValueError(f"transport {chosen.name!r} swaps the blocks of two ranks, but the ep axis has {ep}; "
                         "use transport='auto' or 'all_to_all'.")
    return chosen
