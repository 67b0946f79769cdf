"""Several prompts decoded together as rows of one batch, each row with its own request.

    for event in stream_batch(lm, prompts, redrafter, params, "redrafter", rows=row_params):
        event.thread_id   # the row: its index in `prompts`

A row is one request: its own `max_tokens` and stop strings (`rows[i]`; the sampling settings are
the batch's `params`, one sampler for all rows). A row ends on its EOS, its stop string, its
`max_tokens`, or when `cancelled(row)` says its client has gone; it then gets a `thread_end`
event whose `stats` are the row's own (its tokens, its forwards, its drafts), and the strategy
drops it from the batch before the next step (`DecodeContext.stopped_rows`), so a finished or
abandoned request costs nothing more. The stream ends with a `done` event for the whole batch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx

from ..model.loader import LoadedModel
from .base import (DecodeContext, Event, GenerationParams, GenerationStats, _ThreadText, check_context,
                   make_sampler, peak_memory_mb, take_tokens)


def stream_batch(
    lm: LoadedModel,
    prompts: Sequence[Sequence[int]],
    strategy,
    params: GenerationParams,
    method_name: str,
    resources: Optional[Dict[str, object]] = None,
    rows: Optional[Sequence[GenerationParams]] = None,
    cancelled: Optional[Callable[[int], bool]] = None,
) -> Iterator[Event]:
    """Drive a batch strategy (one Step per live row per decoding step) and turn its steps into
    per-row events. rows: each row's request (max_tokens, stop); default: `params` for every row."""
    prompts = [list(p) for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("empty prompt")
    rows = list(rows) if rows is not None else [params] * len(prompts)
    if len(rows) != len(prompts):
        raise ValueError(f"{len(rows)} row settings for {len(prompts)} prompts")
    limits = [check_context(lm, p, r) for p, r in zip(prompts, rows)]
    # the strategy's own bound is the longest row's; shorter rows leave through stopped_rows
    params = dataclasses.replace(params, max_tokens=max(limits))
    if params.seed is not None:
        mx.random.seed(params.seed)
    stats = GenerationStats(method=method_name, prompt_tokens=sum(len(p) for p in prompts))
    ctx = DecodeContext(lm, prompts[0], params, make_sampler(params), stats,
                        resources=resources or {}, prompts=prompts)
    row_stats = [GenerationStats(method=method_name, prompt_tokens=len(p)) for p in prompts]
    texts = [_ThreadText(lm.tokenizer, r.stop) for r in rows]
    first_at: List[Optional[float]] = [None] * len(prompts)  # per row: its first and last token's time
    last_at: List[Optional[float]] = [None] * len(prompts)
    eos = lm.eos_token_ids
    start = time.perf_counter()
    first_token_at = last_token_at = None
    steps = strategy(ctx)

    def end_row(tid: int, reason: str, now: float) -> Iterator[Event]:
        ctx.stopped_rows.add(tid)  # the strategy drops the row before its next step
        tail = texts[tid].flush()
        if tail:
            yield Event("token", tid, None, [], tail, elapsed_s=now - start)
        row = row_stats[tid]
        row.finish_reason = reason
        row.prefill_s = (ctx.prefill_done_at or now) - start
        row.ttft_s = (first_at[tid] or now) - start
        row.decode_s = (last_at[tid] - first_at[tid]) if first_at[tid] else 0.0
        row.extra = dict(stats.extra, batch_size=len(prompts))
        row.peak_memory_mb = peak_memory_mb()
        yield Event("thread_end", tid, elapsed_s=now - start, stats=row)

    try:
        for step in steps:
            now = time.perf_counter()
            tid = step.thread_id
            if step.kind != "token" or tid in ctx.stopped_rows:
                continue
            if cancelled is not None and cancelled(tid):
                yield from end_row(tid, "cancelled", now)
            else:
                row = row_stats[tid]
                row.forward_passes += 1
                emitted, delta, end = take_tokens(step.tokens, texts[tid], eos, limits[tid] - row.generated_tokens)
                row.generated_tokens += len(emitted)
                stats.generated_tokens += len(emitted)
                reason = "stop" if end else None  # its EOS or its stop string
                if emitted or delta:
                    first_at[tid] = first_at[tid] or now
                    first_token_at = first_token_at or now
                    last_token_at = last_at[tid] = now
                    for counts in (row, stats):
                        counts.drafted += step.drafted
                        counts.accepted += step.accepted
                    yield Event("token", tid, None, emitted, delta, step.drafted, step.accepted, now - start)
                if reason is None and row.generated_tokens >= limits[tid]:
                    reason = "length"
                if reason is not None:
                    yield from end_row(tid, reason, now)
            if len(ctx.stopped_rows) == len(prompts):
                break
    finally:
        steps.close()  # the strategy's `finally`: the cache drops an unverified tree
    end = time.perf_counter()
    for tid in range(len(prompts)):  # rows the strategy ended without telling us (it stopped early)
        if tid not in ctx.stopped_rows:
            yield from end_row(tid, "stop", end)
    stats.prefill_s = (ctx.prefill_done_at or end) - start
    stats.ttft_s = (first_token_at or end) - start
    stats.decode_s = (last_token_at - first_token_at) if first_token_at else 0.0
    stats.finish_reason = "stop"
    stats.peak_memory_mb = peak_memory_mb()
    yield Event("done", elapsed_s=end - start, stats=stats)

