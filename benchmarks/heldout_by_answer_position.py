"""Held-out top-1 of draft heads at draft positions 1 and 2, split by where in the answer the
window starts (tokens 0-63, 64-127, 128-255): whether a head's held-out gain lies in the answer
openings a 64-token bench decodes or later. Teacher forced, valid splits, as drafter_heldout.py.

    python benchmarks/heldout_by_answer_position.py --heads models/drafter-smollm2-135m,DIR \
        --data ~/.cache/mlx-specdec/drafter-data/issue18/train_prompts_natural,...natural2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np

from mlx_specdec.redrafter_head.data import load_splits
from mlx_specdec.redrafter_head.model import load_drafter
from mlx_specdec.redrafter_head.teacher_forcing import Windows, llm_embedding_table, unroll
from mlx_specdec.engine import Engine

SPANS = ((0, 64), (64, 128), (128, 256))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--heads", required=True, help="comma list of drafter directories")
    ap.add_argument("--data", required=True, help="comma list of distillation data directories (valid split used)")
    args = ap.parse_args()
    lm = Engine.load(args.model, drafter=None, apar_adapter=None).lm
    seqs = load_splits([Path(d).expanduser() for d in args.data.split(",")], "valid")
    table = llm_embedding_table(lm)
    answer_start = np.zeros(len(seqs.tokens), np.int64)
    for a, b in zip(seqs.offsets[:-1], seqs.offsets[1:]):
        answer_start[a:b] = a
    print("| head | answer tokens | windows | top-1 draft 1 (%) | top-1 draft 2 (%) |\n|---|---|---:|---:|---:|")
    for directory in args.heads.split(","):
        head, windows = load_drafter(directory, lm), Windows(seqs, 2)
        right, into = [], []  # (N, 2) 1 right / 0 wrong / -1 past the answer; (N,) window start in its answer
        for start in range(0, len(windows), 512):
            pos = windows.positions[start:start + 512]
            toks, valid, hidden, _ = windows.batch(pos)
            logits = unroll(head, table[toks[:, :2]], hidden)  # (B, 2, K)
            ok = np.array(head.draft_to_full[mx.argmax(logits, axis=-1)] == toks[:, 1:])
            right.append(np.where(np.array(valid[:, 1:]), ok, -1))
            into.append(pos - answer_start[pos])
        right, into = np.concatenate(right), np.concatenate(into)
        for lo, hi in SPANS:
            span = right[(into >= lo) & (into < hi)]
            pct = [100 * span[:, k][span[:, k] >= 0].mean() for k in range(2)]
            print(f"| {directory} | {lo}-{hi - 1} | {len(span)} | {pct[0]:.1f} | {pct[1]:.1f} |")


if __name__ == "__main__":
    main()
