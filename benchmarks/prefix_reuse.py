"""Time to first token of a chat's follow-up question about a long document, with and without
prefix reuse (the engine keeps the last prompt's KV cache: `cache/prefix.py`).

    python benchmarks/prefix_reuse.py [--file /usr/share/common-licenses/GPL-3] [--chars 26000]
        [--method ar] [--max-tokens 32]

Turn 1 asks about the document; turn 2 repeats the conversation (document, question, answer) and
asks a follow-up. Without reuse turn 2 prefills everything again; with it only the answer and
the new question. The follow-up's answer must be the same both ways. Run it alone.
"""

import argparse
import time

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine

QUESTIONS = ("What is this document? Answer in one sentence.",
             "Which section talks about conveying verbatim copies? Quote its first sentence.")


def turn(engine, messages, method, max_tokens):
    start = time.perf_counter()
    events = list(engine.chat(messages, method, GenerationParams(max_tokens=max_tokens)))
    stats = events[-1].stats
    text = "".join(e.text for e in events if e.kind == "token")
    return text, stats, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--chars", type=int, default=26000)
    parser.add_argument("--method", default="ar")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    document = open(args.file, encoding="utf-8").read()[: args.chars]
    first = [{"role": "user", "content": f"{document}\n\n{QUESTIONS[0]}"}]
    answers = {}
    for reuse in (False, True):
        engine = Engine.load("default", reuse_prefix=reuse)
        answer, stats, _ = turn(engine, first, args.method, args.max_tokens)
        follow_up = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]
        answers[reuse], stats2, _ = turn(engine, follow_up, args.method, args.max_tokens)
        print(f"reuse {'on ' if reuse else 'off'} | {args.method} | turn 1: {stats.prompt_tokens} prompt tokens, "
              f"TTFT {stats.ttft_s:.2f} s | follow-up: {stats2.prompt_tokens} prompt tokens, "
              f"{stats2.extra.get('prefix_reused', 0)} reused, TTFT {stats2.ttft_s:.2f} s", flush=True)
    print("follow-up answers identical" if answers[False] == answers[True] else "follow-up answers DIFFER")


if __name__ == "__main__":
    main()
