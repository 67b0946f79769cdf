"""What a `redrafter` verify costs inside the decoding loop, by the number of query tokens T.

    python benchmarks/verify_time_by_tokens.py [--max-tokens 96] [--option runners_up_depths=2]

`mlx-specdec calibrate` times T-token forwards in a tight loop; this times the real ones, in the
loop's own modules: each verify's tokens (from `forward`) and the acceptance sync that evaluates it
(`_read`: the verify's compute and the wait for it; the graph build before it is not included).
Prints, per T and per mask (chain = causal, tree = explicit), how many steps and their median ms.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections import defaultdict

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
import numpy as np

from mlx_specdec.bench_prompts import load_prompts
from mlx_specdec.engine import Engine, GenerationParams
from redrafter_step_time import add_option_argument, parsed_options

REDRAFTER = importlib.import_module("mlx_specdec.decoding.redrafter_step")  # the loop's module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="benchmarks/chat_unseen.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    add_option_argument(ap)
    args = ap.parse_args()
    options = parsed_options(args)
    current, times = {}, defaultdict(list)
    forward, read = REDRAFTER.forward, REDRAFTER._read

    def timed_forward(model, tokens, cache, **kwargs):
        current["key"] = (tokens.shape[1], "tree" if kwargs.get("mask") is not None else "chain")
        return forward(model, tokens, cache, **kwargs)

    def timed_read(*arrays):
        start = time.perf_counter()
        out = read(*arrays)
        if "key" in current:  # the first read after a verify: its acceptance
            times[current.pop("key")].append(time.perf_counter() - start)
        return out

    REDRAFTER.forward, REDRAFTER._read = timed_forward, timed_read
    engine = Engine.load("default")
    for prompt in load_prompts(args.prompts, limit=args.limit):
        for _ in engine.chat([{"role": "user", "content": prompt.text}], "redrafter",
                             GenerationParams(max_tokens=args.max_tokens, options=options)):
            pass
    print("| T | mask | steps | median ms |\n|---:|---|---:|---:|")
    for (tokens, mask), seconds in sorted(times.items()):
        print(f"| {tokens} | {mask} | {len(seconds)} | {1e3 * np.median(seconds):.1f} |")


if __name__ == "__main__":
    main()
