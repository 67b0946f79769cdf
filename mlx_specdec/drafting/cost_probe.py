"""The verify-cost table of the machine the engine runs on (`mlx-specdec calibrate`).

ReDrafter's step length (drafting/verify_cost.py) weighs a draft's odds against what one more
query token costs in a forward. That cost is the machine's, not the method's: on one 2-core x86
VM a 5-token forward after 150 tokens cost 1.60 one-token forwards, on another 1.21
(benchmarks/results/issue18_calibrate.md), and on an Apple GPU a few tokens cost about one.
So the table is measured where it is used, once per machine and model, and kept in the user cache:

    for each context C (default 150, 2000, 6000; at most the model's context length - 64):
        prefill C tokens, then R rounds of: one forward of T = 1..T_max query tokens in one row
        (logits for every token, as a verify needs), the cache trimmed back after each
    cost[C, T] = median time of T tokens / median time of 1, then made non-decreasing in T

The rounds interleave the T values, so a slow spell of the machine touches every T alike; the
running maximum removes what noise is left (a longer verify never costs less). The stored file
names the machine it was measured on; on another machine it is ignored.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..cache import ContiguousKVCache
from ..model.device import on_cpu
from ..model.forward import forward
from .verify_cost import CostTable, shipped_table

DEFAULT_CONTEXTS = (150, 2000, 6000)
DEFAULT_TOKENS = 8  # T = 1..8: ReDrafter's default chains verify at most 5, lookup streaks more
DEFAULT_ROUNDS = 9
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


def measure_table(model, contexts: Sequence[int], max_tokens: int = DEFAULT_TOKENS, rounds: int = DEFAULT_ROUNDS,
                  progress: Optional[Callable[[int], None]] = None) -> CostTable:
    """The machine's table (see the module docstring); progress(n) after each n forwards timed."""
    if max_tokens < 2 or rounds < 1 or not contexts:
        raise ValueError("measure at least T = 1..2, one round and one context")
    counts = range(1, max_tokens + 1)
    rows = []
    for context in contexts:
        cache = prefilled(model, 1, context)
        for t in counts:  # warm-up: each shape's first forward builds its kernels
            verify_forward(model, cache, t)
        times = np.zeros((rounds, max_tokens))
        for r in range(rounds):
            for t in counts:
                start = time.perf_counter()
                verify_forward(model, cache, t)
                times[r, t - 1] = time.perf_counter() - start
            if progress:
                progress(max_tokens)
        median = np.median(times, axis=0)
        rows.append(np.maximum.accumulate(median / median[0]))
    return CostTable(np.array(contexts, dtype=np.float64), np.stack(rows), "measured")


def machine() -> dict:
    """What the table depends on besides the model: the device and the CPU it runs on."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {"device": "cpu" if on_cpu() else "gpu", "device_name": str(info.get("device_name", "")),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "system": platform.system()}


def table_path(lm) -> Path:
    from ..model.default import home

    bits = f"{lm.bits}bit" if lm.bits and not lm.dequantized else lm.dtype
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in lm.name)
    return home() / "verify-cost" / f"{name}-{bits}-{machine()['device']}.json"


def save_table(lm, table: CostTable, rounds: int) -> Path:
    path = table_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"contexts": table.contexts.tolist(), "costs": np.round(table.costs, 4).tolist(), "rounds": rounds,
              "model": lm.describe(), "machine": machine(), "mlx": mx.__version__,
              "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # a half-written table is never read
    return path


def load_table(lm) -> Optional[CostTable]:
    """The table `calibrate` stored for this model on this machine, or None."""
    path = table_path(lm)
    try:
        record = json.loads(path.read_text())
        if record["machine"] != machine():
            return None
        costs = np.array(record["costs"], dtype=np.float64)
        contexts = np.array(record["contexts"], dtype=np.float64)
        if costs.ndim != 2 or costs.shape[0] != len(contexts) or costs.shape[1] < 2:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CostTable(contexts, costs, f"measured {record.get('measured_at', '?')} ({path})")


def cost_table_for(lm) -> Optional[CostTable]:
    """The table ReDrafter's step length uses: this machine's, else the shipped one on the CPU,
    else none (a GPU not calibrated: every draft the cutoff keeps is verified)."""
    measured = load_table(lm)
    if measured is not None:
        return measured
    return shipped_table() if on_cpu() else None
