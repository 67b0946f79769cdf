"""Attention masks and positions: the one place this math lives.

Causal masks (plain and over a padded batch), token-tree masks and depths (one tree, a tree over
a cached prefix, one tree per row of a ragged batch) and the per-thread path masks of the
forkable cache: every boolean attention mask a forward gets is built here. Elsewhere masks are
only the string "causal" (SDPA's own) or, in apar/samples.py, `tree_mask_np` blocks placed into
a padded training batch.

All masks here are boolean, True = may attend, shaped to broadcast against
(B, heads, queries, keys) in `mx.fast.scaled_dot_product_attention`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .host_traffic import to_device


def causal_mask(num_queries: int, offset: int) -> mx.array:
    """(L, offset + L): query i (at position offset + i) sees keys 0 .. offset + i. Built on the
    device (no host data)."""
    query_pos = mx.arange(offset, offset + num_queries)[:, None]
    key_pos = mx.arange(offset + num_queries)[None, :]
    return key_pos <= query_pos


def padded_causal_mask(valid: np.ndarray, start: int, end: int) -> mx.array:
    """(B, 1, end - start, end) for queries at positions start .. end-1 of a padded batch.

    valid (B, >= end): which slots hold row b's tokens (False: padding). Query i (slot start + i)
    of row b sees row b's valid slots 0 .. start + i; every query also sees itself, so a padding
    query has a key (no empty softmax row, nothing NaN) and no real token sees a padding one.
    """
    valid = np.asarray(valid, dtype=bool)[:, :end]
    queries = np.arange(start, end)
    causal = np.arange(end)[None, :] <= queries[:, None]  # (c, end)
    mask = causal[None] & valid[:, None, :]
    mask[:, np.arange(end - start), queries] = True
    return mx.array(mask)[:, None]


def path_mask(paths: Sequence[Sequence[int]], width: int) -> mx.array:
    """(1, 1, L, width): query r sees exactly the cache slots in paths[r] (the forkable cache:
    a thread's slots from the root down to its new token)."""
    mask = np.zeros((len(paths), width), dtype=bool)
    for row, slots in enumerate(paths):
        mask[row, list(slots)] = True
    return to_device(mask)[None, None]


def _check_topological(parents: Sequence[int]) -> None:
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree is not in topological order: parent {p} of token {i}")


def tree_mask_np(parents: Sequence[int], hidden: Optional[np.ndarray] = None) -> np.ndarray:
    """(N, N) ancestor-or-self mask of a token tree in topological order.

    parents[i] is the index of token i's parent inside the tree (-1 for a root, which hangs off
    the cached prefix). Row i is True at i and at every ancestor of i. Tokens marked `hidden`
    (N,) are seen by no other token (each still sees itself: no empty softmax row).
    """
    _check_topological(parents)
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    if hidden is not None:
        mask[:, np.asarray(hidden, bool)] = False
        mask[np.arange(n), np.arange(n)] = True
    return mask


def tree_depths_np(parents: Sequence[int], hidden: Optional[np.ndarray] = None) -> np.ndarray:
    """Depth of each tree token (roots at 0): the offset of its position past the prefix.
    `hidden` (N,) tokens take no position: a depth counts only the visible ancestors."""
    _check_topological(parents)
    depth = np.zeros(len(parents), dtype=np.int32)
    for i, p in enumerate(parents):
        step = 0 if hidden is not None and hidden[p] else 1
        depth[i] = depth[p] + step if p >= 0 else 0
    return depth


def prefix_tree_mask(parents: Sequence[int], prefix_len: int) -> mx.array:
    """(N, prefix_len + N): every tree token sees the whole cached prefix and its own path."""
    tree = tree_mask_np(parents)
    prefix = np.ones((len(parents), prefix_len), dtype=bool)
    return mx.array(np.concatenate([prefix, tree], axis=1))


def tree_positions(parents: Sequence[int], prefix_len: int) -> mx.array:
    """(1, N) absolute positions: a token at depth d sits at prefix_len + d."""
    return mx.array(tree_depths_np(parents) + prefix_len)[None]


def ragged_tree_mask(valid: np.ndarray, trees: Sequence[Sequence[int]], width: int) -> mx.array:
    """(B, 1, width, P + width) for one token tree per batch row over a ragged cache.

    valid (B, P): which cache slots hold row b's tokens (rows of a batch commit different counts,
    leaving holes). trees[b]: row b's parents list (topological, N_b <= width tokens). Tree token i
    of row b sees row b's valid slots and its own path; padding tokens (i >= N_b) see only
    themselves, so every query has a key and none leaks into a real token.
    """
    B, P = valid.shape
    mask = np.zeros((B, 1, width, P + width), dtype=bool)
    for b, parents in enumerate(trees):
        n = len(parents)
        mask[b, 0, :n, :P] = valid[b]
        mask[b, 0, :n, P : P + n] = tree_mask_np(parents)
        pads = np.arange(n, width)
        mask[b, 0, pads, P + pads] = True
    return to_device(mask)


def tree_tail_mask(trees: Sequence[Sequence[int]], width: int) -> mx.array:
    """(B, 1, width, width): `ragged_tree_mask` when every cached slot of every row is a token
    (one row, or rows without holes), as a tail mask: it covers only the width new tokens, and
    every cached key before them is visible to every query (the tail-mask convention of
    model/attention.py, which then needs no mask over the long prefix). Padding tokens see the
    prefix and themselves; no real token sees them."""
    mask = np.zeros((len(trees), 1, width, width), dtype=bool)
    for b, parents in enumerate(trees):
        n = len(parents)
        mask[b, 0, :n, :n] = tree_mask_np(parents)
        pads = np.arange(n, width)
        mask[b, 0, pads, pads] = True
    return to_device(mask)


def ragged_tree_positions(lengths: Sequence[int], trees: Sequence[Sequence[int]], width: int) -> mx.array:
    """(B, width) positions: row b's token at depth d sits at lengths[b] + d; padding at 0."""
    positions = np.zeros((len(trees), width), dtype=np.int32)
    for b, parents in enumerate(trees):
        positions[b, : len(parents)] = tree_depths_np(parents) + lengths[b]
    return to_device(positions)


def tree_on_device(parents: mx.array):
    """parents (B, N) int32 on the device, -1 for a root -> (ancestor-or-self mask (B, 1, N, N)
    bool, depths (B, N) int32): `tree_mask_np` and `tree_depths_np` of every row, computed on the
    device. Padding is a root no token descends from: it sees itself (and, as a tail mask, the
    prefix), and no real token sees it. The closure doubles the path length it covers per
    product: log2(N) small matmuls."""
    N = parents.shape[-1]
    reach = (parents[..., None] == mx.arange(N)) | mx.eye(N, dtype=mx.bool_)  # (B, N, N): self or parent
    covered = 1
    while covered < N - 1:
        as_float = reach.astype(mx.float32)
        reach = (as_float @ as_float) > 0  # paths of up to twice the length
        covered *= 2
    depths = reach.astype(mx.int32).sum(axis=-1) - 1  # ancestors, self excluded
    return reach[:, None], depths
