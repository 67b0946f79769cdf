"""What a forward with more than one query token costs on this machine, against one token.

    python benchmarks/forward_cost.py [--context 300] [--tokens 1,2,3,4,6,8,12,16]
    python benchmarks/forward_cost.py --one-row --context 150,2000,6000 --tokens 1,2,3,4,5 --repeats 7
    python benchmarks/forward_cost.py --layout --context 150 --tokens 1,2,3,5,8

The second form prints ReDrafter's verify-cost table (drafting/verify_cost.py's CPU_COST; `mlx-specdec
calibrate` measures and stores the same for the machine it runs on): one row
of T tokens, as a multiple of one token, per context length. The third compares the float32 weights
row-major (as mlx-lm loads them) with the same weights column-major (model/cpu_layout.py: the
engine keeps the faster on this machine), in one process.

Speculative methods buy fewer forwards with wider ones: ReDrafter verifies a packed tree of T
tokens in one row, APAR decodes T live threads as T rows of one token. Either only pays off if
a T-token forward costs much less than T one-token forwards. Prints, for the default model
after a `--context`-token prompt, the median time of one forward (with the vocabulary
projection for every query token, as verification needs) for T tokens in one row and for T rows
of one token each, and both as a multiple of the one-token forward. Run it on a quiet machine.
"""

import argparse

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from mlx_specdec import masks
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.model.timing import median_ms, prefilled
from mlx_specdec.engine import Engine
from mlx_specdec.model.cpu_layout import COLUMN, ROW, current_layout, store_layout
from mlx_specdec.model.forward import forward


def forward_ms(model, rows: int, tokens: int, context: int, repeats: int, tree_mask: bool = False,
               cache: ContiguousKVCache = None) -> float:
    """tree_mask: the chain as ReDrafter verified it before it took the causal path (explicit
    positions and a tail-mask array) instead of contiguous positions and SDPA's causal mask.
    cache: one already holding `context` tokens for `rows` rows (left as it was)."""
    cache = cache or prefilled(model, rows, context)
    query = mx.array([[5 + i for i in range(tokens)] for _ in range(rows)])

    chain = [list(range(-1, tokens - 1))] * rows
    positions = masks.ragged_tree_positions(np.full(rows, context), chain, tokens) if tree_mask else None
    mask = masks.tree_tail_mask(chain, tokens) if tree_mask else None

    def step():
        out = forward(model, query, cache, positions=positions, mask=mask, logits_for="all")
        mx.eval(out.logits)
        cache.trim(tokens)  # the next repeat sees the same context

    return median_ms(step, repeats=repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", default="300")
    parser.add_argument("--tokens", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", default="default", help="as `mlx-specdec bench --model` (default: default)")
    parser.add_argument("--tree-mask", action="store_true",
                        help="add a column: T tokens in one row with explicit positions and a tree (tail) mask")
    parser.add_argument("--one-row", action="store_true",
                        help="only T tokens in one row, for each of a comma list of --context lengths")
    parser.add_argument("--layout", action="store_true",
                        help="one row of T tokens with column-major and with row-major weights")
    args = parser.parse_args()
    model = Engine.load(args.model).lm.model
    counts = [int(t) for t in args.tokens.split(",")]
    if args.layout:
        return layout_table(model, int(args.context.split(",")[0]), counts, args.repeats)
    if args.one_row:
        return one_row_table(model, [int(c) for c in args.context.split(",")], counts, args.repeats)
    args.context = int(args.context)
    print(f"context {args.context} tokens; median of {args.repeats} forwards; mlx {mx.__version__}, "
          f"{mx.default_device()} ({mx.device_info().get('device_name', '?')}), model {args.model}")
    extra = " with a tree mask (ms) | x one token |" if args.tree_mask else ""
    print("| T | T tokens in one row (ms) | x one token | T rows of one token (ms) | x one token |" + extra)
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.tree_mask else ""))
    one = None
    for t in counts:
        row = forward_ms(model, 1, t, args.context, args.repeats)
        rows = forward_ms(model, t, 1, args.context, args.repeats)
        one = one or row
        tree = ""
        if args.tree_mask:
            tree_ms = forward_ms(model, 1, t, args.context, args.repeats, tree_mask=True)
            tree = f" {tree_ms:.1f} | {tree_ms / one:.2f} |"
        print(f"| {t} | {row:.1f} | {row / one:.2f} | {rows:.1f} | {rows / one:.2f} |" + tree, flush=True)


def one_row_table(model, contexts, counts, repeats) -> None:
    print(f"one row of T query tokens after each context, as a multiple of one token; median of {repeats}; "
          f"mlx {mx.__version__}, {mx.default_device()}")
    print("| context | " + " | ".join(f"T={t}" for t in counts) + " |")
    print("|---:|" + "---:|" * len(counts))
    for context in contexts:
        cache = prefilled(model, 1, context)
        ms = [forward_ms(model, 1, t, context, repeats, cache=cache) for t in counts]
        print(f"| {context} | " + " | ".join(f"{m / ms[0]:.2f}" for m in ms) + f" |  (T=1: {ms[0]:.1f} ms)", flush=True)


def layout_table(model, context, counts, repeats) -> None:
    """Every T with the weights column-major, then every T again with them row-major (re-laid in
    place, one matrix at a time, as a load does)."""
    print(f"one row of T query tokens after {context}; median of {repeats}; loaded {current_layout(model)}-major; "
          f"mlx {mx.__version__}, {mx.default_device()}")
    cache = prefilled(model, 1, context)
    store_layout(model, COLUMN)
    column = [forward_ms(model, 1, t, context, repeats, cache=cache) for t in counts]
    store_layout(model, ROW)
    row = [forward_ms(model, 1, t, context, repeats, cache=cache) for t in counts]
    print("| T | row-major (ms) | x one token | column-major (ms) | x one token | column / row |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t, r, c in zip(counts, row, column):
        print(f"| {t} | {r:.1f} | {r / row[0]:.2f} | {c:.1f} | {c / column[0]:.2f} | {c / r:.3f} |")


if __name__ == "__main__":
    main()
