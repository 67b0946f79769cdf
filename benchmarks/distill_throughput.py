"""Distillation data: generated tokens per second against batch size (issue 18: fast before long).

    python benchmarks/distill_throughput.py [--batches 8,16,32,64] [--max-new-tokens 96]

Runs `drafter.data.batched_greedy` (the data builder's generator: left-padded rows, per-row
positions, finished rows leave the batch) on the first B prompts of data/train_prompts_large.jsonl
for each batch size B, and prints new tokens / wall second.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_specdec  # noqa: F401  (BLAS first)

from mlx_specdec.redrafter_head.data import batched_greedy
from mlx_specdec.model.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,16,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", default=str(Path(__file__).resolve().parent.parent / "data/train_prompts_large.jsonl"))
    args = parser.parse_args()
    lm = load_model("default")
    rows = [json.loads(line)["prompt"] for line in open(args.prompts)]
    encoded = [lm.encode_chat([{"role": "user", "content": p}]) for p in rows[:256]]
    batched_greedy(lm, encoded[:4], 8)  # warm-up
    print("| batch | new tokens | seconds | tokens/s |\n|---:|---:|---:|---:|")
    for batch in [int(b) for b in args.batches.split(",")]:
        begin = time.perf_counter()
        results = batched_greedy(lm, encoded[:batch], args.max_new_tokens)
        seconds = time.perf_counter() - begin
        tokens = sum(len(r[0]) for r in results)
        print(f"| {batch} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
