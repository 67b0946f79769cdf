"""The verify-cost table of the machine the engine runs on (`mlx-specdec calibrate`).

ReDrafter's step length (drafting/verify_cost.py) weighs a draft's odds against what one more
query token costs in a forward. That cost is the machine's, not the method's: on one 2-core x86
VM a 5-token forward after 150 tokens cost 1.60 one-token forwards, on another 1.21
(benchmarks/results/issue18_calibrate.md), and on an Apple GPU a few tokens cost about one.
So the table is measured where it is used, once per machine and model, and kept in the user cache:

    for each context C (default 150, 2000, 6000; at most the model's context length - 64):
        prefill C tokens, then R rounds of: one forward of T = 1..T_max query tokens in one row
        (logits for every token, as a verify needs), the cache trimmed back after each
    ratio[r, T] = time of T tokens / time of 1 token, both in round r
    cost[C, T]  = the non-decreasing least-squares fit (pool adjacent violators) of median_r ratio[r, T],
                  with cost[C, 1] = 1

Each round visits the T values in its own rotated order and each ratio pairs forwards timed
moments apart, so a slow spell of the machine (on a shared 2-core VM a one-token forward varies
27-44 ms from one minute to the next) touches a ratio's two sides alike. The fit then removes the
noise that is left without letting one slow median lift every longer T (a running maximum did: one
noisy T = 2 at 1.32 made T = 3..5 cost 1.32 too), since a longer verify never costs less. The stored file
names the machine and the weight layout (model/cpu_layout.py) it was measured with; on another
machine, or over weights laid out otherwise, it is ignored.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..model.cpu_layout import COLUMN, ROW, current_layout
from ..model.device import machine, on_cpu
from ..model.timing import prefilled, verify_forward
from .verify_cost import CostTable, shipped_table

DEFAULT_CONTEXTS = (150, 2000, 6000)
DEFAULT_TOKENS = 8  # T = 1..8: ReDrafter's default chains verify at most 5, lookup streaks more
DEFAULT_ROUNDS = 21  # cheap next to the 6,000-token prefill; the fit is steadier with more


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
            for i in range(max_tokens):
                t = counts[(i + r) % max_tokens]  # round r starts at T = r + 1
                start = time.perf_counter()
                verify_forward(model, cache, t)
                times[r, t - 1] = time.perf_counter() - start
            if progress:
                progress(max_tokens)
        rows.append(relative_costs(times))
    return CostTable(np.array(contexts, dtype=np.float64), np.stack(rows), "measured")


def relative_costs(times: np.ndarray) -> np.ndarray:
    """(rounds, T) forward times -> (T,) costs relative to one token: the monotone fit of the
    per-round ratios' medians, starting at exactly 1."""
    ratios = np.median(times / times[:, :1], axis=0)
    return np.maximum(monotone_fit(ratios), 1.0)


def monotone_fit(values: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators):
    each run that falls is replaced by its mean, merging backwards until the sequence rises."""
    blocks: list = []  # [mean, count] of each pooled run, left to right
    for v in np.asarray(values, dtype=np.float64):
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            prev = blocks[-1]
            prev[0] = (prev[0] * prev[1] + mean * count) / (prev[1] + count)
            prev[1] += count
    return np.concatenate([np.full(count, mean) for mean, count in blocks])


def table_path(lm) -> Path:
    from ..model.default import home

    bits = f"{lm.bits}bit" if lm.bits and not lm.dequantized else lm.dtype
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in lm.name)
    return home() / "verify-cost" / f"{name}-{bits}-{machine()['device']}.json"


def save_table(lm, table: CostTable, rounds: int) -> Path:
    path = table_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"contexts": table.contexts.tolist(), "costs": np.round(table.costs, 4).tolist(), "rounds": rounds,
              "model": lm.describe(), "layout": current_layout(lm.model), "machine": machine(), "mlx": mx.__version__,
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
        # measured over weights in another layout (cpu_layout.py): not what a step costs now; tables
        # from before the layout was recorded were all measured column-major on the CPU
        if record.get("layout", COLUMN if record["machine"]["device"] == "cpu" else ROW) != current_layout(lm.model):
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
