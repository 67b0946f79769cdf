"""Held-out acceptance of several draft heads on the same answers (teacher forced).

Heads trained on different data report accuracy on their own held-out sets; this measures them
side by side on one set: the valid split of one or more distillation data directories (answers to
prompts none of the heads trained on). Prints top-1 and top-4 per draft position and the
teacher-forced chain length (tokens per step at W=1), as a markdown table.

    python benchmarks/drafter_heldout.py --model default \
        --heads models/drafter-smollm2-135m,/tmp/v3 \
        --data ~/.cache/mlx-specdec/drafter-data/issue18/train_prompts_large
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
from mlx_specdec.redrafter_head.data import load_splits
from mlx_specdec.redrafter_head.model import load_drafter
from mlx_specdec.redrafter_head.teacher_forcing import evaluate_head
from mlx_specdec.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", help="the LLM's compute dtype (auto: float32 on the CPU)")
    ap.add_argument("--heads", required=True, help="comma list of drafter directories")
    ap.add_argument("--data", required=True, help="comma list of distillation data directories (valid split used)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    lm = Engine.load(args.model, dtype=args.dtype, drafter=None, apar_adapter=None).lm
    valid = load_splits([Path(d).expanduser() for d in args.data.split(",")], "valid")
    print(f"held-out: {len(valid.offsets) - 1} answers, {len(valid.tokens)} tokens\n")
    print("| head | top-1 by position (%) | top-4 by position (%) | chain tok/step (W=1) | s |")
    print("|---|---|---|---:|---:|")
    rows = {}
    for directory in args.heads.split(","):
        t0 = time.perf_counter()
        report = evaluate_head(load_drafter(directory, lm), lm, valid)
        rows[directory] = report
        pct = lambda xs: " / ".join(f"{100 * x:.1f}" for x in xs)  # noqa: E731
        print(f"| {directory} | {pct(report['acc'])} | {pct(report['top4'])} | "
              f"{report['chain_tokens_per_step_exact']:.3f} | {time.perf_counter() - t0:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"valid_answers": len(valid.offsets) - 1,
                                               "valid_tokens": int(len(valid.tokens)), "heads": rows}, indent=1))


if __name__ == "__main__":
    main()
