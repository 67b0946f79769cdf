"""The peer baseline: `mlx_lm.generate_step` on the same loaded model, as a strategy.

Wrapping it in our driver means both are detokenised, timed and counted by the same code, so the
bench compares decoding loops, not bookkeeping. Penalties are mlx-lm's own logits processors
(`make_logits_processors`), with mlx-lm's definitions: presence and frequency count the last 20
tokens of prompt + answer, not the answer (docs/server.md, "Penalties").
"""

from __future__ import annotations

import time
from typing import Iterator

import mlx.core as mx

from ..penalties import check_method, requested
from .base import DecodeContext, Step


def _processors(ctx: DecodeContext):
    """mlx-lm's own processors for the penalties the request turns on (None: none)."""
    wanted = requested(ctx.params)
    if not wanted:
        return None
    check_method("mlx-lm", ctx.params)  # one this mlx-lm lacks is refused in one line
    from mlx_lm.sample_utils import make_logits_processors

    given = {name: getattr(ctx.params, name) for name in wanted}
    if "repetition_penalty" in given:
        given["repetition_context_size"] = ctx.params.repetition_context_size
    return make_logits_processors(**given)


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
