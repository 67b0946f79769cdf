"""Continuous batching: requests join a running batch at the next step and leave it when they
end, each a row of one ragged KV cache (ragged.py).

    decoder = ContinuousDecoder(lm, resources)
    row = decoder.join(prompt_ids, params)    # prefilled alone, then merged into the batch
    for event in decoder.step():               # one forward for every live row
        event.thread_id                        # the row it belongs to; "done" ends that row

`RowBatch` keeps what every such batch keeps per row: its request's limits (max_tokens clamped
to the window), its text and stop strings, its stats and times, and the events a step's tokens
become. `ContinuousDecoder` is plain decoding on it (`redrafter_join.py` is ReDrafter's).

Plain decoding: a joining row is prefilled alone (resuming from the engine's prefix store where
it can) and laid into the batch cache; each step writes one token per row at the shared
position, at the row's own RoPE position; rows that end leave at once (`select_rows`).

Each row keeps its own sampling settings (temperature, top-p, penalties over its own text),
max_tokens and stop strings. A greedy row writes the tokens it writes alone: its attention sees
exactly its own keys (holes weigh exactly zero). Sampled rows share the one random stream of
the process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .. import masks
from ..cache.contiguous import ContiguousKVCache
from ..model.forward import forward
from ..penalties import History, Penalties
from .base import (DecodeContext, Event, GenerationParams, GenerationStats, _ThreadText, check_context,
                   keep_prefix, make_sampler, peak_memory_mb, prefilled_cache, take_tokens)
from .ragged import cut_unused, merge_row


@dataclass
class _Row:
    ident: int
    params: GenerationParams
    limit: int  # tokens it may write (max_tokens, clamped to the window)
    text: _ThreadText
    stats: GenerationStats
    start: float = field(default_factory=time.perf_counter)
    first_at: Optional[float] = None
    last_at: Optional[float] = None
    peak_rows: int = 1  # the most rows the batch held while this one was in it
    length: int = 0  # plain decoding: tokens in its cache, its RoPE position for the pending token
    pending: int = 0  # ... the token it feeds at the next step
    sampler: object = None
    history: Optional[History] = None  # ... its penalties' state (None: every penalty off)


class RowBatch:
    """The rows of a continuous batch and the events their tokens become."""

    def __init__(self, lm, resources: Optional[Dict[str, object]], method: str):
        self.lm, self.resources, self.method = lm, resources or {}, method
        self.rows: List[_Row] = []  # in cache row order
        self._next_id = 0

    @property
    def live(self) -> int:
        return len(self.rows)

    def _open(self, prompt: Sequence[int], params: GenerationParams) -> Tuple[_Row, DecodeContext, ContiguousKVCache]:
        """A new row for `prompt` and its cache holding all but the prompt's last token (resumed
        from the prefix store where it can; handed back to it at once). Raises what a solo request
        raises for this prompt (an empty one, one past the window)."""
        prompt = list(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        limit = check_context(self.lm, prompt, params)
        stats = GenerationStats(method=self.method, prompt_tokens=len(prompt))
        ctx = DecodeContext(self.lm, prompt, params, make_sampler(params), stats, resources=self.resources)
        started = time.perf_counter()
        alone = prefilled_cache(ctx, prompt[:-1])
        mx.eval(alone.state)
        keep_prefix(ctx, alone, prompt[:-1])  # the next turn of this conversation may resume from it
        stats.prefill_s = time.perf_counter() - started
        row = _Row(self._next_id, params, limit, _ThreadText(self.lm.tokenizer, params.stop), stats, start=started)
        self._next_id += 1
        return row, ctx, alone

    def bytes_with(self, prompt_tokens: int) -> int:
        """The batch cache's bytes once a row of `prompt_tokens` joins (rows share one width)."""
        cache, valid = self._kv()
        if cache is None or not valid.shape[0] or cache.layers[0].keys is None:
            return 0
        rows, width = valid.shape
        per_slot = sum(layer.keys[:1, :, :1].nbytes + layer.values[:1, :, :1].nbytes for layer in cache.layers)
        return (rows + 1) * max(width, prompt_tokens) * per_slot

    def _kv(self):
        """(the batch cache or None, its valid (B, P))."""
        raise NotImplementedError

    def cancel(self, ident: int) -> List[Event]:
        """End a row now (its client left): its held text and its `done`, reason "cancelled"."""
        for b, row in enumerate(self.rows):
            if row.ident == ident:
                events = self._end(row, "cancelled", time.perf_counter())
                self._drop([b])
                return events
        return []

    def _emit(self, row: _Row, tokens: Sequence[int], now: float, drafted: int = 0,
              accepted: int = 0) -> Tuple[List[Event], Optional[str]]:
        """A step's tokens for one row -> its events and why it ended (None: it goes on)."""
        events = []
        row.peak_rows = max(row.peak_rows, len(self.rows))
        kept, delta, end = take_tokens(tokens, row.text, self.lm.eos_token_ids, row.limit - row.stats.generated_tokens)
        row.stats.generated_tokens += len(kept)
        row.stats.forward_passes += 1
        row.stats.drafted += drafted
        row.stats.accepted += accepted
        if kept or delta:
            row.first_at = row.first_at or now
            row.last_at = now
            events.append(Event("token", row.ident, None, kept, delta, drafted, accepted, now - row.start))
        reason = "stop" if end else ("length" if row.stats.generated_tokens >= row.limit else None)
        if reason is not None:
            events.extend(self._end(row, reason, now))
        return events, reason

    def _end(self, row: _Row, reason: str, now: float) -> List[Event]:
        events = []
        tail = row.text.flush()
        if tail:
            events.append(Event("token", row.ident, None, [], tail, elapsed_s=now - row.start))
        stats = row.stats
        stats.finish_reason = reason
        stats.ttft_s = (row.first_at or now) - row.start
        stats.decode_s = (row.last_at - row.first_at) if row.first_at else 0.0
        stats.extra.update(self._row_extra(), batch_rows=row.peak_rows)
        stats.peak_memory_mb = peak_memory_mb()
        events.append(Event("done", row.ident, elapsed_s=now - row.start, stats=stats))
        return events

    def _row_extra(self) -> dict:
        """The method's own figures a row's stats carry when it ends."""
        return {}

    def _drop(self, ended: Sequence[int]) -> None:
        raise NotImplementedError


class ContinuousDecoder(RowBatch):
    def __init__(self, lm, resources: Optional[Dict[str, object]] = None, method: str = "ar"):
        super().__init__(lm, resources, method)
        self.cache: Optional[ContiguousKVCache] = None
        self.valid = np.zeros((0, 0), dtype=bool)  # (B, P): which slots hold each row's tokens

    def _kv(self):
        return self.cache, self.valid

    def join(self, prompt: Sequence[int], params: GenerationParams) -> int:
        """Prefill `prompt` alone and add it as a row; its first token comes at the next step."""
        row, ctx, alone = self._open(prompt, params)
        prompt = ctx.prompt
        self.cache, self.valid = merge_row(self.cache, self.valid, alone, len(prompt) - 1)
        pen = Penalties.of(params)
        row.length, row.pending, row.sampler = len(prompt) - 1, prompt[-1], ctx.sampler
        row.history = None if pen is None else History(pen, prompt)
        self.rows.append(row)
        return row.ident

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
        for b, (row, token) in enumerate(zip(self.rows, values)):
            row.length += 1
            row.pending = token
            row_events, reason = self._emit(row, [token], now)
            events.extend(row_events)
            if reason is not None:
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
        self.valid = cut_unused(self.cache, self.valid)

