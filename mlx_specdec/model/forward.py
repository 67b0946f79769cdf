"""One forward pass over an mlx-lm Llama-family model, with explicit positions and masks.

One block serves Llama, Mistral, Qwen2 and Qwen3: their differences are switches declared in
architectures.py (`head_projections` applies Qwen3's per-head q/k norms; biases and tied
embeddings are mlx-lm's own modules and config).

mlx-lm's Llama attention rotates queries and keys by a scalar `cache.offset`, which cannot
verify a token tree: two tokens at the same depth of different branches need the same position.
`forward` walks the model's own modules (so float16/bfloat16/float32 and mlx-lm's quantized
layers all work unchanged) and takes per-token `positions` and an explicit attention `mask`.

With `positions=None` and `mask=None` it does exactly what mlx-lm does (scalar RoPE offset,
"causal" mask for more than one query), so plain decoding matches `mlx_lm.generate` bit for bit;
on the CPU in float32 the attention runs as MLX's own ops in one compiled graph (`attention.py`
`exact_attention`: the same bits, at any length), in other dtypes over a cache of
`attention.GROUPED_MIN_KEYS` or more keys a faster way, equal up to float rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from .architectures import of_layer
from .attention import Mask, attention_over_cache, bucket_mask, verify_key_bucket, widen_tail_mask
from .device import on_cpu
from .rope_table import rotate, shared_rope, tables, tables_at


@dataclass
class ForwardOutput:
    hidden: mx.array  # (B, L, D) final-norm hidden states: the input of the vocabulary projection
    logits: Optional[mx.array]  # (B, L', V) for the requested positions, or None


_COMPILED_ROPE = "_mlx_specdec_compiled_rope"  # where a rope module keeps its compiled call


def _kept_for(module: nn.Module, key: str, make, partner: Optional[nn.Module] = None):
    """What `make()` built for this very module (and partner: the next layer of a graph spanning
    two), kept in a plain attribute (not a parameter). It is stored with its owner: a shallow copy
    of the module (APAR's model shares the base model's arrays through `copy.copy`,
    apar/adapter.py) inherits the attribute, but its compiled graphs would still read the
    original's weights, so a copy builds its own."""
    owner, mate, built = module.__dict__.get(key, (None, None, None))
    if owner is not module or mate is not partner:
        built = make()
        module.__dict__[key] = (module, partner, built)
    return built


def apply_rope(rope: nn.Module, x: mx.array, offset: Union[int, mx.array]) -> mx.array:
    """`rope(x, offset=offset)`; on the CPU through one `mx.compile`d graph per rope module.

    MLX's CPU RoPE is a graph of small ops built anew each call, and a forward calls it twice a
    layer; compiled, its elementwise ops fuse into one kernel with bit for bit the same output
    (tests/test_forward.py), a few times cheaper. The offset goes in as an array so that one
    compiled graph serves every position; a new input shape retraces it (cheap: the kernel itself
    is built once, on a process's first forward). On a GPU RoPE is one kernel.
    """
    if not on_cpu():
        return rope(x, offset=offset)
    compiled = _kept_for(rope, _COMPILED_ROPE, lambda: mx.compile(lambda values, start: rope(values, offset=start)))
    start = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
    return compiled(x, start)


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """Rotate x (B, H, L, D) so token l of row b sits at positions[b, l].

    `mx.fast.rope` takes one offset per batch row, so every token becomes its own row of
    length 1. This reuses the model's own RoPE module (plain, Llama-3, YaRN, ...) and gives
    bit-identical results to rotating a contiguous sequence.
    """
    return _per_token(lambda per_token, starts: apply_rope(rope, per_token, starts), x, positions)


def _per_token(rotate, x: mx.array, positions: mx.array) -> mx.array:
    B, H, L, D = x.shape
    per_token = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)  # (B*L, H, 1, D)
    rotated = rotate(per_token, positions.reshape(-1).astype(mx.int32))
    return rotated.reshape(B, L, H, D).transpose(0, 2, 1, 3)  # (B, H, L, D)


def head_projections(attn: nn.Module, x: mx.array, qk_norm: bool):
    """(B, L, D) normed input -> queries (B, Hq, L, Dh), keys and values (B, Hkv, L, Dh), before
    RoPE. qk_norm (architectures.py: Qwen3): each head's query and key through the attention's
    `q_norm` / `k_norm` first, in mlx-lm's order (normed over Dh, then moved to heads first)."""
    B, L, _ = x.shape
    queries = attn.q_proj(x).reshape(B, L, attn.n_heads, -1)  # (B, L, Hq, Dh)
    keys = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1)  # (B, L, Hkv, Dh)
    if qk_norm:
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    values = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3), values


def attention(attn: nn.Module, x: mx.array, positions: Optional[mx.array], cache: Any, mask: Mask,
              key_bucket: Optional[int] = None, qk_norm: bool = False):
    """key_bucket: on CUDA, the key count a verify attends (`attention.verify_key_bucket`): a cache
    reads its buffer that far (`fetch_to`), the mask hiding what lies past the tokens."""
    B, L, _ = x.shape
    queries, keys, values = head_projections(attn, x, qk_norm)

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


def transformer_block(layer: nn.Module, x: mx.array, positions, cache, mask, key_bucket=None,
                      rope_tables=None) -> mx.array:
    """rope_tables: the forward's `RopeTables` (CPU, one plain RoPE in every layer) or None."""
    if (COMPILED_BLOCKS and on_cpu() and cache is not None and key_bucket is None
            and getattr(cache, "observe_queries", None) is None and _plain_projections(layer)):
        return _compiled_block(layer, x, positions, cache, mask, rope_tables=rope_tables)
    return _plain_block(layer, x, positions, cache, mask, key_bucket)


class RopeTables:
    """One forward's RoPE cosines and sines (model/rope_table.py), made at the first layer that
    asks for an offset and shared by the others."""

    def __init__(self, rope: nn.RoPE):
        self.rope, self.made = rope, {}

    def at(self, offset: int, length: int):
        if offset not in self.made:
            self.made[offset] = tables(self.rope, lambda unit, start: apply_rope(self.rope, unit, start), offset, length)
        return self.made[offset]

    def at_positions(self, positions: mx.array):
        """The tables at per-token positions (B, L): the forward's one `positions` array."""
        if "positions" not in self.made:
            self.made["positions"] = tables_at(self.rope, lambda unit, starts: apply_rope(self.rope, unit, starts),
                                               positions)
        return self.made["positions"]

    @classmethod
    def for_forward(cls, layers, positions) -> Optional["RopeTables"]:
        if not (COMPILED_BLOCKS and on_cpu()):
            return None
        rope = shared_rope(layers)
        return cls(rope) if rope is not None else None


def _plain_block(layer: nn.Module, x: mx.array, positions, cache, mask, key_bucket=None, rope_tables=None) -> mx.array:
    """The block op by op (rope_tables unused: each layer's RoPE module rotates its own)."""
    h = x + attention(layer.self_attn, layer.input_layernorm(x), positions, cache, mask, key_bucket,
                      of_layer(layer).qk_norm)
    return h + layer.mlp(layer.post_attention_layernorm(h))


_COMPILED_BLOCK = "_mlx_specdec_compiled_block"  # where a layer keeps its compiled halves
COMPILED_BLOCKS = not os.environ.get("MLX_SPECDEC_OP_BY_OP")  # =1: every block op by op (to compare)
_PLAIN_LINEAR = (nn.Linear, nn.QuantizedLinear)
_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _plain_projections(layer: nn.Module) -> bool:
    """Every projection a plain (or quantized) linear layer: nothing in the block keeps Python state
    a compiled graph would freeze at its trace (APAR's gated LoRA reads a per-token gate set between
    forwards). Checked every call (cheap next to a layer): adapters can be attached to a loaded model."""
    for parent, name in _PROJECTIONS:
        if type(getattr(getattr(layer, parent, None), name, None)) not in _PLAIN_LINEAR:
            return False
    return True


def _compiled_block(layer: nn.Module, x: mx.array, positions, cache, mask, rope_tables=None) -> mx.array:
    """`transformer_block` on the CPU with what comes before and after the cache's attention as two
    `mx.compile`d graphs. Uncompiled, Python builds a few dozen small ops a layer anew each
    forward, on the same cores as the compute: a visible share of a one-token forward on a small
    CPU. Compiling them also fuses RoPE with its transposes and the residual adds, so short
    forwards get faster with the same bits (tests/test_forward.py; see docs/cpu-backend.md). The
    layer's parameters are the graphs' inputs, read at every call: new weights are used as they
    come, and a module replaced by one with other parameters (an adapter) changes the inputs,
    which traces the graph anew. The cache's update and the attention stay outside: their shapes
    change every step."""
    attn = layer.self_attn
    halves = _kept_for(layer, _COMPILED_BLOCK, lambda: _block_halves(layer))
    before, before_at, before_rotated, after = halves
    offset = cache.offset if positions is None else None  # (a pool of threads has none: positions)
    if isinstance(offset, int) and rope_tables is not None and x.dtype == mx.float32:
        queries, keys, values = before_rotated(x, *rope_tables.at(offset, x.shape[1]))
    elif positions is not None and rope_tables is not None and x.dtype == mx.float32:
        queries, keys, values = before_rotated(x, *rope_tables.at_positions(positions))
    elif positions is None:
        queries, keys, values = before(x, offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32))
    else:
        queries, keys, values = before_at(x, positions)
    keys, values = cache.update_and_fetch(keys, values)
    return after(x, attention_over_cache(queries, keys, values, attn.scale, mask))


def _joined(layers, caches, h, positions, cached, key_bucket, rope_tables) -> bool:
    """Whether the forward runs as `_compiled_layers`: on the CPU, float32, RoPE's shared tables,
    a sequence cache every layer of which only stores (no retrieval scoring), plain projections."""
    return (rope_tables is not None and h.dtype == mx.float32 and key_bucket is None
            and (positions is not None or isinstance(cached, int)) and caches[0] is not None
            and all(getattr(c, "observe_queries", None) is None for c in caches)
            and all(_plain_projections(layer) for layer in layers))


def _compiled_layers(layers, caches, h, positions, cached, mask, rope_tables) -> mx.array:
    """Every block as `_compiled_block` computes it, with each block's ops after the attention and
    the next block's before it as one compiled graph: one compiled call a layer (plus one) instead
    of two, and the residual add fused with what reads it. Short forwards get faster still, with
    the same bits (benchmarks/compiled_block_ab.py --joined compares; tests/test_forward.py)."""
    cos, sin = rope_tables.at(cached, h.shape[1]) if positions is None else rope_tables.at_positions(positions)
    first = _kept_for(layers[0], _COMPILED_BLOCK, lambda: _block_halves(layers[0]))
    queries, keys, values = first[2](h, cos, sin)  # before_rotated
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        keys, values = cache.update_and_fetch(keys, values)
        out = attention_over_cache(queries, keys, values, layer.self_attn.scale, mask)
        if i + 1 == len(layers):
            return _kept_for(layer, _COMPILED_BLOCK, lambda: _block_halves(layer))[3](h, out)  # after
        following = layers[i + 1]
        joint = _kept_for(layer, _COMPILED_JOINT, lambda: _joint_graph(layer, following), partner=following)
        h, queries, keys, values = joint(h, out, cos, sin)


_COMPILED_JOINT = "_mlx_specdec_compiled_joint"  # where a layer keeps its graph with the next layer's


def _joint_graph(layer: nn.Module, following: nn.Module):
    """One graph: `layer`'s ops after its attention, then `following`'s before its attention."""
    after, before_rotated = _block_functions(layer)[4], _block_functions(following)[3]

    def joint(x, out, cos, sin):
        h = after(x, out)
        return (h, *before_rotated(h, cos, sin))

    return mx.compile(joint, inputs=[layer, following])


def _block_halves(layer: nn.Module):
    return tuple(mx.compile(f, inputs=[layer]) for f in _block_functions(layer)[1:])


def _block_functions(layer: nn.Module):
    """The block's ops before the cache's attention (three ways to rotate) and after it, plain
    functions of the layer: (projections, before, before_at, before_rotated, after)."""
    attn = layer.self_attn
    qk_norm = of_layer(layer).qk_norm

    def projections(x):  # (B, L, D) -> queries (B, Hq, L, Dh), keys and values (B, Hkv, L, Dh)
        return head_projections(attn, layer.input_layernorm(x), qk_norm)

    def before(x, start):  # contiguous positions from `start`
        queries, keys, values = projections(x)
        return attn.rope(queries, offset=start), attn.rope(keys, offset=start), values

    def before_at(x, positions):  # per-token positions (B, L)
        queries, keys, values = projections(x)
        rotate = lambda per_token, starts: attn.rope(per_token, offset=starts)  # noqa: E731
        return _per_token(rotate, queries, positions), _per_token(rotate, keys, positions), values

    def before_rotated(x, cos, sin):  # RoPE's tables made once per forward: (1|B, 1, L, Dh/2)
        queries, keys, values = projections(x)
        traditional = attn.rope.traditional
        return rotate(queries, cos, sin, traditional), rotate(keys, cos, sin, traditional), values

    def after(x, out):  # out (B, Hq, L, Dh): the attention's
        B, L, _ = x.shape
        h = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    return projections, before, before_at, before_rotated, after


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
        mask = widen_tail_mask(mask, h.shape[1], cached + h.shape[1], h.dtype)  # once here for every layer
    rope_tables = RopeTables.for_forward(inner.layers, positions)
    if _joined(inner.layers, layer_caches, h, positions, cached, key_bucket, rope_tables):
        h = _compiled_layers(inner.layers, layer_caches, h, positions, cached, mask, rope_tables)
    else:
        for layer, layer_cache in zip(inner.layers, layer_caches):
            h = transformer_block(layer, h, positions, layer_cache, mask, key_bucket, rope_tables)
    hidden = inner.norm(h)

    if isinstance(logits_for, str):
        if logits_for == "none":
            return ForwardOutput(hidden, None)
        selected = hidden[:, -1:, :] if logits_for == "last" else hidden
    else:
        selected = hidden[:, logits_for, :]
    return ForwardOutput(hidden, lm_head(model, selected))
