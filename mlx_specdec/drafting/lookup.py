"""Prompt lookup in front of the draft head (`redrafter --lookup N`).

The default model repeats itself and its prompt a lot: over the 162 held-out answers to the natural
training prompts, the text so far ended in a 2-gram seen before at a third of the steps, and the
continuation found there was the model's own next 2.3 of 4 tokens, where the head's chain of 2
drafts gives 0.54 (benchmarks/lookup_sim.py; results/issue18_lookup_sim.md). So each step, per row:

    the text + the target's own token ends in an n-gram (n >= LOOKUP_MIN_NGRAM) seen before
        -> draft the N tokens that followed its latest occurrence (free; the confidence of draft k
           is the lookup's measured acceptance at depth k, which the lookup's own running trust
           calibrates as the head's trust does the head's)
    otherwise
        -> the head's drafts, as without lookup (its confidence, the cutoff, the trust)

A row whose last lookup was accepted whole is in a streak (the answer is copying text it has
seen): its next lookup may draft twice as many tokens, up to STREAK_LONGEST x N, and carries the
streak's acceptance, far higher than a fresh lookup's (0.88 against 0.57 at the first draft, 0.93-0.97
deeper: `python benchmarks/lookup_sim.py --streaks`). Any other step ends the streak (N again).

A row's drafts come from one source per step. The head's drafts are built lazily before the
step's sync, as always; they are read (computed) only when some row needs them.

Lossless either way: greedy acceptance keeps only tokens equal to the target's own, and a lookup
draft is chosen from the committed text alone, so under sampling it is a deterministic draft
(q one-hot: accepted with the target's probability of it, `acceptance.sampling_accept`).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np

from .tree import dedup_prefix
from .base import Proposal, one_hot_probs, read_host
from .ngram import NgramProposer

# Shortest suffix that may trigger a lookup. Simulated with 4 lookup drafts (results/issue18_lookup_sim.md):
# a 1-gram drafts at 63 % of steps but only 1.4 tokens right per lookup; 2-grams at 35 % with 2.3
# right, the most tokens per step (2.16 against the head's 1.54); 3-grams 2.10.
LOOKUP_MIN_NGRAM = 2
LOOKUP_MAX_NGRAM = 4
# Occurrences looked at, newest first; the longest continuation wins. In a loop shorter than the
# draft, the newest occurrence ends a period ago and only a period follows it; an older one
# continues the loop for the whole draft (the padding of a short one is cut: confidence 0).
CANDIDATES = 4
# P(lookup draft k is the model's token | drafts 1..k-1 were), deeper drafts taking the last value:
# the same held-out walk with 2-gram triggers and streaks (`python benchmarks/lookup_sim.py --streaks`,
# results/issue18_lookup_sim.md), for a lookup after a step that was not a whole accepted lookup
# (3,449 lookups) and for one after a whole accepted lookup (1,338).
LOOKUP_CONFIDENCE = (0.57, 0.70, 0.76, 0.82)
STREAK_CONFIDENCE = (0.88, 0.89, 0.90, 0.94, 0.93, 0.93, 0.93, 0.96, 0.97)
# A streak doubles the row's lookup length each step, up to this many times N (--lookup): simulated
# at 256 tokens, 2.17 -> 2.34 tokens a step and +3 % tokens per unit of verify cost (x 4 against x 2).
STREAK_LONGEST = 4


class Drafted(NamedTuple):
    proposal: Proposal  # beams, owner, confidence as MLX arrays; draft_probs when sampling
    beams: np.ndarray  # (B, W, L) the same, on the host
    owner: np.ndarray  # (B, W, L)
    confidence: np.ndarray  # (B, W, L-1): the head's, or the lookup's measured acceptance (0 for padding)
    from_lookup: np.ndarray  # (B,) bool: the row's drafts are a lookup's


class LookupFirst:
    def __init__(self, drafts: int, vocab: int):
        """drafts: tokens a lookup proposes outside a streak (its beam length is drafts + 1)."""
        self.drafts, self.longest = drafts, drafts * STREAK_LONGEST
        self.ngram = NgramProposer(CANDIDATES, self.longest + 1, vocab, max_ngram=LOOKUP_MAX_NGRAM,
                                   min_ngram=LOOKUP_MIN_NGRAM)
        self.vocab = vocab

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Each row's text: its whole prompt (the target's first own token comes after it)."""
        self.ngram.begin(prompts)
        B = len(prompts)
        self.allowed = np.full(B, self.drafts)  # lookup drafts the row may propose next
        self.streak = np.zeros(B, dtype=bool)  # the row's last lookup was accepted whole
        self.proposed = np.zeros(B, dtype=np.int64)  # lookup drafts in the row's current proposal (0: the head's)

    def commit(self, tokens: Sequence[Sequence[int]], verified: Optional[int] = None) -> None:
        """Per row: the own token the step started from and the drafts accepted after it.
        verified: drafts the step verified (the cutoff and the cost rule may verify fewer than
        proposed); a lookup all of whose verified drafts were accepted starts or extends a streak."""
        self.ngram.commit(tokens)
        checked = self.proposed if verified is None else np.minimum(self.proposed, verified)
        accepted = np.array([len(t) - 1 for t in tokens])
        self.streak = (checked > 0) & (accepted >= checked)
        self.allowed = np.where(self.streak, np.minimum(2 * self.allowed, self.longest), self.drafts)

    def select_rows(self, keep: Sequence[int]) -> None:
        self.ngram.select_rows(keep)
        self.allowed, self.streak, self.proposed = (a[keep] for a in (self.allowed, self.streak, self.proposed))

    def draft(self, head: Proposal, own: np.ndarray) -> Drafted:
        """head: the head's lazy proposal from the own tokens (B,), which `own` holds on the host."""
        found = [self._continuation(b, int(x)) for b, x in enumerate(own)]
        found = [None if f is None else f[: self.allowed[b]] for b, f in enumerate(found)]
        from_lookup = np.array([f is not None for f in found])
        self.proposed = np.array([0 if f is None else len(f) for f in found], dtype=np.int64)
        W = head.beams.shape[1]
        if from_lookup.all():
            head_beams = head_confidence = None
            length = 1 + max(len(f) for f in found)
        else:
            # Host sync, only when a row needs the head: its drafts (beams, confidence).
            head_beams, head_confidence = read_host(head.beams, head.confidence)
            length = max([head_beams.shape[-1]] + [1 + len(f) for f in found if f is not None])
        B = len(own)
        beams = np.empty((B, W, length), dtype=np.int32)
        confidence = np.zeros((B, W, length - 1), dtype=np.float32)
        for b, follow in enumerate(found):
            if follow is None:  # the head's beams, padded by repeating their last token (confidence 0)
                Lh = head_beams.shape[-1]
                beams[b, :, :Lh] = head_beams[b]
                beams[b, :, Lh:] = head_beams[b, :, -1:]
                confidence[b, :, : Lh - 1] = head_confidence[b]
            else:  # every beam the lookup chain: the packing keeps it once
                chain = [int(own[b])] + follow + [follow[-1]] * (length - 1 - len(follow))
                beams[b, :, :] = chain
                confidence[b, :, : len(follow)] = lookup_confidence(len(follow), bool(self.streak[b]))
        owner = dedup_prefix(beams, np)
        probs = None if head.draft_probs is None else self._draft_probs(head, beams, from_lookup)
        proposal = Proposal(mx.array(beams), mx.array(owner), probs, mx.array(confidence))
        return Drafted(proposal, beams, owner, confidence, from_lookup)

    def _continuation(self, row: int, token: int) -> Optional[List[int]]:
        found = self.ngram.continuations(row, token)
        return max(found, key=len) if found else None  # the newest of the longest

    def _draft_probs(self, head: Proposal, beams: np.ndarray, from_lookup: np.ndarray) -> mx.array:
        """(B, W, L-1, V) q of each drafted token: the head's where it sampled them, one-hot for
        lookup drafts and for the padding past the head's length (deterministic drafts)."""
        one_hot = one_hot_probs(mx.array(beams), self.vocab)  # (B, W, L-1, V)
        if from_lookup.all():  # the head's distributions are not needed (nor computed)
            return one_hot
        head_probs = head.draft_probs  # (B, W, Lh-1, V)
        depth, drafted = head_probs.shape[2], beams.shape[-1] - 1
        if drafted > depth:
            head_probs = mx.concatenate([head_probs, one_hot[:, :, depth:]], axis=2)
        elif drafted < depth:  # every row a lookup, shorter than the head's beams
            head_probs = head_probs[:, :, :drafted]
        return mx.where(mx.array(from_lookup)[:, None, None, None], one_hot, head_probs)


def lookup_confidence(drafts: int, streak: bool = False) -> np.ndarray:
    """(drafts,) the measured acceptance of lookup drafts 1..drafts, each given the ones before,
    for a lookup in a streak (the row's last lookup accepted whole) or not."""
    measured = STREAK_CONFIDENCE if streak else LOOKUP_CONFIDENCE
    depth = np.minimum(np.arange(drafts), len(measured) - 1)
    return np.asarray(measured, dtype=np.float32)[depth]
