"""Host-side sources in front of a device-side fallback: per row, the first that offers drafts.

ReDrafter drafts through an ordered list of sources (`redrafter --sources`, default
`lookup,head`). Each step, per row, the host-side sources are asked in order for a chain after
the target's own token x (`draft_after`); the first that offers one drafts the row. A row no
host-side source drafts takes the fallback's drafts: the ReDrafter head's proposal, built lazily
before the step's sync and read (computed) only when some row needs it.

A row's drafts come from one source per step. Rows are padded to one beam length: a shorter
chain repeats its last token at confidence 0 (never verified). After the verify, every source
commits the text and hears how its own drafts fared (`judged`: drafts verified and accepted, 0
in the rows it did not draft), which is what its confidence learns from.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..host_traffic import to_device
from .base import Chain, Proposal, Proposer, one_hot_probs, read_host
from .tree import dedup_prefix


class Drafted(NamedTuple):
    proposal: Proposal  # beams, owner, confidence as MLX arrays; draft_probs when sampling
    beams: np.ndarray  # (B, W, L) the same, on the host
    owner: np.ndarray  # (B, W, L)
    confidence: np.ndarray  # (B, W, L-1): each row's source's confidence (0 for padding)
    source: np.ndarray  # (B,) int: the index of the source that drafted the row; len(sources): the fallback
    from_host: np.ndarray  # (B,) bool: a host-side source drafted the row


class FirstOffer:
    def __init__(self, sources: Sequence[Proposer], vocab: int):
        """sources: host-side sources, in the order they are asked; vocab: the target's vocabulary
        size (one-hot draft distributions when sampling)."""
        self.sources, self.vocab = list(sources), vocab
        self.fallback = len(self.sources)
        self.source = np.zeros(0, dtype=np.int64)  # per row: who drafted its current proposal
        self.proposed = np.zeros(0, dtype=np.int64)  # per row: host-side drafts in it (0: the fallback's)

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Each row's text: its whole prompt (the target's first own token comes after it)."""
        for source in self.sources:
            source.begin(prompts)
        self.source = np.full(len(prompts), self.fallback, dtype=np.int64)
        self.proposed = np.zeros(len(prompts), dtype=np.int64)

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None:
        """Rows joining a running batch (its text so far each), drafted by no source yet."""
        for source in self.sources:
            source.add_rows(prompts)
        self.source = np.concatenate([self.source, np.full(len(prompts), self.fallback, dtype=np.int64)])
        self.proposed = np.concatenate([self.proposed, np.zeros(len(prompts), dtype=np.int64)])

    def commit(self, tokens: Sequence[Sequence[int]], verified: Optional[int] = None) -> None:
        """Per row: the own token the step started from and the drafts accepted after it.
        verified: drafts the step verified (the cutoff and the cost rule may verify fewer than
        proposed; None: all)."""
        checked = self.proposed if verified is None else np.minimum(self.proposed, verified)
        accepted = np.array([len(t) - 1 for t in tokens])
        for i, source in enumerate(self.sources):
            source.commit(tokens)
            mine = self.source == i
            source.judged(np.where(mine, checked, 0), np.where(mine, accepted, 0))

    def select_rows(self, keep: Sequence[int]) -> None:
        for source in self.sources:
            source.select_rows(keep)
        self.source, self.proposed = self.source[keep], self.proposed[keep]

    def offers(self, own: np.ndarray) -> List[Optional[Chain]]:
        """Per row, the chain of the first source that offers one (None: the fallback drafts it)."""
        chains: List[Optional[Chain]] = [None] * len(own)
        self.source = np.full(len(own), self.fallback, dtype=np.int64)
        for i, source in enumerate(self.sources):
            asked = self.source == self.fallback
            if not asked.any():
                break
            for b, chain in enumerate(source.draft_after(own, asked)):
                if asked[b] and chain is not None and chain.tokens:
                    chains[b], self.source[b] = chain, i
        self.proposed = np.array([0 if c is None else len(c.tokens) for c in chains], dtype=np.int64)
        return chains

    def draft(self, fallback: Proposal, own: np.ndarray, fallback_read: Optional[tuple] = None,
              upload: bool = True) -> Drafted:
        """fallback: the device-side source's lazy proposal from the own tokens (B,), which `own`
        holds on the host; fallback_read: its beams and confidence already read (no sync here).
        upload: the Proposal as MLX arrays (else None: the caller packs from the host arrays)."""
        chains = self.offers(own)
        from_host = self.source != self.fallback
        W = fallback.beams.shape[1]
        if from_host.all():
            head_beams = head_confidence = None
            length = 1 + max(len(c.tokens) for c in chains)
        else:
            # Host sync, only when a row needs the fallback: its drafts (beams, confidence).
            head_beams, head_confidence = fallback_read or read_host(fallback.beams, fallback.confidence)
            length = max([head_beams.shape[-1]] + [1 + len(c.tokens) for c in chains if c is not None])
        B = len(own)
        beams = np.empty((B, W, length), dtype=np.int32)
        confidence = np.zeros((B, W, length - 1), dtype=np.float32)
        for b, chain in enumerate(chains):
            if chain is None:  # the fallback's beams, padded by repeating their last token (confidence 0)
                Lh = head_beams.shape[-1]
                beams[b, :, :Lh] = head_beams[b]
                beams[b, :, Lh:] = head_beams[b, :, -1:]
                confidence[b, :, : Lh - 1] = head_confidence[b]
            else:  # every beam the chain: the packing keeps it once
                follow = chain.tokens
                beams[b, :, :] = [int(own[b])] + follow + [follow[-1]] * (length - 1 - len(follow))
                confidence[b, :, : len(follow)] = chain.confidence
        owner = dedup_prefix(beams, np)
        if not upload:
            return Drafted(None, beams, owner, confidence, self.source.copy(), from_host)
        probs = None if fallback.draft_probs is None else self._draft_probs(fallback, beams, from_host)
        proposal = Proposal(to_device(beams), to_device(owner), probs, to_device(confidence))
        return Drafted(proposal, beams, owner, confidence, self.source.copy(), from_host)

    def _draft_probs(self, fallback: Proposal, beams: np.ndarray, from_host: np.ndarray) -> mx.array:
        """(B, W, L-1, V) q of each drafted token: the fallback's where it sampled them, one-hot
        for host-side drafts and for the padding past the fallback's length (deterministic)."""
        one_hot = one_hot_probs(mx.array(beams), self.vocab)  # (B, W, L-1, V)
        if from_host.all():  # the fallback's distributions are not needed (nor computed)
            return one_hot
        head_probs = fallback.draft_probs  # (B, W, Lh-1, V)
        depth, drafted = head_probs.shape[2], beams.shape[-1] - 1
        if drafted > depth:
            head_probs = mx.concatenate([head_probs, one_hot[:, :, depth:]], axis=2)
        elif drafted < depth:  # every row a host-side chain, shorter than the fallback's beams
            head_probs = head_probs[:, :, :drafted]
        return mx.where(mx.array(from_host)[:, None, None, None], one_hot, head_probs)
