"""What committing a verified step costs on the cache, at a long context.

    python benchmarks/cache_keep_cost.py [--context 6000] [--repeats 15]

A speculative step appends its drafts to the cache, verifies them, then keeps the accepted path
(`ContiguousKVCache.keep_appended_rows`). Moving kept tokens down is a gather and a write into the
buffer the gather reads, which MLX cannot do in place: it copies the whole KV buffer, every layer,
every step. Prints the median time of one decoding step of one token (the default model, a
`--context`-token cache) as `ar` takes it, as a ReDrafter step with nothing to move takes it now
(explicit position and tail mask, the offset moved), and with the kept token moved anyway (the
gather path every step took before). The cache holds random keys and values: the cost does not
depend on what they are, so no 6K prefill is needed. Run it on a quiet machine.
"""

import argparse

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from roofline import median_ms

from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.engine import Engine
from mlx_specdec.model.forward import forward


def filled_cache(model, context: int) -> ContiguousKVCache:
    cache = ContiguousKVCache.for_model(model)
    for layer, block in zip(cache.layers, model.model.layers):
        attn = block.self_attn
        shape = (1, attn.n_kv_heads, context, attn.k_proj.weight.shape[0] // attn.n_kv_heads)
        layer.update_and_fetch(mx.random.normal(shape) * 0.1, mx.random.normal(shape) * 0.1)
    mx.eval(cache.state)
    return cache


def step_ms(model, context: int, kind: str, repeats: int) -> float:
    cache = filled_cache(model, context)
    token = mx.array([[42]])

    def step():
        start = cache.offset
        if kind == "ar":
            out = forward(model, token, cache)
        else:
            out = forward(model, token, cache, positions=mx.array([[start]]), mask=mx.ones((1, 1, 1, 1), dtype=mx.bool_))
        if kind == "keep":
            cache.keep_appended_rows(start, [[0]])  # in place: the offset moves
        elif kind == "gather":
            for layer in cache.layers:  # the layer-level gather-and-write, as before
                layer.keep_appended_rows(start, mx.array([[0]], dtype=mx.int32), 1)
        mx.eval(mx.argmax(out.logits[:, -1], axis=-1), cache.state)
        cache.trim(1)  # every repeat sees the same context

    return median_ms(step, repeats=repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    model = Engine.load("default").lm.model
    rows = [(kind, step_ms(model, args.context, kind, args.repeats)) for kind in ("ar", "keep", "gather")]
    base = rows[0][1]
    print(f"| one-token step at {args.context} tokens of context | ms | x `ar` |\n|---|---:|---:|")
    names = {"ar": "`ar` (no mask, scalar offset)", "keep": "ReDrafter step, nothing moved (now)",
             "gather": "ReDrafter step, kept token gathered and written back (before)"}
    for kind, ms in rows:
        print(f"| {names[kind]} | {ms:.1f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
