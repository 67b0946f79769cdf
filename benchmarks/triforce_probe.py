"""One long-document prompt through `ar` and `triforce`: identical output, speed, per-level figures.

    python benchmarks/triforce_probe.py [--file /usr/share/common-licenses/GPL-3] [--chars 26000]
        [--budget 512] [--gamma 6] [--bottom ngram] [--max-tokens 48]

A stand-in until the long-document prompt set and `bench --context-length` exist: the first
`--chars` characters of a text file (Debian ships the GPL in every install), then a question that
makes the answer quote the document. Prints one line per method. Run it alone.
"""

import argparse

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine

QUESTION = "Quote the first sentence of section 2 above, word for word."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--chars", type=int, default=26000)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--bottom", default="ngram")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    text = open(args.file, encoding="utf-8").read()[: args.chars]
    engine = Engine.load("default")
    ids = engine.lm.encode_chat([{"role": "user", "content": text + "\n\n" + QUESTION}])
    reference = None
    options = {"budget": args.budget, "gamma": args.gamma, "bottom": args.bottom}
    for method, opts in (("ar", {}), ("triforce", options)):
        events = list(engine.generate_ids(ids, method, GenerationParams(max_tokens=args.max_tokens, options=opts)))
        tokens = [t for e in events if e.kind == "token" for t in e.tokens]
        reference = reference if reference is not None else tokens
        stats = events[-1].stats
        figures = {k: stats.extra[k] for k in ("budget", "bottom_acceptance", "middle_acceptance",
                                               "tokens_per_full_forward", "middle_forwards") if k in stats.extra}
        print(f"{len(ids)} prompt tokens | {method} | decode {stats.decode_tps:.2f} tok/s | prefill {stats.prefill_s:.1f} s"
              f" | {stats.forward_passes} full forwards | {figures} | "
              f"{'identical to ar' if tokens == reference else 'DIFFERENT from ar'}", flush=True)


if __name__ == "__main__":
    main()
