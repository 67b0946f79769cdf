"""What a T-token forward over a long cache costs here, and where the time goes: the verify table.

    python benchmarks/attention_cost.py [--contexts 256,2048,4096,8000] [--tokens 1,6]
        [--repeats 7] [-o benchmarks/results/attention_cost_cpu.md]

Speculation over a long context pays only if verifying T tokens costs little more than one
step: the KV cache is read once either way. Prints, for the default model (float32) after a
prompt of each context length:

1. the forward table: the prefill time of the context (chunks of 1024) and the median time of
   one forward with T query tokens (logits for every query, as a verify needs), with MLX's own
   attention (`fused`, `mx.fast.scaled_dot_product_attention`), the grouped path of
   mlx_specdec/model/attention.py from GROUPED_MIN_KEYS keys (`grouped`) and the engine's attention
   (`engine`: `exact_attention` on the CPU in float32), and the T-token / 1-token ratios;
2. one layer's attention split into its parts at the model's shapes (9 query heads, 3 KV heads,
   head size 64): the two matmuls, MLX's `exp` and softmax, the fast `exp`, the whole fused and
   grouped attention, and the largest difference between the two outputs.

Run it alone on a quiet machine; it reports the environment with the table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import median_ms  # noqa: E402

from mlx_specdec import _allocator, _blas  # noqa: E402
from mlx_specdec.cache import ContiguousKVCache  # noqa: E402
from mlx_specdec.engine import Engine  # noqa: E402
from mlx_specdec.model import attention as attn_mod  # noqa: E402
from mlx_specdec.model.forward import forward  # noqa: E402


def prefilled_cache(model, context: int) -> ContiguousKVCache:
    cache = ContiguousKVCache.for_model(model)
    prompt = mx.array([[1000 + (i * 7) % 5000 for i in range(context)]])
    for start in range(0, context, 1024):  # chunked prefill: bounded memory at 8K
        forward(model, prompt[:, start:start + 1024], cache, logits_for="none")
        mx.eval(cache.state)
    return cache


def forward_ms(model, cache, tokens: int, repeats: int) -> float:
    query = mx.array([[5 + i for i in range(tokens)]])

    def step():
        out = forward(model, query, cache, logits_for="all")
        mx.eval(out.logits)
        cache.trim(tokens)  # the next repeat sees the same context

    return median_ms(step, repeats=repeats, warmup=2)


def forward_table(model, contexts, tokens, repeats, bar) -> list:
    lines = ["| context | path | prefill (s) | " + " | ".join(f"T={t} (ms)" for t in tokens) + " | "
             + " | ".join(f"T={t} / T={tokens[0]}" for t in tokens[1:]) + " |",
             "|---:|---|---:|" + "---:|" * (2 * len(tokens) - 1)]
    threshold, exact = attn_mod.GROUPED_MIN_KEYS, attn_mod.EXACT_ATTENTION
    for context in contexts:
        for path in ("fused", "grouped", "engine"):
            attn_mod.GROUPED_MIN_KEYS = 10 ** 9 if path == "fused" else threshold
            attn_mod.EXACT_ATTENTION = path == "engine"
            start = time.perf_counter()
            cache = prefilled_cache(model, context)
            prefill_s = time.perf_counter() - start
            times = []
            for t in tokens:
                times.append(forward_ms(model, cache, t, repeats))
                bar.update(1)
            del cache
            ratios = [f"{x / times[0]:.2f}" for x in times[1:]]
            lines.append(f"| {context} | {path} | {prefill_s:.1f} | " + " | ".join(f"{x:.1f}" for x in times)
                         + " | " + " | ".join(ratios) + " |")
    attn_mod.GROUPED_MIN_KEYS, attn_mod.EXACT_ATTENTION = threshold, exact
    return lines


def parts_table(contexts, tokens, repeats, bar) -> list:
    Hq, Hkv, Dh = 9, 3, 64
    lines = ["| context | T | q·K (ms) | MLX exp (ms) | MLX softmax (ms) | fast exp (ms) | p·V (ms) | "
             "fused attention (ms) | grouped attention (ms) | max abs diff |",
             "|---:|---:|" + "---:|" * 8]
    for context in contexts:
        for t in tokens:
            mx.random.seed(0)
            q = mx.random.normal((1, Hq, t, Dh))
            k = mx.random.normal((1, Hkv, context, Dh))
            v = mx.random.normal((1, Hkv, context, Dh))
            qg = q.reshape(1, Hkv, Hq // Hkv * t, Dh)
            scores = qg @ k.swapaxes(-1, -2)
            shifted = scores - scores.max(axis=-1, keepdims=True)
            mx.eval(q, k, v, qg, scores, shifted)
            mask = "causal" if t > 1 else None

            def timed(fn):
                return median_ms(lambda: mx.eval(fn()), repeats=repeats, warmup=2)

            fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
            grouped = attn_mod.grouped_attention(q, k, v, 0.125, mask)
            row = [timed(lambda: qg @ k.swapaxes(-1, -2)), timed(lambda: mx.exp(shifted)),
                   timed(lambda: mx.softmax(scores, axis=-1, precise=True)),
                   timed(lambda: attn_mod.fast_exp(shifted)), timed(lambda: shifted @ v),
                   timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)),
                   timed(lambda: attn_mod.grouped_attention(q, k, v, 0.125, mask))]
            diff = float(mx.abs(fused - grouped).max())
            lines.append(f"| {context} | {t} | " + " | ".join(f"{x:.2f}" for x in row) + f" | {diff:.1e} |")
            bar.update(1)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="256,2048,4096,8000", help="cache lengths (default: %(default)s)")
    parser.add_argument("--tokens", default="1,6", help="query tokens per forward, the first is the base "
                                                         "of the ratios (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed forwards per cell (default: %(default)s)")
    parser.add_argument("--skip-parts", action="store_true", help="only the forward table")
    parser.add_argument("--output", "-o", default=None, help="also write the tables here (Markdown)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    model = Engine.load("default").lm.model
    env = (f"{platform.machine()}, {mx.default_device()}, MLX {mx.__version__}, BLAS {_blas.loaded_blas}, "
           f"malloc {_allocator.allocator}, "
           f"default model float32, grouped path from {attn_mod.GROUPED_MIN_KEYS} keys; medians of {args.repeats}")
    total = len(contexts) * len(tokens) * 2 + (0 if args.skip_parts else len(contexts) * len(tokens))
    with tqdm(total=total, desc="attention cost", unit="cell", file=sys.stderr) as bar:
        lines = [f"Environment: {env}", "", "One forward of the default model over a cache of `context` tokens:", ""]
        lines += forward_table(model, contexts, tokens, args.repeats, bar)
        if not args.skip_parts:
            lines += ["", "One layer's attention at the model's shapes (9 query heads, 3 KV heads, head size 64):", ""]
            lines += parts_table(contexts, tokens, args.repeats, bar)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
