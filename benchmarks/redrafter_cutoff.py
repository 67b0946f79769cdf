"""Would a draft-probability cutoff make ReDrafter pay? A teacher-forced measurement.

    python benchmarks/redrafter_cutoff.py [--limit 16] [--max-tokens 96] [--length 5]

For each prompt (benchmarks/prompts.jsonl, or --prompts) the default model writes its greedy answer;
one forward over prompt + answer gives the hidden state that produced every answer token. At each
answer position the shipped head drafts its greedy chain of `length - 1` tokens with its own
probability of each; comparing with the answer gives how many drafts a greedy verify accepts
(exactly what `redrafter` with one beam would accept at that point). Then, per cutoff c, a step
verifies the last token plus the leading drafts whose probability is at least c (no draft: a plain
step), and the walk over the answer adds 1 + accepted tokens per step at the cost of a T-token
forward from a measured table (`--verify-cost`; default benchmarks/results/forward_cost_cpu.md).
A prediction, not a measurement: `mlx-specdec bench --draft-cutoff` is the measure. Prints tokens per step,
steps per token, and the predicted speed-up over plain decoding for each cutoff (draft cost included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx_specdec  # noqa: F401  (BLAS first)
import mlx.core as mx
import numpy as np

from mlx_specdec.distributed.drafters import HeadDrafter
from mlx_specdec.engine import Engine
from mlx_specdec.model.forward import forward

# a T-token forward's cost as a multiple of one plain decoding step (forward_cost_cpu.md, 2026-11-23)
VERIFY_COST = {1: 1.00, 2: 1.20, 3: 1.39, 4: 1.56, 5: 1.63, 6: 1.69}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default=str(Path(__file__).with_name("prompts.jsonl")))
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--length", type=int, default=5, help="beam length: the last token + length-1 drafts")
    parser.add_argument("--draft-cost", type=float, default=0.2, help="one chain's cost, x one token (card: 0.13-0.27)")
    parser.add_argument("--verify-cost", default=None,
                        help="T:cost,... a T-token forward's cost in plain steps (default: forward_cost_cpu.md's table)")
    args = parser.parse_args()
    if args.verify_cost:
        VERIFY_COST.update({int(k): float(v) for k, v in (item.split(":") for item in args.verify_cost.split(","))})
    engine = Engine.load("default")
    lm = engine.lm
    drafter = HeadDrafter(engine.drafter, lm.model.model.embed_tokens, lm.model.model.embed_tokens.weight.shape[0],
                          args.length - 1)
    from mlx_specdec.decoding import GenerationParams

    prompts = [json.loads(line)["turns"][0] for line in open(args.prompts)][: args.limit]
    steps = []  # per answer position: (accepted drafts, draft probabilities)
    for text in prompts:
        ids = lm.encode_prompt(text)
        events = list(engine.generate_ids(ids, "ar", GenerationParams(max_tokens=args.max_tokens)))
        answer = [t for e in events if e.kind == "token" for t in e.tokens]
        hidden = forward(lm.model, mx.array([ids + answer]), None, logits_for="none").hidden[0]  # (P+A, D)
        for i in range(len(answer) - 1):
            # answer[i] was produced from the hidden state at position len(ids) - 1 + i
            drafter.observe(hidden[len(ids) - 1 + i], answer[i], 0)
            truth = answer[i + 1:i + args.length]
            accepted = 0
            for d, t in zip(drafter.chain, truth):
                if d != t:
                    break
                accepted += 1
            steps.append((accepted, list(drafter.confidence)))
        print(f"{len(steps)} positions", file=sys.stderr)
    print(f"{len(prompts)} prompts, {len(steps)} answer positions, chain of {args.length - 1} drafts\n")
    print("| cutoff | drafts verified / step | tokens / step | cost / step (x plain) | predicted speed-up |")
    print("|---:|---:|---:|---:|---:|")
    by_position = {i: steps[i] for i in range(len(steps))}
    for cutoff in [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01]:
        i = tokens = cost = verified = count = 0
        while i in by_position:
            accepted, probs = by_position[i]
            keep = 0
            while keep < len(probs) and probs[keep] >= cutoff:
                keep += 1
            gained = 1 + min(accepted, keep)
            tokens += gained
            cost += VERIFY_COST[1 + keep] + args.draft_cost  # the chain is drafted before its probabilities are read
            verified += keep
            count += 1
            i += gained
        print(f"| {cutoff:.1f} | {verified / count:.2f} | {tokens / count:.3f} | {cost / count:.3f} | "
              f"{tokens / cost:.3f}x |")
    first = np.array([p[0] for _, p in steps])
    hit = np.array([a >= 1 for a, _ in steps])
    print("\nCalibration of the first draft (its probability vs how often it was right):")
    for lo, hi in [(0, .2), (.2, .4), (.4, .6), (.6, .8), (.8, 1.01)]:
        pick = (first >= lo) & (first < hi)
        if pick.any():
            print(f"  p in [{lo:.1f}, {hi:.1f}): {pick.sum()} positions, right {hit[pick].mean():.2f}")


if __name__ == "__main__":
    main()
