"""Float32 weights laid out for OpenBLAS on the CPU: each matrix stored column-major.

An `nn.Linear` computes `x @ W.T` with W (out, in) row-major, so every projection (and the tied
vocabulary projection, `embed_tokens.as_linear`) reaches OpenBLAS as a GEMM with a transposed
right operand. On the 2-core CPU that "NT" GEMM is slower than the plain "NN" one for the few rows
a decoding step has: over the default model's 210 projection matrices 39.5 vs 29.3 ms for one row,
44.0 vs 34.3 ms for two, 53.9 vs 45.2 ms for five (benchmarks/results/cpu_weight_layout.md).

So at load, on the CPU and in float32, each plain Linear / Embedding weight W keeps its shape and
values but its memory holds W.T row-major: `contiguous(W.T).T`. `x @ W.T` then reads a row-major
(in, out) matrix and OpenBLAS runs the NN kernel. Nothing else changes: the same array shape for
every reader of `.weight`, no extra memory, and the logits the same as before: bit for bit where
OpenBLAS runs the same kernel for both layouts (the VM it was measured on), in the last bits only
where it sums in another order (an AVX-only EPYC VM), the same greedy tokens either way
(tests/test_cpu_layout.py against the row-major model). Every method decodes over the same laid-out
weights, so greedy identity between methods does not depend on it. An embedding
lookup gathers strided rows, T x D reads, which costs nothing next to the projections.

Quantized layers keep MLX's own layout (they are dequantized first on the CPU when they fit:
loader.should_dequantize). Elementwise arithmetic on a weight keeps its layout; a weight replaced
by a new row-major array is simply computed the old way: correct, only without this speed-up.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

LAID_OUT = (nn.Linear, nn.Embedding)  # exactly these types: quantized and LoRA layers are left as they are


def is_column_major(weight: mx.array) -> bool:
    """The 2-D weight's memory holds its transpose row-major (what `store_column_major` makes)."""
    if weight.ndim != 2:
        return False
    item = weight.itemsize
    return memoryview(weight).strides == (item, item * weight.shape[0])  # bytes; evaluates the weight


def column_major(weight: mx.array) -> mx.array:
    """The same (out, in) matrix, its memory holding (in, out) row-major: `x @ weight.T` is an NN GEMM."""
    laid = mx.contiguous(weight.T).T
    mx.eval(laid)
    return laid


def store_column_major(model: nn.Module) -> int:
    """Re-lay every plain Linear / Embedding float32 weight column-major, in place. -> how many."""
    count = 0
    for _, module in model.named_modules():
        if type(module) not in LAID_OUT:
            continue
        weight = module.weight
        if weight.dtype != mx.float32 or weight.ndim != 2 or is_column_major(weight):
            continue
        module.weight = column_major(weight)  # one matrix at a time: the old copy is freed before the next
        count += 1
    return count
