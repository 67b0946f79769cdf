"""The drafting protocol every drafting source (a proposer) follows, and what they share.

A proposer drafts continuations of the target's own latest token x, per batch row, together with
how far to trust each drafted token (its confidence: the probability that the draft is the
target's token given that the drafts before it were, as well as the source can say) and, when
sampling, the distribution each was drawn from (what exact acceptance divides by:
`acceptance.sampling_accept`). Every caller (ReDrafter's step, TriForce's bottom level,
PipeInfer's first rank) talks to a source through these members only:

    width, length        beams per row and tokens per beam (x first) that `propose` returns
    needs_hidden         its drafts read the target's hidden state after x (`propose`'s `hidden`)
    host_side            it drafts on the host from the committed text (`draft_after`); otherwise
                         on the device, lazily (`propose`)
    begin(prompts)       start a batch: each row's committed text is its prompt
    propose(x, hidden)   -> Proposal(beams (B, W, L), owner, draft_probs, confidence) for every row
    draft_after(xs, rows) host-side drafts after each asked row's token: a `Chain` (tokens and
                         their confidence) or None where it has none; a device-side source
                         returns None for every row
    commit(tokens)       per row, what became text this step: x and the drafts accepted after it
    rollback(lengths)    cut each row's text back to lengths[row] tokens (in a hierarchy the level
                         above may reject what this level accepted); None forgets only what was
                         proposed and not committed
    select_rows(keep)    the rows still decoding (a batch shrinks as rows finish)
    judged(verified, accepted)  per row, how many of its last drafts a verify checked and how
                         many of those it accepted: the evidence its confidence is calibrated on

`owner` is the dedup table of shared prefixes (`tree.dedup_prefix`): verification packs each
distinct prefix once. A source whose drafts follow from the committed text alone keeps that text
as its state (n-gram lookup); one that reads the target's hidden state has none (the ReDrafter
head): its commit and rollback do nothing. A small draft model over a StreamingLLM cache
(`draft_model.py`) keeps both the text and its cache, cut back to the text at each proposal.
Host-side drafts are deterministic given the text, so their distribution is one-hot.

`ProposerDefaults` gives the members a source has no use for their do-nothing form,
`HostSideDefaults` a host-side source's `propose` from its `draft_after`, and `RunningRate` a
confidence for sources with no probability of their own.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Protocol, Sequence

import mlx.core as mx
import numpy as np

from ..host_traffic import read_host  # noqa: F401  (the drafting layer's sync, re-exported)


class Proposal(NamedTuple):
    beams: mx.array  # (B, W, L) int32; [:, :, 0] is the target's own latest token
    owner: mx.array  # (B, W, L) int32: the first beam with the same prefix through each depth
    draft_probs: Optional[mx.array]  # (B, W, L-1, V) q of each drafted token; None when greedy
    confidence: Optional[mx.array] = None  # (B, W, L-1) the source's confidence in each drafted token


class Chain(NamedTuple):
    """A host-side draft for one row: the tokens after x, and the confidence in each."""

    tokens: List[int]
    confidence: np.ndarray  # (len(tokens),)


class Proposer(Protocol):
    width: int
    length: int
    needs_hidden: bool
    host_side: bool

    def begin(self, prompts: Sequence[Sequence[int]]) -> None: ...

    def propose(self, token: mx.array, hidden: Optional[mx.array]) -> Proposal: ...

    def draft_after(self, tokens: Sequence[int], rows: Optional[np.ndarray] = None) -> List[Optional[Chain]]: ...

    def commit(self, tokens: Sequence[Sequence[int]]) -> None: ...

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None: ...

    def select_rows(self, keep: Sequence[int]) -> None: ...

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None: ...

    def judged(self, verified: Sequence[int], accepted: Sequence[int]) -> None: ...


class ProposerDefaults:
    """The protocol's members in their do-nothing form: a device-side source that reads no
    hidden state, keeps no text and learns nothing from verification."""

    needs_hidden = False
    host_side = False
    keeps_text = False  # a device-side source that drafts after the committed text (a draft model)

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        pass

    def draft_after(self, tokens: Sequence[int], rows: Optional[np.ndarray] = None) -> List[Optional[Chain]]:
        return [None] * len(tokens)

    def commit(self, tokens: Sequence[Sequence[int]]) -> None:
        pass

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None:
        pass

    def select_rows(self, keep: Sequence[int]) -> None:
        pass

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None:
        pass

    def judged(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        pass


class HostSideDefaults(ProposerDefaults):
    """A host-side source that writes only `draft_after` (and keeps `length`, `vocab`): `propose`
    puts its chains in the Proposal shapes, one beam a row."""

    host_side = True
    width = 1
    sampling = False  # one-hot draft distributions in `propose` (sampling), else None

    def propose(self, token: mx.array, hidden: Optional[mx.array] = None) -> Proposal:
        tokens = np.array(token).reshape(-1)  # host sync: the drafts follow the token's value
        return chains_proposal(tokens, self.draft_after(tokens), self.length, self.vocab if self.sampling else None)


class NoDrafts(HostSideDefaults):
    """A source that never drafts (TriForce's `--bottom none`: the level above writes one token
    per forward)."""

    length, vocab = 1, 0


class NoHead(ProposerDefaults):
    """ReDrafter's fallback for a model with no draft head: it drafts nothing, lazily, so a row no
    host-side source drafts takes a plain step (the step's one sync reads nothing extra)."""

    width, length, runners_up, stepwise = 1, 1, 0, False

    def propose(self, token: mx.array, hidden: Optional[mx.array] = None) -> Proposal:
        beams = token.astype(mx.int32).reshape(-1, 1, 1)  # (B, 1, 1): the own token alone
        return Proposal(beams, mx.zeros_like(beams), None, mx.zeros((beams.shape[0], 1, 0)))


class RunningRate:
    """A confidence for drafts with no probability of their own (a lookup, a chain written by
    another level): the running acceptance rate of its verified drafts, each verified draft one
    event (accepted, or the first rejected one), the newest weighing RATE_WEIGHT."""

    RATE_WEIGHT = 0.2
    rate = 0.5  # before any evidence

    def judged(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        for checked, kept in zip(verified, accepted):
            for k in range(min(int(checked), int(kept) + 1)):
                self.rate += self.RATE_WEIGHT * (float(k < int(kept)) - self.rate)

    def rate_confidence(self, drafts: int) -> np.ndarray:
        return np.full(drafts, self.rate)


def chains_proposal(tokens: np.ndarray, chains: Sequence[Optional[Chain]], length: int,
                    vocab: Optional[int] = None) -> Proposal:
    """Host-side chains (one per row; None: no drafts) as a Proposal of one beam of `length` per
    row, a short chain padded with its last token at confidence 0 (never verified); one-hot draft
    distributions over `vocab` when given."""
    B = len(tokens)
    beams = np.repeat(np.asarray(tokens, dtype=np.int32).reshape(B, 1, 1), length, axis=-1)  # (B, 1, L)
    confidence = np.zeros((B, 1, length - 1), dtype=np.float32)
    for b, chain in enumerate(chains):
        if chain is not None and chain.tokens and length > 1:
            follow = chain.tokens[: length - 1]
            beams[b, 0, 1: 1 + len(follow)] = follow
            beams[b, 0, 1 + len(follow):] = follow[-1]
            confidence[b, 0, : len(follow)] = chain.confidence[: len(follow)]
    drafts = mx.array(beams)
    probs = None if vocab is None else one_hot_probs(drafts, vocab)
    return Proposal(drafts, mx.zeros_like(drafts), probs, mx.array(confidence))


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


