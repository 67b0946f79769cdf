"""The peer baseline: `mlx_lm.generate_step` on the same loaded model, as a strategy.

Wrapping it in our driver means both are detokenised, timed and counted by the same code, so the
bench compares decoding loops, not bookkeeping. Penalties go in as mlx-lm's own logits processor
hook, computed by penalties.py over the tokens mlx-lm hands it (prompt + answer).
"""

from __future__ import annotations

import time
from typing import Iterator

import mlx.core as mx

from ..penalties import Penalties, penalize
from .base import DecodeContext, Step


def _processors(ctx: DecodeContext):
    pen = Penalties.of(ctx.params)
    if pen is None:
        return None
    start = len(ctx.prompt)

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:  # tokens: prompt + answer so far
        counts = None
        if pen.counts:
            counts = mx.zeros(logits.shape, dtype=mx.float32)
            if len(tokens) > start:
                counts = counts.at[0, tokens[start:]].add(1.0)
        return penalize(logits, pen, counts, tokens[-pen.window:][None] if pen.recent else None)

    return [processor]


def mlx_lm_baseline(ctx: DecodeContext) -> Iterator[Step]:
    from mlx_lm.generate import generate_step

    def on_prompt_progress(done: int, total: int) -> None:
        if done == total and not ctx.prefill_done_at:
            ctx.prefill_done_at = time.perf_counter()

    steps = generate_step(
        mx.array(ctx.prompt),
        ctx.lm.model,
        max_tokens=-1,  # the driver decides when to stop
        sampler=ctx.sampler,
        logits_processors=_processors(ctx),
        prefill_step_size=ctx.params.prefill_chunk,
        prompt_progress_callback=on_prompt_progress,
    )
    eos = ctx.lm.eos_token_ids
    try:
        for token, _ in steps:
            ctx.stats.forward_passes += 1
            yield Step([token])
            if token in eos:
                return
    finally:
        steps.close()
