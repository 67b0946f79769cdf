"""Proposers: the drafts every speculative method verifies, behind one interface (`base.py`).

- `HeadProposer` (head.py): ReDrafter's RNN draft head on the target's last hidden state.
- `NgramProposer` (ngram.py): prompt lookup, continuations of the longest suffix match in the
  prompt and the answer so far.
"""

from .base import Proposal, Proposer, one_hot_probs, select_rows
from .head import HeadProposer
from .ngram import NgramProposer

__all__ = ["HeadProposer", "NgramProposer", "Proposal", "Proposer", "one_hot_probs", "select_rows"]
