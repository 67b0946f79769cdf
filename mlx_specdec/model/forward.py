"""One forward pass over an mlx-lm Llama-family model, with explicit positions and masks.

mlx-lm's Llama attention rotates queries and keys by a scalar `cache.offset`, which cannot
verify a token tree: two tokens at the same depth of different branches need the same position.
`forward` walks the model's own modules (so float16/bfloat16/float32 and mlx-lm's quantized
layers all work unchanged) and takes per-token `positions` and an explicit attention `mask`.

With `positions=None` and `mask=None` it does exactly what mlx-lm does (scalar RoPE offset,
"causal" mask for more than one query), so plain decoding matches `mlx_lm.generate` bit for bit;
on the CPU over a cache of `attention.GROUPED_MIN_KEYS` or more keys it computes the same
attention a faster way (`attention.py`), equal up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from .attention import Mask, attention_over_cache, bucket_mask, verify_key_bucket, widen_tail_mask
from .device import on_cpu


@dataclass
class ForwardOutput:
    hidden: mx.array  # (B, L, D) final-norm hidden states: the input of the vocabulary projection
    logits: Optional[mx.array]  # (B, L', V) for the requested positions, or None


_COMPILED_ROPE = "_mlx_specdec_compiled_rope"  # where a rope module keeps its compiled call


def apply_rope(rope: nn.Module, x: mx.array, offset: Union[int, mx.array]) -> mx.array:
    """`rope(x, offset=offset)`; on the CPU through one `mx.compile`d graph per rope module.

    MLX's CPU RoPE is a graph of small ops built anew each call: the default model's 60 calls of a
    forward took 11.0 ms on their own, 2.4 ms compiled (its elementwise ops fused into one kernel),
    bit for bit the same output (tests/test_forward.py); inside a ~55 ms one-token forward that
    saved 2-3 ms (benchmarks/results/cpu_weight_layout.md). The offset goes in as an
    array so that one compiled graph serves every position; a new input shape retraces it (~0.5 ms;
    the kernel is built once, ~0.5 s, on a process's first forward). On a GPU RoPE is one kernel.
    """
    if not on_cpu():
        return rope(x, offset=offset)
    compiled = rope.__dict__.get(_COMPILED_ROPE)
    if compiled is None:
        compiled = mx.compile(lambda values, start: rope(values, offset=start))
        rope.__dict__[_COMPILED_ROPE] = compiled  # a plain attribute: not a parameter of the module
    start = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
    return compiled(x, start)


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """Rotate x (B, H, L, D) so token l of row b sits at positions[b, l].

    `mx.fast.rope` takes one offset per batch row, so every token becomes its own row of
    length 1. This reuses the model's own RoPE module (plain, Llama-3, YaRN, ...) and gives
    bit-identical results to rotating a contiguous sequence.
    """
    B, H, L, D = x.shape
    per_token = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)  # (B*L, H, 1, D)
    rotated = apply_rope(rope, per_token, positions.reshape(-1).astype(mx.int32))
    return rotated.reshape(B, L, H, D).transpose(0, 2, 1, 3)  # (B, H, L, D)


def attention(attn: nn.Module, x: mx.array, positions: Optional[mx.array], cache: Any, mask: Mask,
              key_bucket: Optional[int] = None):
    """key_bucket: on CUDA, the key count a verify attends (`attention.verify_key_bucket`): a cache
    reads its buffer that far (`fetch_to`), the mask hiding what lies past the tokens."""
    B, L, _ = x.shape
    queries = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)  # (B, Hq, L, Dh)
    keys = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)  # (B, Hkv, L, Dh)
    values = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)

    if positions is None:
        offset = cache.offset if cache is not None else 0
        queries = apply_rope(attn.rope, queries, offset)
        keys = apply_rope(attn.rope, keys, offset)
    else:
        queries = rope_at(attn.rope, queries, positions)
        keys = rope_at(attn.rope, keys, positions)

    if cache is not None:
        observe = getattr(cache, "observe_queries", None)  # e.g. retrieval scoring (cache/retrieval.py)
        if observe is not None:
            observe(queries)
        keys, values = cache.update_and_fetch(keys, values)
        if key_bucket is not None:
            keys, values = cache.fetch_to(key_bucket)  # no per-layer copy into a padded array

    out = attention_over_cache(queries, keys, values, attn.scale, mask)  # (B, Hq, L, Dh)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))  # (B, L, D)


def transformer_block(layer: nn.Module, x: mx.array, positions, cache, mask, key_bucket=None) -> mx.array:
    h = x + attention(layer.self_attn, layer.input_layernorm(x), positions, cache, mask, key_bucket)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


def forward(
    model: nn.Module,
    tokens: mx.array,
    cache: Any = None,
    positions: Optional[mx.array] = None,
    mask: Mask = None,
    logits_for: Union[Literal["all", "last", "none"], mx.array] = "all",
    input_embeddings: Optional[mx.array] = None,
) -> ForwardOutput:
    """Run the model on tokens (B, L).

    cache:      a model-level cache (`cache.layers[i]` per block, `cache.offset`) or None.
    positions:  (B, L) int positions per token, or None for contiguous from `cache.offset`.
    mask:       None, "causal", or a boolean/additive array broadcastable to
                (B, heads, L, cached + L). None means "causal" when L > 1 (as mlx-lm). A mask
                narrower than the keys is a tail mask: it covers the last keys and every
                earlier key is visible to every query (model/attention.py).
    logits_for: "all", "last", "none", or an index array (K,) of query positions to project.
    """
    inner = model.model
    h = inner.embed_tokens(tokens) if input_embeddings is None else input_embeddings  # (B, L, D)
    if mask is None and h.shape[1] > 1:
        mask = "causal"
    cached = getattr(cache, "offset", None)  # sequence caches; a thread pool has none (full masks)
    layer_caches = cache.layers if cache is not None else [None] * len(inner.layers)
    # a cache whose layers can read their buffer past the offset (contiguous); others pad per layer
    key_bucket = verify_key_bucket(h.shape[1], cached) if hasattr(layer_caches[0], "fetch_to") else None
    if key_bucket is not None:  # a verify on CUDA: its mask over the bucket of keys, once for every layer
        mask = bucket_mask(mask, h.shape[1], cached + h.shape[1], key_bucket)
    elif isinstance(mask, mx.array) and cached is not None:
        mask = widen_tail_mask(mask, cached + h.shape[1])  # once here for every layer
    for layer, layer_cache in zip(inner.layers, layer_caches):
        h = transformer_block(layer, h, positions, layer_cache, mask, key_bucket)
    hidden = inner.norm(h)

    if isinstance(logits_for, str):
        if logits_for == "none":
            return ForwardOutput(hidden, None)
        selected = hidden[:, -1:, :] if logits_for == "last" else hidden
    else:
        selected = hidden[:, logits_for, :]
    return ForwardOutput(hidden, lm_head(model, selected))
