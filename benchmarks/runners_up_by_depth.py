"""How often a runner-up would rescue a greedy chain, by depth: teacher forced on the model's own
answers to the bench prompts (as drafter_bench_answers.py makes them, never written to disk).

    python benchmarks/runners_up_by_depth.py [--max-tokens 96] [--runners 3]

A chain x0, d1, d2, ... is accepted up to its first wrong draft; a runner-up at depth k (the head's
2nd, 3rd, ... choice there) is accepted where d1..d(k-1) are right and d_k is not. Teacher forced,
the head's inputs after a right draft are the real tokens, so the rank of the real token at depth k
among the head's choices says what a runner-up there would have done. Prints, per depth, top-1 and
top-3 and the share of positions where 1..S runners-up at that depth rescue the chain.
"""

from __future__ import annotations

import argparse

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np

from drafter_bench_answers import BENCH_FILES, bench_answers
from mlx_specdec.redrafter_head.model import load_drafter
from mlx_specdec.redrafter_head.teacher_forcing import Windows, llm_embedding_table, unroll
from mlx_specdec.engine import Engine


def ranks(head, lm, seqs, depths: int) -> np.ndarray:
    """(N, depths) the rank of the real token among the head's choices at each depth (0 = its top
    one; 9999 outside the draft vocabulary), over windows with all `depths` targets in the answer."""
    windows, table = Windows(seqs, depths), llm_embedding_table(lm)
    full_to_draft = np.array(head.full_to_draft)
    out = []
    for start in range(0, len(windows), 512):
        toks, valid, hidden, _ = windows.batch(windows.positions[start:start + 512])
        logits = np.array(unroll(head, table[toks[:, :depths]], hidden).astype(mx.float32))  # (B, T, K)
        target = full_to_draft[np.array(toks[:, 1:])]  # (B, T) draft-vocabulary ids, -1 outside
        real = np.take_along_axis(logits, np.maximum(target, 0)[..., None], -1)
        rank = np.where(target < 0, 9999, (logits > real).sum(-1))
        out.append(rank[np.array(valid[:, 1:]).all(axis=1)])
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="models/drafter-smollm2-135m")
    ap.add_argument("--prompts", default=",".join(BENCH_FILES), help="comma list of bench prompt files")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--runners", type=int, default=3, help="most runners-up a depth (default: %(default)s)")
    args = ap.parse_args()
    lm = Engine.load("default", drafter=None, apar_adapter=None).lm
    seqs = bench_answers(lm, args.prompts.split(","), args.max_tokens)
    rank = ranks(load_drafter(args.drafter, lm), lm, seqs, args.depths)
    print(f"{len(rank)} positions of {len(seqs.offsets) - 1} answers ({args.max_tokens} tokens at most)\n")
    print("| depth | top-1 | top-3 | chain right before it | "
          + " | ".join(f"rescued by {s} runner{'s' if s > 1 else ''}-up" for s in range(1, args.runners + 1))
          + " |\n|---:|---:|---:|---:|" + "---:|" * args.runners)
    before = np.ones(len(rank), dtype=bool)  # the chain's drafts before this depth all right
    for k in range(args.depths):
        wrong_here = before & (rank[:, k] > 0)
        rescued = [np.mean(wrong_here & (rank[:, k] <= s)) for s in range(1, args.runners + 1)]
        print(f"| {k + 1} | {np.mean(rank[:, k] == 0):.1%} | {np.mean(rank[:, k] < 3):.1%} | {before.mean():.1%} | "
              + " | ".join(f"{r:.1%}" for r in rescued) + " |")
        before &= rank[:, k] == 0


if __name__ == "__main__":
    main()
