"""RoPE's cosines and sines computed once per forward on the CPU, shared by every layer.

MLX's CPU RoPE (`mx.fast.rope`'s fallback) computes the frequencies, the angles and their cosines
and sines anew on each call: ~6 small kernels for each of a layer's two calls (queries, keys),
~360 of a one-token forward's ~2,700 ops, for the same handful of numbers in every layer. Here
they are read once, from the model's own RoPE module rotating a unit vector: each pair (1, 0)
comes out as (cos, sin) exactly (1*c - 0*s = c, 1*s + 0*c = s), so they are the very values the
module multiplies by. `rotate` then applies them as the module does (two products, one sum each),
with the same bits (tests/test_forward.py). A tree's per-token positions get one table row per
token the same way (`tables_at`), in place of 60 per-token rotations. Used for float32
activations and plain `nn.RoPE` modules rotating a whole head, shared by every layer (the default
model and every Llama without rope scaling); anything else keeps its module (a float16 RoPE rounds
once, after both products).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

Tables = Tuple[mx.array, mx.array]  # cos, sin: (1, 1, L, D/2), or (B, 1, L, D/2) per token


def shared_rope(layers: Sequence[nn.Module]) -> Optional[nn.RoPE]:
    """The one plain RoPE every layer uses, rotating whole heads; else None."""
    first = layers[0].self_attn
    rope = getattr(first, "rope", None)
    if type(rope) is not nn.RoPE or rope.dims != getattr(first, "head_dim", None) or rope.dims % 2:
        return None
    key = (rope.dims, rope.traditional, rope.base, rope.scale)
    for layer in layers[1:]:
        other = getattr(layer.self_attn, "rope", None)
        if type(other) is not nn.RoPE or (other.dims, other.traditional, other.base, other.scale) != key:
            return None
    return rope


def tables(rope: nn.RoPE, rotate_with, offset, length: int) -> Tables:
    """cos, sin (1, 1, length, D/2) at positions offset .. offset + length - 1, as `rotate_with(x,
    offset)` (the module, or its compiled call) multiplies by them."""
    return _read_off(rope, (1, 1, length), lambda unit: rotate_with(unit, offset))


def tables_at(rope: nn.RoPE, rotate_with, positions: mx.array) -> Tables:
    """cos, sin (B, 1, L, D/2) at per-token positions (B, L) (a verified tree's): a unit vector per
    token, rotated once with the token's position as its row's offset (`rotate_with(x, starts)`
    rotates row r of x (R, 1, 1, D) at starts[r], as the per-token RoPE of model/forward.py does)."""
    positions = positions.reshape(-1, positions.shape[-1])  # (L,), (B, L) or (B, 1, L): as the queries' rows
    B, L = positions.shape
    starts = positions.reshape(-1).astype(mx.int32)
    cos, sin = _read_off(rope, (B * L, 1, 1), lambda unit: rotate_with(unit, starts))  # (B*L, 1, 1, D/2)
    return cos.reshape(B, 1, L, -1), sin.reshape(B, 1, L, -1)


def _read_off(rope: nn.RoPE, rows: tuple, rotated) -> Tables:
    """cos, sin (*rows, D/2): `rotated` applied to unit vectors (*rows, D), each pair (1, 0) in the
    module's layout coming out as (cos, sin)."""
    half = rope.dims // 2
    ones, zeros = mx.ones(rows + (half,)), mx.zeros(rows + (half,))
    if rope.traditional:  # pairs (x[2i], x[2i+1])
        out = rotated(mx.stack([ones, zeros], axis=-1).reshape(rows + (rope.dims,))).reshape(rows + (half, 2))
        return out[..., 0], out[..., 1]
    out = rotated(mx.concatenate([ones, zeros], axis=-1))  # halves (x[:D/2], x[D/2:])
    return out[..., :half], out[..., half:]


def rotate(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """x (B, H, L, D) rotated by the tables: (a, b) -> (a c - b s, a s + b c) per pair."""
    B, H, L, D = x.shape
    if traditional:
        pairs = x.reshape(B, H, L, D // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(B, H, L, D)
    a, b = x[..., : D // 2], x[..., D // 2:]
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
