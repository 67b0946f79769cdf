"""Chain drafts for the pipeline's first rank, from the drafting layer's sources.

    draft(seq, committed, k) -> (up to k tokens continuing seq, the source's confidence in each)

`seq` is everything the first rank has committed or sent (committed text, then the speculative
tokens in flight); `committed` how much of it is committed. Continuous speculation asks again
and again as the speculative tail grows, so a drafter continues the tail, not only the committed
text. `outcome(accepted)` tells it each verified draft's fate (the source's `judged`);
`observe(hidden, token, position)` hands it the final hidden state that produced a newly
committed token (a source that `needs_hidden` drafts from it).

`PipelineDrafter` adapts any source of the drafting protocol:
- a host-side source keeps seq but its tip as its text (committed and rolled back as seq moves)
  and drafts after the tip (`draft_after`);
- a source that needs the hidden state drafts a chain from the newest committed token's state
  (`propose`), handed out in micro-batches while the tail in flight is its prefix.

`NgramDrafter` (prompt lookup; confidence: the running acceptance rate of its drafts),
`HeadDrafter` (the ReDrafter head's greedy chain; confidence: the head's probability of each
token) and `ScriptedDrafter` are it over one source each. `ScriptedSource` drafts a given
continuation with wrong tokens at chosen answer positions: tests force rejections and
cancellations with it, and the bench uses it to measure the pipeline's scheduling apart from any
drafter's quality ("oracle" rows, labelled as such).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..cache.prefix import common_prefix
from ..drafting import HeadProposer, NgramProposer, Proposer
from ..drafting.base import Chain, HostSideDefaults, read_host


class PipelineDrafter:
    def __init__(self, source: Proposer):
        self.source = source
        self.needs_hidden = source.needs_hidden  # the last stage sends the final hidden states with its tokens
        self.known: List[int] = []  # host-side: the text the source holds
        self.chain: List[int] = []  # needs_hidden: drafts after the newest committed token
        self.chain_at = -1  # that token's position in seq
        self.confidence: List[float] = []

    def begin(self, prompt: Sequence[int]) -> None:
        self.source.begin([list(prompt[:-1])])  # the text before the tip: the tip is the token drafted after
        self.known = list(prompt[:-1])
        self.chain, self.chain_at, self.confidence = [], -1, []

    def outcome(self, accepted: bool) -> None:
        self.source.judged([1], [int(accepted)])

    def observe(self, hidden: Optional[mx.array], token: int, position: int) -> None:
        if not self.needs_hidden:
            return
        proposal = self.source.propose(mx.array([token]), hidden[None])
        beams, confidence = read_host(proposal.beams, proposal.confidence)  # host sync: the drafts' values
        self.chain, self.confidence = beams[0, 0, 1:].tolist(), confidence[0, 0].tolist()
        self.chain_at = position

    def draft(self, seq: Sequence[int], committed: int, k: int) -> Tuple[List[int], List[float]]:
        if self.needs_hidden:
            return self._from_chain(seq, committed, k)
        body = list(seq[:-1])  # the source's text: everything before the tip
        keep = common_prefix(self.known, body)
        if keep < len(self.known):
            self.source.rollback([keep])
        if keep < len(body):
            self.source.commit([body[keep:]])
        self.known = body
        chain = self.source.draft_after([seq[-1]])[0]
        if chain is None:
            return [], []
        return list(chain.tokens[:k]), chain.confidence[:k].tolist()

    def _from_chain(self, seq: Sequence[int], committed: int, k: int) -> Tuple[List[int], List[float]]:
        if self.chain_at != committed - 1:
            return [], []
        tail = list(seq[committed:])
        if tail != self.chain[: len(tail)]:
            return [], []  # the runs in flight follow older drafts
        rest = self.chain[len(tail): len(tail) + k]
        return rest, self.confidence[len(tail): len(tail) + len(rest)]


class NgramDrafter(PipelineDrafter):
    def __init__(self, vocab: int, length: int = 8):
        super().__init__(NgramProposer(1, length + 1, vocab))


class HeadDrafter(PipelineDrafter):
    def __init__(self, head, embed, vocab: int, length: int):
        super().__init__(HeadProposer(head, embed, 1, length + 1, vocab))


class ScriptedDrafter(PipelineDrafter):
    def __init__(self, continuation: Sequence[int], wrong_at: Sequence[int] = (), vocab: int = 0,
                 prompt_length: int = 0):
        super().__init__(ScriptedSource(continuation, wrong_at, vocab, prompt_length))


class ScriptedSource(HostSideDefaults):
    def __init__(self, continuation: Sequence[int], wrong_at: Sequence[int] = (), vocab: int = 0,
                 prompt_length: int = 0):
        """continuation: the answer the target will write; wrong_at: answer indices drafted wrong;
        prompt_length: the prompt's length with its last token (`begin` sets it)."""
        self.continuation = list(continuation)
        self.wrong: Dict[int, int] = {}
        for index in wrong_at:
            if 0 <= index < len(self.continuation):
                self.wrong[index] = (self.continuation[index] + 1) % max(vocab, 2)
        self.vocab, self.length = vocab, len(self.continuation) + 1
        self.answer_start = prompt_length  # the answer's first position: the prompt's length, its last token included
        self.text_length = max(prompt_length - 1, 0)

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        self.text_length = len(prompts[0])
        self.answer_start = self.text_length + 1  # the prompt's last token is the first drafted after

    def commit(self, tokens: Sequence[Sequence[int]]) -> None:
        self.text_length += len(tokens[0])

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None:
        if lengths is not None:
            self.text_length = int(lengths[0])

    def draft_after(self, tokens: Sequence[int], rows=None) -> List[Optional[Chain]]:
        start = self.text_length + 1 - self.answer_start  # the answer index of the next token
        drafted = [self._at(i) for i in range(max(start, 0), len(self.continuation))]
        return [Chain(drafted, np.ones(len(drafted))) if drafted else None]

    def _at(self, index: int) -> int:
        return self.wrong.get(index, self.continuation[index])
