"""The verify-cost table of the machine the engine runs on (`mlx-specdec calibrate`).

ReDrafter's step length (drafting/verify_cost.py) weighs a draft's odds against what one more
query token costs in a forward. That cost is the machine's, not the method's: it differs between
two CPUs of the same kind, and on a GPU a few more tokens cost about nothing. So the table is
measured where it is used, once per machine and model, and kept in the user cache:

    for each context C (default 150, 2000, 6000; at most the model's context length - 64):
        prefill C tokens, then R rounds of: one forward of T = 1..T_max query tokens in one row
        (logits for every token, as a verify needs), the cache trimmed back after each
    ratio[r, T] = time of T tokens / time of 1 token, both in round r
    cost[C, T]  = 1 + a (T - 1) + b (T - 1)^2, a, b >= 0: the least-squares fit of median_r ratio[r, T]

Each round visits the T values in its own rotated order and each ratio pairs forwards timed
moments apart, so a slow spell of a shared machine touches a ratio's two sides alike. The fit then
removes the noise that is left. Why this curve: an extra query token adds its rows' FMAs and
attention, so the cost rises steadily with T (on the CPU from a few rows on, once the products
stop being bound by the weights' stream: convex), and ReDrafter's planner weighs each token by
what it adds to the cost (drafting/runners_up.plan_step): a fit that kept the noise's flat runs
would make some extra token look free and fill it with unlikely runners-up. Each context's
medians are stored beside the fit (`ratios`). The stored file names the machine and the weight
layout (model/cpu_layout.py) it was measured with; on another machine, or over weights laid out
otherwise, it is ignored. A stored table that is not convex in T (hand-edited, or written by an
older fit) is refitted on load, from its medians where it kept them: the step-length rule takes
the argmax for greedy and the first peak for sampling (drafting/verify_cost.py), which agree only
on a convex table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..model.cpu_layout import COLUMN, ROW, current_layout
from ..model.device import machine, on_cpu
from ..model.timing import prefilled, verify_forward
from .verify_cost import CostTable, row_by_row_table, shipped_table

DEFAULT_CONTEXTS = (150, 2000, 6000)
DEFAULT_TOKENS = 8  # T = 1..8: ReDrafter's default chains verify at most 5, lookup streaks more
DEFAULT_ROUNDS = 21  # cheap next to the 6,000-token prefill; the fit is steadier with more
# On first use on a GPU: a chat's and a long document's context, a few rounds (a GPU forward
# takes milliseconds, so this is seconds); `calibrate` measures more.
FIRST_USE_CONTEXTS = (150, 2000)
FIRST_USE_ROUNDS = 5
NO_FIRST_USE_ENV = "MLX_SPECDEC_NO_FIRST_USE_CALIBRATION"
# How far a stored row's steps may shrink and still count as convex: a fit rounded to 4 decimals
# (`save_table`) moves a second difference by 2e-4 at most.
CONVEX_SLACK = 1e-3


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
        rows.append(median_ratios(times))
    ratios = np.stack(rows)
    return CostTable(np.array(contexts, dtype=np.float64), np.stack([convex_fit(r) for r in ratios]), "measured",
                     ratios)


def median_ratios(times: np.ndarray) -> np.ndarray:
    """(rounds, T) forward times -> (T,) the median over rounds of each T's time over its round's T = 1."""
    return np.median(times / times[:, :1], axis=0)


def convex_fit(ratios: np.ndarray) -> np.ndarray:
    """(T,) measured costs, ratios[0] = 1 -> 1 + a t + b t^2 at t = 0..T-1 with a, b >= 0 closest
    in least squares (two unknowns: the unconstrained solution, else the better one-term fit)."""
    t = np.arange(len(ratios), dtype=np.float64)
    terms, rise = np.stack([t, t * t], axis=1), np.asarray(ratios, dtype=np.float64) - 1.0
    coef = np.linalg.lstsq(terms, rise, rcond=None)[0]
    if (coef < 0).any():  # the best fit with a term fixed at 0 (each one-term fit clipped at 0)
        fits = []
        for j in range(2):
            column = terms[:, j]
            weight = max(0.0, float(column @ rise) / float(column @ column))
            fits.append(np.where(np.arange(2) == j, weight, 0.0))
        coef = min(fits, key=lambda c: float(((terms @ c - rise) ** 2).sum()))
    return 1.0 + terms @ coef


def table_path(lm) -> Path:
    from ..model.default import home

    bits = f"{lm.bits}bit" if lm.bits and not lm.dequantized else lm.dtype
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in lm.name)
    return home() / "verify-cost" / f"{name}-{bits}-{machine()['device']}.json"


def save_table(lm, table: CostTable, rounds: int) -> Path:
    path = table_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"contexts": table.contexts.tolist(), "costs": np.round(table.costs, 4).tolist(), "rounds": rounds,
              "ratios": None if table.ratios is None else np.round(table.ratios, 4).tolist(),
              "model": lm.describe(), "layout": current_layout(lm.model), "machine": machine(), "mlx": mx.__version__,
              "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # a half-written table is never read
    return path


def load_table(lm) -> Optional[CostTable]:
    """The table `calibrate` stored for this model on this machine (refitted where not convex), or None."""
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
        if not (np.isfinite(costs).all() and (costs > 0).all() and (np.diff(contexts) > 0).all()):
            return None
        ratios = np.array(record.get("ratios") or costs, dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    source = f"measured {record.get('measured_at', '?')} ({path})"
    if not is_convex(costs):
        measured = ratios.shape == costs.shape and np.isfinite(ratios).all() and (ratios > 0).all()
        fit_to = ratios if measured else costs
        costs, source = np.stack([convex_fit(row / row[0]) for row in fit_to]), source + ", refitted convex"
    return CostTable(contexts, costs, source)


def is_convex(costs: np.ndarray, slack: float = CONVEX_SLACK) -> bool:
    """costs (C, T): every row starts at 1 and no step in T is smaller than the one before it."""
    return bool(np.allclose(costs[:, 0], 1.0) and (np.diff(costs, n=2, axis=1) >= -slack).all())


def cost_table_for(lm) -> Optional[CostTable]:
    """The table ReDrafter's step length uses: this machine's, else on the CPU the shipped one (a
    model kept quantized there: `row_by_row_table`), else (a GPU never calibrated for this model) a
    short measurement made now and kept, unless $MLX_SPECDEC_NO_FIRST_USE_CALIBRATION is set (then
    none: every draft the cutoff keeps is verified)."""
    measured = load_table(lm)
    if measured is not None:
        return measured
    if on_cpu():
        return row_by_row_table() if lm.bits and not lm.dequantized else shipped_table()
    if os.environ.get(NO_FIRST_USE_ENV):
        return None
    return measure_on_first_use(lm)


def measure_on_first_use(lm) -> Optional[CostTable]:
    """A GPU's table measured in a few seconds (fewer contexts and rounds than `calibrate`) and
    saved, so the first redrafter answer on a new machine plans its steps by that machine's costs."""
    contexts = [c for c in FIRST_USE_CONTEXTS if c <= lm.context_length - DEFAULT_TOKENS]
    if not contexts:
        return None
    print(f"measuring what a verify costs on this {machine()['device']} for {lm.name}, once "
          f"(`mlx-specdec calibrate` measures it more closely) ...", file=sys.stderr, flush=True)
    try:
        table = measure_table(lm.model, contexts, DEFAULT_TOKENS, FIRST_USE_ROUNDS)
    except (RuntimeError, ValueError, MemoryError) as error:  # a device that cannot: speculate without it
        print(f"warning: could not measure the verify cost ({error}); verifying every draft kept", file=sys.stderr)
        return None
    path = save_table(lm, table, FIRST_USE_ROUNDS)
    return CostTable(table.contexts, table.costs, f"measured on first use ({path})", table.ratios)
