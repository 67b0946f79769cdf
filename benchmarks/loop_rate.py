"""How often a chat answer loops, per sampling setting: the measurement behind the chat's defaults.

    python benchmarks/loop_rate.py [--model default] [--max-tokens 256] [--seeds 0,1,2]
        [--settings NAME,...] [--answers answers.jsonl] [-o table.md]

Twelve list-shaped questions (written for this probe, in no other prompt set), each answered
with `ar` (the chat template, `--max-tokens` tokens) under each setting: the old default
(greedy) and candidates, the sampled ones once per seed. Per setting it prints

    repeated lines   non-empty lines that repeat an earlier line of the same answer, of all
                     non-empty lines (and the answers with at least one): exactly, and with the
                     list marker set aside ("7. Portable stove: ..." repeats "3. Portable stove: ...")
    repeated heads   bold heads (`**...**`) that repeat an earlier head of the same answer, of
                     all bold heads (and the answers with at least one); and list items' heads (a
                     list item's text before its first colon, bold or not) likewise
    distinct 3-grams distinct word 3-grams of all word 3-grams (low: the answer goes round)
    EOS              answers that ended on their own before --max-tokens
    tokens           mean tokens per answer

--answers writes every answer (setting, seed, prompt, text) as JSON lines, to read a few;
--summarize FILE,... prints the table from such files (settings run one process each) without
generating.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine

QUESTIONS = [
    "What are good habits for staying healthy?",
    "How do I take care of a bicycle?",
    "What should I pack for a weekend camping trip?",
    "What are the main causes of air pollution in cities?",
    "How do I prepare for a job interview?",
    "What are some fun things to do on a rainy day?",
    "What are the benefits of learning a second language?",
    "How can a small bookshop attract more customers?",
    "What should a beginner know before adopting a dog?",
    "What are ways to reduce stress at work?",
    "Which skills does a good software engineer need?",
    "How can I make my home more energy efficient?",
]
PROMPTS = [q + " Give a list." for q in QUESTIONS]

#: name -> GenerationParams fields; a setting with temperature > 0 runs once per seed
SETTINGS = {
    "greedy (old default)": dict(temperature=0.0),
    "greedy, repetition 1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "greedy, frequency 0.3": dict(temperature=0.0, frequency_penalty=0.3),
    "T 0.2, top-p 0.9 (model card)": dict(temperature=0.2, top_p=0.9),
    "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "T 0.7, top-p 0.9, repetition 1.1": dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
    "T 0.7, top-p 0.9, frequency 0.3": dict(temperature=0.7, top_p=0.9, frequency_penalty=0.3),
    "T 0.7, top-p 0.9, presence 0.3": dict(temperature=0.7, top_p=0.9, presence_penalty=0.3),
    "T 0.2, top-p 0.9, repetition 1.1": dict(temperature=0.2, top_p=0.9, repetition_penalty=1.1),
}

HEAD = re.compile(r"\*\*(.+?)\*\*")
MARKER = re.compile(r"^(\d+[.)]|[-*•])\s+")  # a list item's number or bullet


def loops(text: str) -> dict:
    """The figures of one answer."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    heads = [h.strip().rstrip(":").strip().lower() for h in HEAD.findall(text)]
    words = text.split()
    grams = [tuple(words[i: i + 3]) for i in range(len(words) - 2)]
    items = [MARKER.sub("", line) for line in lines]
    item_heads = [item.split(":")[0].strip("* ").lower() for line, item in zip(lines, items)
                  if item != line and ":" in item[:80]]
    return dict(lines=len(lines), repeated_lines=len(lines) - len(set(lines)),
                repeated_items=len(items) - len(set(items)), item_heads=len(item_heads),
                repeated_item_heads=len(item_heads) - len(set(item_heads)), heads=len(heads),
                repeated_heads=len(heads) - len(set(heads)), grams=len(grams), distinct_grams=len(set(grams)))


def answer(engine: Engine, prompt: str, params: GenerationParams) -> tuple:
    text, stats = [], None
    for event in engine.generate(prompt, method="ar", params=params):
        if event.kind == "token":
            text.append(event.text)
        elif event.kind == "done":
            stats = event.stats
    return "".join(text), stats


def summary(rows: list) -> dict:
    total = {k: sum(r[k] for r in rows) for k in ("lines", "repeated_lines", "repeated_items", "item_heads",
                                                    "repeated_item_heads", "heads", "repeated_heads", "grams",
                                                    "distinct_grams", "tokens")}
    n = len(rows)
    return dict(answers=n,
                repeated_lines=total["repeated_lines"] / max(1, total["lines"]),
                answers_repeating_lines=sum(r["repeated_lines"] > 0 for r in rows) / n,
                repeated_items=total["repeated_items"] / max(1, total["lines"]),
                answers_repeating_items=sum(r["repeated_items"] > 0 for r in rows) / n,
                repeated_item_heads=total["repeated_item_heads"] / max(1, total["item_heads"]),
                answers_repeating_item_heads=sum(r["repeated_item_heads"] > 0 for r in rows) / n,
                repeated_heads=total["repeated_heads"] / max(1, total["heads"]),
                answers_repeating_heads=sum(r["repeated_heads"] > 0 for r in rows) / n,
                heads=total["heads"] / n,
                distinct_grams=total["distinct_grams"] / max(1, total["grams"]),
                eos=sum(r["eos"] for r in rows) / n, tokens=total["tokens"] / n)


def table(results: dict) -> str:
    lines = ["| setting | answers | repeated lines (answers with one) | ... list marker aside | "
             "repeated bold heads (heads per answer) | answers with one | repeated item heads (answers with one) | "
             "distinct 3-grams | EOS | tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in results.items():
        lines.append(f"| {name} | {s['answers']} | {s['repeated_lines']:.1%} ({s['answers_repeating_lines']:.0%}) | "
                     f"{s['repeated_items']:.1%} ({s['answers_repeating_items']:.0%}) | "
                     f"{s['repeated_heads']:.1%} ({s['heads']:.1f}) | {s['answers_repeating_heads']:.0%} | "
                     f"{s['repeated_item_heads']:.1%} ({s['answers_repeating_item_heads']:.0%}) | "
                     f"{s['distinct_grams']:.1%} | {s['eos']:.0%} | {s['tokens']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seeds", default="0,1,2", help="the seeds of each sampled setting")
    p.add_argument("--settings", default=None, help="setting names separated by ; (default: all)")
    p.add_argument("--answers", default=None, help="write every answer here (JSON lines)")
    p.add_argument("--output", "-o", default=None, help="also write the table here")
    p.add_argument("--summarize", default=None, help="comma list of --answers files: their table, nothing run")
    args = p.parse_args()
    if args.summarize:
        by_setting: dict = {}
        for path in args.summarize.split(","):
            for line in Path(path).read_text().splitlines():
                row = json.loads(line)  # the figures made again from the text, as this version counts
                by_setting.setdefault(row["setting"], []).append({**row, **loops(row["text"])})
        print(table({name: summary(rows) for name, rows in by_setting.items()}))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = SETTINGS if not args.settings else {k: SETTINGS[k] for k in args.settings.split(";")}
    engine = Engine.load(args.model)
    answers = open(args.answers, "w") if args.answers else None
    results = {}
    for name, fields in chosen.items():
        rows = []
        for seed in (seeds if fields.get("temperature", 0.0) > 0 else [None]):
            for prompt in PROMPTS:
                params = GenerationParams(max_tokens=args.max_tokens, seed=seed, **fields)
                text, stats = answer(engine, prompt, params)
                row = loops(text)
                row.update(tokens=stats.generated_tokens, eos=stats.finish_reason == "stop")
                rows.append(row)
                if answers:
                    answers.write(json.dumps(dict(setting=name, seed=seed, prompt=prompt, text=text, **row)) + "\n")
        results[name] = summary(rows)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    out = (f"{engine.lm.describe()}, ar, {args.max_tokens} tokens, seeds {args.seeds}, "
           f"{platform.machine()} {platform.system()}\n\n{table(results)}\n")
    print(out)
    if args.output:
        Path(args.output).write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
