"""Held-out acceptance of draft heads on the same answers, with a spread over answers.

Like benchmarks/drafter_heldout.py (teacher-forced top-1 per draft position and the chain length
1 + sum_k prod_{j<=k} acc_j), but each answer is scored on its own so that a bootstrap over answers
(1000 resamples) gives a 95% interval for every figure.

    python benchmarks/results/train_drafter_budget/heldout_spread.py \
        --heads models/drafter-smollm2-135m,/work/bench_out/drafter_budget30 --data DIR[,DIR...] --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
from mlx_specdec.engine import Engine
from mlx_specdec.redrafter_head.data import keep_prompts, load_splits
from mlx_specdec.redrafter_head.model import load_drafter
from mlx_specdec.redrafter_head.teacher_forcing import evaluate_head


def per_answer(head, lm, valid):
    """(correct, count) per answer and draft position: count_k = windows with a k-th target."""
    T = head.config.draft_length
    correct, count = [], []
    for pid, a, b in zip(valid.prompt_ids, valid.offsets[:-1], valid.offsets[1:]):
        n = int(b - a)
        counts = np.array([max(0, n - k) for k in range(1, T + 1)], float)
        if counts[0] == 0:
            continue
        acc = np.array(evaluate_head(head, lm, keep_prompts(valid, [pid]))["acc"])
        correct.append(np.round(acc * counts))
        count.append(counts)
    return np.array(correct), np.array(count)


def figures(correct, count):
    acc = correct.sum(0) / count.sum(0)
    return acc, 1 + float(np.sum(np.cumprod(acc)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--heads", required=True)
    ap.add_argument("--data", required=True, help="comma list of distillation data directories (valid split)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = Engine.load(args.model, drafter=None, apar_adapter=None).lm
    valid = load_splits([Path(d) for d in args.data.split(",")], "valid")
    print(f"held-out: {len(valid.offsets) - 1} answers, {len(valid.tokens)} tokens")
    rng = np.random.default_rng(0)
    out = {"answers": len(valid.offsets) - 1, "tokens": int(len(valid.tokens)),
           "prompt_ids": [str(i) for i in valid.prompt_ids], "heads": {}}
    for directory in args.heads.split(","):
        head = load_drafter(directory, lm)
        whole = evaluate_head(head, lm, valid)  # top-4 and the exact teacher-forced chain as well
        correct, count = per_answer(head, lm, valid)
        acc, chain = figures(correct, count)
        boots = [figures(correct[s], count[s]) for s in (rng.integers(0, len(count), len(count)) for _ in range(1000))]
        acc_lo, acc_hi = np.percentile([b[0] for b in boots], [2.5, 97.5], axis=0)
        chain_lo, chain_hi = np.percentile([b[1] for b in boots], [2.5, 97.5])
        out["heads"][directory] = {"acc": acc.round(4).tolist(), "acc_95": [acc_lo.round(4).tolist(), acc_hi.round(4).tolist()],
                                   "chain_product": round(chain, 3), "chain_95": [round(chain_lo, 3), round(chain_hi, 3)],
                                   "windows": int(count[:, 0].sum()), "whole_set": whole}
        cells = " / ".join(f"{100 * a:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" for a, lo, hi in zip(acc, acc_lo, acc_hi))
        print(f"| {directory} | {cells} | {chain:.3f} [{chain_lo:.3f}, {chain_hi:.3f}] | "
              f"{whole['chain_tokens_per_step_exact']:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
