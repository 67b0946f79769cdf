"""Write multi-turn distillation prompts: a second user turn after the model's own first answer.

    python data/make_followups.py --data-dir ~/.cache/mlx-specdec/drafter-data/issue18 \
        --prompts data/train_prompts_large.jsonl --out data/train_prompts_followups.jsonl [--model default]

For each first-turn prompt of the training split whose answer the data directory holds (the LLM's
own greedy answer, as `mlx-specdec train-drafter --data-only` wrote it), one conversation: the
prompt, that answer as the assistant's turn, and a follow-up picked by the answer's shape (a list,
code, or prose) and seeded by the prompt id. Only training-split answers are used, so no
validation answer enters the training data; the follow-ups are this file's own words, none from
the public MT-Bench or Vicuna-Bench second turns. Then distil the second answers as usual:

    mlx-specdec train-drafter --model default --prompts data/train_prompts_followups.jsonl --data-only ...
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zlib
from pathlib import Path

FOLLOWUPS = {
    "list": ["Can you explain the second point in more detail?", "Which of these matters most, and why?",
             "Turn that list into a short paragraph.", "Add two more items to the list.",
             "Give a concrete example for the first point.", "Which of these would you start with as a beginner?",
             "Put these in order from easiest to hardest.", "Shorten each point to a few words."],
    "code": ["Can you add comments to the code?", "How would you test this function?",
             "What is the time complexity of this?", "What happens if the input is empty?",
             "Can you make it shorter?", "Explain the code line by line.",
             "Rewrite it in another programming language of your choice."],
    "prose": ["Can you summarize that in two sentences?", "Explain that to a ten-year-old.",
              "Can you give me an example?", "Why is that?", "What are the downsides?",
              "Can you write that as a bulleted list?", "Say more about the last part.",
              "Is there a common misconception about this?", "How would this work in practice?",
              "Make it more formal.", "Now make it funny."],
}


def answer_shape(text: str) -> str:
    if "```" in text or re.search(r"^\s*(def|class|function|for|return|import)\b", text, re.M):
        return "code"
    if len(re.findall(r"^\s*(\d+[.)]|[-*•])\s+", text, re.M)) >= 2:
        return "list"
    return "prose"


def followup_rows(prompts: dict, answers: dict) -> list:
    """prompts: id -> first-turn row; answers: id -> the model's answer text (training split only).
    One conversation row per answered prompt, in the prompts' order."""
    rows = []
    for pid, row in prompts.items():
        text = answers.get(pid, "").strip()
        if not text or "prompt" not in row:
            continue
        choices = FOLLOWUPS[answer_shape(text)]
        followup = choices[zlib.crc32(str(pid).encode()) % len(choices)]
        rows.append({"id": f"{pid}+followup", "category": row.get("category", "") + "+followup",
                     "messages": [{"role": "user", "content": row["prompt"]},
                                  {"role": "assistant", "content": text},
                                  {"role": "user", "content": followup}]})
    return rows


def evenly_spaced(rows: list, limit) -> list:
    """At most `limit` rows spread over the whole list (every category and prompt length), in order."""
    if limit is None or limit >= len(rows):
        return rows
    if limit < 1:
        raise SystemExit("--limit must be at least 1")
    return [rows[(i * len(rows)) // limit] for i in range(limit)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="a train-drafter data directory (its train/ shards)")
    parser.add_argument("--prompts", required=True, help="the prompt file those shards were made from")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="default", help="the model whose tokenizer wrote the answers")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most this many conversations, evenly spaced over the answered prompts "
                             "(distilling a second turn costs more than a first: a longer prompt)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mlx_specdec.redrafter_head.data import load_split, load_train_prompts
    from mlx_specdec.model.loader import load_model

    tokenizer = load_model(args.model).tokenizer
    train = load_split(Path(args.data_dir).expanduser(), "train")
    answers = {}
    for i, pid in enumerate(train.prompt_ids):
        tokens = train.tokens[train.offsets[i]:train.offsets[i + 1]].tolist()
        answers[str(pid)] = tokenizer.decode(tokens, skip_special_tokens=True)
    prompts = {str(r["id"]): r for r in load_train_prompts(Path(args.prompts))}
    rows = evenly_spaced(followup_rows(prompts, answers), args.limit)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    shapes = {k: sum(r["messages"][-1]["content"] in v for r in rows) for k, v in FOLLOWUPS.items()}
    print(f"{len(rows)} conversations ({shapes}) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
