"""Teacher-forced acceptance of draft heads on the model's own answers to the *bench* prompts.

The held-out split of the distillation data (answers to prompts written like the training ones)
has overstated what a new head brings to the bench three times (v5, v7, v8: the drafter card).
This measures heads where the bench decodes: the default model's greedy answers to
benchmarks/prompts.jsonl and benchmarks/chat_unseen.jsonl (their first turns), generated here
and never written to disk, so nothing trains on them. Top-1 / top-4 per draft position and the
teacher-forced chain length, as drafter_heldout.py prints them, in a few minutes instead of a
bench run per head (and without its run-to-run noise).

    python benchmarks/drafter_bench_answers.py --heads models/drafter-smollm2-135m,DIR --max-tokens 128
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
import numpy as np

from mlx_specdec.bench_prompts import load_prompts
from mlx_specdec.redrafter_head.data import Sequences, batched_greedy
from mlx_specdec.redrafter_head.model import load_drafter
from mlx_specdec.redrafter_head.teacher_forcing import evaluate_head
from mlx_specdec.engine import Engine

BENCH_FILES = ("benchmarks/prompts.jsonl", "benchmarks/chat_unseen.jsonl")


def bench_answers(lm, files, max_tokens: int, batch: int = 32) -> Sequences:
    """The model's greedy answers to the prompt files, read and encoded as `bench` does."""
    texts = [p.text for f in files for p in load_prompts(Path(f))]
    prompts = [lm.encode_prompt(text, chat=True) for text in texts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # batches pad little
    answers = []
    for start in range(0, len(order), batch):
        answers += batched_greedy(lm, [prompts[i] for i in order[start:start + batch]], max_tokens)
    tokens = np.concatenate([np.array(a[0], np.int32) for a in answers])
    hidden = np.concatenate([a[1] for a in answers])
    offsets = np.concatenate([[0], np.cumsum([len(a[0]) for a in answers])]).astype(np.int64)
    return Sequences(tokens, hidden, offsets, np.array(order))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--heads", required=True, help="comma list of drafter directories")
    ap.add_argument("--prompts", default=",".join(BENCH_FILES), help="comma list of bench prompt files")
    ap.add_argument("--max-tokens", type=int, default=128, help="answer length (default: %(default)s)")
    args = ap.parse_args()
    lm = Engine.load(args.model, drafter=None, apar_adapter=None).lm
    seqs = bench_answers(lm, args.prompts.split(","), args.max_tokens)
    print(f"bench answers: {len(seqs.offsets) - 1}, {len(seqs.tokens)} tokens (at most {args.max_tokens} each)\n")
    print("| head | top-1 by position (%) | top-4 by position (%) | chain tok/step (W=1) |\n|---|---|---|---:|")
    pct = lambda xs: " / ".join(f"{100 * x:.1f}" for x in xs)  # noqa: E731
    for directory in args.heads.split(","):
        report = evaluate_head(load_drafter(directory, lm), lm, seqs)
        print(f"| {directory} | {pct(report['acc'])} | {pct(report['top4'])} | {report['chain_tokens_per_step_exact']:.3f} |")


if __name__ == "__main__":
    main()
