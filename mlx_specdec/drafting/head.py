"""ReDrafter's draft head as a proposer: beam search (greedy) or sampled chains (temperature > 0)
from the RNN head on the target's last hidden state (`drafter/head.py`, `drafter/beam.py`).

The head's state is rebuilt every step from the target's hidden state after the last accepted
token, so there is nothing to commit or roll back. Both draft kinds are lazy MLX graphs: the
caller builds the next step's drafts before its one host sync.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ..drafter.beam import compiled_beam_search, dedup_prefix, sample_beams
from .base import Proposal


class HeadProposer:
    def __init__(self, head, embed, width: int, length: int, vocab: int, temperature: float = 0.0):
        """vocab: the target's vocabulary size (the width of the draft distributions it checks)."""
        self.head, self.embed, self.vocab = head, embed, vocab
        self.width, self.length, self.temperature = width, length, temperature
        self._search = compiled_beam_search(head, embed, width, length) if temperature <= 0 else None

    def propose(self, token: mx.array, hidden: Optional[mx.array]) -> Proposal:
        """token (B,): the target's own latest token; hidden (B, D): the state that produced it."""
        if self._search is not None:
            beams, owner, confidence = self._search(hidden, token)
            return Proposal(beams, owner, None, confidence)
        drafts = sample_beams(self.head, self.embed, hidden, token, self.width, self.length, self.temperature)
        return Proposal(drafts.beams, dedup_prefix(drafts.beams), self._full_vocab(drafts.draft_probs),
                        drafts.confidence)

    def _full_vocab(self, draft_probs: mx.array) -> mx.array:
        """(B, W, L-1, K) draft-vocabulary distribution -> (B, W, L-1, V), zero outside it."""
        full = mx.zeros(draft_probs.shape[:-1] + (self.vocab,), dtype=draft_probs.dtype)
        return full.at[..., self.head.draft_to_full].add(draft_probs)

    def commit(self, tokens: Sequence[Sequence[int]]) -> None:
        pass

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None:
        pass
