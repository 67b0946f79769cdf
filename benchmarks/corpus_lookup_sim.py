"""Would a datastore of the model's own answers draft better than the head (REST-style retrieval)?

    python benchmarks/corpus_lookup_sim.py --corpus-prompts 320     # ~4 min of generation, then ~1 min

The default model's greedy answers (128 tokens) to the first N prompts of
data/train_prompts_natural.jsonl (training prompts: never the bench's) are the datastore, indexed
by every 2..6-gram. On the model's answers to the bench prompt files (generated here, never
written), at every position: the longest suffix of the answer so far found in the datastore, and
the most frequent token that followed it there, against the head's teacher-forced first draft at
the same position. Prints how often the datastore matches and how often each is right there.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np

from drafter_bench_answers import bench_answers
from mlx_specdec.redrafter_head.data import batched_greedy, load_train_prompts, row_messages
from mlx_specdec.redrafter_head.model import load_drafter
from mlx_specdec.redrafter_head.teacher_forcing import Windows, llm_embedding_table, unroll
from mlx_specdec.engine import Engine

LONGEST, SHORTEST = 6, 2


def datastore(lm, prompts_file: str, count: int, batch: int = 64):
    rows = load_train_prompts(Path(prompts_file))[:count]
    answers = []
    for start in range(0, len(rows), batch):
        prompts = [lm.encode_chat(row_messages(r)) for r in rows[start:start + batch]]
        answers += [list(map(int, tokens)) for tokens, _ in batched_greedy(lm, prompts, 128)]
        print(f"datastore: {start + len(prompts)} / {len(rows)} answers", flush=True)
    following = collections.defaultdict(collections.Counter)  # n-gram -> counts of the next token
    for answer in answers:
        for end in range(1, len(answer)):
            for n in range(SHORTEST, min(LONGEST, end) + 1):
                following[tuple(answer[end - n:end])][answer[end]] += 1
    return following, sum(len(a) for a in answers)


def retrieve(following, context):
    """(n, token, share) for the longest suffix of context seen in the datastore, or None."""
    for n in range(min(LONGEST, len(context)), SHORTEST - 1, -1):
        counts = following.get(tuple(context[-n:]))
        if counts:
            token, seen = counts.most_common(1)[0]
            return n, token, seen / sum(counts.values())
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-prompts", type=int, default=320)
    ap.add_argument("--train-prompts", default="data/train_prompts_natural.jsonl")
    ap.add_argument("--bench", default="benchmarks/chat_unseen.jsonl,benchmarks/prompts.jsonl")
    args = ap.parse_args()
    lm = Engine.load("default", drafter=None, apar_adapter=None).lm
    following, size = datastore(lm, args.train_prompts, args.corpus_prompts)
    head = load_drafter("models/drafter-smollm2-135m", lm)
    table = llm_embedding_table(lm)
    print(f"\ndatastore: {size} tokens\n")
    print("| bench answers | positions | head top-1 | datastore matches | datastore right there | head right there "
          "| confident matches (share >= 0.6) | datastore right there | head right there |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for bench_file in args.bench.split(","):
        seqs = bench_answers(lm, [bench_file], 128)
        windows = Windows(seqs, head.config.draft_length)
        toks, valid, hidden, _ = windows.batch(windows.positions)
        logits = unroll(head, table[toks[:, : head.config.draft_length]], hidden)
        head_right = np.array(head.draft_to_full[mx.argmax(logits[:, 0], axis=-1)]) == np.array(toks[:, 1])
        tally = collections.Counter()
        for j, position in enumerate(windows.positions):
            answer = int(np.searchsorted(seqs.offsets, position, side="right") - 1)
            found = retrieve(following, list(seqs.tokens[seqs.offsets[answer]:position + 1]))
            if found is None:
                continue
            right = int(found[1] == int(seqs.tokens[position + 1]))  # ints: numpy bools add as `or`
            head_ok = int(head_right[j])
            tally.update(matched=1, right=right, head=head_ok)
            if found[2] >= 0.6:
                tally.update(confident=1, confident_right=right, confident_head=head_ok)
        n = len(windows.positions)
        share = lambda a, b: f"{100 * a / max(b, 1):.1f} %"  # noqa: E731
        print(f"| {bench_file} | {n} | {share(head_right.sum(), n)} | {share(tally['matched'], n)} "
              f"| {share(tally['right'], tally['matched'])} | {share(tally['head'], tally['matched'])} "
              f"| {share(tally['confident'], n)} | {share(tally['confident_right'], tally['confident'])} "
              f"| {share(tally['confident_head'], tally['confident'])} |", flush=True)


if __name__ == "__main__":
    main()
