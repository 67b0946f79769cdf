"""Proposers: the drafts every speculative method verifies, behind one interface (`base.py`).

- `HeadProposer` (head_source.py): ReDrafter's RNN draft head on the target's last hidden state.
- `NgramProposer` (ngram.py): prompt lookup, continuations of the longest suffix match in the
  prompt and the answer so far.
- `ModelProposer` (draft_model.py): a small same-tokenizer model over a StreamingLLM cache (sink +
  recent window), TriForce's bottom level.
- `MiddleLevelProposer` (middle.py): the target over a retrieval cache, drafting for the same
  target over its full cache (TriForce's middle level), with a lower proposer drafting for it.
"""

from .base import Proposal, Proposer, one_hot_probs, select_rows
from .head_source import HeadProposer
from .middle import ChainVerifier, MiddleLevelProposer
from .draft_model import ModelProposer
from .ngram import NgramProposer

__all__ = ["ChainVerifier", "HeadProposer", "MiddleLevelProposer", "ModelProposer", "NgramProposer", "Proposal", "Proposer", "one_hot_probs", "select_rows"]
