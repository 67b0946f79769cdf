"""Each block compiled (model/forward.py `_compiled_block`) against op by op, in one process.

    python benchmarks/compiled_block_ab.py

Forwards of T = 1..5 query tokens after 150 cached tokens of the default model, both paths
interleaved, every logit computed; checks the two give the same bits first, then prints median
milliseconds per path and their ratio (benchmarks/results/compiled_block.md).
"""
import time, importlib
import mlx_specdec  # noqa
import mlx.core as mx
import numpy as np
from mlx_specdec.engine import Engine
from mlx_specdec.model.timing import prefilled
F = importlib.import_module("mlx_specdec.model.forward")
model = Engine.load("default").lm.model
cache = prefilled(model, 1, 150)
compiled = F._compiled_block
plain = lambda layer, x, positions, cache, mask: F._plain_block(layer, x, positions, cache, mask)
def run(T, use):
    F._compiled_block = compiled if use else plain
    t0 = time.perf_counter()
    out = F.forward(model, mx.array([[5 + i for i in range(T)]]), cache, logits_for="all")
    mx.eval(out.logits)
    dt = time.perf_counter() - t0
    cache.trim(T)
    return dt, np.array(out.logits)
for T in [1, 3]:
    assert np.array_equal(run(T, True)[1], run(T, False)[1])
for T in [1, 2, 3, 4, 5]:
    r = {True: [], False: []}
    for i in range(50):
        for use in (False, True):
            dt = run(T, use)[0]
            if i >= 3: r[use].append(dt)
    print(T, f"plain {1000*np.median(r[False]):.2f} compiled {1000*np.median(r[True]):.2f} ratio {np.median(r[True])/np.median(r[False]):.3f}", flush=True)
