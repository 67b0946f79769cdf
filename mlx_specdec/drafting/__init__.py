"""Drafting sources: the drafts every speculative method verifies, behind one protocol (`base.py`).

- `HeadProposer` (head_source.py): ReDrafter's RNN draft head on the target's last hidden state.
- `NgramProposer` (ngram.py): prompt lookup, continuations of the longest suffix match in the
  prompt and the answer so far; `PromptLookup` (lookup.py): the same as ReDrafter drafts it in
  front of the head (measured confidence, streaks).
- `ModelProposer` (draft_model.py): a small same-tokenizer model over a StreamingLLM cache
  (sink + recent window), TriForce's bottom level.
- `MiddleLevelProposer` (middle.py): the target over a retrieval cache, drafting for the same
  target over its full cache (TriForce's middle level), with a lower source drafting for it.

`FirstOffer` (first_offer.py) composes host-side sources in front of the head; `tree.py` packs
drafted beams into the tree one forward verifies.
"""

from .base import Chain, Proposal, Proposer, ProposerDefaults, one_hot_probs, select_rows
from .draft_model import ModelProposer
from .head_source import HeadProposer
from .lookup import PromptLookup
from .middle import ChainVerifier, MiddleLevelProposer
from .ngram import NgramProposer

__all__ = ["Chain", "ChainVerifier", "HeadProposer", "MiddleLevelProposer", "ModelProposer", "NgramProposer",
           "PromptLookup", "Proposal", "Proposer", "ProposerDefaults", "one_hot_probs", "select_rows"]
