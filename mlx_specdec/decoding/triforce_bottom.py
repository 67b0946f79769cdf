"""TriForce's bottom level: a proposer from the drafting layer behind one small adapter.

    draft(x, hidden) -> (up to γ1 tokens after x, their draft distributions (k, V) or None)

None when greedy (only the tokens matter); when sampling, each row is the distribution its token
was drawn from (q): one-hot for deterministic drafts (n-gram lookup), the draft model's or the
head's own distribution otherwise. `commit` and `rollback` keep the proposer's text equal to
what the level above holds (the middle level's accepted tokens; cut back to the top level's).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..drafting import HeadProposer, ModelProposer, NgramProposer, one_hot_probs
from ..errors import UserError

BOTTOMS = ("ngram", "none", "model", "redrafter")


class Bottom:
    def __init__(self, proposer, vocab: int, sampling: bool):
        self.proposer, self.vocab, self.sampling = proposer, vocab, sampling

    def begin(self, prompt: Sequence[int]) -> None:
        if hasattr(self.proposer, "begin"):
            self.proposer.begin([prompt])

    def draft(self, x: int, hidden: Optional[mx.array]) -> Tuple[List[int], Optional[mx.array]]:
        if self.proposer is None:
            return [], None
        if isinstance(self.proposer, NgramProposer):  # host-side lookup; no match drafts nothing
            found = self.proposer.continuations(0, x)
            tokens = found[0] if found else []
            if not tokens or not self.sampling:
                return tokens, None
            return tokens, one_hot_probs(mx.array([[[x] + tokens]]), self.vocab)[0, 0]
        if hidden is None and isinstance(self.proposer, HeadProposer):
            return [], None  # the round's first middle forward has no hidden state yet for the head
        proposal = self.proposer.propose(mx.array([x]), hidden)
        tokens = [int(t) for t in proposal.beams[0, 0, 1:].tolist()]  # host sync (the drafts' values)
        probs = None if proposal.draft_probs is None else proposal.draft_probs[0, 0]
        return tokens, probs

    def commit(self, tokens: Sequence[int]) -> None:
        if self.proposer is not None:
            self.proposer.commit([list(tokens)])

    def rollback(self, length: int) -> None:
        if self.proposer is not None:
            self.proposer.rollback([length])


def make_bottom(name: str, ctx, draft_length: int, vocab: int) -> Bottom:
    """The bottom proposer `name` for this generation (resources: "draft_model", "drafter");
    vocab: the width of the target's logits."""
    if name not in BOTTOMS:
        raise UserError(f"--bottom is {', '.join(BOTTOMS)}, not {name!r}")
    params = ctx.params
    sampling = not params.greedy
    if name == "none":
        return Bottom(None, vocab, sampling)
    if name == "ngram":
        return Bottom(NgramProposer(1, draft_length + 1, vocab=vocab), vocab, sampling)
    if name == "model":
        draft = ctx.resources.get("draft_model")
        if draft is None:
            raise UserError("--bottom model needs a small draft model with the target's tokenizer: "
                            "pass --draft-model PATH")
        options = params.options
        sink, window = int(options.get("draft_sink", 16)), int(options.get("draft_window", 240))
        return Bottom(ModelProposer(draft.model, draft_length + 1, vocab, sink=sink, window=window,
                                    temperature=params.temperature, top_p=params.top_p), vocab, sampling)
    head = ctx.resources.get("drafter")
    if head is None:
        raise UserError("--bottom redrafter needs a trained draft head for this model (none found)")
    embed = ctx.lm.model.model.embed_tokens
    return Bottom(HeadProposer(head, embed, 1, draft_length + 1, vocab, temperature=params.temperature),
                  vocab, sampling)
