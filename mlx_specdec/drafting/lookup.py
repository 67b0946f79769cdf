"""Prompt lookup as ReDrafter drafts it in front of the head (the `lookup` source).

Each step, per row: where the text + the target's own token x ends in an n-gram
(LOOKUP_MIN_NGRAM <= n <= LOOKUP_MAX_NGRAM) seen before, draft the N tokens that followed its
latest occurrence (free: no model). The confidence of draft k is the measured acceptance of a
lookup's draft at depth k (given the ones before it), which the caller's running trust in the
source calibrates per row (`calibration.DraftTrust`) as it does the head's.

A row whose last lookup was accepted whole is in a streak (the answer is copying text it has
seen): its next lookup may draft twice as many tokens, up to STREAK_LONGEST x N, and carries the
streak's acceptance, which is far higher than a fresh lookup's. Any other step ends the streak
(N again).

Lossless either way: greedy acceptance keeps only tokens equal to the target's own, and a lookup
draft is chosen from the committed text alone, so under sampling it is a deterministic draft
(q one-hot: accepted with the target's probability of it, `acceptance.sampling_accept`).
The measurements behind the constants are in docs/decisions.md.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .base import Chain, HostSideDefaults
from .ngram import NgramProposer

LOOKUP_MIN_NGRAM = 2  # shortest suffix that may trigger a lookup (1-grams match often, and are often wrong)
LOOKUP_MAX_NGRAM = 4  # longest suffix looked up (the longest match wins)
# Occurrences looked at, newest first; the longest continuation wins. In a loop shorter than the
# draft, the newest occurrence ends a period ago and only a period follows it; an older one
# continues the loop for the whole draft.
CANDIDATES = 4
# P(lookup draft k is the model's token | drafts 1..k-1 were), deeper drafts taking the last
# value: after a step that was not a whole accepted lookup, and in a streak.
LOOKUP_CONFIDENCE = (0.57, 0.70, 0.76, 0.82)
STREAK_CONFIDENCE = (0.88, 0.89, 0.90, 0.94, 0.93, 0.93, 0.93, 0.96, 0.97)
STREAK_LONGEST = 4  # a streak doubles the row's lookup length each step, up to this many times N


class PromptLookup(HostSideDefaults):
    def __init__(self, drafts: int, vocab: int):
        """drafts: tokens a lookup proposes outside a streak (N)."""
        self.drafts, self.longest, self.vocab = drafts, drafts * STREAK_LONGEST, vocab
        self.length = self.longest + 1
        self.ngram = NgramProposer(CANDIDATES, self.length, vocab, max_ngram=LOOKUP_MAX_NGRAM,
                                   min_ngram=LOOKUP_MIN_NGRAM)
        self.allowed = np.zeros(0, dtype=np.int64)  # lookup drafts each row may propose next
        self.streak = np.zeros(0, dtype=bool)  # the row's last lookup was accepted whole

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Each row's text: its whole prompt (the target's first own token comes after it)."""
        self.ngram.begin([])
        self.allowed, self.streak = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        self.add_rows(prompts)

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None:
        """Rows joining a running batch, each with its text so far."""
        self.ngram.add_rows(prompts)
        self.allowed = np.concatenate([self.allowed, np.full(len(prompts), self.drafts)])
        self.streak = np.concatenate([self.streak, np.zeros(len(prompts), dtype=bool)])

    def draft_after(self, tokens: Sequence[int], rows: Optional[np.ndarray] = None) -> List[Optional[Chain]]:
        chains: List[Optional[Chain]] = []
        for b, x in enumerate(tokens):
            found = self.ngram.continuations(b, int(x)) if rows is None or rows[b] else []
            if not found:
                chains.append(None)
                continue
            follow = max(found, key=len)[: self.allowed[b]]  # the newest of the longest
            chains.append(Chain(follow, lookup_confidence(len(follow), bool(self.streak[b]))))
        return chains

    def commit(self, tokens: Sequence[Sequence[int]]) -> None:
        self.ngram.commit(tokens)

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None:
        self.ngram.rollback(lengths)

    def select_rows(self, keep: Sequence[int]) -> None:
        self.ngram.select_rows(keep)
        self.allowed, self.streak = self.allowed[keep], self.streak[keep]

    def judged(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """A lookup all of whose verified drafts were accepted starts or extends a streak."""
        verified, accepted = np.asarray(verified), np.asarray(accepted)
        self.streak = (verified > 0) & (accepted >= verified)
        self.allowed = np.where(self.streak, np.minimum(2 * self.allowed, self.longest), self.drafts)


def lookup_confidence(drafts: int, streak: bool = False) -> np.ndarray:
    """(drafts,) the measured acceptance of lookup drafts 1..drafts, each given the ones before,
    for a lookup in a streak (the row's last lookup accepted whole) or not."""
    measured = STREAK_CONFIDENCE if streak else LOOKUP_CONFIDENCE
    depth = np.minimum(np.arange(drafts), len(measured) - 1)
    return np.asarray(measured, dtype=np.float32)[depth]
