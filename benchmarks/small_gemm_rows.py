"""The small-row GEMM (mlx_specdec/native/small_gemm.c) over the default model's weight matrices, for
1..8 rows of x, with its prefetch of the weights and without, interleaved in one process.

    python benchmarks/small_gemm_rows.py [--rows 1,2,3,4,5,6,8] [--repeats 15]
    python benchmarks/small_gemm_rows.py --pairs [--rows 1,2,3,4,5,6,8]
    python benchmarks/small_gemm_rows.py --values 6000 [--rows 3,6,9,15]
    python benchmarks/small_gemm_rows.py --scores 6000 [--rows 3,9,15,24]

The second form times attention's value product instead, as the grouped CPU attention runs it
after `--values` cached tokens: (rows, keys) @ values (keys, head dim) for every layer and KV
head (x @ W, not transposed), with several vectors of columns a pass (shipped) against one. The
third its scores, (rows, head dim) @ keys (keys, head dim).T: from 4 rows a group, 8 keys at once with
their dot products summed together (shipped), against one key at a time.

A verify multiplies a few rows by every weight matrix; the kernel streams each weight row once for
up to 8 rows. Memory-bound for 1-3 rows; from ~4 rows on the FMAs take long enough that, without
help, the hardware prefetcher falls behind the weight stream. Builds the kernel twice into a
temporary folder (as mlx_specdec/_blas.py does, once with PREFETCH_MIN_ROWS=99: no prefetch), calls
`small_gemm` directly on float32 copies of the model's 2-D weights (x @ W.T, both threads), and
prints the median milliseconds for all of them per row count, and whether both give the same bits.
"""

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)
from mlx_specdec import _blas
import numpy as np
from mlx.utils import tree_flatten

from mlx_specdec.engine import Engine
from mlx_specdec.model.timing import median_ms

FLOAT_P = ctypes.POINTER(ctypes.c_float)


def build(folder: Path, name: str, defines: tuple) -> ctypes.CDLL:
    target = folder / f"{name}.so"
    subprocess.run(["gcc", *_blas.SMALL_GEMM_FLAGS, *defines, str(_blas.SMALL_GEMM_SOURCE), "-o", str(target)],
                   check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(target), mode=ctypes.RTLD_LOCAL)


def all_products(library: ctypes.CDLL, weights, x: np.ndarray, out: np.ndarray, rows: int) -> None:
    for w in weights:  # C (rows, N) = x (rows, K) @ W (N, K).T
        n, k = w.shape
        library.small_gemm(1, rows, n, k, ctypes.c_float(1.0), x.ctypes.data_as(FLOAT_P), k,
                           w.ctypes.data_as(FLOAT_P), k, ctypes.c_float(0.0), out.ctypes.data_as(FLOAT_P), n)


def value_products(library: ctypes.CDLL, values, weights: np.ndarray, out: np.ndarray) -> None:
    rows, keys = weights.shape
    for v in values:  # C (rows, D) = P (rows, keys) @ V (keys, D)
        head_dim = v.shape[1]
        library.small_gemm(0, rows, head_dim, keys, ctypes.c_float(1.0), weights.ctypes.data_as(FLOAT_P), keys,
                           v.ctypes.data_as(FLOAT_P), head_dim, ctypes.c_float(0.0), out.ctypes.data_as(FLOAT_P),
                           head_dim)


def score_products(library: ctypes.CDLL, keys, queries: np.ndarray, out: np.ndarray) -> None:
    rows, head_dim = queries.shape
    for k in keys:  # C (rows, keys) = Q (rows, D) @ K (keys, D).T
        library.small_gemm(1, rows, k.shape[0], head_dim, ctypes.c_float(1.0), queries.ctypes.data_as(FLOAT_P),
                           head_dim, k.ctypes.data_as(FLOAT_P), head_dim, ctypes.c_float(0.0),
                           out.ctypes.data_as(FLOAT_P), k.shape[0])


def interleaved_table(variants: dict, row_counts, repeats: int, product, width: int) -> None:
    """product(library, rows, out (rows, width)) for each variant, interleaved: median ms per row
    count, the first variant against the second, and whether all gave the same bits."""
    print("| rows | " + " | ".join(f"{name} (ms)" for name in variants) + " | ratio | same bits |")
    print("|---:|" + "---:|" * (len(variants) + 2))
    for rows in row_counts:
        outs = {name: np.zeros((rows, width), np.float32) for name in variants}
        times = {name: [] for name in variants}
        for _ in range(repeats):
            for name, library in variants.items():
                times[name].append(median_ms(lambda: product(library, rows, outs[name]), repeats=1, warmup=0))
        med = [float(np.median(t)) for t in times.values()]
        first = next(iter(outs.values()))
        same = all(np.array_equal(first, out) for out in outs.values())
        print(f"| {rows} | " + " | ".join(f"{m:.2f}" for m in med) + f" | {med[0] / med[1]:.2f} | {same} |",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,6,8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--values", type=int, default=0, metavar="KEYS",
                        help="time the attention value products after KEYS cached tokens instead")
    parser.add_argument("--scores", type=int, default=0, metavar="KEYS",
                        help="time the attention score products over KEYS cached tokens instead")
    parser.add_argument("--pairs", action="store_true",
                        help="compare two weight rows a pass (shipped) with one, instead of the prefetch")
    args = parser.parse_args()
    model = Engine.load("default").lm.model
    row_counts = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        config = model.args
        head_dim = config.hidden_size // config.num_attention_heads
        heads = config.num_hidden_layers * config.num_key_value_heads
        if args.scores:  # (rows, head_dim) @ (keys, head_dim).T per layer and KV head
            keys = [rng.standard_normal((args.scores, head_dim)).astype(np.float32) for _ in range(heads)]
            queries = {rows: rng.standard_normal((rows, head_dim)).astype(np.float32) for rows in row_counts}
            variants = {"8 keys at once (shipped)": build(Path(folder), "eight", ()),
                        "one key at a time": build(Path(folder), "one", ("-DNT8_ENABLED=0",))}
            print(f"{heads} score products (layers x KV heads) over ({args.scores}, {head_dim}); "
                  f"median of {args.repeats}, interleaved")
            interleaved_table(variants, row_counts, args.repeats,
                              lambda lib, rows, out: score_products(lib, keys, queries[rows], out), args.scores)
            return
        if args.values:  # (rows, keys) @ (keys, head_dim) per layer and KV head
            values = [rng.standard_normal((args.values, head_dim)).astype(np.float32) for _ in range(heads)]
            weights = {rows: rng.random((rows, args.values)).astype(np.float32) for rows in row_counts}
            variants = {"vectors a pass (shipped)": build(Path(folder), "blocks", ()),
                        "one vector a pass": build(Path(folder), "one", ("-DSMALL_GEMM_NN_ONE_VECTOR",))}
            print(f"{heads} value products (layers x KV heads) of ({args.values}, {head_dim}); "
                  f"median of {args.repeats}, interleaved")
            interleaved_table(variants, row_counts, args.repeats,
                              lambda lib, rows, out: value_products(lib, values, weights[rows], out), head_dim)
            return
        matrices = [np.ascontiguousarray(np.array(w, dtype=np.float32))
                    for _, w in tree_flatten(model.parameters()) if w.ndim == 2]
        nbytes = sum(w.nbytes for w in matrices)
        widest = max(max(w.shape) for w in matrices)
        x = rng.standard_normal((8, widest)).astype(np.float32)
        if args.pairs:
            variants = {"two weight rows a pass (shipped)": build(Path(folder), "pairs", ()),
                        "one weight row a pass": build(Path(folder), "single", ("-DNT_PAIR_MAX_ROWS=0",))}
        else:
            variants = {"prefetch (shipped)": build(Path(folder), "prefetch", ()),
                        "no prefetch": build(Path(folder), "plain", ("-DPREFETCH_MIN_ROWS=99",))}
        print(f"{len(matrices)} matrices, {nbytes / 1e6:.0f} MB float32; median of {args.repeats}, variants interleaved")
        interleaved_table(variants, row_counts, args.repeats,
                          lambda lib, rows, out: all_products(lib, matrices, x, out, rows), widest)


if __name__ == "__main__":
    main()
