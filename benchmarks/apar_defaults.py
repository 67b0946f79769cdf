"""APAR at the chat's sampling defaults: speed, the quality guard, and heads repeated across threads.

    python benchmarks/apar_defaults.py --temp 0.7 --top-p 0.9 --seeds 0 --limit 8 --max-tokens 128 \
        --configs "sibling_penalty=0;sibling_penalty=3;sibling_penalty=inf" --answers answers.jsonl
    python benchmarks/apar_defaults.py --summarize answers_a.jsonl,answers_b.jsonl

The first --limit of the loop-rate probe's twelve list questions (`loop_rate.py`, written for it, in no other prompt
set), each answered by `ar` and by `apar` under every config (APAR options, `;`-separated), in the
same run, prompt-major, the order rotated per prompt. Per config:

    speed x ar     decode tokens/s over `ar`'s, each pooled over the prompts of one seed; median
                   over seeds (and the median of the per-answer ratios)
    NLL x ar       mean NLL per token of the restored answers under the original model
                   (`apar.quality.answer_nll`) over `ar`'s answers at the same settings, pooled per
                   seed; median over seeds
    forked         answers with at least one child; children per answer
    cross heads    children whose head (the parent's line where it forked the child: what the
                   child details) repeats the head of an earlier child of the same parent; a
                   line's head: without its list marker and bold marks, before its first colon if
                   it has one in its first 80 characters, lower case, no trailing punctuation
    cross openings children whose own first line's first three words repeat an earlier sibling's
    loop figures   `loop_rate.loops` on the restored answer: repeated lines (list marker aside),
                   repeated item heads, repeated bold heads
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
from pathlib import Path

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_rate import MARKER, PROMPTS, loops  # noqa: E402

from mlx_specdec.apar.quality import answer_nll  # noqa: E402
from mlx_specdec.apar.tree import Fork, tree_from_events  # noqa: E402
from mlx_specdec.decoding import GenerationParams  # noqa: E402
from mlx_specdec.engine import Engine  # noqa: E402


def head_of(text: str) -> str:
    """A thread's head: its first non-empty line, list marker and bold marks off, before its colon."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = MARKER.sub("", line).replace("**", "").strip()
    if ":" in line[:80]:
        line = line.split(":")[0]
    return re.sub(r"[\s.,;:!?]+$", "", line.lower()).strip()


def cross_thread(tree, decode) -> dict:
    """Per child: does its head (the parent's line where it forked it: what the child details)
    repeat an earlier fork head of the same parent, and do the first three words of its own first
    line repeat an earlier sibling's? `repeating`: children with either."""
    children = heads = openings = either = 0
    for parent in tree.threads:
        seen_heads, seen_openings, before = [], [], []
        for piece in tree.streams[parent]:
            if not isinstance(piece, Fork):
                before.append(piece)
                continue
            lines = [line for line in decode(before).splitlines() if line.strip()]
            head = head_of(lines[-1]) if lines else ""
            opening = " ".join(head_of(decode(tree.restore(piece.child))).split()[:3])
            repeats_head = bool(head) and head in seen_heads
            repeats_opening = bool(opening) and opening in seen_openings
            children += 1
            heads += repeats_head
            openings += repeats_opening
            either += repeats_head or repeats_opening
            seen_heads.append(head)
            seen_openings.append(opening)
    return dict(children=children, cross_heads=heads, cross_openings=openings, cross_either=either)


def run(engine, prompt, method, params):
    events = list(engine.generate(prompt, method=method, params=params))
    stats = next(e.stats for e in events if e.kind == "done")
    tokenizer = engine.lm_for(method).tokenizer
    tree = tree_from_events(events)
    text = tokenizer.decode(tree.restore())
    row = dict(tokens=stats.generated_tokens, decode_s=stats.decode_s, text=text,
               nll=answer_nll(engine.lm, engine.lm.encode_prompt(prompt, chat=True), text), **loops(text))
    if method == "apar":
        row.update(cross_thread(tree, tokenizer.decode), threads=len(tree.threads),
                   forked=tree.forked, heads_by_thread={t: head_of(tokenizer.decode(tree.own(t)))
                                                        for t in tree.threads})
    return row


def config_options(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        out[key] = float(value) if "." in value or key == "sibling_penalty" else int(value)
    return out


def summarize(rows: list) -> str:
    by_seed: dict = {}
    for r in rows:
        by_seed.setdefault(r["seed"], []).append(r)
    configs = sorted({r["config"] for r in rows if r["method"] == "apar"})
    ar_rows = [r for r in rows if r["method"] == "ar"]
    lines = ["| method | config | answers | speed x ar (per-answer median) | NLL x ar | forked | children per answer | "
             "children repeating a sibling's head | ... its opening (3 words) | ... either | repeated lines, marker aside (answers) | "
             "repeated item heads | repeated bold heads | tokens |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for config in ["-"] + configs:
        method = "ar" if config == "-" else "apar"
        mine = [r for r in rows if r["method"] == method and r["config"] == config]
        speed, nll, per_answer = [], [], []
        for seed, seed_rows in by_seed.items():
            ar = {r["prompt"]: r for r in seed_rows if r["method"] == "ar"}
            it = [r for r in seed_rows if r["method"] == method and r["config"] == config]
            tps = lambda rs: sum(r["tokens"] for r in rs) / max(1e-9, sum(r["decode_s"] for r in rs))
            speed.append(tps(it) / tps([ar[r["prompt"]] for r in it]))
            per_answer += [(r["tokens"] / r["decode_s"]) / (ar[r["prompt"]]["tokens"] / ar[r["prompt"]]["decode_s"])
                           for r in it]
            nll.append(statistics.mean(r["nll"] for r in it) / statistics.mean(ar[r["prompt"]]["nll"] for r in it))
        n = len(mine)
        agg = lambda k: sum(r[k] for r in mine)
        children = agg("children") if method == "apar" else 0
        fork = (f"{sum(r['forked'] for r in mine)}/{n} | {children / n:.1f} | "
                f"{agg('cross_heads')}/{children} ({agg('cross_heads') / max(1, children):.0%}) | "
                f"{agg('cross_openings')}/{children} ({agg('cross_openings') / max(1, children):.0%}) | "
                f"{agg('cross_either')}/{children} ({agg('cross_either') / max(1, children):.0%})"
                if method == "apar" else "- | - | - | - | -")
        lines.append(
            f"| {method} | {config} | {n} | {statistics.median(speed):.2f}x ({statistics.median(per_answer):.2f}x) | "
            f"{statistics.median(nll):.3f}x | {fork} | "
            f"{agg('repeated_items') / max(1, agg('lines')):.1%} ({sum(r['repeated_items'] > 0 for r in mine)}/{n}) | "
            f"{agg('repeated_item_heads') / max(1, agg('item_heads')):.1%} | "
            f"{agg('repeated_heads') / max(1, agg('heads')):.1%} | {agg('tokens') / n:.0f} |")
    per_seed = {seed: round(statistics.mean(r["nll"] for r in rs if r["method"] == "ar"), 3)
                for seed, rs in by_seed.items()}
    return "\n".join(lines) + f"\n\nar's mean NLL per seed: {per_seed}; ar answers: {len(ar_rows)}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seeds", default="0,1,2", help="sampling seeds (greedy: one run, seed ignored)")
    p.add_argument("--limit", type=int, default=8, help="the first N questions")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--configs", default="sibling_penalty=0;sibling_penalty=3;sibling_penalty=inf",
                   help="APAR options per config, ';' between configs, ',' between options")
    p.add_argument("--answers", default=None, help="append every answer here (JSON lines)")
    p.add_argument("--summarize", default=None, help="comma list of --answers files: their table, nothing run")
    args = p.parse_args()
    if args.summarize:
        rows = [json.loads(line) for path in args.summarize.split(",") for line in Path(path).read_text().splitlines()]
        print(summarize(rows))
        return 0
    engine = Engine.load(args.model)
    configs = [c.strip() for c in args.configs.split(";")]
    seeds = [int(s) for s in args.seeds.split(",")]  # greedy: repeats (the seed changes nothing)
    warm = GenerationParams(max_tokens=8)
    for method in ("ar", "apar"):
        list(engine.generate("Say hello in one short sentence.", method=method, params=warm))
    out = open(args.answers, "a") if args.answers else None
    rows = []
    for seed in seeds:
        for i, prompt in enumerate(PROMPTS[: args.limit]):
            runs = [("ar", "-")] + [("apar", c) for c in configs]
            k = i % len(runs)
            for method, config in runs[k:] + runs[:k]:  # the order rotated per prompt
                params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                                          seed=seed, options=config_options(config) if method == "apar" else {})
                row = dict(method=method, config=config, seed=seed, prompt=prompt, temp=args.temp, top_p=args.top_p,
                           **run(engine, prompt, method, params))
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
            print(f"seed {seed} prompt {i} done", file=sys.stderr, flush=True)
    print(f"{engine.lm.describe()}, T {args.temp}, top-p {args.top_p}, {args.max_tokens} tokens, seeds {args.seeds}, "
          f"{platform.machine()} {platform.system()}\n")
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
