"""Proposers: the drafts every speculative method verifies, behind one interface (`base.py`).

- `HeadProposer` (head.py): ReDrafter's RNN draft head on the target's last hidden state.
- `NgramProposer` (ngram.py): prompt lookup, continuations of the longest suffix match in the
  prompt and the answer so far.
- `ModelProposer` (model.py): a small same-tokenizer model over a StreamingLLM cache (sink +
  recent window), TriForce's bottom level.
"""

from .base import Proposal, Proposer, one_hot_probs, select_rows
from .head import HeadProposer
from .model import ModelProposer
from .ngram import NgramProposer

__all__ = ["HeadProposer", "ModelProposer", "NgramProposer", "Proposal", "Proposer", "one_hot_probs", "select_rows"]
