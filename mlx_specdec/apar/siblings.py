"""Threads that do not repeat each other's heads: a penalty on following a head already written.

An APAR parent writes a list's heads with the details forked away ("1. **Sleep**:" [Fork]
"2. **Diet**:" [Fork] ...), so what it sees is a bare list of heads, which the model readily
repeats ("2. **Sleep**:", "3. **Sleep**:"); and a child sees none of its siblings, so children
forked at similar points open with the same words. The rule, per row of a step:

    a thread's heads      the line it was on at each of its forks (what its child details)
    a child's openings    the first line of each earlier child of the same parent
    a line's text         its tokens from the first one with a letter (list marker, bold marks
                          and spaces before it set aside), at most `HEAD_TOKENS`
    while the text of the row's current line equals the start of one of its heads (or, on a
    child's first line, of an earlier sibling's opening), and is at least one token long, the
    token that would continue that head has `penalty` subtracted from its logit (before the
    temperature; inf: never written)

So a head's first word is free and what follows it is pushed off the path of every head
already written; once a line leaves them all nothing changes for it. A thread that has not
forked and has no earlier sibling is never touched: an answer that never forks is written
exactly as without the rule.

What the rule sees when it builds step `s` (steps numbered by when their tokens are read, 1 on):
the tokens sampled in steps <= s - 2 (and forks read by then) from the host, and the token each
row feeds (sampled in step s - 1) in the graph. That is exactly what the host knows when the
pipelined loop builds the next step before reading this one's tokens (`decoding/apar.py`), so
the threads are the same with the pipelining on or off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

#: the tokens of a head the rule compares (a line's text from its first letter)
HEAD_TOKENS = 16
#: the default penalty (logit units, before the temperature); 0 turns the rule off. 100 is a ban in
#: effect: the token's probability underflows to 0 in float32, and it is never an argmax
DEFAULT_PENALTY = 100.0

BREAK, LETTER, OTHER = 0, 1, 2


@dataclass
class _Thread:
    parent: Optional[int]
    tokens: List[int] = field(default_factory=list)  # its answer tokens (no control tokens)
    steps: List[int] = field(default_factory=list)  # the step each token was sampled in
    heads: List[Tuple[int, List[int]]] = field(default_factory=list)  # (step its fork was read, head)


class SiblingRule:
    """Per answer: every thread's tokens and heads, and the penalties of the rows of a step."""

    def __init__(self, tokenizer, penalty: float = DEFAULT_PENALTY, head_tokens: int = HEAD_TOKENS):
        self.tokenizer = tokenizer
        self.penalty = float(penalty)
        self.head_tokens = head_tokens
        self.threads: Dict[int, _Thread] = {}
        self.children: Dict[int, List[int]] = {}  # parent -> its children in fork order
        self._kinds: Dict[int, int] = {}

    # -- what the decoding loop reports ---------------------------------------------------------
    def start(self, thread: int, parent: Optional[int]) -> None:
        self.threads[thread] = _Thread(parent)
        if parent is not None:
            self.children.setdefault(parent, []).append(thread)

    def wrote(self, thread: int, token: int, step: int) -> None:
        """`thread` wrote answer token `token`, sampled in step `step`."""
        me = self.threads[thread]
        me.tokens.append(token)
        me.steps.append(step)

    def forked(self, thread: int, step: int) -> None:
        """`thread` sampled [Fork] in step `step`: the line it is on is one of its heads."""
        me = self.threads[thread]
        head = self._text(me.tokens)
        if head:
            me.heads.append((step, head))

    # -- the penalties ----------------------------------------------------------------------------
    def pairs(self, order: Sequence[int], step: int) -> List[Tuple[int, int, int]]:
        """(row, condition, token) for step `step` of rows `order`: subtract the penalty from
        `token`'s logit in `row` if the row feeds `condition`."""
        out = set()
        for row, t in enumerate(order):
            me = self.threads.get(t)
            if me is None:
                continue
            known = _until(me, step - 2)
            heads = [h for s, h in me.heads if s <= step - 2]
            if me.parent is not None and not any(self._kind(x) == BREAK for x in known):  # its first line
                heads += [self._text(_until(self.threads[s], step - 2), first_line=True)
                          for s in self.children[me.parent] if s < t]
            if not heads:
                continue
            line = self._text(known)
            m = len(line)
            for head in heads:
                if len(head) > m + 1 and head[:m] == line:
                    out.add((row, head[m], head[m + 1]))  # it feeds head[m]: push it off head[m + 1]
        return sorted(out)

    def apply(self, logits: mx.array, fed: mx.array, order: Sequence[int], step: int) -> mx.array:
        """logits (N, V) of rows `order`, fed (N,) the tokens they feed: the penalised logits."""
        pairs = self.pairs(order, step) if self.penalty > 0.0 else []
        if not pairs:
            return logits
        rows, conditions, tokens = (mx.array(column) for column in zip(*pairs))
        amount = mx.where(fed[rows] == conditions, mx.array(-self.penalty, dtype=mx.float32),
                          mx.array(0.0, dtype=mx.float32))
        return logits.astype(mx.float32).at[rows, tokens].add(amount)

    # -- lines ------------------------------------------------------------------------------------
    def _kind(self, token: int) -> int:
        kind = self._kinds.get(token)
        if kind is None:
            text = self.tokenizer.decode([token])
            kind = BREAK if "\n" in text else LETTER if any(c.isalpha() for c in text) else OTHER
            self._kinds[token] = kind
        return kind

    def _text(self, tokens: List[int], first_line: bool = False) -> List[int]:
        """The text (from its first letter, at most `head_tokens`) of the last line of `tokens`,
        or of the first line with first_line."""
        if first_line:
            end = next((i for i, x in enumerate(tokens) if self._kind(x) == BREAK), len(tokens))
            line = tokens[:end]
        else:
            start = next((i + 1 for i in range(len(tokens) - 1, -1, -1) if self._kind(tokens[i]) == BREAK), 0)
            line = tokens[start:]
        first = next((i for i, x in enumerate(line) if self._kind(x) == LETTER), len(line))
        return line[first: first + self.head_tokens]


def _until(thread: _Thread, step: int) -> List[int]:
    """The thread's tokens sampled in steps <= `step`."""
    n = len(thread.tokens)
    while n and thread.steps[n - 1] > step:
        n -= 1
    return thread.tokens[:n]
