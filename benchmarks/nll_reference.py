"""How far APAR's quality guard moves for answers the original model itself writes.

    python benchmarks/nll_reference.py [--shapes list] [--limit 12] [--max-tokens 192] \
        [--temps 0.3,0.7,1.0] [--seeds 0,1]

The guard (`mlx_specdec.apar.quality`) scores an answer by its mean per-token NLL under the
original model, against the original model's own greedy answer to the same prompt. Greedy
decoding picks the likeliest token at every step, so any other answer scores higher, even one
the original model wrote itself. This prints, for the same prompts, the ratio the guard would
report for the original model's own *sampled* answers at a few temperatures (plain decoding,
seeded), next to greedy's 1.00: a scale for the guard's 1.10 threshold and APAR's figure.
"""

import argparse
import statistics
import sys

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
from tqdm import tqdm

from mlx_specdec.apar.quality import answer_nll
from mlx_specdec.bench import load_prompts
from mlx_specdec.decoding.base import GenerationParams
from mlx_specdec.engine import Engine


def answer_tokens(engine: Engine, prompt_ids, params: GenerationParams):
    tokens = []
    for event in engine.generate_ids(prompt_ids, "ar", params):
        if event.kind == "token":
            tokens.extend(event.tokens)
    return tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default=None, help="prompt file (default: benchmarks/prompts.jsonl)")
    parser.add_argument("--shapes", default="list")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--temps", default="0.3,0.7,1.0")
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    temps = [float(t) for t in args.temps.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    engine = Engine.load("default")
    lm = engine.lm
    prompts = load_prompts(args.prompts, args.limit, shapes=args.shapes.split(","))

    def nll(prompt_ids, tokens):
        return answer_nll(lm, prompt_ids, lm.tokenizer.decode(tokens))

    greedy, sampled = [], {t: [] for t in temps}  # per prompt: NLL; per temp: (prompt index, NLL)
    runs = len(prompts) * (1 + len(temps) * len(seeds))
    with tqdm(total=runs, unit="answer", file=sys.stderr) as bar:
        for index, prompt in enumerate(prompts):
            prompt_ids = lm.encode_prompt(prompt.text)
            greedy.append(nll(prompt_ids, answer_tokens(engine, prompt_ids, GenerationParams(max_tokens=args.max_tokens))))
            bar.update(1)
            for temp in temps:
                for seed in seeds:
                    params = GenerationParams(max_tokens=args.max_tokens, temperature=temp, seed=seed)
                    sampled[temp].append((index, nll(prompt_ids, answer_tokens(engine, prompt_ids, params))))
                    bar.update(1)

    # The guard's ratio: mean NLL of the answers over the mean NLL of greedy's (as `bench` reports it).
    print(f"{len(prompts)} prompts (shapes {args.shapes}), at most {args.max_tokens} new tokens, "
          f"seeds {args.seeds}; mlx {mx.__version__}, {mx.default_device()}, {lm.dtype}")
    print("| original model's answers | mean NLL (nats/token) | vs greedy (the guard's ratio) | per-prompt ratio, median |")
    print("|---|---:|---:|---:|")
    base = statistics.fmean(greedy)
    print(f"| greedy | {base:.3f} | 1.00 | 1.00 |")
    for temp in temps:
        values = [v for _, v in sampled[temp]]
        per_prompt = statistics.median(v / greedy[i] for i, v in sampled[temp])
        print(f"| sampled, temperature {temp:g} | {statistics.fmean(values):.3f} | "
              f"{statistics.fmean(values) / base:.2f} | {per_prompt:.2f} |")


if __name__ == "__main__":
    main()
