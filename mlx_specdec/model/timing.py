"""Timing forwards on this machine: the measurements behind its measured decisions (the CPU weight
layout, model/cpu_layout.py; ReDrafter's verify-cost table, drafting/cost_probe.py)."""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import numpy as np

from ..cache.contiguous import ContiguousKVCache
from .forward import forward

PREFILL_CHUNK = 1024  # as the engine prefills: one 6K-token forward would hold 9 x 6K x 6K scores per layer


def median_ms(fn: Callable[[], None], repeats: int = 15, warmup: int = 3) -> float:
    times = []
    for i in range(repeats + warmup):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def prefilled(model, rows: int, context: int) -> ContiguousKVCache:
    """A cache holding `context` tokens of an arbitrary prompt for `rows` rows."""
    cache = ContiguousKVCache.for_model(model)
    prompt = mx.array([[1000 + (i * 7 + r) % 5000 for i in range(context)] for r in range(rows)])
    for start in range(0, context, PREFILL_CHUNK):
        forward(model, prompt[:, start:start + PREFILL_CHUNK], cache, logits_for="none")
        mx.eval(cache.state)
    return cache


def verify_forward(model, cache: ContiguousKVCache, tokens: int) -> None:
    """One forward of `tokens` query tokens in one row, every logit computed, then the cache as before."""
    out = forward(model, mx.array([[5 + i for i in range(tokens)]]), cache, logits_for="all")
    mx.eval(out.logits)
    cache.trim(tokens)
