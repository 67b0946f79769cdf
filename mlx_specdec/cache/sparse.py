"""A read-only sparse view of a contiguous cache (TriForce's retrieval cache).

The view attends to a chosen subset of the full cache's positions, chosen per KV head
(`indices`: (B, Hkv, K) positions into the base cache), plus the tokens appended through the
view itself, which live in a small buffer of the view's own. The base cache is never written,
so dropping the view leaves the full cache exactly as it was.

Positions: the view's `offset` is the base cache's true length plus the view's own tokens, so
RoPE rotates new tokens by their true positions even though fewer keys are attended.
"""

from __future__ import annotations

import mlx.core as mx

from .contiguous import ContiguousKVCache, ContiguousLayerCache


class SparseLayerView:
    def __init__(self, base: ContiguousLayerCache, indices: mx.array, base_length: int):
        self.base = base
        self.indices = indices  # (B, Hkv, K)
        self.base_length = base_length
        self.own = ContiguousLayerCache()  # tokens appended through the view

    @property
    def offset(self) -> int:
        return self.base_length + self.own.offset

    def selected(self):
        """Gather the selected keys/values: (B, Hkv, K, Dh)."""
        index = self.indices[..., None]  # (B, Hkv, K, 1)
        keys = mx.take_along_axis(self.base.keys[..., : self.base_length, :], index, axis=2)
        values = mx.take_along_axis(self.base.values[..., : self.base_length, :], index, axis=2)
        return keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        own_keys, own_values = self.own.update_and_fetch(keys, values)
        sel_keys, sel_values = self.selected()
        return (
            mx.concatenate([sel_keys, own_keys], axis=2),
            mx.concatenate([sel_values, own_values], axis=2),
        )


class SparseKVView:
    def __init__(self, base: ContiguousKVCache, indices: list[mx.array]):
        """indices[i]: (B, Hkv, K) positions of layer i's base cache to attend to."""
        if len(indices) != len(base.layers):
            raise ValueError("one index array per layer")
        length = base.offset
        for idx in indices:
            if idx.size and int(idx.max().item()) >= length:
                raise ValueError(f"index past the cache length {length}")
            if idx.size and int(idx.min().item()) < 0:
                raise ValueError("negative cache index")
        self.base = base
        self.layers = [SparseLayerView(b, idx, length) for b, idx in zip(base.layers, indices)]

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    @property
    def budget(self) -> int:
        return self.layers[0].indices.shape[-1]

    def trim(self, n: int) -> int:
        """Forget the last n tokens appended through the view (never the base's)."""
        dropped = 0
        for layer in self.layers:
            dropped = layer.own.trim(n)
        return dropped
