"""Token chunks of the expert-parallel exchange: how `ep_moe(chunks=n)` splits a rank's tokens.

Legend: T tokens on this rank, n the chunks asked for, N the chunks run (`min(n, T)`, at least 1).

A rank's T tokens are cut into N contiguous chunks whose sizes differ by at most one token (the
first `T % N` chunks hold one more), like `numpy.array_split`. Uneven chunks rather than masked
padding: padding tokens would enlarge every chunk's buffers (dropless C is the chunk's own route
count) and could change a capacity computed from the chunk size, while uneven chunks cost only a
second traced shape. A rank with fewer tokens than chunks (decode) runs one chunk per token, so
one `EPOptions` serves prefill and decode; T = 0 is one empty chunk. Every rank of a `shard_map`
has the same static T, so every rank cuts the same chunks and their exchanges pair up.
"""

from __future__ import annotations

from moe_jax.validation import check_int

__all__ = ["check_chunks", "token_chunks"]


def check_chunks(chunks, name: str = "chunks") -> int:
    """`chunks` as a Python int >= 1; TypeError/ValueError naming the argument (`name`) otherwise."""
    try:
        return check_int(name, chunks)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{err} Pass {name}=1 for one exchange of all tokens, or n > 1 to split a "
                        "rank's tokens into n chunks whose exchanges can overlap the expert GEMMs.") from None


def token_chunks(tokens: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """The `(start, stop)` token ranges of the N = `min(chunks, tokens)` chunks (one `(0, 0)`
    chunk when `tokens == 0`): contiguous, in order, sizes `ceil(T/N)` for the first `T % N`
    chunks and `floor(T/N)` for the rest."""
    tokens = check_int("tokens", tokens, minimum=0)
    count = max(1, min(check_chunks(chunks), tokens))
    size, extra = divmod(tokens, count)
    bounds, start = [], 0
    for i in range(count):
        stop = start + size + (i < extra)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)
