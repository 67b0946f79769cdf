"""Check a file of new training prompts before generating their answers.

    .venv/bin/python data/check_new_prompts.py NEW.jsonl ID_LO ID_HI [--against data/train_prompts_natural.jsonl,...]

Prints every problem: bad rows, ids outside ID_LO..ID_HI or repeated, near copies of a bench prompt
(word-trigram Jaccard >= 0.3: the bench measures the head, so it must not be trained on), of a prompt
in the --against files or of each other (>= 0.6); then the count per category. The natural prompt
sets (data/train_prompts_natural*.jsonl) were written by helper agents and checked with it.
"""

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_specdec.redrafter_head.data import bench_questions, near_copies, word_ngrams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("id_lo", type=int)
    parser.add_argument("id_hi", type=int)
    parser.add_argument("--against", default="data/train_prompts_natural.jsonl",
                        help="comma list of prompt files the new ones must not nearly copy")
    args = parser.parse_args()
    rows, problems = [], []
    for n, line in enumerate(open(args.path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            assert set(row) == {"id", "category", "prompt"} and str(row["prompt"]).strip()
        except (ValueError, AssertionError, TypeError) as exc:
            problems.append(f"line {n}: bad row ({exc})")
            continue
        if not args.id_lo <= row["id"] <= args.id_hi:
            problems.append(f"line {n}: id {row['id']} outside {args.id_lo}-{args.id_hi}")
        rows.append(row)
    problems += [f"id {i} repeated" for i, c in collections.Counter(r["id"] for r in rows).items() if c > 1]
    texts = [r["prompt"] for r in rows]
    for text, _, j in near_copies(texts, bench_questions(), threshold=0.3):
        problems.append(f"near a BENCH prompt ({j:.2f}): {text[:70]!r}")
    old = [json.loads(l)["prompt"] for f in args.against.split(",") if f and Path(f).resolve() != Path(args.path).resolve()
           for l in open(f) if l.strip()]
    for text, ref, j in near_copies(texts, old, threshold=0.6):
        problems.append(f"near an existing prompt ({j:.2f}): {text[:70]!r} ~ {ref[:50]!r}")
    grams = [word_ngrams(t) for t in texts]
    for i in range(len(texts)):
        for k in range(i):
            if grams[i] and grams[k] and len(grams[i] & grams[k]) / len(grams[i] | grams[k]) >= 0.6:
                problems.append(f"two new prompts alike: {texts[i][:50]!r} ~ {texts[k][:50]!r}")
    print("\n".join(problems) or "no problems")
    print(len(rows), "prompts;", dict(collections.Counter(r["category"] for r in rows)))


if __name__ == "__main__":
    main()
