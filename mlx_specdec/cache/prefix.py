"""Prefix reuse between requests: keep one conversation's KV cache and resume from the longest
common token prefix (as mlx_lm.server, LM Studio and Ollama do).

A chat's follow-up repeats every earlier message, an attached document first: without reuse each
turn prefills the whole document again. The store holds one cache (the last request's) with the
tokens it holds; `take` hands it to the next request cut back to the longest prefix it shares
with that request's prompt (a changed earlier message cuts it back to the change), and `put`
returns it after the request with only the prompt kept (the answer's tokens are re-fed as part
of the next prompt: strategies leave speculative leftovers after the prompt, never inside it).

Memory: one cache, so at most one context window of KV (SmolLM2-135M, float32, 8K tokens:
30 layers x 2 x 3 KV heads x 64 x 8192 x 4 B = 377 MB); `clear()` frees it. The store is taken
exclusively: a second request while one runs gets a fresh cache and leaves the stored one alone.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence, Tuple

from .contiguous import ContiguousKVCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixStore:
    def __init__(self):
        self._lock = threading.Lock()
        self._owner: Optional[int] = None  # id() of the model the cache belongs to
        self._tokens: list = []
        self._cache: Optional[ContiguousKVCache] = None

    def take(self, model, tokens: Sequence[int]) -> Tuple[ContiguousKVCache, int]:
        """A cache for `tokens` (what the caller will prefill) and how many of them it already
        holds. The store is empty until `put`."""
        with self._lock:
            cache, held, owner = self._cache, self._tokens, self._owner
            self._cache, self._tokens, self._owner = None, [], None
        if cache is None or owner != id(model):
            return ContiguousKVCache.for_model(model), 0
        reused = common_prefix(held, tokens)
        cache.trim(cache.offset - reused)
        return cache, reused

    def put(self, model, tokens: Sequence[int], cache: ContiguousKVCache) -> None:
        """Keep `cache`, holding `tokens` first (anything after them is dropped)."""
        if cache.offset < len(tokens):
            return  # stopped before its prefill finished: nothing safe to keep
        cache.trim(cache.offset - len(tokens))
        with self._lock:
            self._cache, self._tokens, self._owner = cache, list(tokens), id(model)

    def clear(self) -> None:
        with self._lock:
            self._cache, self._tokens, self._owner = None, [], None

    @property
    def held_tokens(self) -> int:
        return len(self._tokens)
