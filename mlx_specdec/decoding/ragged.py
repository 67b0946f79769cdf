"""A ragged batch cache that rows join and leave while it runs (continuous batching).

Every row of a batch cache writes at the same physical position; row b's tokens are the slots
where `valid[b]` is true, the others holes that the attention mask hides (their keys weigh
exactly zero). A joining row, prefilled alone, is laid in left-padded: its tokens are the last
`length` slots before the shared write position. A row longer than the batch so far pushes
every other row right by the difference (holes in front of them). Leading slots no row uses any
more (their rows left) are cut off once there are enough of them to be worth a copy.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from ..cache.contiguous import ContiguousKVCache

COMPACT_MIN = 64  # cut leading unused slots once there are at least this many


def merge_row(cache: Optional[ContiguousKVCache], valid: np.ndarray, alone: ContiguousKVCache,
              length: int) -> Tuple[ContiguousKVCache, np.ndarray]:
    """Lay a one-row cache holding `length` tokens into the batch (cache None or valid with no
    rows: it becomes the batch) -> (the batch cache, its valid (B + 1, P'))."""
    B, P = valid.shape
    if cache is None or B == 0:
        return alone_copy(alone, length), np.ones((1, length), dtype=bool)
    width = max(P, length)
    for mine, theirs in zip(cache.layers, alone.layers):
        like = mine.keys if mine.keys is not None else theirs.keys
        if like is None:  # neither side holds a token yet: only the offset moves
            mine.offset = width
            continue
        keys = _slots(mine.keys, B, P, like, width)
        values = _slots(mine.values, B, P, mine.values if mine.values is not None else theirs.values, width)
        mine.keys = mx.concatenate([keys, _slots(theirs.keys, 1, length, like, width)], axis=0)
        mine.values = mx.concatenate([values, _slots(theirs.values, 1, length, values, width)], axis=0)
        mine.offset = width
    merged = np.zeros((B + 1, width), dtype=bool)
    merged[:B, width - P:] = valid
    merged[B, width - length:] = True
    mx.eval(cache.state)
    return cache, merged


def cut_unused(cache: ContiguousKVCache, valid: np.ndarray) -> np.ndarray:
    """Cut the leading slots no row uses (once there are COMPACT_MIN of them) -> the new valid."""
    if valid.shape[0] == 0 or valid.shape[1] == 0:
        return valid
    unused = int(np.argmax(valid.any(axis=0)))  # leading slots no row uses
    if unused < COMPACT_MIN:
        return valid
    for layer in cache.layers:
        layer.keys = layer.keys[..., unused: layer.offset, :]
        layer.values = layer.values[..., unused: layer.offset, :]
        layer.offset -= unused
    return valid[:, unused:]


def alone_copy(alone: ContiguousKVCache, length: int) -> ContiguousKVCache:
    """A batch cache of one row holding `alone`'s first `length` tokens (its own arrays)."""
    cache = ContiguousKVCache(len(alone.layers))
    for mine, theirs in zip(cache.layers, alone.layers):
        if theirs.keys is not None:
            mine.keys, mine.values = theirs.keys[..., :length, :], theirs.values[..., :length, :]
        mine.offset = length
    return cache


def _slots(x: Optional[mx.array], rows: int, used: int, like: mx.array, width: int) -> mx.array:
    """(rows, H, width, D): the first `used` slots of x moved to the end, zeros in front (x may be
    None when it holds no token yet; `like` gives the shape and dtype)."""
    zeros = mx.zeros((rows, like.shape[1], width - used, like.shape[3]), dtype=like.dtype)
    if x is None or used == 0:
        return mx.zeros((rows, like.shape[1], width, like.shape[3]), dtype=like.dtype)
    return mx.concatenate([zeros, x[..., :used, :].astype(like.dtype)], axis=2) if width > used else x[..., :used, :]
