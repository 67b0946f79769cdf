"""Where a `redrafter` step's wall time goes, measured without adding a sync (unlike --profile).

    python benchmarks/redrafter_step_time.py                      # 8 unseen chats, 64 tokens
    python benchmarks/redrafter_step_time.py --prompts benchmarks/prompts.jsonl --limit 16
    python benchmarks/redrafter_step_time.py --max-tokens 96 --option runners_up_depths=2

Wraps, in the decoding loop's own modules, the verify's graph build (`forward`), the step's
host syncs (the acceptance read, the head's first draft read where prompt lookup found none, each
deeper depth of a chain) and the lookup's host work, and times them with perf_counter; the rest
of a step is the loop's own Python. A sync's time is compute (the graph it evaluates) plus the
wait for it, so "build" and "other" are the host work no computation overlaps. Milliseconds per
step, summed over the answers (decode only: from the first token on), one line per repeat.
"""

from __future__ import annotations

import argparse
import importlib
import time

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)

from mlx_specdec.bench_prompts import load_prompts
from mlx_specdec.engine import Engine, GenerationParams

REDRAFTER = importlib.import_module("mlx_specdec.decoding.redrafter_step")  # the loop's module
LOOKUP = importlib.import_module("mlx_specdec.drafting.first_offer")
HEAD = importlib.import_module("mlx_specdec.drafting.head_source")
PARTS = (  # (module or class, attribute, name): what is timed
    (REDRAFTER, "forward", "verify graph build"),
    (REDRAFTER, "_read", "acceptance sync (verify compute)"),
    (LOOKUP, "read_host", "head's first draft sync"),
    (HEAD, "read_host", "head syncs (deeper drafts, runners-up)"),
    (LOOKUP.FirstOffer, "commit", "lookup commit"),
)


def timed(owner, attribute: str, name: str, totals: dict) -> None:
    inner = getattr(owner, attribute)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
            totals[name + " calls"] = totals.get(name + " calls", 0) + 1

    setattr(owner, attribute, wrapper)


def add_option_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a redrafter option over the shipped default, e.g. runners_up_depths=2 (repeatable)")


def parsed_options(args) -> dict:
    """--option NAME=VALUE ... -> {NAME: int or float}."""
    return {name: float(value) if "." in value else int(value)
            for name, value in (item.split("=", 1) for item in args.option)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="benchmarks/chat_unseen.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    add_option_argument(ap)
    args = ap.parse_args()
    options = parsed_options(args)
    totals: dict = {}
    for owner, attribute, name in PARTS:
        timed(owner, attribute, name, totals)
    engine = Engine.load("default")
    prompts = [p.text for p in load_prompts(args.prompts, limit=args.limit)]
    for repeat in range(args.repeats):
        decode, steps = 0.0, 0
        spent = dict.fromkeys([name for _, _, name in PARTS], 0.0)
        for text in prompts:
            first = None
            for event in engine.chat([{"role": "user", "content": text}], "redrafter",
                                     GenerationParams(max_tokens=args.max_tokens, options=options)):
                if event.tokens and first is None:  # decode starts: count from here
                    first, before = time.perf_counter(), dict(totals)
            decode += time.perf_counter() - first
            steps += totals.get("acceptance sync (verify compute) calls", 0) - \
                before.get("acceptance sync (verify compute) calls", 0)
            for name in spent:
                spent[name] += totals.get(name, 0.0) - before.get(name, 0.0)
        per_step = {name: 1e3 * seconds / steps for name, seconds in spent.items()}
        other = 1e3 * decode / steps - sum(per_step.values())
        print(f"repeat {repeat}: {steps} steps, {1e3 * decode / steps:.1f} ms a step: "
              + ", ".join(f"{name} {ms:.2f}" for name, ms in per_step.items()) + f", other {other:.2f}", flush=True)


if __name__ == "__main__":
    main()
