"""Continuous batching for plain decoding: requests join a running batch at the next step and
leave it when they end, each a row of one ragged KV cache.

    decoder = ContinuousDecoder(lm, resources)
    row = decoder.join(prompt_ids, params)    # prefilled alone, then merged into the batch
    for event in decoder.step():               # one forward for every live row
        event.thread_id                        # the row it belongs to; "done" ends that row

A joining row is prefilled alone (resuming from the engine's prefix store where it can), then its
keys are laid into the batch cache left-padded: each row's tokens are the last `length` slots
before the shared write position, the slots before them holes that the mask hides. A row longer
than the batch so far pushes every other row right by the difference (holes in front of them).
Each step writes one token per row at the shared position, at the row's own RoPE position; rows
that end leave at once (`select_rows`), and leading slots that no row uses any more are cut off.

Each row keeps its own sampling settings (temperature, top-p, penalties over its own text),
max_tokens and stop strings. A
greedy row writes the tokens it writes alone: its attention sees exactly its own keys (holes
weigh exactly zero). Sampled rows share the one random stream of the process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .. import masks
from ..cache.contiguous import ContiguousKVCache
from ..model.forward import forward
from ..penalties import History, Penalties
from .base import (DecodeContext, Event, GenerationParams, GenerationStats, _ThreadText, check_context,
                   keep_prefix, make_sampler, peak_memory_mb, prefilled_cache, take_tokens)

COMPACT_MIN = 64  # cut leading unused slots once there are at least this many


@dataclass
class _Row:
    ident: int
    params: GenerationParams
    limit: int  # tokens it may still write (max_tokens, clamped to the window)
    length: int  # tokens in its cache: its RoPE position for the pending token
    pending: int  # the token it feeds at the next step
    text: _ThreadText
    stats: GenerationStats
    sampler: object
    history: Optional[History]  # its penalties' state (None: every penalty off)
    start: float = field(default_factory=time.perf_counter)
    first_at: Optional[float] = None
    last_at: Optional[float] = None


class ContinuousDecoder:
    def __init__(self, lm, resources: Optional[Dict[str, object]] = None, method: str = "ar"):
        self.lm, self.resources, self.method = lm, resources or {}, method
        self.rows: List[_Row] = []  # in cache row order
        self.cache: Optional[ContiguousKVCache] = None
        self.valid = np.zeros((0, 0), dtype=bool)  # (B, P): which slots hold each row's tokens
        self._next_id = 0

    @property
    def live(self) -> int:
        return len(self.rows)

    def join(self, prompt: Sequence[int], params: GenerationParams) -> int:
        """Prefill `prompt` alone and add it as a row; its first token comes at the next step.
        Raises what a solo request raises for this prompt (a prompt past the window)."""
        prompt = list(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        limit = check_context(self.lm, prompt, params)
        stats = GenerationStats(method=self.method, prompt_tokens=len(prompt))
        ctx = DecodeContext(self.lm, prompt, params, make_sampler(params), stats, resources=self.resources)
        started = time.perf_counter()
        alone = prefilled_cache(ctx, prompt[:-1])
        mx.eval(alone.state)
        self._merge(alone, len(prompt) - 1)
        keep_prefix(ctx, alone, prompt[:-1])  # the next turn of this conversation may resume from it
        stats.prefill_s = time.perf_counter() - started
        pen = Penalties.of(params)
        row = _Row(self._next_id, params, limit, len(prompt) - 1, prompt[-1],
                   _ThreadText(self.lm.tokenizer, params.stop), stats, ctx.sampler,
                   None if pen is None else History(pen, prompt), start=started)
        self._next_id += 1
        self.rows.append(row)
        return row.ident

    def cancel(self, ident: int) -> List[Event]:
        """End a row now (its client left): its held text and its `done`, reason "cancelled"."""
        for b, row in enumerate(self.rows):
            if row.ident == ident:
                events = self._end(row, "cancelled", time.perf_counter())
                self._drop([b])
                return events
        return []

    def step(self) -> List[Event]:
        """One forward for every row: each row's next token (and text), and a `done` for each row
        that ended (EOS, a stop string, its max_tokens)."""
        if not self.rows:
            return []
        B, P = self.valid.shape
        tokens = mx.array([[row.pending] for row in self.rows])
        lengths = np.array([row.length for row in self.rows])
        positions = masks.ragged_tree_positions(lengths, [[-1]] * B, 1)
        mask = masks.ragged_tree_mask(self.valid, [[-1]] * B, 1)
        logits = forward(self.lm.model, tokens, self.cache, positions=positions, mask=mask,
                         logits_for="last").logits[:, -1, :]  # (B, V)
        chosen = mx.concatenate([self._choose(row, logits[b : b + 1]) for b, row in enumerate(self.rows)])
        values = chosen.tolist()  # host sync: one per step for every row
        self.valid = np.concatenate([self.valid, np.ones((B, 1), dtype=bool)], axis=1)
        now = time.perf_counter()
        events, ended = [], []
        eos = self.lm.eos_token_ids
        for b, (row, token) in enumerate(zip(self.rows, values)):
            row.length += 1
            row.pending = token
            row.stats.forward_passes += 1
            kept, delta, end = take_tokens([token], row.text, eos, row.limit - row.stats.generated_tokens)
            row.stats.generated_tokens += len(kept)
            if kept or delta:
                row.first_at = row.first_at or now
                row.last_at = now
                events.append(Event("token", row.ident, None, kept, delta, elapsed_s=now - row.start))
            reason = "stop" if end else ("length" if row.stats.generated_tokens >= row.limit else None)
            if reason is not None:
                events.extend(self._end(row, reason, now))
                ended.append(b)
        self._drop(ended)
        return events

    def _choose(self, row: _Row, logits: mx.array) -> mx.array:  # (1, V) -> (1,)
        if row.history is not None:
            logits = row.history(logits)
        if row.params.greedy:
            chosen = mx.argmax(logits, axis=-1)
        else:
            chosen = row.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        if row.history is not None:
            row.history.add(chosen)
        return chosen

    def _end(self, row: _Row, reason: str, now: float) -> List[Event]:
        events = []
        tail = row.text.flush()
        if tail:
            events.append(Event("token", row.ident, None, [], tail, elapsed_s=now - row.start))
        stats = row.stats
        stats.finish_reason = reason
        stats.ttft_s = (row.first_at or now) - row.start
        stats.decode_s = (row.last_at - row.first_at) if row.first_at else 0.0
        stats.extra["batch_rows"] = len(self.rows)
        stats.peak_memory_mb = peak_memory_mb()
        events.append(Event("done", row.ident, elapsed_s=now - row.start, stats=stats))
        return events

    def _merge(self, alone: ContiguousKVCache, length: int) -> None:
        """Lay a one-row cache of `length` tokens into the batch, left-padded."""
        if self.cache is None or not self.rows:
            self.cache, self.valid = alone_copy(alone, length), np.ones((1, length), dtype=bool)
            return
        B, P = self.valid.shape
        width = max(P, length)
        for mine, theirs in zip(self.cache.layers, alone.layers):
            like = mine.keys if mine.keys is not None else theirs.keys
            if like is None:  # neither side holds a token yet: only the offset moves
                mine.offset = width
                continue
            keys = _slots(mine.keys, B, P, like, width)
            values = _slots(mine.values, B, P, mine.values if mine.values is not None else theirs.values, width)
            mine.keys = mx.concatenate([keys, _slots(theirs.keys, 1, length, like, width)], axis=0)
            mine.values = mx.concatenate([values, _slots(theirs.values, 1, length, values, width)], axis=0)
            mine.offset = width
        valid = np.zeros((B + 1, width), dtype=bool)
        valid[:B, width - P:] = self.valid
        valid[B, width - length:] = True
        self.valid = valid
        mx.eval(self.cache.state)

    def _drop(self, ended: Sequence[int]) -> None:
        """Rows that ended leave the cache; leading slots no row uses any more are cut off."""
        if ended:
            keep = [b for b in range(len(self.rows)) if b not in set(ended)]
            self.rows = [self.rows[b] for b in keep]
            if not keep:
                self.cache, self.valid = None, np.zeros((0, 0), dtype=bool)
                return
            self.cache.select_rows(keep)
            self.valid = self.valid[keep]
        unused = int(np.argmax(self.valid.any(axis=0)))  # leading slots no row uses
        if unused >= COMPACT_MIN:
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., unused: layer.offset, :]
                layer.values = layer.values[..., unused: layer.offset, :]
                layer.offset -= unused
            self.valid = self.valid[:, unused:]


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
