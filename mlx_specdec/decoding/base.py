"""What every decoding strategy shares: parameters, the event stream, prefill, the driver.

A strategy is a generator function `strategy(ctx) -> Iterator[Step]` that yields the tokens it
commits, thread by thread, and keeps its cache consistent in `finally` (the driver may close it
at any token). The driver (`stream_events`) turns steps into `Event`s: detokenises per thread,
applies stop strings / EOS / max tokens, times everything and closes with a `done` event.
The CLI, the bench and the chat consume only `Event`s.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .. import masks
from ..acceptance import sample_token
from ..cache import ContiguousKVCache
from ..errors import ContextOverflow
from ..model.forward import forward
from ..model.loader import LoadedModel


@dataclass
class GenerationParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    prefill_chunk: int = 512
    options: Dict[str, object] = field(default_factory=dict)  # method-specific settings
    # repetition penalties on the logits (penalties.py): OpenAI's two and mlx-lm's; these values = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20  # the tokens the repetition penalty looks back over
    # the chat template's thinking switch (Qwen3's enable_thinking); None: the template's default.
    # It shapes the prompt only (`Engine.generate`, `Engine.chat`, the server's encoding).
    thinking: Optional[bool] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Step:
    """Tokens a strategy commits to one thread in one decoding step."""

    tokens: List[int]
    thread_id: int = 0
    parent_id: Optional[int] = None
    drafted: int = 0  # draft tokens proposed for this step
    accepted: int = 0  # of those, accepted by the target model
    kind: str = "token"  # "token" | "thread_start" | "thread_end"


@dataclass
class GenerationStats:
    method: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens resumed from the prefix store, not prefilled again
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0  # first token -> last token
    forward_passes: int = 0  # target-model forwards from the last prompt token on
    drafted: int = 0
    accepted: int = 0
    peak_memory_mb: float = 0.0
    finish_reason: str = "length"
    extra: Dict[str, object] = field(default_factory=dict)  # method-specific figures

    @property
    def prefill_tps(self) -> float:
        prefilled = self.prompt_tokens - self.cached_tokens
        return prefilled / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens(self) -> int:
        return max(self.generated_tokens - 1, 0)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.forward_passes if self.forward_passes else 0.0

    def summary(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        line = (
            f"[{self.method}] prompt {self.prompt_tokens} tok{cached}, prefill {self.prefill_tps:.1f} tok/s | "
            f"{self.generated_tokens} tok, decode {self.decode_tps:.1f} tok/s, "
            f"{self.tokens_per_forward:.2f} tok/forward | TTFT {self.ttft_s * 1000:.0f} ms | "
            f"peak {self.peak_memory_mb:.0f} MB | {self.finish_reason}"
        )
        if self.drafted:
            line += f" | accepted {self.accepted}/{self.drafted} drafted"
        extra = self.extra
        if "speedup_vs_plain" in extra:  # plain decoding here, same sampling, about this context
            line += f" | x{extra['speedup_vs_plain']:.2f} vs plain {extra['plain_tps']:.1f} tok/s"
        if "acceptance_per_position" in extra:
            line += f" | acceptance by position {extra['acceptance_per_position']}"
        if "compression" in extra:
            line += (f" | tree {extra['tree_tokens_after_dedup']}/{extra['tree_tokens_before_dedup']} "
                     f"tokens after dedup")
        if "threads" in extra:  # apar: vs the same answer flattened and decoded sequentially
            line += (f" | {extra['threads']} threads, {extra['decode_steps']} steps vs {extra['flat_decode_steps']}"
                     f" | max cached {extra['max_cached_tokens']} vs {extra['flat_max_cached_tokens']}"
                     f" | attended {extra['attended_tokens_mean']} vs {extra['flat_attended_tokens_mean']} (flat)")
        if "syncs_per_step" in extra:
            line += (f" | per step {extra['syncs_per_step']:g} reads, {extra['host_arrays_per_step']:g} host arrays"
                     f", {extra['host_idle_ms_per_step']:.1f} ms device idle; {extra['verify_shapes']} verify shapes")
        timed = [k for k in ("draft_s", "pack_s", "verify_s", "accept_s", "sync_s") if k in extra]
        if timed and extra.get("steps"):
            line += " | ms/step " + " ".join(f"{k[:-2]} {1000 * extra[k] / extra['steps']:.1f}" for k in timed)
        return line


@dataclass
class Event:
    kind: str  # "token" | "thread_start" | "thread_end" | "done"
    thread_id: int = 0
    parent_id: Optional[int] = None
    tokens: List[int] = field(default_factory=list)
    text: str = ""  # text delta of this thread
    drafted: int = 0
    accepted: int = 0
    elapsed_s: float = 0.0
    stats: Optional[GenerationStats] = None
    #: on the first event of an `auto` answer: what was chosen and why, {"chose": ..., "why": ...}
    chosen: Optional[dict] = None
    #: on the first event of an answer decoded alone: plain decoding's tok/s here at the context
    #: the answer is expected to average, in its sampling mode (None where not measured)
    plain_tps: Optional[float] = None


@dataclass
class DecodeContext:
    """Everything a strategy needs; strategies report counts back through it."""

    lm: LoadedModel
    prompt: List[int]
    params: GenerationParams
    sampler: Callable[[mx.array], mx.array]
    stats: GenerationStats
    prefill_done_at: float = 0.0
    resources: Dict[str, object] = field(default_factory=dict)  # e.g. {"drafter": DrafterHead}
    prompts: List[List[int]] = field(default_factory=list)  # a batch: one prompt per row (thread)
    stopped_rows: set = field(default_factory=set)  # a batch's rows whose request has ended (batch.py)


def make_sampler(params: GenerationParams) -> Callable[[mx.array], mx.array]:
    """log-probs -> token: argmax when greedy, else a draw from `acceptance.sampling_logits`, the
    one target distribution every speculative method accepts against (mlx-lm's sampler's rule)."""
    if params.greedy:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    temperature, top_p = params.temperature, params.top_p
    return lambda logprobs: sample_token(logprobs, temperature, top_p)


def prefill(ctx: DecodeContext, cache, tokens: Sequence[int]) -> None:
    """Run tokens through the model in chunks (all but the caller's last token), filling cache."""
    model = ctx.lm.model
    chunk = max(1, ctx.params.prefill_chunk)
    for start in range(0, len(tokens), chunk):
        piece = mx.array(tokens[start : start + chunk])[None]
        forward(model, piece, cache, logits_for="none")
        mx.eval(cache.state)  # deliberate sync per chunk: bounds the graph and the memory of prefill
    ctx.prefill_done_at = time.perf_counter()


def prefill_rows(ctx: DecodeContext, cache, rows: Sequence[Sequence[int]], last_hidden: bool = False):
    """Prefill a batch of prompts of different lengths into one cache (right-padded, ragged).

    Returns valid (B, P): which of the P cache slots hold each row's tokens. Padding slots hold
    finite garbage (pad queries attend to themselves, so nothing is NaN) that later masks hide.
    One row (or equal lengths) takes the plain path: no explicit mask, exactly as `prefill`.
    last_hidden (every row non-empty): also each row's hidden state at its last token, (B, D).
    """
    lengths = [len(r) for r in rows]
    width = max(lengths)
    last = [None] * len(rows)
    if min(lengths) == width:
        if width:
            model = ctx.lm.model
            chunk = max(1, ctx.params.prefill_chunk)
            tokens = mx.array([list(r) for r in rows])
            for start in range(0, width, chunk):
                out = forward(model, tokens[:, start : start + chunk], cache, logits_for="none")
                mx.eval(cache.state)  # deliberate sync per chunk (see `prefill`)
            if last_hidden:
                last = list(out.hidden[:, -1])
        ctx.prefill_done_at = time.perf_counter()
        valid = np.ones((len(rows), width), dtype=bool)
        return (valid, mx.stack(last)) if last_hidden else valid
    valid = np.zeros((len(rows), width), dtype=bool)
    tokens = np.zeros((len(rows), width), dtype=np.int32)
    for b, r in enumerate(rows):
        valid[b, : len(r)] = True
        tokens[b, : len(r)] = r
    positions = np.where(valid, np.arange(width)[None, :], 0).astype(np.int32)
    chunk = max(1, ctx.params.prefill_chunk)
    for start in range(0, width, chunk):
        end = min(width, start + chunk)
        mask = masks.padded_causal_mask(valid, start, end)  # (B, 1, c, end): pads see themselves
        out = forward(ctx.lm.model, mx.array(tokens[:, start:end]), cache,
                      positions=mx.array(positions[:, start:end]), mask=mask, logits_for="none")
        mx.eval(cache.state)  # deliberate sync per chunk (see `prefill`)
        for row, length in enumerate(lengths if last_hidden else ()):
            if start < length <= end:
                last[row] = out.hidden[row, length - 1 - start]
    ctx.prefill_done_at = time.perf_counter()
    return (valid, mx.stack(last)) if last_hidden else valid


def new_contiguous_cache(ctx: DecodeContext) -> ContiguousKVCache:
    return ContiguousKVCache.for_model(ctx.lm.model)


def prefilled_cache(ctx: DecodeContext, tokens: Sequence[int]) -> ContiguousKVCache:
    """A cache holding `tokens` (the prompt but its last token): resumed from the engine's prefix
    store when it has one (`cache/prefix.py`: only the tokens after the common prefix are
    prefilled), else prefilled from scratch. Hand it back with `keep_prefix` when done."""
    store = ctx.resources.get("prefix_store")
    if store is None:
        cache, reused = new_contiguous_cache(ctx), 0
    else:
        cache, reused = store.take(ctx.lm.model, tokens)
        ctx.stats.cached_tokens = reused
        ctx.stats.extra["prefix_reused"] = reused  # the chat app's name for it
    prefill(ctx, cache, list(tokens)[reused:])
    return cache


def keep_prefix(ctx: DecodeContext, cache: ContiguousKVCache, tokens: Sequence[int]) -> None:
    """Return the cache to the prefix store, keeping `tokens` (the caller's `prefilled_cache`
    tokens; what was decoded after them is dropped). Without a store the cache is discarded."""
    store = ctx.resources.get("prefix_store")
    if store is not None:
        store.put(ctx.lm.model, tokens, cache)


def peak_memory_mb() -> float:
    peak = mx.get_peak_memory()
    if peak:
        return peak / 1e6
    # The CPU backend may not track its allocations: fall back to the process's peak RSS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e6 if sys.platform == "darwin" else rss / 1e3


class _ThreadText:
    """Per-thread streaming detokeniser and exact stop-string search. Text that could still be the
    beginning of a stop string is held back until it cannot, so no part of a stop string is ever
    emitted, even one that spans several tokens; `flush` emits what was held at the end."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.detok = tokenizer.detokenizer
        self.stop = [s for s in stop if s]
        self.text = ""  # the thread's text so far, cut at a stop string
        self.sent = 0  # characters of `text` already emitted
        self.stopped = False

    def add(self, token: int) -> tuple[str, bool]:
        """Returns (text delta, hit a stop string)."""
        self.detok.add_token(token)
        return self._advance(self.detok.last_segment, final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self.detok.finalize()
        return self._advance(self.detok.last_segment, final=True)[0]

    def _advance(self, delta: str, final: bool) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        before = len(self.text)
        self.text += delta
        if self.stop and delta:
            window_start = max(0, before - max(len(s) for s in self.stop) + 1)
            hits = [h for h in (self.text.find(s, window_start) for s in self.stop) if h >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
                return self._emit(len(self.text)), True
        return self._emit(len(self.text) - (0 if final else _held_back(self.text, self.stop))), False

    def _emit(self, end: int) -> str:
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


def _held_back(text: str, stops: Sequence[str]) -> int:
    """The longest end of `text` that is the beginning of a stop string (0: none)."""
    longest = 0
    for s in stops:
        for k in range(min(len(text), len(s) - 1), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def take_tokens(tokens: Sequence[int], text: _ThreadText, eos, room: int):
    """One step's tokens for one thread: at most `room` of them, up to an EOS (left out) or a
    stop string (cut from the text). Returns (kept tokens, their text delta, "eos" | "stop" | None)."""
    kept, delta = [], ""
    for token in tokens:
        if len(kept) >= room:
            break
        if token in eos:
            return kept, delta, "eos"
        kept.append(token)
        piece, stop_hit = text.add(token)
        delta += piece
        if stop_hit:
            return kept, delta, "stop"
    return kept, delta, None


def check_context(lm: LoadedModel, prompt: Sequence[int], params: GenerationParams) -> int:
    """Refuse a prompt that does not fit; clamp max_tokens to what is left of the window."""
    window = lm.context_length
    if len(prompt) >= window:
        raise ContextOverflow(
            f"prompt has {len(prompt)} tokens but the context window of {lm.name} is {window}"
        )
    return min(params.max_tokens, window - len(prompt))


def stream_events(
    lm: LoadedModel,
    prompt: List[int],
    strategy,
    params: GenerationParams,
    method_name: str,
    resources: Optional[Dict[str, object]] = None,
) -> Iterator[Event]:
    """Drive `strategy` and turn its steps into events: thread 0's EOS or stop string ends the
    stream; max_tokens counts every thread's tokens (APAR's threads write one answer). A batch of
    prompts, one request per row, is `batch.stream_batch`."""
    if not prompt:
        raise ValueError("empty prompt")
    max_tokens = check_context(lm, prompt, params)
    if params.seed is not None:
        mx.random.seed(params.seed)
    stats = GenerationStats(method=method_name, prompt_tokens=len(prompt))
    ctx = DecodeContext(lm, list(prompt), params, make_sampler(params), stats,
                        resources=resources or {}, prompts=[list(prompt)])
    eos = lm.eos_token_ids
    texts: Dict[int, _ThreadText] = {}
    start = time.perf_counter()
    first_token_at = last_token_at = None
    steps = strategy(ctx)
    try:
        for step in steps:
            now = time.perf_counter()
            if step.kind != "token":
                yield Event(step.kind, step.thread_id, step.parent_id, elapsed_s=now - start)
                continue
            tid = step.thread_id
            thread = texts.setdefault(tid, _ThreadText(lm.tokenizer, params.stop))
            emitted, delta, end = take_tokens(step.tokens, thread, eos, max_tokens - stats.generated_tokens)
            stats.generated_tokens += len(emitted)
            stop_hit = end == "stop" or (end == "eos" and tid == 0)  # another thread's EOS ends that thread only
            if emitted or delta:
                first_token_at = first_token_at or now
                last_token_at = now
                stats.drafted += step.drafted
                stats.accepted += step.accepted
                yield Event("token", tid, step.parent_id, emitted, delta,
                            step.drafted, step.accepted, now - start)
            if stop_hit or stats.generated_tokens >= max_tokens:
                stats.finish_reason = "stop" if stop_hit else "length"
                break
        else:
            stats.finish_reason = "stop"
    finally:
        steps.close()  # runs the strategy's `finally`: caches roll back to a consistent state
    for tid, thread in texts.items():
        tail = thread.flush()
        if tail:
            yield Event("token", tid, None, [], tail, elapsed_s=time.perf_counter() - start)
    end = time.perf_counter()
    stats.prefill_s = (ctx.prefill_done_at or end) - start
    stats.ttft_s = (first_token_at or end) - start
    stats.decode_s = (last_token_at - first_token_at) if first_token_at else 0.0
    stats.peak_memory_mb = peak_memory_mb()
    yield Event("done", elapsed_s=end - start, stats=stats)


def drop_finished_rows(rows: List[int], new_tokens, emitted, eos, max_tokens, stopped_rows):
    """Rows that hit EOS or max_tokens, or whose request ended (a stop string, its own max_tokens,
    a client gone: `stopped_rows`), leave the batch: (live rows, their indices or None)."""
    keep = [b for b, tokens in enumerate(new_tokens)
            if emitted[b] < max_tokens and not any(t in eos for t in tokens) and rows[b] not in stopped_rows]
    if len(keep) == len(rows):
        return rows, None
    return [rows[b] for b in keep], np.array(keep, dtype=np.int64)
