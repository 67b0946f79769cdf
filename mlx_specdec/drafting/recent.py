"""`recent`: draft what followed the newest earlier occurrence of the own token alone.

A 1-gram prompt lookup. Behind `lookup` (which needs the last 2-4 tokens to match) it drafts for
more rows, and is right less often; it has no measured acceptance, so its confidence is the
running acceptance rate of its verified drafts (`base.RunningRate`), and the caller's per-row
trust, the cutoff and the verify-cost rule keep its drafts out of the tree where they fail.
Deterministic drafts from the committed text: lossless like every source.

    --sources lookup,recent,head
"""

from __future__ import annotations

from .ngram import NgramProposer


class RecentToken(NgramProposer):
    def __init__(self, drafts: int, vocab: int):
        """drafts: the tokens after the own token's newest earlier occurrence that it proposes."""
        super().__init__(1, drafts + 1, vocab, max_ngram=1, min_ngram=1)
