"""StreamingLLM's cache (Xiao et al. 2023): the first `sink` tokens and a recent window, nothing else.

TriForce's bottom level runs a small draft model over this cache so that its cost per token
stays flat however long the document is. Keys are stored after RoPE at their true positions (as
mlx-lm's `RotatingKVCache` does: the model applies RoPE before caching), so `offset` is the true
length of the text and evicting a key does not move the others.

Appends go after the window; `trim(n)` forgets the last n tokens (speculative ones: they are
always the most recent). Eviction is explicit (`evict`, which the owner calls between rounds),
never inside `update_and_fetch`: a verify can then still trim everything it appended. Attention
over the kept keys with the "causal" mask aligns the new tokens to the last keys (the engine's
tail-mask rule), so each sees the sink, the window and its own predecessors.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import mlx.nn as nn

from .contiguous import LayeredCache

GROW_STEP = 64


class StreamingLayerCache:
    def __init__(self, sink: int, window: int):
        self.sink, self.window = sink, window
        self.keys: mx.array | None = None  # (B, Hkv, capacity, Dh): sink, window, then appended
        self.values: mx.array | None = None
        self.stored = 0  # keys held
        self.offset = 0  # true length of the text (the next token's position)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        end = self.stored + n
        if self.keys is None or end > self.keys.shape[2]:
            capacity = ((end + GROW_STEP - 1) // GROW_STEP) * GROW_STEP
            shape = (*keys.shape[:2], capacity)
            grown_keys = mx.zeros(shape + (keys.shape[3],), keys.dtype)
            grown_values = mx.zeros(shape + (values.shape[3],), values.dtype)
            if self.stored:
                grown_keys[..., : self.stored, :] = self.keys[..., : self.stored, :]
                grown_values[..., : self.stored, :] = self.values[..., : self.stored, :]
            self.keys, self.values = grown_keys, grown_values
        self.keys[..., self.stored : end, :] = keys
        self.values[..., self.stored : end, :] = values
        self.stored, self.offset = end, self.offset + n
        return self.keys[..., :end, :], self.values[..., :end, :]

    def trim(self, n: int) -> int:
        """Forget the last n tokens, at most back to the sink and the start of the window."""
        n = max(0, min(n, self.stored - min(self.sink, self.stored)))
        self.stored -= n
        self.offset -= n
        return n

    def evict(self) -> int:
        """Drop the oldest keys after the sink so that at most sink + window remain."""
        extra = self.stored - (self.sink + self.window)
        if extra <= 0:
            return 0
        start = self.sink + extra  # the first kept window key
        kept = self.stored - start
        self.keys[..., self.sink : self.sink + kept, :] = self.keys[..., start : self.stored, :]
        self.values[..., self.sink : self.sink + kept, :] = self.values[..., start : self.stored, :]
        self.stored = self.sink + kept
        return extra

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys[..., : self.stored, :], self.values[..., : self.stored, :]]


class StreamingKVCache(LayeredCache):
    def __init__(self, num_layers: int, sink: int = 16, window: int = 240):
        if sink < 0 or window < 1:
            raise ValueError("a streaming cache needs sink >= 0 and window >= 1")
        self.layers: List[StreamingLayerCache] = [StreamingLayerCache(sink, window) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model: nn.Module, sink: int = 16, window: int = 240) -> "StreamingKVCache":
        return cls(len(model.model.layers), sink, window)

    @property
    def stored(self) -> int:
        return self.layers[0].stored

    def evict(self) -> int:
        dropped = 0
        for layer in self.layers:
            dropped = layer.evict()
        return dropped

    @property
    def state(self):
        return [array for layer in self.layers for array in layer.state]
