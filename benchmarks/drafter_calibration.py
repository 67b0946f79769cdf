"""How honest a draft head's confidence is for greedy verification, and the temperature that fixes it.

Greedy ReDrafter verifies a drafted token only where the head's confidence clears the cutoff and
the verify-cost rule finds it worth its cost (drafting/verify_cost.py); both read the confidence
as "the chance the target's own token is this one". A head trained on hard labels learns exactly
that. A head trained on the LLM's soft distribution (`train-drafter --soft-targets`) learns the
LLM's *sampling* probability instead, which is lower wherever the LLM's top token is not sure yet
still its top token: its drafts get cut though they would be accepted.

Teacher forced over held-out answers, for each head and draft position 1..T: the mean confidence
of the head's top token against how often it is right, by confidence bin; then the temperature tau
with the best log-likelihood of "right" under confidence = softmax(logits / tau)[top] (the top
token does not change). `--write` stores each head's tau in its config.json
(`confidence_temperature`), which greedy drafting then uses for its confidences.

    python benchmarks/drafter_calibration.py --heads models/drafter-smollm2-135m,DIR \
        --data ~/.cache/mlx-specdec/drafter-data/issue18/train_prompts_natural,...natural2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np

from mlx_specdec.redrafter_head.data import load_splits
from mlx_specdec.redrafter_head.model import CONFIG_FILE, load_drafter
from mlx_specdec.redrafter_head.teacher_forcing import Windows, llm_embedding_table, unroll
from mlx_specdec.engine import Engine

TAUS = np.round(np.arange(0.60, 2.001, 0.1), 2)  # 15 temperatures: each is a logsumexp over K per draft
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0001)


def top_logits(head, lm, seqs, batch_size: int = 512):
    """Per (window, position): the head's logits over the draft vocabulary, reduced to what the
    fit needs: the top logit, the logsumexp at every tau, and whether the top token is right."""
    T = head.config.draft_length
    windows, table = Windows(seqs, T), llm_embedding_table(lm)
    lse = {float(t): [] for t in TAUS}
    top, right, valid = [], [], []
    for start in range(0, len(windows), batch_size):
        toks, ok, hidden, _ = windows.batch(windows.positions[start:start + batch_size])
        logits = unroll(head, table[toks[:, :T]], hidden)  # (B, T, K)
        best = logits.max(axis=-1)
        for t in TAUS:
            lse[float(t)].append(np.array(mx.logsumexp(logits / float(t), axis=-1)))
        top.append(np.array(best))
        right.append(np.array(head.draft_to_full[mx.argmax(logits, axis=-1)] == toks[:, 1:]))
        valid.append(np.array(ok[:, 1:]))
    cat = lambda xs: np.concatenate(xs)  # noqa: E731
    return cat(top), {t: cat(v) for t, v in lse.items()}, cat(right), cat(valid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--heads", required=True, help="comma list of drafter directories")
    ap.add_argument("--data", required=True, help="comma list of distillation data directories (valid split used)")
    ap.add_argument("--write", action="store_true", help="store each head's fitted tau in its config.json")
    args = ap.parse_args()

    lm = Engine.load(args.model, drafter=None, apar_adapter=None).lm
    valid_split = load_splits([Path(d).expanduser() for d in args.data.split(",")], "valid")
    print(f"held-out: {len(valid_split.offsets) - 1} answers, {len(valid_split.tokens)} tokens\n")
    for directory in args.heads.split(","):
        head = load_drafter(directory, lm)
        top, lse, right, valid = top_logits(head, lm, valid_split)
        r = right[valid].astype(np.float64)

        def confidence(tau):
            return np.exp(top / tau - lse[tau])[valid]

        def loglik(tau):
            c = np.clip(confidence(tau), 1e-6, 1 - 1e-6)
            return float(np.mean(r * np.log(c) + (1 - r) * np.log(1 - c)))

        best = max((float(t) for t in TAUS), key=loglik)
        print(f"## {directory}\n\nfitted tau {best:.2f} (log-likelihood of right/wrong {loglik(best):.4f}; "
              f"at tau 1: {loglik(1.0):.4f})\n")
        print("| confidence bin | drafts | mean confidence (tau 1) | right | mean confidence (tau fitted) |")
        print("|---|---:|---:|---:|---:|")
        raw, fitted = confidence(1.0), confidence(best)
        for lo, hi in zip(BINS[:-1], BINS[1:]):
            inside = (raw >= lo) & (raw < hi)
            if inside.any():
                print(f"| {lo:.1f}-{min(hi, 1.0):.1f} | {int(inside.sum())} | {raw[inside].mean():.3f} | "
                      f"{r[inside].mean():.3f} | {fitted[inside].mean():.3f} |")
        print(f"| all | {len(r)} | {raw.mean():.3f} | {r.mean():.3f} | {fitted.mean():.3f} |\n")
        if args.write:
            path = Path(directory) / CONFIG_FILE
            config = json.loads(path.read_text())
            config["confidence_temperature"] = best
            path.write_text(json.dumps(config, indent=2) + "\n")
            print(f"wrote confidence_temperature {best:.2f} to {path}\n")


if __name__ == "__main__":
    main()
