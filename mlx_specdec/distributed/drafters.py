"""Chain drafts for the pipeline's head, from the drafting layer's proposers.

    draft(seq, committed, k) -> (up to k tokens continuing seq, the drafter's confidence in each)

`seq` is everything the head has committed or sent (committed text, then the speculative tokens in
flight); `committed` how much of it is committed. Continuous speculation asks again and again as
the speculative tail grows, so a drafter continues the tail, not only the committed text.
`outcome(accepted)` tells it each verified draft's fate; `observe(hidden, token, position)` hands the drafter the final hidden state that produced a newly committed
token (the ReDrafter head drafts from it).

- `NgramDrafter`: prompt lookup over seq (`drafting.NgramProposer`); confidence: the running
  acceptance rate of its drafts (a lookup has no probability of its own).
- `HeadDrafter`: the ReDrafter head's chain from the newest committed token's hidden state
  (redrafter_head/beam.py's greedy search, one beam), handed out in micro-batches while the tail in
  flight is its prefix; confidence: the head's own probability of each token.
- `ScriptedDrafter`: a given continuation with wrong tokens at chosen answer positions. Tests
  force rejections and cancellations with it, and the bench uses it to measure the pipeline's
  scheduling apart from any drafter's quality ("oracle" rows, labelled as such).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..cache.prefix import common_prefix
from ..drafting import NgramProposer


class NgramDrafter:
    RATE_WEIGHT = 0.2  # the newest draft's weight in the running acceptance rate

    def __init__(self, vocab: int, length: int = 8):
        self.proposer = NgramProposer(1, length + 1, vocab)
        self.known: List[int] = []
        self.rate = 0.5  # running acceptance rate of its drafts: its confidence

    def outcome(self, accepted: bool) -> None:
        self.rate += self.RATE_WEIGHT * (float(accepted) - self.rate)

    def begin(self, prompt: Sequence[int]) -> None:
        self.proposer.begin([list(prompt[:-1])])
        self.known = list(prompt[:-1])

    def observe(self, hidden: Optional[mx.array], token: int, position: int) -> None:
        pass

    def draft(self, seq: Sequence[int], committed: int, k: int) -> Tuple[List[int], List[float]]:
        body = list(seq[:-1])  # the proposer's text: everything before the tip
        keep = common_prefix(self.known, body)
        if keep < len(self.known):
            self.proposer.rollback([keep])
        if keep < len(body):
            self.proposer.commit([body[keep:]])
        self.known = body
        found = self.proposer.continuations(0, seq[-1])
        tokens = found[0][:k] if found else []
        return tokens, [self.rate] * len(tokens)


class HeadDrafter:
    needs_hidden = True  # the last stage sends the final hidden states with its tokens

    def __init__(self, head, embed, vocab: int, length: int):
        self.chain: List[int] = []  # drafts after the newest committed token
        self.chain_at = -1  # that token's position in seq
        self.confidence: List[float] = []
        self._draft = _compiled_chain(head, embed, length + 1)

    def begin(self, prompt: Sequence[int]) -> None:
        self.chain, self.chain_at, self.confidence = [], -1, []

    def outcome(self, accepted: bool) -> None:
        pass

    def observe(self, hidden: Optional[mx.array], token: int, position: int) -> None:
        tokens, probs = self._draft(hidden[None], mx.array([token]))
        mx.eval(tokens, probs)  # host sync: the drafts' values
        self.chain, self.confidence = tokens.tolist(), probs.tolist()
        self.chain_at = position

    def draft(self, seq: Sequence[int], committed: int, k: int) -> Tuple[List[int], List[float]]:
        if self.chain_at != committed - 1:
            return [], []
        tail = list(seq[committed:])
        if tail != self.chain[: len(tail)]:
            return [], []  # the runs in flight follow older drafts
        rest = self.chain[len(tail): len(tail) + k]
        return rest, self.confidence[len(tail): len(tail) + len(rest)]


def _compiled_chain(head, embed, length: int):
    """(hidden (1, D), token (1,)) -> (length - 1 greedy drafts, the head's probability of each):
    one compiled graph (as redrafter_head/beam.py's beam search, one beam, keeping the probabilities)."""
    from ..redrafter_head.beam import _start

    def chain(hidden, token):
        state, hid, _ = _start(head, embed, hidden, token, 1)  # (1, 1, E), (1, 1, D)
        tokens, probs = [], []
        for _ in range(length - 1):
            logits = head.logits(state, hid).astype(mx.float32)  # (1, 1, K)
            best = mx.argmax(logits, axis=-1)  # (1, 1)
            probs.append(mx.softmax(logits, axis=-1).max(axis=-1)[0, 0])
            full = head.draft_to_full[best]  # (1, 1) full-vocabulary id
            tokens.append(full[0, 0])
            state = head.next_state(state, embed(full))
        return mx.stack(tokens), mx.stack(probs)

    return mx.compile(chain)


class ScriptedDrafter:
    def __init__(self, continuation: Sequence[int], wrong_at: Sequence[int] = (), vocab: int = 0,
                 prompt_length: int = 0):
        """continuation: the answer the target will write; wrong_at: answer indices drafted wrong."""
        self.continuation = list(continuation)
        self.wrong: Dict[int, int] = {}
        for index in wrong_at:
            if 0 <= index < len(self.continuation):
                self.wrong[index] = (self.continuation[index] + 1) % max(vocab, 2)
        self.prompt_length = prompt_length

    def begin(self, prompt: Sequence[int]) -> None:
        self.prompt_length = len(prompt)

    def outcome(self, accepted: bool) -> None:
        pass

    def observe(self, hidden, token: int, position: int) -> None:
        pass

    def draft(self, seq: Sequence[int], committed: int, k: int) -> Tuple[List[int], List[float]]:
        start = len(seq) - self.prompt_length  # the answer index of the next token
        first = committed - self.prompt_length  # the answer index of the speculative tail
        if any(t != self._at(first + i) for i, t in enumerate(seq[committed:])):
            return [], []  # the tail follows a wrong draft: nothing sensible to add
        tokens = [self._at(i) for i in range(start, min(start + k, len(self.continuation)))]
        return tokens, [1.0] * len(tokens)

    def _at(self, index: int) -> int:
        if index >= len(self.continuation):
            return -1
        return self.wrong.get(index, self.continuation[index])
