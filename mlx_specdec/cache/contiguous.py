"""Contiguous KV cache with rollback: the cache every speculative method verifies against.

The cache interface the forward pass needs is small and duck-typed (as in mlx-lm):
a model-level object with `.layers` (one per transformer block, each with
`update_and_fetch(keys, values) -> (keys, values)`) and `.offset` (the next position).

Speculation appends drafted tokens, verifies them, and must then forget the rejected ones:
`trim(n)` drops the last n tokens, `rollback_to(offset)` returns to a saved length, and
`keep_appended(start, kept)` compacts a verified token tree down to its accepted path.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..host_traffic import to_device

GROW_STEP = 256  # grow buffers in steps, as mlx-lm does, so appends rarely reallocate


class ContiguousLayerCache:
    def __init__(self):
        self.keys: mx.array | None = None  # (B, Hkv, capacity, Dh)
        self.values: mx.array | None = None
        self.offset = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start, n = self.offset, keys.shape[2]
        if self.keys is None or start + n > self.capacity:
            self._grow(keys, values, start + n)
        self.keys[..., start : start + n, :] = keys
        self.values[..., start : start + n, :] = values
        self.offset = start + n
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def fetch_to(self, width: int):
        """Keys and values (B, Hkv, width, Dh): the buffer's first `width` >= offset positions, for an
        attention whose mask hides every one past the offset (they hold zeros or dropped tokens, all
        finite). A CUDA verify attends a bucket of keys this way (model/attention.py) without copying."""
        if width > self.capacity:
            self._grow(self.keys, self.values, width)
        return self.keys[..., :width, :], self.values[..., :width, :]

    def _grow(self, keys: mx.array, values: mx.array, needed: int):
        B, H, _, Dk = keys.shape
        Dv = values.shape[3]
        new_capacity = ((needed + GROW_STEP - 1) // GROW_STEP) * GROW_STEP
        new_keys = mx.zeros((B, H, new_capacity, Dk), keys.dtype)
        new_values = mx.zeros((B, H, new_capacity, Dv), values.dtype)
        if self.keys is not None and self.offset > 0:
            new_keys[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_values[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_keys, new_values

    def trim(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"cannot trim a negative number of tokens ({n})")
        n = min(self.offset, n)
        self.offset -= n
        return n

    def keep_appended(self, start: int, kept: mx.array):
        """Keep only the appended tokens at start + kept (ascending), packed from `start` on."""
        k = kept.shape[0]
        index = kept + start
        self.keys[..., start : start + k, :] = self.keys[..., index, :]
        self.values[..., start : start + k, :] = self.values[..., index, :]
        self.offset = start + k

    def keep_appended_rows(self, start: int, kept: mx.array, width: int):
        """Per row b keep the appended tokens at start + kept[b] (B, width), packed from `start`."""
        index = (kept + start)[:, None, :, None]  # (B, 1, width, 1)
        gathered_keys = mx.take_along_axis(self.keys, index, axis=2)  # (B, H, width, Dk)
        gathered_values = mx.take_along_axis(self.values, index, axis=2)
        self.keys[..., start : start + width, :] = gathered_keys
        self.values[..., start : start + width, :] = gathered_values
        self.offset = start + width

    def select_rows(self, rows: mx.array):
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys[..., : self.offset, :], self.values[..., : self.offset, :]]


class LayeredCache:
    """What every model-level cache shares: `layers` (one per block, each with `offset` and
    `trim`), the offset they all have, and trimming them together."""

    layers: list

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    def trim(self, n: int) -> int:
        """Forget the last n tokens; returns how many were dropped."""
        dropped = 0
        for layer in self.layers:
            dropped = layer.trim(n)
        return dropped


class ContiguousKVCache(LayeredCache):
    """Model-level cache: one `ContiguousLayerCache` per transformer block."""

    def __init__(self, num_layers: int):
        self.layers = [ContiguousLayerCache() for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model: nn.Module) -> "ContiguousKVCache":
        return cls(len(model.model.layers))

    def rollback_to(self, offset: int) -> None:
        if not 0 <= offset <= self.offset:
            raise ValueError(f"cannot roll back from {self.offset} to {offset}")
        self.trim(self.offset - offset)

    def keep_appended(self, start: int, kept: Sequence[int] | mx.array) -> None:
        """After verifying tokens appended at start.., keep only `kept` (relative, ascending).

        Used to commit the accepted path of a verified token tree: the accepted tokens' keys and
        values were computed at their true positions, so moving them down is exact.
        """
        if not isinstance(kept, mx.array) and _in_place(kept):
            self._keep_first(start, len(kept))
            return
        kept = mx.array(kept, dtype=mx.int32) if not isinstance(kept, mx.array) else kept
        for layer in self.layers:
            layer.keep_appended(start, kept)

    def keep_appended_rows(self, start: int, kept_rows: Sequence[Sequence[int]]) -> int:
        """Batch version of `keep_appended`: row b keeps kept_rows[b] (relative, ascending).

        Rows keep different counts; every row is packed from `start` and the new offset is
        start + the longest, so shorter rows end in holes that the caller masks out (ragged batch).
        Returns the new offset.
        """
        width = max(len(k) for k in kept_rows)
        if all(_in_place(k) for k in kept_rows):
            # Every row's accepted path is already where it would be moved to (a chain, a plain
            # step, beam 0 of a tree): only the offset moves. A gather-and-write here copies the
            # whole cache buffer (it reads the buffer it writes, so MLX cannot update it in place),
            # which over a long cache costs a large share of a plain step.
            # Shorter rows' holes then hold their rejected drafts instead of a repeated kept
            # token: masked out all the same.
            self._keep_first(start, width)
            return self.offset
        padded = [[int(i) for i in k] + [int(k[-1])] * (width - len(k)) for k in kept_rows]  # holes repeat a kept token
        kept = to_device(padded, dtype=mx.int32)  # (B, width)
        for layer in self.layers:
            layer.keep_appended_rows(start, kept, width)
        return self.offset

    def _keep_first(self, start: int, count: int) -> None:
        for layer in self.layers:
            layer.offset = start + count

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only these batch rows (finished rows leave the batch)."""
        index = mx.array([int(r) for r in rows], dtype=mx.int32)
        for layer in self.layers:
            layer.select_rows(index)

    @property
    def state(self):
        return [array for layer in self.layers for array in layer.state]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def _in_place(kept) -> bool:
    """kept (relative, ascending) is 0, 1, ..., n-1: nothing to move."""
    return all(int(i) == j for j, i in enumerate(kept))
