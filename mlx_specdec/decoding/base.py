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
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

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
        line = (
            f"[{self.method}] prompt {self.prompt_tokens} tok, prefill {self.prefill_tps:.1f} tok/s | "
            f"{self.generated_tokens} tok, decode {self.decode_tps:.1f} tok/s, "
            f"{self.tokens_per_forward:.2f} tok/forward | TTFT {self.ttft_s * 1000:.0f} ms | "
            f"peak {self.peak_memory_mb:.0f} MB | {self.finish_reason}"
        )
        if self.drafted:
            line += f" | accepted {self.accepted}/{self.drafted} drafted"
        extra = self.extra
        if "acceptance_per_position" in extra:
            line += f" | acceptance by position {extra['acceptance_per_position']}"
        if "compression" in extra:
            line += (f" | tree {extra['tree_tokens_after_dedup']}/{extra['tree_tokens_before_dedup']} "
                     f"tokens after dedup")
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


def make_sampler(params: GenerationParams):
    from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

    return mlx_lm_make_sampler(temp=params.temperature, top_p=params.top_p)


def prefill(ctx: DecodeContext, cache, tokens: Sequence[int]) -> None:
    """Run tokens through the model in chunks (all but the caller's last token), filling cache."""
    model = ctx.lm.model
    chunk = max(1, ctx.params.prefill_chunk)
    for start in range(0, len(tokens), chunk):
        piece = mx.array(tokens[start : start + chunk])[None]
        forward(model, piece, cache, logits_for="none")
        mx.eval(cache.state)  # deliberate sync per chunk: bounds the graph and the memory of prefill
    ctx.prefill_done_at = time.perf_counter()


def new_contiguous_cache(ctx: DecodeContext) -> ContiguousKVCache:
    return ContiguousKVCache.for_model(ctx.lm.model)


def peak_memory_mb() -> float:
    peak = mx.get_peak_memory()
    if peak:
        return peak / 1e6
    # The CPU backend may not track its allocations: fall back to the process's peak RSS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e6 if sys.platform == "darwin" else rss / 1e3


class _ThreadText:
    """Per-thread streaming detokeniser and stop-string search."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.detok = tokenizer.detokenizer
        self.stop = [s for s in stop if s]
        self.text = ""

    def add(self, token: int) -> tuple[str, bool]:
        """Returns (text delta, hit a stop string)."""
        self.detok.add_token(token)
        delta = self.detok.last_segment
        if not self.stop or not delta:
            self.text += delta
            return delta, False
        before = len(self.text)
        self.text += delta
        window_start = max(0, before - max(len(s) for s in self.stop))
        for s in self.stop:
            hit = self.text.find(s, window_start)
            if hit >= 0:
                cut = self.text[:hit]
                delta = cut[before:] if hit >= before else ""
                self.text = cut
                return delta, True
        return delta, False

    def flush(self) -> str:
        self.detok.finalize()
        delta = self.detok.last_segment
        self.text += delta
        return delta


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
    if not prompt:
        raise ValueError("empty prompt")
    max_tokens = check_context(lm, prompt, params)
    if params.seed is not None:
        mx.random.seed(params.seed)
    stats = GenerationStats(method=method_name, prompt_tokens=len(prompt))
    ctx = DecodeContext(lm, list(prompt), params, make_sampler(params), stats, resources=resources or {})
    eos = lm.eos_token_ids
    texts: Dict[int, _ThreadText] = {}
    start = time.perf_counter()
    first_token_at = last_token_at = None
    finished_threads: set = set()
    steps = strategy(ctx)
    try:
        for step in steps:
            now = time.perf_counter()
            if step.kind != "token":
                if step.kind == "thread_end":
                    finished_threads.add(step.thread_id)
                yield Event(step.kind, step.thread_id, step.parent_id, elapsed_s=now - start)
                continue
            thread = texts.setdefault(step.thread_id, _ThreadText(lm.tokenizer, params.stop))
            emitted, delta, stop_hit = [], "", False
            for token in step.tokens:
                if stats.generated_tokens >= max_tokens:
                    break
                if token in eos:
                    if step.thread_id == 0:
                        stop_hit = True
                    break
                emitted.append(token)
                stats.generated_tokens += 1
                piece, stop_hit = thread.add(token)
                delta += piece
                if stop_hit:
                    break
            if emitted or delta:
                first_token_at = first_token_at or now
                last_token_at = now
                stats.drafted += step.drafted
                stats.accepted += step.accepted
                yield Event("token", step.thread_id, step.parent_id, emitted, delta,
                            step.drafted, step.accepted, now - start)
            if stop_hit:
                stats.finish_reason = "stop"
                break
            if stats.generated_tokens >= max_tokens:
                stats.finish_reason = "length"
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
