"""Two ways of running the default model's blocks on the CPU, A/B in one process.

    python benchmarks/compiled_block_ab.py                 # compiled blocks vs op by op
    python benchmarks/compiled_block_ab.py --joined        # blocks joined in pairs vs each alone
    python benchmarks/compiled_block_ab.py --rope-tables   # RoPE's tables once a forward vs per layer
    python benchmarks/compiled_block_ab.py --rope-tables --tree  # the same for verified trees
    python benchmarks/compiled_block_ab.py --exact-attention --context 600  # MLX's attention op vs exact_attention

Forwards of T = 1..5 query tokens after 150 cached tokens (--context), both ways interleaved, every logit
computed; checks the two give the same bits first, then prints median milliseconds per way and
their ratio (benchmarks/results/compiled_block.md, issue18_stop37.md, issue18_stop38.md). The
first compares model/forward.py's compiled blocks with `_plain_block` (COMPILED_BLOCKS off);
--joined, `_compiled_layers` (each block's ops after its attention and the next block's before it
as one graph) with `_compiled_block` for every block; the third, both compiled, RoPE's cosines
and sines made once per forward (model/rope_table.py) with each layer's RoPE module making its own.
--tree verifies a tree at per-token positions instead of a chain (the root, a chain under it and
siblings of its first draft, as `redrafter`'s runners-up make them), where the layers' RoPE
rotates each token on its own (`rope_at`) and the tables give one row per token (`tables_at`).
--exact-attention compares MLX's own attention op with model/attention.py's `exact_attention` (its
ops as one compiled graph; T = 1..8: one query over fewer than 300 keys takes MLX's op either way).
"""

import argparse
import importlib
import time

import mlx_specdec  # noqa: F401  (preloads BLAS before mlx)
import mlx.core as mx
import numpy as np

from mlx_specdec import masks
from mlx_specdec.engine import Engine
from mlx_specdec.model.timing import prefilled

F = importlib.import_module("mlx_specdec.model.forward")  # the module, not the function
A = importlib.import_module("mlx_specdec.model.attention")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rope-tables", action="store_true", help="compare RoPE's shared tables instead")
    parser.add_argument("--joined", action="store_true", help="compare blocks joined in pairs instead")
    parser.add_argument("--exact-attention", action="store_true", help="compare exact_attention instead")
    parser.add_argument("--tree", action="store_true", help="verify trees at per-token positions")
    parser.add_argument("--context", type=int, default=150, help="cached tokens before each forward")
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    model = Engine.load("default").lm.model
    cache = prefilled(model, 1, args.context)
    tables, joined = F.RopeTables.for_forward, F._joined
    if args.exact_attention:
        names = ("MLX's op", "exact_attention")
        ways = {False: lambda: setattr(A, "EXACT_ATTENTION", False), True: lambda: setattr(A, "EXACT_ATTENTION", True)}
    elif args.joined:
        names = ("block by block", "joined")
        ways = {False: lambda: setattr(F, "_joined", lambda *a: False), True: lambda: setattr(F, "_joined", joined)}
    elif args.rope_tables:
        names = ("per layer", "tables")
        ways = {False: lambda: setattr(F.RopeTables, "for_forward", staticmethod(lambda layers, positions: None)),
                True: lambda: setattr(F.RopeTables, "for_forward", tables)}
    else:
        names = ("op by op", "compiled")
        ways = {False: lambda: setattr(F, "COMPILED_BLOCKS", False), True: lambda: setattr(F, "COMPILED_BLOCKS", True)}

    def run(tokens: int, use: bool):
        ways[use]()
        where = {}
        if args.tree:  # a chain of up to 3 from the root, the rest siblings of its first draft
            parents = [-1] + [min(i, 2) if i < 3 else 0 for i in range(tokens - 1)]
            where = dict(positions=masks.ragged_tree_positions(np.array([cache.offset]), [parents], tokens),
                         mask=masks.tree_tail_mask([parents], tokens))
        start = time.perf_counter()
        out = F.forward(model, mx.array([[5 + i for i in range(tokens)]]), cache, logits_for="all", **where)
        mx.eval(out.logits)
        seconds = time.perf_counter() - start
        cache.trim(tokens)
        return seconds, np.array(out.logits)

    for tokens in (1, 3, 5):
        assert np.array_equal(run(tokens, True)[1], run(tokens, False)[1]), "not the same bits"
    print(f"same bits; median ms of {args.rounds - 3} interleaved forwards after {args.context} tokens"
          + (" (trees at per-token positions)" if args.tree else ""))
    print(f"| query tokens | {names[0]} (ms) | {names[1]} (ms) | ratio |")
    print("|---:|---:|---:|---:|")
    counts = (1, 2, 3, 4, 5, 6, 8) if args.exact_attention else (1, 2, 3, 4, 5, 6) if args.tree else (1, 2, 3, 4, 5)
    for tokens in counts:
        times = {True: [], False: []}
        for round_ in range(args.rounds):
            for use in (False, True):
                seconds = run(tokens, use)[0]
                if round_ >= 3:
                    times[use].append(seconds)
        a, b = np.median(times[False]), np.median(times[True])
        print(f"| {tokens} | {1e3 * a:.2f} | {1e3 * b:.2f} | {b / a:.3f} |", flush=True)


if __name__ == "__main__":
    main()
