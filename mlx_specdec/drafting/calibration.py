"""How far to trust a proposer's confidence, learnt while decoding (per batch row).

A draft cutoff ("verify a draft only where the proposer gives it >= c") assumes the proposer's
probabilities are honest. They are not everywhere: a ReDrafter head distilled on short chats is
as sure of itself over a long document as over a chat but right far less often there, and each
of those verifies costs a long-context step more than a plain one. So each row keeps a running
ratio

    trust = (accepted + PRIOR) / (confidence of the drafts it judged + PRIOR)    (decayed sums)

and the cutoff applies to min(1, trust * confidence). Trust starts at 1 (the cutoff as chosen)
and moves with evidence; every judged draft is one event at the depth it was reached:

    depth k <= n            accepted                     (n: drafts the step accepted)
    depth n + 1, verified   rejected
    depth n + 1, cut        accepted iff it equals the target's next token (greedy: exactly what
                            verifying it would have said; sampling: a proxy) -- for free, so a row
                            whose drafts are all cut still learns when the head becomes right again

Deeper drafts were not reached and say nothing. Speed only: trust comes from earlier steps, and
the cutoff decides before any drafted token of the step is checked. Greedy output stays the
target's. Sampling stays exact: a sampled draft's confidence is the peak of the q it was drawn
from (`redrafter_head.beam.sample_beams`), which depends on the drafts before it in its chain and
not on the draft itself, so whether depth j+1 is kept is settled by the depths before it (a
stopping rule: drafting/verify_cost.py, "Sampling").
"""

from __future__ import annotations

import numpy as np

PRIOR = 2.0  # pseudo-events at trust 1: a row needs a few drafts of evidence before trust moves far
DECAY = 0.95  # per step: the evidence of the last ~20 steps counts (a chat can change its register)


class DraftTrust:
    def __init__(self, rows: int):
        self.accepted = np.zeros(rows)  # decayed sum of judged drafts that were (or would be) accepted
        self.expected = np.zeros(rows)  # decayed sum of the confidence given to them
        self.events = 0  # judged drafts, all rows (reported)
        self.free_events = 0  # of which cut drafts judged against the target's own next token

    @property
    def trust(self) -> np.ndarray:  # (B,)
        return (self.accepted + PRIOR) / (self.expected + PRIOR)

    def calibrated(self, confidence: np.ndarray) -> np.ndarray:
        """confidence (B, W, L-1) -> min(1, trust * confidence), the same shape."""
        return np.minimum(1.0, confidence * self.trust[:, None, None])

    def select_rows(self, keep: np.ndarray) -> None:
        self.accepted, self.expected = self.accepted[keep], self.expected[keep]

    def add_rows(self, n: int) -> None:
        """Rows joining a running batch, with no evidence yet (trust 1)."""
        self.accepted, self.expected = np.concatenate([self.accepted, np.zeros(n)]), np.concatenate([self.expected, np.zeros(n)])

    def update(self, beams: np.ndarray, confidence: np.ndarray, best: np.ndarray, accepted: np.ndarray,
               next_token: np.ndarray, verified: int, rows: np.ndarray | None = None) -> None:
        """After a step. beams (B, W, L) and confidence (B, W, L-1): the step's drafts before the cut;
        best (B,) the beam accepted from, accepted (B,) how many of its drafts; next_token (B,) the
        target's own token after them; verified: how many drafts per beam the step checked;
        rows (B,) bool: the rows whose drafts were this proposer's (None = all)."""
        self.accepted *= DECAY
        self.expected *= DECAY
        depths = confidence.shape[-1]
        for b in range(len(best)):
            if rows is not None and not rows[b]:
                continue
            w, n = int(best[b]), int(accepted[b])
            self.accepted[b] += n
            self.expected[b] += float(confidence[b, w, :n].sum())
            self.events += n
            if n < depths:  # the first draft not accepted: rejected, or cut and judged for free
                if n >= verified:
                    self.accepted[b] += float(beams[b, w, n + 1] == next_token[b])
                    self.free_events += 1
                self.expected[b] += float(confidence[b, w, n])
                self.events += 1
