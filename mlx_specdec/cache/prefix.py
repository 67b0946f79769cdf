"""Prefix reuse between requests: keep several conversations' KV caches and resume each request
from the one sharing the longest token prefix with its prompt (as mlx_lm.server, LM Studio and
Ollama do).

A chat's follow-up repeats every earlier message, an attached document first: without reuse each
turn prefills the whole document again. A server talks to several clients at once, so the store
keeps one entry per conversation, least recently used first out:

- `take(model, tokens)` picks the entry sharing the longest prefix with `tokens` (ties: the most
  recent). If the whole entry is a prefix of `tokens` (the same conversation, one turn on), the
  entry itself is handed over and leaves the store. If only part of it is (another conversation
  with the same system prompt, or an earlier message changed), that part is copied into a new
  cache and the entry stays for its own conversation.
- `put(model, tokens, cache)` stores the cache back as the most recent entry with only `tokens`
  kept (the answer's tokens are re-fed as part of the next prompt: strategies leave speculative
  leftovers after the prompt, never inside it), drops entries it makes redundant (their tokens a
  prefix of its), then evicts the least recent until the store is within `max_entries` and
  `max_bytes`.

Bytes are the entries' KV buffers as allocated (`cache_nbytes`): the kept tokens, rounded up to
the cache's growth step, plus at most a quarter of that unused (a buffer with more slack is copied
down when stored). An entry over the whole bound is not kept. Thread-safe: a taken entry is out of the store until it is put back, so a
concurrent request never shares it (it gets the next best entry, or a fresh cache).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .contiguous import GROW_STEP, ContiguousKVCache

DEFAULT_MAX_ENTRIES = 10  # mlx_lm.server's default prompt cache size


def machine_memory() -> int:
    """This machine's memory in bytes (16 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 16 << 30


def default_max_bytes() -> int:
    """2 GiB, or an eighth of this machine's memory where that is less."""
    return min(2 << 30, machine_memory() // 8)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def cache_nbytes(cache: ContiguousKVCache) -> int:
    """The bytes a cache's KV buffers hold (allocated slots, not only the used ones)."""
    return sum(x.nbytes for layer in cache.layers for x in (layer.keys, layer.values) if x is not None)


@dataclass(eq=False)  # entries are removed by identity (their tokens are arrays)
class _Entry:
    owner: int  # id() of the model the cache belongs to
    tokens: np.ndarray
    cache: ContiguousKVCache
    nbytes: int


class PrefixStore:
    def __init__(self, max_bytes: Optional[int] = None, max_entries: int = DEFAULT_MAX_ENTRIES):
        """max_bytes: the KV bytes all entries together may hold (default: `default_max_bytes()`);
        max_entries: how many conversations it keeps."""
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: List[_Entry] = []  # least recent first
        self._nbytes = 0

    def take(self, model, tokens: Sequence[int]) -> Tuple[ContiguousKVCache, int]:
        """A cache for `tokens` (what the caller will prefill) and how many of them it already
        holds: the entry sharing the longest prefix, cut back to it, or a fresh cache."""
        tokens = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            best, reused = None, 0
            for entry in reversed(self._entries):  # most recent first: it wins ties
                if entry.owner == id(model):
                    n = common_prefix(entry.tokens, tokens)
                    if n > reused:
                        best, reused = entry, n
            if best is None:
                return ContiguousKVCache.for_model(model), 0
            if reused == len(best.tokens):  # all of it: the conversation goes on with this cache
                self._remove(best)
                return best.cache, reused
            return _copy_prefix(best.cache, reused), reused  # part: the entry stays for its own

    def put(self, model, tokens: Sequence[int], cache: ContiguousKVCache) -> None:
        """Keep `cache`, holding `tokens` first (anything after them is dropped), as the most
        recent entry."""
        if not len(tokens) or cache.offset < len(tokens):
            return  # nothing to keep, or stopped before its prefill finished: nothing safe to keep
        cache.trim(cache.offset - len(tokens))
        _shrink(cache)
        tokens = np.asarray(tokens, dtype=np.int64)
        entry = _Entry(id(model), tokens, cache, cache_nbytes(cache))
        with self._lock:
            for other in list(self._entries):
                if other.owner != entry.owner:
                    continue
                n = common_prefix(other.tokens, tokens)
                if n == len(tokens):  # an entry already holds all of these: it is the one kept
                    self._remove(other)
                    self._append(other)
                    return
                if n == len(other.tokens):  # this entry holds all of that one's
                    self._remove(other)
            self._append(entry)
            while self._entries and (len(self._entries) > self.max_entries or self._nbytes > self.max_bytes):
                self._remove(self._entries[0])

    def _append(self, entry: _Entry) -> None:
        self._entries.append(entry)
        self._nbytes += entry.nbytes

    def _remove(self, entry: _Entry) -> None:
        self._entries.remove(entry)
        self._nbytes -= entry.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries, self._nbytes = [], 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def held_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in list(self._entries))


def _own(x: mx.array, n: int, slots: int) -> mx.array:
    """x's first n positions (axis 2) in a buffer of its own with `slots` positions."""
    out = mx.zeros(x.shape[:2] + (slots,) + x.shape[3:], x.dtype)
    out[..., :n, :] = x[..., :n, :]
    return out


def _slots_for(n: int) -> int:
    return max(GROW_STEP, -(-n // GROW_STEP) * GROW_STEP)


def _copy_prefix(cache: ContiguousKVCache, n: int) -> ContiguousKVCache:
    """A new cache holding a copy of `cache`'s first n tokens."""
    copy = ContiguousKVCache(len(cache.layers))
    for mine, theirs in zip(copy.layers, cache.layers):
        if theirs.keys is not None:
            slots = _slots_for(n)
            mine.keys, mine.values = _own(theirs.keys, n, slots), _own(theirs.values, n, slots)
        mine.offset = n
    mx.eval([x for layer in copy.layers for x in (layer.keys, layer.values) if x is not None])
    return copy


def _shrink(cache: ContiguousKVCache) -> None:
    """Copy buffers down to what the kept tokens need where over a quarter of it would be unused
    (a long answer after a short prompt); a little slack is cheaper to keep than to copy away."""
    for layer in cache.layers:
        slots = _slots_for(layer.offset)
        if layer.keys is not None and layer.capacity - slots > slots // 4:
            layer.keys, layer.values = _own(layer.keys, layer.offset, slots), _own(layer.values, layer.offset, slots)
    mx.eval([x for layer in cache.layers for x in (layer.keys, layer.values) if x is not None])
