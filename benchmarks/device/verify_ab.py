"""What a T-token verify forward costs on CUDA, two ways in one process, interleaved, and T tokens
against one: as shipped (the key bucket read from the cache buffer and its mask built once per
forward, model/forward.py), and the keys and mask padded in every layer (attention.bucket_keys,
the build before). (At b28d02e a third column timed chains attending per query: dropped, slower
over 1000 keys.)

    python benchmarks/device/verify_ab.py --model default --context 150,1000 --tokens 1,2,3,4,6,8

Meant for the lent NVIDIA machine (benchmarks/device/cuda_bench.sh); on the CPU both are the same
path (no bucket). Prints a markdown table: median ms per forward, each T as a multiple of T = 1.
"""

import argparse
import importlib
import time

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx on a CPU)
import mlx.core as mx
import numpy as np

from mlx_specdec import masks
from mlx_specdec.engine import Engine
from mlx_specdec.model.forward import forward
from mlx_specdec.model.timing import prefilled

forward_module = importlib.import_module("mlx_specdec.model.forward")  # the package re-exports `forward`
SHIPPED_BUCKET = forward_module.verify_key_bucket
PATHS = ("bucket once", "pad per layer")


def use(path: str) -> None:
    forward_module.verify_key_bucket = (lambda *args: None) if path == "pad per layer" else SHIPPED_BUCKET


def timed(model, cache, tokens: int, tree: bool) -> float:
    """Seconds of one verify forward of `tokens` tokens in one row (every logit), the cache as before."""
    context = cache.offset
    parents = [-1] + list(range(tokens - 1))
    positions = masks.ragged_tree_positions(np.array([context]), [parents], tokens) if tree else None
    mask = masks.tree_tail_mask([parents], tokens) if tree else None
    start = time.perf_counter()
    out = forward(model, mx.array([[5 + i for i in range(tokens)]]), cache, positions=positions, mask=mask)
    mx.eval(out.logits)
    elapsed = time.perf_counter() - start
    cache.trim(tokens)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--context", default="150,1000")
    parser.add_argument("--tokens", default="1,2,3,4,6,8")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    lm = Engine.load(args.model, drafter=None, apar_adapter=None).lm
    model = lm.model
    paths = PATHS
    print(f"model {args.model} ({lm.dtype}), device {mx.default_device()}, median of {args.repeats} "
          "after 3 warm-ups, interleaved\n")
    print("| context | mask | T | " + " | ".join(f"{p} ms | x T=1" for p in paths) + " |")
    print("|---:|---|---:|" + "---:|---:|" * len(paths))
    for context in (int(c) for c in args.context.split(",")):
        cache = prefilled(model, 1, context)
        for tree in (False, True):
            base = {}
            for tokens in (int(t) for t in args.tokens.split(",")):
                times = {p: [] for p in paths}
                for i in range(args.repeats + 3):
                    for name in paths:  # interleaved: drift hits all alike
                        use(name)
                        elapsed = timed(model, cache, tokens, tree)
                        if i >= 3:
                            times[name].append(elapsed)
                use("bucket once")
                cells = []
                for name in paths:
                    ms = 1000 * float(np.median(times[name]))
                    base.setdefault(name, ms)
                    cells.append(f"{ms:.2f} | {ms / base[name]:.2f}")
                print(f"| {context} | {'tree' if tree else 'causal'} | {tokens} | " + " | ".join(cells) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
