"""What a speculative step costs beyond its verify, on this device: the fixed cost the planner
adds to every step it weighs (redrafter's device step, `auto`'s prediction).

The verify-cost table (cost_probe.py) says what a T-token forward costs against a one-token one.
A ReDrafter step pays more than its verify: the head drafts its whole chain and runners-up, the
acceptance runs, the host reads once. On a GPU that is a few small launches and a round trip,
the same order as a small model's forward, so it decides how deep a step should go: with a fixed
cost F per step, a step of T query tokens yields

    expected tokens / (cost(T) + F)

which rewards deeper steps more than cost(T) alone does, and `auto` predicts ReDrafter's speed
from it. F is measured once per machine, model and head (median of ROUNDS, after a warm-up):
the head's whole chain and its read over a one-token forward's, at a chat's context, beside the
verify-cost table. A GPU measures it at first use (milliseconds of work); the CPU's host-read
step drafts lazily and is not planned with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..model.timing import median_ms, prefilled, verify_forward

CONTEXT = 150  # a chat's context
ROUNDS = 9


def measure_step_overhead(lm, head, length: int, runners_up: int, runner_depths: int, rounds: int = ROUNDS) -> float:
    """The head's whole chain, runners-up included, and its read, as a multiple of a one-token
    forward at CONTEXT tokens."""
    from .head_source import HeadProposer

    model = lm.model
    cache = prefilled(model, 1, min(CONTEXT, lm.context_length - 1))
    one = median_ms(lambda: verify_forward(model, cache, 1), repeats=rounds)
    vocab = int(model.args.vocab_size)
    proposer = HeadProposer(head, model.model.embed_tokens, 1, length, vocab, stepwise=True,
                            runners_up=runners_up, runner_depths=runner_depths)
    proposer.whole_chain = proposer.stepwise
    hidden = mx.random.normal((1, int(model.args.hidden_size))).astype(model.model.embed_tokens.weight.dtype)
    token = mx.array([5], dtype=mx.int32)

    def draft() -> None:
        drafts = proposer.propose(token, hidden)
        extra = proposer.lazy_outputs() if proposer.whole_chain else []
        mx.eval(drafts.beams, drafts.confidence, *extra)

    return median_ms(draft, repeats=rounds) / one


def overhead_path(table_file: Path, head_name: str) -> Path:
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(head_name).name)
    return table_file.with_name(f"{table_file.stem}-step-{name}.json")


def step_overhead_for(lm, head, head_name: str, length: int, runners_up: int, runner_depths: int,
                      measure: bool) -> Optional[float]:
    """The stored F for this model, head and machine; none stored and `measure`: measured now and
    kept; else None (the planner adds nothing)."""
    from .cost_probe import table_path

    path = overhead_path(table_path(lm), head_name)
    try:
        return float(json.loads(path.read_text())["step_overhead"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not measure or head is None:
        return None
    print(f"measuring what a draft step costs on this device for {lm.name}, once ...", file=sys.stderr, flush=True)
    try:
        value = measure_step_overhead(lm, head, length, runners_up, runner_depths)
    except (RuntimeError, ValueError, MemoryError) as error:  # a device that cannot: plan without it
        print(f"warning: could not measure the draft step's cost ({error})", file=sys.stderr)
        return None
    save_step_overhead(path, value, length, runners_up)
    return value


def save_step_overhead(path: Path, value: float, length: int, runners_up: int) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step_overhead": round(value, 4), "context": CONTEXT, "length": length,
                                    "runners_up": runners_up}, indent=1))
    except OSError:  # a read-only cache: measured again next time
        pass
