"""How often prompt lookup would draft well on the default model's own greedy answers (offline).

    python benchmarks/lookup_sim.py [--data DIR[,DIR]] [--prompts FILE[,FILE]] [--drafts 2,4,6] [--min-ngram 1,2,3]
    python benchmarks/lookup_sim.py --depths     # acceptance per draft depth, one fixed length
    python benchmarks/lookup_sim.py --streaks    # lookup.LOOKUP_CONFIDENCE / STREAK_CONFIDENCE

Walks each held-out distillation answer (prompt + the model's greedy answer, as `train-drafter
--data-only` wrote them) the way `redrafter --lookup N` decodes it: at each step, if the text so
far + the target's own token ends in an n-gram seen before, the lookup's N drafts are checked
against the answer's real next tokens (exactly what greedy verification accepts); otherwise the
head drafts, modelled by its measured acceptance (first draft 0.366, second given first 0.48:
W1 L3 cutoff 0.2, 4 unseen chats, 2026-11-26). Prints tokens per step, the share of lookup steps
and the tokens accepted per lookup step, per setting. No model runs: the answers are the model's.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_specdec.redrafter_head.data import load_split, load_train_prompts, row_messages  # noqa: E402
from mlx_specdec.drafting.ngram import NgramProposer  # noqa: E402

HEAD_ACCEPTANCE = (0.366, 0.177 / 0.366)  # P(first draft), P(second | first)
DATA = Path.home() / ".cache/mlx-specdec/drafter-data/issue18"


def walk(answer, prompt, drafts, min_ngram, rng):
    """(steps, tokens, lookup steps, tokens accepted by lookups) for one answer."""
    lookup = NgramProposer(4, drafts + 1, vocab=1, max_ngram=4, min_ngram=min_ngram)
    lookup.begin([prompt])
    pos, steps, lookup_steps, lookup_accepted = 0, 0, 0, 0
    while pos < len(answer) - 1:  # answer[pos]: the target's own token; drafts guess answer[pos + 1:]
        found = lookup.continuations(0, answer[pos])
        if found:
            follow = max(found, key=len)
            accepted = 0
            while accepted < len(follow) and pos + 1 + accepted < len(answer) \
                    and follow[accepted] == answer[pos + 1 + accepted]:
                accepted += 1
            lookup_steps, lookup_accepted = lookup_steps + 1, lookup_accepted + accepted
        else:
            accepted = 0
            for p in HEAD_ACCEPTANCE:
                if rng.random() >= p:
                    break
                accepted += 1
            accepted = min(accepted, len(answer) - 1 - pos)
        lookup.commit([answer[pos:pos + accepted + 1]])
        pos, steps = pos + accepted + 1, steps + 1
    return steps, pos, lookup_steps, lookup_accepted


def depth_acceptance(answers, drafts: int = 6):
    """P(lookup draft k is the answer's token | drafts 1..k-1 were), 2-gram triggers, lookups only
    (a step without one advances one token), every lookup `drafts` long: (reached, accepted) per depth.
    A streak that may not grow past `drafts` is exactly that walk; its two halves add up."""
    reached, accepted = streak_acceptance(answers, drafts=drafts, longest=drafts)
    return reached.sum(axis=0), accepted.sum(axis=0)


def streak_acceptance(answers, drafts: int = 4, longest: int = 16):
    """As `redrafter --lookup drafts` with streaks: a lookup accepted whole doubles the next one (up
    to `longest`), anything else resets it. Per depth, for lookups outside a streak [0] and in one
    [1]: (reached, accepted)."""
    reached, accepted = np.zeros((2, longest)), np.zeros((2, longest))
    for answer, prompt in answers:
        lookup = NgramProposer(4, longest + 1, vocab=1, max_ngram=4, min_ngram=2)
        lookup.begin([prompt])
        pos, streak, allowed = 0, 0, drafts
        while pos < len(answer) - 1:
            found, n = lookup.continuations(0, answer[pos]), 0
            if found:
                follow = max(found, key=len)[:allowed]
                for k in range(min(len(follow), len(answer) - 1 - pos)):
                    reached[streak, k] += 1
                    if follow[k] != answer[pos + 1 + k]:
                        break
                    accepted[streak, k], n = accepted[streak, k] + 1, n + 1
                streak = int(n == len(follow))
            else:
                streak = 0
            allowed = min(2 * allowed, longest) if streak else drafts
            lookup.commit([answer[pos:pos + n + 1]])
            pos += n + 1
    return reached, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=f"{DATA}/train_prompts_natural,{DATA}/train_prompts_natural2")
    parser.add_argument("--prompts", default="data/train_prompts_natural.jsonl,data/train_prompts_natural2.jsonl")
    parser.add_argument("--drafts", default="2,4,6")
    parser.add_argument("--min-ngram", default="1,2,3")
    parser.add_argument("--depths", action="store_true", help="print the lookup's acceptance per draft depth")
    parser.add_argument("--streaks", action="store_true",
                        help="the same outside and inside a streak of whole accepted lookups (4 drafts, up to 16)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path.home() / ".cache/mlx-specdec/models/SmolLM2-135M-Instruct-f16"))
    answers = []
    for directory, prompt_file in zip(args.data.split(","), args.prompts.split(",")):
        rows = {str(r["id"]): r for r in load_train_prompts(ROOT / prompt_file)}
        seqs = load_split(Path(directory), "valid")
        for i, pid in enumerate(seqs.prompt_ids):
            prompt = tokenizer.apply_chat_template(row_messages(rows[str(pid)]), add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
            answers.append((seqs.tokens[seqs.offsets[i]:seqs.offsets[i + 1]].tolist(), list(prompt)))
    print(f"{len(answers)} held-out answers, {sum(len(a) for a, _ in answers)} tokens; head alone: "
          f"{1 + HEAD_ACCEPTANCE[0] + HEAD_ACCEPTANCE[0] * HEAD_ACCEPTANCE[1]:.3f} tokens a step")
    if args.streaks:
        reached, accepted = streak_acceptance(answers)
        print("| depth | lookups outside a streak | P(accepted given the drafts before) | in a streak | P(...) |")
        print("|---:|---:|---:|---:|---:|")
        for k in range(reached.shape[1]):
            print(f"| {k + 1} | {int(reached[0, k])} | {accepted[0, k] / max(1, reached[0, k]):.3f} | "
                  f"{int(reached[1, k])} | {accepted[1, k] / max(1, reached[1, k]):.3f} |")
        return
    if args.depths:
        reached, accepted = depth_acceptance(answers)
        print("| depth | lookups reaching it | P(accepted given the drafts before) |\n|---:|---:|---:|")
        for k, (r, a) in enumerate(zip(reached, accepted)):
            print(f"| {k + 1} | {int(r)} | {a / max(1, r):.3f} |")
        return
    print("| min n-gram | lookup drafts | tokens/step | lookup steps | accepted per lookup step |")
    print("|---:|---:|---:|---:|---:|")
    for min_ngram in [int(x) for x in args.min_ngram.split(",")]:
        for drafts in [int(x) for x in args.drafts.split(",")]:
            rng = np.random.default_rng(0)
            totals = np.sum([walk(a, p, drafts, min_ngram, rng) for a, p in answers], axis=0)
            steps, tokens, lookups, accepted = (int(t) for t in totals)
            print(f"| {min_ngram} | {drafts} | {tokens / steps:.3f} | {lookups / steps:.2f} | {accepted / max(1, lookups):.2f} |")


if __name__ == "__main__":
    main()
