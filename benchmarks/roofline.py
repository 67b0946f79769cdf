"""Where one decode step of the default model goes on this machine (issue 2's roofline question).

    python benchmarks/roofline.py

Prints: memory bandwidth (numpy copy), the weight bytes one token reads, the roofline tok/s,
the measured time of (a) the weight matrix-vector products alone, as one MLX graph, (b) a full
forward of one token with our engine, (c) mlx-lm's model call, all medians over repeats.
"""

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.model.timing import median_ms
from mlx_specdec.engine import Engine
from mlx_specdec.model.forward import forward


def main():
    big = np.ones(256 * 2**20 // 8)  # 256 MiB
    copy_ms = median_ms(lambda: big.copy(), repeats=7)
    bandwidth = 2 * big.nbytes / (copy_ms / 1000) / 1e9  # read + write
    engine = Engine.load("default")
    model = engine.lm.model
    weights = [(name, w) for name, w in __import__("mlx.utils").utils.tree_flatten(model.parameters())]
    nbytes = sum(w.nbytes for _, w in weights)  # tied embedding: read once as the output projection
    print(f"memory bandwidth (numpy copy): {bandwidth:.1f} GB/s")
    print(f"weights read per token: {nbytes / 1e6:.0f} MB -> roofline {bandwidth * 1e9 / nbytes:.1f} tok/s")

    matrices = [w for name, w in weights if w.ndim == 2]
    x = {w.shape[1]: mx.ones((1, w.shape[1])) for w in matrices}
    mx.eval(list(x.values()))

    def matvecs():
        mx.eval([x[w.shape[1]] @ w.T for w in matrices])

    prompt = list(range(1000, 1300))
    cache = ContiguousKVCache.for_model(model)
    forward(model, mx.array(prompt)[None], cache, logits_for="none")
    mx.eval(cache.state)

    def one_token():
        out = forward(model, mx.array([[5]]), cache, logits_for="last")
        mx.eval(out.logits)
        cache.trim(1)

    from mlx_lm.models.cache import make_prompt_cache

    lm_cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=lm_cache))

    def mlx_lm_token():
        mx.eval(model(mx.array([[5]]), cache=lm_cache))
        for c in lm_cache:
            c.trim(1)

    print(f"{len(matrices)} weight mat-vecs alone, one graph: {median_ms(matvecs):.1f} ms")
    print(f"one token, our forward (300-token context): {median_ms(one_token):.1f} ms")
    print(f"one token, mlx-lm model call: {median_ms(mlx_lm_token):.1f} ms")


if __name__ == "__main__":
    main()
