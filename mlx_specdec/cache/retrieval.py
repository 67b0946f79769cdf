"""TriForce's retrieval cache: a small contiguous KV buffer of the prompt's most relevant chunks.

Built once from the full cache (and rebuilt when the caller decides): the prompt's keys are cut
into chunks of `CHUNK` tokens; each chunk is scored per KV head by the last prompt token's
post-RoPE query against the chunk's mean key (the G query heads of a KV group reduced by their
mean or max: SmolLM2 has 3 query heads per KV head, the reference code only handles G = 1);
chunk 0 (the attention sink) is always kept, then the best-scoring chunks up to the budget, and
the prompt's last `len % CHUNK` tokens (the unfinished chunk, the most recent text) always.
Their keys and values are copied once into the cache's own buffer, per layer and KV head:
decoding over it reads `budget` keys, not a gather over the full cache every step.

Tokens decoded through it are appended after the retrieved ones; `trim` forgets them again,
never the retrieved part. Keys are stored after RoPE, so a retrieved token keeps its true
position, and `offset` is the true length (prompt + own tokens): RoPE rotates new tokens by
their true positions although fewer keys are attended. A forward with several new tokens and no
mask gets "causal", which the engine's attention aligns to the last keys (its tail-mask rule),
so every new token sees every retrieved one and its own predecessors.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import numpy as np

from .contiguous import ContiguousKVCache, LayeredCache

CHUNK = 8


class RetrievalLayerCache:
    def __init__(self, keys: mx.array, values: mx.array, prompt_length: int):
        self.retrieved = keys.shape[2]  # (B, Hkv, budget, Dh) copied from the full cache
        self.prompt_length = prompt_length
        self.keys, self.values = keys, values
        self.own = 0  # tokens appended through this cache

    @property
    def offset(self) -> int:
        return self.prompt_length + self.own

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        end = self.retrieved + self.own + keys.shape[2]
        if end > self.keys.shape[2]:
            grow = ((end - self.keys.shape[2] + 63) // 64) * 64
            pad = (*self.keys.shape[:2], grow)
            self.keys = mx.concatenate([self.keys, mx.zeros(pad + (self.keys.shape[3],), self.keys.dtype)], axis=2)
            self.values = mx.concatenate([self.values, mx.zeros(pad + (self.values.shape[3],), self.values.dtype)], axis=2)
        start = self.retrieved + self.own
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.own += keys.shape[2]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def trim(self, n: int) -> int:
        n = max(0, min(self.own, n))
        self.own -= n
        return n


class QueryRecorder:
    """Wraps a full cache for one forward and keeps every layer's post-RoPE queries (the forward
    hands them to a layer cache that has `observe_queries`)."""

    class _Layer:
        def __init__(self, inner):
            self.inner, self.queries = inner, None

        @property
        def offset(self) -> int:
            return self.inner.offset

        def observe_queries(self, queries: mx.array) -> None:
            self.queries = queries  # (B, Hq, L, Dh)

        def update_and_fetch(self, keys, values):
            return self.inner.update_and_fetch(keys, values)

    def __init__(self, cache: ContiguousKVCache):
        self.cache = cache
        self.layers = [self._Layer(layer) for layer in cache.layers]

    @property
    def offset(self) -> int:
        return self.cache.offset

    def queries(self) -> List[mx.array]:
        return [layer.queries for layer in self.layers]


def chunk_scores(query: mx.array, keys: mx.array, reduce: str = "mean") -> mx.array:
    """query (B, Hq, Dh) or (B, Hq, K, Dh): post-RoPE queries of the last prompt token (or of the
    last K); keys (B, Hkv, n*CHUNK, Dh). Returns (B, Hkv, n): each chunk's mean key against the
    query heads of its KV group (and the K tokens), reduced by their mean or max (no 1/sqrt(d)
    or softmax: only the order matters)."""
    if query.ndim == 3:
        query = query[:, :, None]
    B, Hq, K, Dh = query.shape
    Hkv = keys.shape[1]
    means = keys.reshape(B, Hkv, -1, CHUNK, Dh).astype(mx.float32).mean(axis=3)  # (B, Hkv, n, Dh)
    grouped = query.astype(mx.float32).reshape(B, Hkv, (Hq // Hkv) * K, Dh)  # heads j*G + g share KV head j
    scores = grouped @ means.swapaxes(-1, -2)  # (B, Hkv, G*K, n)
    if reduce == "max":
        return scores.max(axis=2)
    if reduce == "mean":
        return scores.mean(axis=2)
    raise ValueError(f"reduce is mean or max, not {reduce!r}")


def choose_positions(query: mx.array, keys: mx.array, budget: int, reduce: str = "mean") -> np.ndarray:
    """(B, Hkv, budget) ascending positions of the prompt's keys (B, Hkv, S, Dh) to keep: chunk 0,
    the best chunks, and the unfinished last chunk. The host reads the scores once (a build)."""
    S = keys.shape[2]
    tail = S % CHUNK
    chunks = S // CHUNK
    picks = (budget - tail) // CHUNK
    if budget >= S or picks >= chunks:
        return np.broadcast_to(np.arange(S), keys.shape[:2] + (S,)).copy()
    if picks < 1:
        raise ValueError(f"a budget of {budget} holds no chunk of {CHUNK} beside the last {tail} tokens")
    scores = np.array(chunk_scores(query, keys[:, :, : chunks * CHUNK], reduce))  # host sync: the build
    scores[..., 0] = np.inf  # the sink is always kept
    best = np.argsort(-scores, axis=-1, kind="stable")[..., :picks]  # (B, Hkv, picks)
    best.sort(axis=-1)
    positions = (best[..., :, None] * CHUNK + np.arange(CHUNK)).reshape(best.shape[:2] + (picks * CHUNK,))
    recent = np.broadcast_to(np.arange(chunks * CHUNK, S), best.shape[:2] + (tail,))
    return np.concatenate([positions, recent], axis=-1).astype(np.int32)


def streaming_positions(heads: tuple, S: int, budget: int) -> np.ndarray:
    """(B, Hkv, budget) positions StreamingLLM would keep of S: the first chunk (the sink) and
    the most recent budget - CHUNK."""
    if budget >= S:
        kept = np.arange(S)
    else:
        kept = np.concatenate([np.arange(min(CHUNK, budget)), np.arange(S - (budget - min(CHUNK, budget)), S)])
    return np.broadcast_to(kept, tuple(heads) + (len(kept),)).astype(np.int32).copy()


class RetrievalKVCache(LayeredCache):
    def __init__(self, layers: List[RetrievalLayerCache], positions: List[np.ndarray]):
        self.layers = layers
        self.positions = positions  # per layer (B, Hkv, budget): which prompt positions were kept

    @classmethod
    def build(cls, full: ContiguousKVCache, queries: List[mx.array], budget: int,
              reduce: str = "mean", prompt_length: Optional[int] = None, query_index=-1,
              policy: str = "retrieval") -> "RetrievalKVCache":
        """full: the cache of the prompt (and of the tokens generated since, when rebuilding);
        queries[i]: layer i's post-RoPE queries, (B, Hq, L, Dh), of which `query_index` (an
        index, or a slice of several tokens whose scores are averaged) scores.
        Chunks are chosen among the first `prompt_length` positions (default: all); every later
        one (the generated text) is kept after them. policy "streaming" keeps the sink and the
        most recent prompt positions instead (StreamingLLM's choice, for comparison)."""
        S = full.offset
        P = S if prompt_length is None else prompt_length
        layers, kept = [], []
        for layer, query in zip(full.layers, queries):
            keys, values = layer.keys[..., :P, :], layer.values[..., :P, :]
            if policy == "retrieval":
                positions = choose_positions(query[:, :, query_index], keys, budget, reduce)
            elif policy == "streaming":
                positions = streaming_positions(keys.shape[:2], P, budget)
            else:
                raise ValueError(f"policy is retrieval or streaming, not {policy!r}")
            index = mx.array(positions)[..., None]  # (B, Hkv, budget, 1)
            cache = RetrievalLayerCache(mx.take_along_axis(keys, index, axis=2),
                                        mx.take_along_axis(values, index, axis=2), P)
            if S > P:  # the text generated since the prompt: kept whole, in order
                cache.update_and_fetch(layer.keys[..., P:S, :], layer.values[..., P:S, :])
            layers.append(cache)
            kept.append(positions)
        mx.eval([(layer.keys, layer.values) for layer in layers])
        return cls(layers, kept)

    @property
    def budget(self) -> int:
        return self.layers[0].retrieved

    @property
    def state(self):
        return [(layer.keys, layer.values) for layer in self.layers]


def attention_recall(queries: List[mx.array], full: ContiguousKVCache, positions: List[np.ndarray],
                     scale: Optional[float] = None) -> float:
    """The share of the last prompt token's attention (softmax over every prompt key, all query
    heads, averaged over layers) that falls on the kept positions: how much a budget sees."""
    S = full.offset
    shares = []
    for query, layer, kept in zip(queries, full.layers, positions):
        q = query[:, :, -1].astype(mx.float32)  # (B, Hq, Dh)
        B, Hq, Dh = q.shape
        keys = layer.keys[..., :S, :].astype(mx.float32)
        Hkv = keys.shape[1]
        logits = q.reshape(B, Hkv, Hq // Hkv, Dh) @ keys.swapaxes(-1, -2) * (scale or Dh ** -0.5)  # (B, Hkv, G, S)
        probs = np.array(mx.softmax(logits, axis=-1))
        mask = np.zeros((B, Hkv, 1, S), dtype=bool)
        np.put_along_axis(mask, kept[:, :, None, :], True, axis=-1)
        shares.append(float((probs * mask).sum(-1).mean()))
    return float(np.mean(shares))
