"""ReDrafter's draft head as a proposer: beam search (greedy) or sampled chains (temperature > 0)
from the RNN head on the target's last hidden state (`redrafter_head/model.py`, `redrafter_head/beam.py`).

The head's state is rebuilt every step from the target's hidden state after the last accepted
token, so there is nothing to commit or roll back. Both draft kinds are lazy MLX graphs: the
caller builds the next step's drafts before its one host sync.

Stepwise (greedy, one chain): `propose` builds the first draft only and `extend` drafts deeper
one depth at a time, each behind a host sync, while the caller's test says a step could still
verify that deep. Each depth costs a projection onto the draft vocabulary (most of a draft's
cost), and most steps verify fewer drafts than the head can make: the cutoff cuts a chain at its
first doubtful draft, so the drafts after it need not exist. Same drafts, same
confidences (the same ops as `beam_search`), so the same trees are verified.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ..redrafter_head.beam import beam_search, compiled_chain, sample_beams
from .base import Proposal, ProposerDefaults, read_host
from .tree import dedup_prefix

_SEARCHES: dict = {}


def compiled_beam_search(head, embed, width: int, length: int):
    """`beam_search` + `dedup_prefix` as one compiled graph: (hidden (B, D), token (B,)) ->
    (beams, owner, confidence). Compiling fuses the many small per-step ops (the weights are
    frozen, so capturing them as constants is safe)."""
    key = (id(head), id(embed), width, length)
    if key not in _SEARCHES:
        def draft(hidden, token):
            drafts = beam_search(head, embed, hidden, token, width, length)
            return drafts.beams, dedup_prefix(drafts.beams), drafts.confidence

        _SEARCHES[key] = mx.compile(draft)
    return _SEARCHES[key]


class HeadProposer(ProposerDefaults):
    needs_hidden = True  # drafts from the target's hidden state; no text, nothing to commit

    def __init__(self, head, embed, width: int, length: int, vocab: int, temperature: float = 0.0,
                 stepwise: bool = False, runners_up: int = 0, runner_depths: int = 1):
        """vocab: the target's vocabulary size (the width of the draft distributions it checks).
        stepwise: greedy single chains only (ignored otherwise): see the module docstring.
        runners_up: stepwise only, the head's next choices at each of the chain's first
        `runner_depths` drafts to offer beside it (`runners_up_on_host`;
        `drafting.tree.with_runners_up` verifies them)."""
        self.head, self.embed, self.vocab = head, embed, vocab
        self.width, self.length, self.temperature = width, length, temperature
        self.stepwise = stepwise and temperature <= 0 and width == 1 and length > 2
        self.runners_up = runners_up if self.stepwise else 0
        self.runner_depths = max(1, runner_depths) if self.runners_up else 0
        self._search = compiled_beam_search(head, embed, width, length) if temperature <= 0 else None
        self._chain = compiled_chain(head, embed, self.runners_up, self.runner_depths > 1) if self.stepwise else None
        self._pending = None  # stepwise: (state, hidden, draft, score) of the deepest draft made
        self._runners = None  # stepwise with runners_up: (tokens (B, S), confidences (B, S)), lazy
        self._first = None  # stepwise: the first draft and its confidence (B,) each, lazy
        self._deeper_runners = []  # the same at depths 2.. as `extend` read them, on the host
        self.whole_chain = False  # stepwise chains drafted every depth at once (the device step)
        self._runners_read = self._first_read = None  # ... and read with the step

    def propose(self, token: mx.array, hidden: Optional[mx.array]) -> Proposal:
        """token (B,): the target's own latest token; hidden (B, D): the state that produced it."""
        if self.stepwise and self.whole_chain:
            return self._whole_chain(token, hidden)
        if self.stepwise:  # the first draft only: `extend` goes deeper
            state, draft, score, confidence, *runners = self._chain[0](hidden, token)
            self._pending = (state, hidden, draft, score)
            self._runners = runners or None
            self._first = (draft, confidence)
            self._deeper_runners = []
            beams = mx.stack([token.astype(mx.int32), draft.astype(mx.int32)], axis=-1)[:, None, :]  # (B, 1, 2)
            return Proposal(beams, mx.zeros(beams.shape, dtype=mx.int32), None, confidence[:, None, None])
        if self._search is not None:
            beams, owner, confidence = self._search(hidden, token)
            return Proposal(beams, owner, None, confidence)
        drafts = sample_beams(self.head, self.embed, hidden, token, self.width, self.length, self.temperature)
        return Proposal(drafts.beams, dedup_prefix(drafts.beams), self._full_vocab(drafts.draft_probs),
                        drafts.confidence)

    def _whole_chain(self, token: mx.array, hidden: mx.array) -> Proposal:
        """Every depth of the chain in one lazy graph (the device step reads it with the step's
        acceptance): the same drafts and confidences as `extend` makes depth by depth, and the
        runners-up at the first `runner_depths` depths, for `runners_up_on_host` once read."""
        state, draft, score, confidence, *runners = self._chain[0](hidden, token)
        self._first = (draft, confidence)
        drafts, confidences, runner_tokens, runner_confidences = [draft], [confidence], [], []
        if runners:
            runner_tokens.append(runners[0].astype(mx.int32))
            runner_confidences.append(runners[1])
        for depth in range(2, self.length):
            with_runners = depth <= self.runner_depths
            state, draft, score, step_conf, *runners = (self._chain[1] if with_runners else self._chain[2])(
                state, hidden, draft, score)
            drafts.append(draft)
            confidences.append(step_conf)
            if runners and with_runners:
                runner_tokens.append(runners[0].astype(mx.int32))
                runner_confidences.append(runners[1])
        self._runners = [mx.stack(runner_tokens, axis=1), mx.stack(runner_confidences, axis=1)] \
            if runner_tokens else None  # (B, D, S) each
        self._runners_read = None
        beams = mx.stack([token.astype(mx.int32)] + [d.astype(mx.int32) for d in drafts], axis=-1)[:, None, :]
        return Proposal(beams, mx.zeros(beams.shape, dtype=mx.int32), None,
                        mx.stack(confidences, axis=-1)[:, None, :])  # (B, 1, L), (B, 1, L-1)

    def lazy_outputs(self) -> list:
        """The whole chain's runners-up and first draft (lazy): for the step's one read."""
        return [*(self._runners or []), *self._first]

    def took(self, values: list) -> None:
        """The values of `lazy_outputs`, read with the step: later reads of them are free."""
        split = 2 if self._runners is not None else 0
        self._runners_read = values[:split] or None
        self._first_read = values[split:]

    def extend(self, beams: np.ndarray, confidence: np.ndarray, rows: np.ndarray,
               wanted: Callable[[np.ndarray], bool]):
        """Stepwise: deepen the chains of the last `propose`, on the host.

        beams (B, 1, L0), confidence (B, 1, L0-1): the step's drafts as read, the head's first
        draft at depth 1 in the `rows` (B,) bool that are the head's (others: a lookup's, kept);
        wanted(confidence (B, 1, k)): whether a step could verify past the k drafts so far.
        -> the same with the head's rows as deep as wanted (<= length - 1 drafts), every row
        padded to the new length with its last token at confidence 0 (never verified)."""
        head_beams, head_conf = beams[:, :, :2], confidence[:, :, :1]
        state, hidden, draft, score = self._pending
        while head_conf.shape[-1] < self.length - 1 and wanted(head_conf):
            with_runners = 1 + len(self._deeper_runners) < self.runner_depths
            chain_step = self._chain[1] if with_runners else self._chain[2]
            state, draft, score, step_conf, *runners = chain_step(state, hidden, draft, score)
            # Host sync: one depth deeper, only when a draft the step may verify leads to it
            # (with its runners-up, computed in the same call).
            token, conf, *runners = read_host(draft, step_conf, *runners)
            if runners and with_runners:
                self._deeper_runners.append((runners[0].astype(np.int32), runners[1]))
            head_beams = np.concatenate([head_beams, token[:, None, None].astype(beams.dtype)], axis=-1)
            head_conf = np.concatenate([head_conf, conf[:, None, None].astype(confidence.dtype)], axis=-1)
        self._pending = (state, hidden, draft, score)
        depth = head_conf.shape[-1]
        if depth == 1:
            return beams, confidence
        length = max(beams.shape[-1], depth + 1)
        out_beams = np.repeat(beams[:, :, -1:], length, axis=-1)  # padding: the last token ...
        out_conf = np.zeros(beams.shape[:2] + (length - 1,), dtype=confidence.dtype)  # ... never verified
        out_beams[:, :, : beams.shape[-1]] = beams
        out_conf[:, :, : confidence.shape[-1]] = confidence
        out_beams[rows] = np.repeat(head_beams[rows][:, :, -1:], length, axis=-1)
        out_beams[rows, :, : depth + 1] = head_beams[rows]
        out_conf[rows] = 0.0
        out_conf[rows, :, :depth] = head_conf[rows]
        return out_beams, out_conf

    def runners_up_on_host(self):
        """The last `propose`'s runners-up at depths 1..D (D <= runner_depths, as deep as `extend`
        drafted): tokens (B, D, S) int32, confidences (B, D, S). Depth 1's come from the same
        compiled call as the first draft, so reading them costs a sync only; deeper ones were read
        with their depth's draft."""
        if self.whole_chain:  # every depth's, read with the step
            tokens, confidence = self._runners_read
            return tokens.astype(np.int32), confidence
        tokens, confidence = read_host(*self._runners)
        deeper = self._deeper_runners
        return (np.stack([tokens.astype(np.int32)] + [t for t, _ in deeper], axis=1),
                np.stack([confidence] + [c for _, c in deeper], axis=1))

    def first_on_host(self):
        """The last `propose`'s first draft and its confidence, (B,) int32 and (B,): a sync, which
        computes them if the caller has not read the drafts (every row a lookup's)."""
        token, confidence = self._first_read if self.whole_chain else read_host(*self._first)
        return token.astype(np.int32), confidence

    def select_rows(self, keep: np.ndarray) -> None:
        """Rows leaving the batch: the runners-up follow the proposals (`base.select_rows`)."""
        index = mx.array(keep)
        if self._first is not None:
            self._first = tuple(a[index] for a in self._first)
        if self._runners is not None:
            self._runners = [r[index] for r in self._runners]
            self._deeper_runners = [(t[keep], c[keep]) for t, c in self._deeper_runners]
        if self._runners_read is not None:
            self._runners_read = [r[keep] for r in self._runners_read]
        if self._first_read is not None:
            self._first_read = [r[keep] for r in self._first_read]

    def add_rows(self, prompts) -> None:
        """Rows joining a running batch before the next step: no runners-up (confidence 0)."""
        n = len(prompts)
        if self._first is not None:
            self._first = tuple(mx.concatenate([a, mx.zeros((n,) + a.shape[1:], dtype=a.dtype)]) for a in self._first)
        if self._runners is not None:
            self._runners = [mx.concatenate([r, mx.zeros((n,) + r.shape[1:], dtype=r.dtype)]) for r in self._runners]
            self._deeper_runners = [(np.concatenate([t, np.zeros((n,) + t.shape[1:], dtype=t.dtype)]),
                                     np.concatenate([c, np.zeros((n,) + c.shape[1:], dtype=c.dtype)]))
                                    for t, c in self._deeper_runners]

    def _full_vocab(self, draft_probs: mx.array) -> mx.array:
        """(B, W, L-1, K) draft-vocabulary distribution -> (B, W, L-1, V), zero outside it."""
        full = mx.zeros(draft_probs.shape[:-1] + (self.vocab,), dtype=draft_probs.dtype)
        return full.at[..., self.head.draft_to_full].add(draft_probs)
