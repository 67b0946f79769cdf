"""Per-stage costs for the pipeline simulator (benchmarks/pipeline_sim.py), measured on one core.

    python benchmarks/pipeline_stage_cost.py [--model default] [--tokens 1,2,3,5] [--out FILE.json]

Times, on core 0 with one BLAS thread (as a pinned rank runs), one decoder layer over T new tokens
after a 64-token cache, the final norm + vocabulary projection for T rows, and the ReDrafter head's
4-token chain; then the same layer while another process computes on core 1 (two ranks on one
machine share its memory bandwidth: the contention factor). Medians of 20 runs. Where the system
cannot pin a process (macOS) the cores are the scheduler's choice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ["OPENBLAS_NUM_THREADS"] = "1"
if hasattr(os, "sched_setaffinity"):  # Linux; elsewhere (macOS) the system places the threads
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import mlx_specdec  # noqa: E402,F401  (BLAS first)
import mlx.core as mx  # noqa: E402

from mlx_specdec.cache import ContiguousKVCache  # noqa: E402
from mlx_specdec.model.forward import lm_head, transformer_block  # noqa: E402
from mlx_specdec.model.loader import load_model  # noqa: E402

BUSY_CORE = """
import os; os.environ["OPENBLAS_NUM_THREADS"] = "1"
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
import mlx_specdec, mlx.core as mx, time
a = mx.random.normal((2048, 2048)); v = mx.random.normal((2048, 1))
end = time.time() + float(os.environ["BUSY_S"])
while time.time() < end:
    mx.eval(a @ v)
"""


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", default="1,2,3,5")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lm = load_model(args.model)
    model = lm.model
    layers = model.model.layers
    width = model.model.embed_tokens.weight.shape[1]
    cache = ContiguousKVCache.for_model(model)
    h0 = mx.random.normal((1, 64, width))
    for layer, layer_cache in zip(layers, cache.layers):
        mx.eval(transformer_block(layer, h0, None, layer_cache, "causal"))

    def layer_ms(t: int) -> float:
        x = mx.random.normal((1, t, width))

        def one():
            out = x
            for layer, layer_cache in zip(layers[:6], cache.layers[:6]):
                out = transformer_block(layer, out, None, layer_cache, "causal" if t > 1 else None)
            mx.eval(out)
            for layer_cache in cache.layers[:6]:
                layer_cache.trim(t)
        return median_ms(one) / 6

    def head_ms(t: int) -> float:
        x = mx.random.normal((1, t, width))
        return median_ms(lambda: mx.eval(lm_head(model, model.model.norm(x))))

    tokens = [int(t) for t in args.tokens.split(",")]
    result = dict(model=lm.name, layers=len(layers), layer_ms={t: round(layer_ms(t), 3) for t in tokens},
                  vocab_projection_ms={t: round(head_ms(t), 3) for t in tokens})
    from mlx_specdec.engine import Engine

    head = Engine(lm).drafter
    if head is not None:
        from mlx_specdec.distributed.drafters import HeadDrafter

        drafter = HeadDrafter(head, model.model.embed_tokens, lm.model.model.embed_tokens.weight.shape[0], 4)
        hidden = mx.random.normal((width,))
        result["draft_chain_ms"] = round(median_ms(lambda: drafter.observe(hidden, 100, 0)), 3)
    busy = subprocess.Popen([sys.executable, "-c", BUSY_CORE], env=dict(os.environ, BUSY_S="30"))
    time.sleep(2)
    result["layer_ms_while_other_core_computes"] = {t: round(layer_ms(t), 3) for t in tokens[:2]}
    busy.kill()
    result["contention_factor"] = round(result["layer_ms_while_other_core_computes"][1] / result["layer_ms"][1], 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
