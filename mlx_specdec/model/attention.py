"""Attention over the KV cache: MLX's fused kernel; on the CPU its own ops compiled, or a grouped one.

On Metal `mx.fast.scaled_dot_product_attention` is a fused kernel: it is always used there. On
the CPU it is composed from ops, and over a long cache its softmax dominates: MLX's prebuilt CPU
`exp` is slow per element, so a verify over thousands of keys spends far more time in `exp` than
in both matmuls together. The grouped path computes the same attention with

- the query heads of one KV head stacked into one matrix, so each KV head is read once for all
  its G query heads and all T query tokens: scores (B, Hkv, G*T, S) = one GEMM per KV head;
- `exp` as 2^n * e^r (x = n ln 2 + r, e^r by a degree-7 polynomial), fused by `mx.compile`
  into one elementwise kernel: relative error < 2e-7 (float32), several times faster than MLX's;
- the normalisation after the value matmul: (e @ V) / sum(e), T x D divisions instead of T x S.

It is used only where it pays (`use_grouped`): on the CPU with at least `GROUPED_MIN_KEYS` keys,
for what `exact_attention` does not take (float16 and bfloat16, or all of it with
MLX_SPECDEC_OP_BY_OP=1). Both compute softmax(Q K^T * scale + mask) V; they differ by float
rounding.

On the CPU in float32, every forward of 2+ queries (a verify, a prefill chunk) and every one-query
step over EXACT_ONE_QUERY_MIN_KEYS+ keys runs MLX's own attention as `exact_attention`: the ops of
its fallback in the same order as one compiled graph, its softmax the same arithmetic
(`_softmax`), the query heads of a KV head as the rows of one product where the small-row GEMM
gives them the same bits. The bits are MLX's (so `ar` matches mlx-lm at every length), and it is
faster than MLX's own op: the softmax's `exp` is vectorized by the JIT (mlx_specdec/_jit.py)
where MLX's prebuilt one is not, and it beats the grouped path too, over long caches and in
prefill. The measurements behind these thresholds: see docs/cpu-backend.md.
"""

from __future__ import annotations

import functools
import math
import os
import platform
from typing import Union

import mlx.core as mx

from .. import _blas, masks
from .device import on_cuda

Mask = Union[None, str, mx.array]

# Thresholds chosen by timing both paths on the CPU (benchmarks/attention_cost.py).
GROUPED_MIN_KEYS = 1024  # fewer keys: the fused op is as fast
# MLX_SPECDEC_OP_BY_OP=1: MLX's own attention op (and the grouped path over long caches) instead.
# Only on x86-64, where MLX's CPU kernels have no SIMD types and its softmax sums a row in order as
# `_softmax` does; on arm64 (NEON, Accelerate) it sums in lanes, so the bits would differ there.
EXACT_ATTENTION = not os.environ.get("MLX_SPECDEC_OP_BY_OP") and platform.machine() in ("x86_64", "AMD64")
EXACT_ONE_QUERY_MIN_KEYS = 300  # one query over fewer keys: MLX's attention op is as fast as exact_attention
SMALL_GEMM_ROWS = 64  # products of at most this many rows run on the engine's small-row GEMM (_blas.py)

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # ln 2 = _LN2_HI + _LN2_LO; _LN2_HI has 16 significant bits
_LN2_LO = 1.4286068203094173e-06
_P = [1.0 / math.factorial(k) for k in range(8)]  # e^r = sum r^k / k!, |r| <= 0.35: error < 3e-8
_FLOOR = -87.0  # e^-87 ~ 1.6e-38: the smallest normal float32, so 2^n stays a normal number


def _exp_parts(x: mx.array):
    """For e^x, x <= 0 (float32, clamped at -87): (e^r, the float32 bits of 2^n), x = n ln2 + r.

    n = round(x / ln2); r = x - n ln2 with ln2 split in two (Cody-Waite: n * _LN2_HI is exact),
    so r keeps its digits however large |x| is; e^r on |r| <= ln2/2 by its Taylor polynomial.
    Elementwise only, so `mx.compile(shapeless=True)` fuses it into one kernel reused for every
    cache length; the bits become a float outside it (a bitcast has no shapeless form)."""
    x = mx.maximum(x, _FLOOR)
    n = mx.round(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _P[-1]
    for c in reversed(_P[:-1]):  # Horner
        p = p * r + c
    return p, (n.astype(mx.int32) + 127) << 23  # the IEEE exponent field of 2^n, n in [-126, 0]


def _shifted_exp_parts(x: mx.array, shift: mx.array):
    return _exp_parts(x - shift)


_exp_parts_fused = mx.compile(_shifted_exp_parts, shapeless=True)


def fast_exp(x: mx.array, shift: float | mx.array = 0.0) -> mx.array:
    """e^(x - shift) for x <= shift (shift broadcasts: a row maximum), relative error < 2e-7;
    several times faster than MLX's CPU `exp`. The subtraction is fused in."""
    p, bits = _exp_parts_fused(x, mx.array(shift, dtype=mx.float32) if not isinstance(shift, mx.array) else shift)
    return p * mx.view(bits, mx.float32)


def _grouped_for(queries: int, keys: int, dtype: mx.Dtype) -> bool:
    """The grouped path: the CPU, a long cache, where `exact_attention` does not run."""
    return keys >= GROUPED_MIN_KEYS and mx.default_device() == mx.cpu and not _exact_for(queries, keys, dtype)


#: On CUDA, MLX 0.32's fused attention over more than one query runs a cuDNN graph built for each
#: (queries, keys) shape, which costs several forwards' time, and a verify meets a new key count
#: every step; the composed path has per-shape costs of its own. So a verify (up to this many
#: queries) pads its keys, masked out, to a multiple of CUDA_KEY_BUCKET: one graph per bucket.
#: (Attending per query with MLX's one-query kernel instead only pays over short caches.) The
#: forward reads the bucket straight from a contiguous cache's buffer, its mask built once
#: (`verify_key_bucket`).
CUDA_VERIFY_MAX_QUERIES = 64
CUDA_KEY_BUCKET = 256


def _verify_on_cuda(queries: int) -> bool:
    return 1 < queries <= CUDA_VERIFY_MAX_QUERIES and on_cuda()


def use_grouped(queries: mx.array, keys: mx.array) -> bool:
    """The grouped path only where it pays: the CPU and a long cache (any number of queries: a
    one-token step, a verify, a prefill chunk), for what `exact_attention` does not take (float16,
    bfloat16, or with it switched off)."""
    return _grouped_for(queries.shape[2], keys.shape[2], queries.dtype)


def key_bucket(keys: int) -> int:
    """The key count a CUDA verify over `keys` keys attends: the next multiple of CUDA_KEY_BUCKET."""
    return -(-keys // CUDA_KEY_BUCKET) * CUDA_KEY_BUCKET


def verify_key_bucket(queries: int, cached: int | None) -> int | None:
    """On CUDA, the key count a verify of `queries` tokens over `cached` cached ones attends (the
    forward builds its mask for that width once, and reads that far in the cache's buffer); else None."""
    if cached is None or not _verify_on_cuda(queries):
        return None
    return key_bucket(cached + queries)


def bucket_mask(mask: Mask, queries: int, keys: int, width: int) -> mx.array:
    """Any mask over `keys` keys (None, "causal", tail or full) as a full-width one over `width` >=
    `keys` keys that hides every key past `keys`; one already `width` wide unchanged."""
    if isinstance(mask, mx.array) and mask.shape[-1] == width:
        return mask
    if mask is None:
        mask = mx.ones((queries, keys), dtype=mx.bool_)
    elif isinstance(mask, str):  # "causal", bottom-right aligned
        mask = masks.causal_mask(queries, keys - queries)
    else:
        mask = _with_visible_prefix(mask, keys)
    extra = width - keys
    if extra == 0:
        return mask
    hidden = mx.zeros(mask.shape[:-1] + (extra,), dtype=mx.bool_) if mask.dtype == mx.bool_ else \
        mx.full(mask.shape[:-1] + (extra,), -math.inf, dtype=mask.dtype)
    return mx.concatenate([mask, hidden], axis=-1)


def bucket_keys(queries: mx.array, keys: mx.array, values: mx.array, mask: Mask):
    """keys, values (B, Hkv, S, Dh) padded to the next multiple of CUDA_KEY_BUCKET, and the mask as a
    full-width one over them that hides the padding: the same attention, a shape seen before.
    (A forward over a cache that reads its buffer that far, `forward.attention`, pads nothing here.)"""
    T, S = queries.shape[2], keys.shape[2]
    width = key_bucket(S)
    if width == S:
        return keys, values, mask
    padding = [(0, 0), (0, 0), (0, width - S), (0, 0)]
    return mx.pad(keys, padding), mx.pad(values, padding), bucket_mask(mask, T, S, width)


def _with_visible_prefix(mask: mx.array, keys: int) -> mx.array:
    """A tail mask (it covers the last keys; every earlier key is visible to every query) widened
    to all `keys` keys; a full-width mask unchanged."""
    if mask.shape[-1] >= keys:
        return mask
    head = mx.ones(mask.shape[:-1] + (keys - mask.shape[-1],), dtype=mx.bool_)
    if mask.dtype != mx.bool_:
        head = mx.zeros(head.shape, dtype=mask.dtype)
    return mx.concatenate([head, mask], axis=-1)


def widen_tail_mask(mask: mx.array, queries: int, keys: int, dtype: mx.Dtype) -> mx.array:
    """A tail mask over `keys` keys as the attention that will run takes it: narrow for the grouped
    path (it skips the prefix), widened for MLX's fused one and `exact_attention`. A forward calls
    this once for all its layers (they share the mask, the query and key counts and the dtype)."""
    return mask if _grouped_for(queries, keys, dtype) else _with_visible_prefix(mask, keys)


def full_width(mask: Mask, queries: mx.array, keys: mx.array) -> Mask:
    """Any mask as MLX's fused attention takes it: a tail mask widened (normally the forward has
    done it already, `widen_tail_mask`), anything else unchanged."""
    return _with_visible_prefix(mask, keys.shape[2]) if isinstance(mask, mx.array) else mask


def _grouped(mask: mx.array, Hkv: int, G: int) -> mx.array:
    """A mask broadcastable to (B, Hq, T, M) -> broadcastable to (B, Hkv, G, T, M)."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]  # (B|1, 1, 1, T, M)
    return mask.reshape(mask.shape[0], Hkv, G, mask.shape[2], mask.shape[3])


def _masked_scores(scores: mx.array, mask: mx.array):
    """Scores (B, Hkv, G, T, M) under a boolean or additive mask: (scores, keep or None)."""
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, -math.inf), mask
    return scores + mask.astype(mx.float32), None


def grouped_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: Mask = None) -> mx.array:
    """softmax(Q K^T * scale + mask) V with the query heads grouped per KV head.

    queries (B, Hq, T, Dh); keys, values (B, Hkv, S, Dh). mask: None; "causal" (bottom-right
    aligned, as SDPA: query i sees keys 0 .. S - T + i); or a boolean (True = attend) or additive
    array broadcastable to (B, Hq, T, M). M = S masks every key; M < S is a tail mask: it masks
    the last M keys, and the first S - M (the prefix every query of a verify sees) are visible to
    all: those scores need no mask at all, the one elementwise pass over them is the fused exp.
    Returns (B, Hq, T, Dh) in the queries' dtype.
    """
    B, Hq, T, Dh = queries.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    if isinstance(mask, str):
        mask = masks.causal_mask(T, 0)  # (T, T) over the last T keys: a tail mask
    M = 0 if mask is None else mask.shape[-1]  # keys under the mask, at the end
    q = (queries * scale).reshape(B, Hkv, G * T, Dh)  # heads h = j*G + g share KV head j
    parts = []  # (scores (B, Hkv, G, T, n), keep or None, values (B, Hkv, n, Dh)) per key block
    if M < S:  # the keys every query sees
        head = (q @ keys[:, :, : S - M].swapaxes(-1, -2)).astype(mx.float32)
        parts.append((head.reshape(B, Hkv, G, T, S - M), None, values[:, :, : S - M]))
    if M:
        tail = (q @ keys[:, :, S - M:].swapaxes(-1, -2)).astype(mx.float32).reshape(B, Hkv, G, T, M)
        tail, keep = _masked_scores(tail, _grouped(mask, Hkv, G))
        parts.append((tail, keep, values[:, :, S - M:]))
    peak = parts[0][0].max(axis=-1, keepdims=True)  # every row sees a key: finite
    for scores, _, _ in parts[1:]:
        peak = mx.maximum(peak, scores.max(axis=-1, keepdims=True))
    out, total = None, None
    for scores, keep, block_values in parts:
        weights = fast_exp(scores, peak)  # (B, Hkv, G, T, n) in (0, 1]
        if keep is not None:
            weights = mx.where(keep, weights, 0.0)  # a masked key adds exactly nothing
        n = weights.shape[-1]
        partial = weights.reshape(B, Hkv, G * T, n).astype(values.dtype) @ block_values  # (B, Hkv, G*T, Dh)
        out = partial if out is None else out + partial
        total = weights.sum(axis=-1) if total is None else total + weights.sum(axis=-1)  # (B, Hkv, G, T)
    out = out.reshape(B, Hkv, G, T, Dh) / total[..., None].astype(out.dtype)
    return out.reshape(B, Hq, T, Dh)


def _softmax(scores: mx.array) -> mx.array:
    """MLX's CPU softmax over the last axis, step for step (mlx/backend/cpu/softmax.cpp, float32):
    the row's maximum, e = exp(x - max), their sum in order (MLX's sum reduction adds one element
    at a time as its softmax does, on a CPU without its SIMD types), then e * (1 / sum)."""
    peak = mx.max(scores, axis=-1, keepdims=True)
    e = mx.exp(scores - peak)
    return e * (1 / mx.sum(e, axis=-1, keepdims=True))


_FLOAT32_MIN = mx.finfo(mx.float32).min  # what MLX's attention writes where a boolean mask hides a key


def _attend(q, keys, values, scale, mask=None, bias=None):
    """MLX's attention fallback after its reshapes: softmax(scale * q @ keys^T, masked) @ values."""
    scores = (scale * q) @ keys.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(_FLOAT32_MIN, mx.float32))
    elif bias is not None:
        scores = scores + bias
    return _softmax(scores) @ values


# One graph each for no mask, a boolean mask and an additive one, whatever the shapes: Python builds
# one call a layer, and the scaling, the mask and the softmax's elementwise steps are fused kernels.
_ATTEND = (mx.compile(lambda q, k, v, s: _attend(q, k, v, s), shapeless=True),
           mx.compile(lambda q, k, v, s, m: _attend(q, k, v, s, mask=m), shapeless=True),
           mx.compile(lambda q, k, v, s, b: _attend(q, k, v, s, bias=b), shapeless=True))


@functools.lru_cache(maxsize=4)
def _scale_array(scale: float) -> mx.array:
    return mx.array(scale, dtype=mx.float32)


def _exact_for(queries: int, keys: int, dtype: mx.Dtype = mx.float32) -> bool:
    """MLX's attention as `exact_attention`: the CPU, float32, 2+ queries or one over at least
    EXACT_ONE_QUERY_MIN_KEYS keys (fewer: MLX's op is as fast), at any length (it beats the
    grouped path over long caches too, prefill included); EXACT_ATTENTION on."""
    return ((queries > 1 or keys >= EXACT_ONE_QUERY_MIN_KEYS) and dtype == mx.float32
            and mx.default_device() == mx.cpu and EXACT_ATTENTION)


@functools.lru_cache(maxsize=8)
def _causal(queries: int, keys: int) -> mx.array:
    """SDPA's "causal" as a boolean (T, S) array, bottom-right aligned: made once for a forward's
    layers (the same T and S) rather than in each, as MLX's op does."""
    return masks.causal_mask(queries, keys - queries)


_last_rows_mask = (None, 0, None)  # (mask, G, its rows): the last `_mask_as_rows`, for the next layer


def _mask_as_rows(mask: mx.array, Hkv: int, G: int) -> mx.array:
    """A mask broadcastable to (B, Hq, T, S) as (B|1, Hkv|1, G*T, S), the rows of the query heads
    stacked per KV head: a copy G times its size, made once for a forward's layers (they pass the
    very same mask array; the one kept here stays alive, so `is` cannot match a new one)."""
    global _last_rows_mask
    last, last_groups, rows = _last_rows_mask
    if last is mask and last_groups == G:
        return rows
    grouped = _grouped(mask, Hkv, G)  # (B|1, Hkv|1, G|1, T, S)
    T, S = grouped.shape[-2:]
    rows = mx.broadcast_to(grouped, grouped.shape[:2] + (G, T, S)).reshape(*grouped.shape[:2], G * T, S)
    _last_rows_mask = (mask, G, rows)
    return rows


def exact_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                    mask: Mask = None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` on the CPU, the same bits: its fallback's ops
    (mlx/fast.cpp) as one compiled graph (`_attend`). queries (B, Hq, T, Dh), float32; keys,
    values (B, Hkv, S, Dh); mask None, "causal", or a boolean or additive array broadcastable to
    (B, Hq, T, S)."""
    B, Hq, T, Dh = queries.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    if isinstance(mask, str):  # "causal" over the keys this layer attends (a sparse cache: not all)
        mask = _causal(T, S)
    if 1 < G and G * T <= SMALL_GEMM_ROWS and _blas.small_gemm is not None:
        # The query heads of a KV head as the rows of one product (B, Hkv, G*T, Dh): the keys and
        # values are read once for all G heads, and the engine's small-row GEMM gives every row the
        # bits it gives it in MLX's G products of T rows (native/small_gemm.c: the same bits whatever
        # the row count).
        queries = queries.reshape(B, Hkv, G * T, Dh)
        mask = None if mask is None else _mask_as_rows(mask, Hkv, G)
    elif G > 1:  # MLX's own layout: (B, Hkv, G, T, Dh) against (B, Hkv, 1, S, Dh)
        queries = queries.reshape(B, Hkv, G, T, Dh)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        mask = None if mask is None else _grouped(mask, Hkv, G)  # (B|1, Hkv|1, G|1, T, S)
    scale = _scale_array(scale)
    if mask is None:
        out = _ATTEND[0](queries, keys, values, scale)
    elif mask.dtype == mx.bool_:
        out = _ATTEND[1](queries, keys, values, scale, mask)
    else:
        out = _ATTEND[2](queries, keys, values, scale, mask.astype(mx.float32))
    return out.reshape(B, Hq, T, Dh)


def attention_over_cache(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                         mask: Mask = None) -> mx.array:
    """The attention every forward uses: the grouped path where it pays, else MLX's own (on the
    CPU, where it pays, as `exact_attention`: the same bits)."""
    if _exact_for(queries.shape[2], keys.shape[2], queries.dtype):
        return exact_attention(queries, keys, values, scale, full_width(mask, queries, keys))
    if use_grouped(queries, keys):
        return grouped_attention(queries, keys, values, scale, mask)
    mask = full_width(mask, queries, keys)
    if _verify_on_cuda(queries.shape[2]):
        keys, values, mask = bucket_keys(queries, keys, values, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
