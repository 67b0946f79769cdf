"""Plain autoregressive decoding: the baseline every method must match token for token.

One forward per token; the next step's graph is queued with `mx.async_eval` before the host
reads the current token, so the one host sync per token overlaps with the next forward
(the same pipelining as `mlx_lm.generate_step`).
"""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx

from ..host_traffic import Tally, queue, read_scalar
from ..model.forward import forward
from ..penalties import History, Penalties
from .base import DecodeContext, Step, keep_prefix, prefilled_cache


def autoregressive(ctx: DecodeContext) -> Iterator[Step]:
    model, sampler = ctx.lm.model, ctx.sampler
    greedy = ctx.params.greedy
    cache = prefilled_cache(ctx, ctx.prompt[:-1])
    pen = Penalties.of(ctx.params)
    history = None if pen is None else History(pen, ctx.prompt)

    def next_token(token: mx.array) -> mx.array:  # token: (1,) -> (1,)
        logits = forward(model, token[None], cache, logits_for="last").logits[:, -1, :]  # (1, V)
        if history is not None:
            chosen = choose(history(logits))
            history.add(chosen)
            return chosen
        return choose(logits)

    def choose(logits: mx.array) -> mx.array:
        if greedy:  # argmax needs no normalisation: skip a vocabulary-wide logsumexp per token
            return mx.argmax(logits, axis=-1)
        return sampler(logits - mx.logsumexp(logits, keepdims=True))

    eos = ctx.lm.eos_token_ids
    token = next_token(mx.array(ctx.prompt[-1:]))
    traffic = Tally()  # per step: one read, no host-built array, one shape
    queue(token)
    try:
        while True:
            following = next_token(token)
            queue(following)
            value = read_scalar(token)  # host sync (one per token), overlapped with `following`
            ctx.stats.forward_passes += 1  # the forward that produced `value`
            traffic.verify((1, 1))
            yield Step([value])
            if value in eos:
                return
            token = following
    finally:
        ctx.stats.extra.update(traffic.figures())  # once, not per token
        mx.eval(cache.state)  # settle the queued step
        keep_prefix(ctx, cache, ctx.prompt[:-1])  # the next chat turn may resume from the prompt
