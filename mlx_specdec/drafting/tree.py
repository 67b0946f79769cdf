"""Tree packing: W drafted beams per row verified as one tree of their distinct prefixes.

Beams share prefixes (every beam starts with the target's own token, and beam search keeps
siblings), so verifying all W*L tokens would repeat work. `dedup_prefix` finds, for every
(beam, depth), the first beam with the same prefix; `pack_beams` keeps each distinct prefix once,
in one sequence with per-token depths and parents (the tree mask: `masks.ragged_tree_mask`), and
an index that unpacks the verified logits back to (W, L). `with_runners_up` adds siblings of a
chain's drafts (other candidates for the same depth) to a packed chain.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np


def dedup_prefix(beams, xp=mx):
    """beams (B, W, L) -> owner (B, W, L): the smallest beam index k with beams[k, :j+1] == beams[w, :j+1].

    Token (w, j) is verified only if owner[w, j] == w; otherwise beam `owner` carries the same prefix.
    xp: mx for a lazy graph, np for drafts already on the host (prompt lookup's).
    """
    same = beams[:, :, None, :] == beams[:, None, :, :]  # (B, W, W, L): token j equal in beams w and k
    same_prefix = xp.cumprod(same.astype(xp.int32), axis=-1)  # (B, W, W, L): equal through depth j
    return xp.argmax(same_prefix, axis=2).astype(xp.int32)  # first k (argmax takes the first max)


class PackedTree(NamedTuple):
    tokens: np.ndarray  # (N,) distinct prefix tokens in topological (beam-major) order
    parents: np.ndarray  # (N,) index of each token's parent in the packing, -1 for the root(s)
    depths: np.ndarray  # (N,) depth in its beam: position = prefix length + depth
    index: np.ndarray  # (W, L) packed index of every beam token (shared prefixes share an index)


def pack_beams(beams: np.ndarray, owner: np.ndarray) -> PackedTree:
    """Host-side packing of one row, from the owner table: a few dozen integers per step.

    beams, owner: (W, L). Beam-major order is topological: a token's parent is either earlier in
    its own beam or in a lower-indexed beam that owns the shared prefix.
    """
    W, L = beams.shape
    index = np.empty((W, L), dtype=np.int32)
    tokens, parents, depths = [], [], []
    for w in range(W):
        for j in range(L):
            k = owner[w, j]
            if k != w:  # the prefix through depth j is carried by beam k < w
                index[w, j] = index[k, j]
                continue
            index[w, j] = len(tokens)
            tokens.append(beams[w, j])
            parents.append(index[w, j - 1] if j > 0 else -1)
            depths.append(j)
    return PackedTree(np.array(tokens, dtype=np.int32), np.array(parents, dtype=np.int32),
                      np.array(depths, dtype=np.int32), index)


def with_runners_up(beams: np.ndarray, trees: list, runners: np.ndarray, verify: np.ndarray,
                    depths: np.ndarray | None = None):
    """Siblings of the chain's drafts, verified beside it in the same forward.

    beams (B, 1, L): one chain a row; trees: their `pack_beams`; runners (B, R): the head's next
    choices at the depths (R,) given (default: all at depth 1), each k <= L - 1; verify (B, R)
    bool: which of them to verify. -> beams (B, 1+R, L) and trees where beam r >= 1 is the chain's
    first k tokens, then runner r, then -1 (which never equals a target token): a child of the
    chain's depth k-1 token, so it is accepted k deep at most, and only where the chain's own
    k-th draft is not. A runner not verified has no tree token (its beam points at the root and
    never matches)."""
    B, _, L = beams.shape
    R = runners.shape[1]
    depths = np.ones(R, dtype=np.int64) if depths is None else np.asarray(depths)
    out = np.full((B, 1 + R, L), -1, dtype=beams.dtype)
    out[:, 0] = beams[:, 0]
    out[:, 1:, 0] = beams[:, :1, 0]
    packed = []
    for b, tree in enumerate(trees):
        tokens, parents, tree_depths = list(tree.tokens), list(tree.parents), list(tree.depths)
        index = np.zeros((1 + R, L), dtype=np.int32)
        index[0] = tree.index[0]
        for r in np.flatnonzero(verify[b]):
            k = int(depths[r])
            out[b, 1 + r, :k] = beams[b, 0, :k]
            out[b, 1 + r, k] = runners[b, r]
            index[1 + r, :k] = tree.index[0, :k]
            index[1 + r, k:] = len(tokens)
            tokens.append(runners[b, r])
            parents.append(tree.index[0, k - 1])
            tree_depths.append(k)
        packed.append(PackedTree(np.array(tokens, dtype=np.int32), np.array(parents, dtype=np.int32),
                                 np.array(tree_depths, dtype=np.int32), index))
    return out, packed
