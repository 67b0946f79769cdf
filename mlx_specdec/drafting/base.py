"""The drafting interface every speculative method stacks.

A proposer drafts W candidate continuations of length L per batch row, each starting with the
target's own latest token, together with the distribution each drafted token was drawn from
(what the rejection-sampling acceptance needs; `acceptance.sampling_accept`):

    propose(token (B,), hidden (B, D) | None) -> Proposal(beams (B, W, L), owner, draft_probs)
    commit(tokens per row)   what became text this step, before the target's next own token: the
                             own token the proposal started from and the drafts accepted after it
    rollback(lengths | None) cut each row's committed text back to lengths[row] tokens (in a
                             hierarchy the level above may reject what the proposer's own verifier
                             accepted: TriForce's full-cache verify); None forgets only what was
                             proposed and not committed

`owner` is the dedup table of shared prefixes (`drafting.tree.dedup_prefix`): verification packs
each distinct prefix once. A proposer whose drafts follow from the committed text alone keeps
that text as its state (n-gram lookup); one that reads the target's hidden state has none
(the ReDrafter head): its commit and rollback do nothing. A small draft model over a StreamingLLM
cache (`draft_model.py`) keeps both the text and its cache, cut back to the text at each proposal.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Sequence

import mlx.core as mx
import numpy as np


class Proposal(NamedTuple):
    beams: mx.array  # (B, W, L) int32; [:, :, 0] is the target's own latest token
    owner: mx.array  # (B, W, L) int32: the first beam with the same prefix through each depth
    draft_probs: Optional[mx.array]  # (B, W, L-1, V) q of each drafted token; None when greedy
    confidence: Optional[mx.array] = None  # (B, W, L-1) the proposer's probability of each drafted token


class Proposer(Protocol):
    width: int
    length: int

    def propose(self, token: mx.array, hidden: Optional[mx.array]) -> Proposal: ...

    def commit(self, tokens: Sequence[Sequence[int]]) -> None: ...

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None: ...


def select_rows(proposal: Proposal, keep: np.ndarray) -> Proposal:
    """The proposal of the rows still decoding (a batch shrinks as rows finish)."""
    index = mx.array(keep)
    probs = None if proposal.draft_probs is None else proposal.draft_probs[index]
    confidence = None if proposal.confidence is None else proposal.confidence[index]
    return Proposal(proposal.beams[index], proposal.owner[index], probs, confidence)


def one_hot_probs(beams: mx.array, vocab: int) -> mx.array:
    """(B, W, L) deterministic drafts -> (B, W, L-1, V): each drafted token had probability 1
    (q = 1: accepted with probability p(token), the residual is p without it)."""
    drafted = beams[..., 1:]
    return (mx.arange(vocab)[None, None, None, :] == drafted[..., None]).astype(mx.float32)


def read_host(*arrays) -> list:
    """Evaluate together and bring to the host (a decoding loop's deliberate sync): numpy arrays."""
    mx.eval(*arrays)
    return [np.array(a) for a in arrays]
