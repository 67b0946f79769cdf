"""Prompt lookup: draft the continuation of the longest suffix of the text that occurred before.

The text is the prompt plus the answer so far, per batch row, kept on the host. To draft after
token x, find the longest n-gram (n from `max_ngram` down to `min_ngram`) ending the text + x
that also occurs earlier, and propose the L-1 tokens that followed it there; W beams take the W
most recent distinct continuations. Free (no model), and strong where the answer quotes its
document: a summary, a quote, a code edit, a long chat that repeats itself.

A lookup has no probability of its own: its confidence is the running acceptance rate of its
verified drafts (`base.RunningRate`). In `propose`, a row with no match proposes its token
repeated (a draft the target will mostly reject, at no cost but the verify width, confidence 0);
`draft_after` offers nothing there. Drafts are deterministic: their distribution is one-hot
(q = 1), so under sampling a drafted token is accepted with the target's own probability of it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .base import Chain, Proposal, ProposerDefaults, RunningRate, one_hot_probs
from .tree import dedup_prefix


class NgramProposer(RunningRate, ProposerDefaults):
    host_side = True

    def __init__(self, width: int, length: int, vocab: int, max_ngram: int = 4, min_ngram: int = 1,
                 sampling: bool = False):
        if width < 1 or length < 2 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("NgramProposer needs width >= 1, length >= 2, 1 <= min_ngram <= max_ngram")
        self.width, self.length, self.vocab = width, length, vocab
        self.max_ngram, self.min_ngram, self.sampling = max_ngram, min_ngram, sampling
        self.texts: List[List[int]] = []
        self._index: List[Dict[Tuple[int, ...], List[int]]] = []  # per row: n-gram -> end positions

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Start a batch: each row's text is its prompt (the committed tokens before the first own one)."""
        self.texts, self._index = [], []
        self.add_rows(prompts)

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None:
        """Rows joining a running batch (continuous batching), each with its text so far."""
        for prompt in prompts:
            self.texts.append([])
            self._index.append({})
            self._extend(len(self.texts) - 1, prompt)

    def select_rows(self, keep: Sequence[int]) -> None:
        """The rows still decoding (a batch shrinks as rows finish)."""
        self.texts = [self.texts[b] for b in keep]
        self._index = [self._index[b] for b in keep]

    def _extend(self, row: int, tokens: Sequence[int]) -> None:
        text, index = self.texts[row], self._index[row]
        for token in tokens:
            text.append(int(token))
            end = len(text)  # the n-grams ending at this token, keyed by their tokens
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    index.setdefault(tuple(text[end - n:end]), []).append(end)

    def continuations(self, row: int, token: int) -> List[List[int]]:
        """Up to W distinct continuations (each L-1 tokens, or shorter at the text's end) of the
        longest suffix of text + token seen before, most recent occurrence first."""
        text = self.texts[row] + [int(token)]
        found: List[List[int]] = []
        for n in range(min(self.max_ngram, len(text) - 1), self.min_ngram - 1, -1):
            for end in reversed(self._index[row].get(tuple(text[-n:]), [])):
                if end >= len(text) - 1:  # it ends right before the token: it would only predict the token again
                    continue
                follow = text[end:end + self.length - 1]
                if follow and follow not in found:
                    found.append(follow)
                if len(found) == self.width:
                    return found
            if found:
                return found
        return found

    def draft_after(self, tokens: Sequence[int], rows: Optional[np.ndarray] = None) -> List[Optional[Chain]]:
        """Per asked row, the longest of its continuations after the token (the most recent among
        equals), at the running acceptance rate; None where the text has no match."""
        chains: List[Optional[Chain]] = []
        for b, x in enumerate(tokens):
            found = self.continuations(b, int(x)) if rows is None or rows[b] else []
            follow = max(found, key=len) if found else None
            chains.append(None if follow is None else Chain(follow, self.rate_confidence(len(follow))))
        return chains

    def propose(self, token: mx.array, hidden: Optional[mx.array] = None) -> Proposal:
        """token (B,): the target's own latest token, read on the host (a sync: this proposer
        runs after the step's verify is read). `hidden` is not used."""
        tokens = np.array(token).reshape(-1)  # host sync: the lookup needs the token's value
        B, W, L = len(tokens), self.width, self.length
        beams = np.zeros((B, W, L), dtype=np.int32)
        confidence = np.zeros((B, W, L - 1), dtype=np.float32)
        for b, x in enumerate(tokens):
            beams[b, :, :] = x
            for w, follow in enumerate(self.continuations(b, int(x))):
                beams[b, w, 1:1 + len(follow)] = follow
                beams[b, w, 1 + len(follow):] = follow[-1]  # short at the end: repeat, mostly rejected
                confidence[b, w, : len(follow)] = self.rate
        beams = mx.array(beams)
        probs = one_hot_probs(beams, self.vocab) if self.sampling else None
        return Proposal(beams, dedup_prefix(beams), probs, mx.array(confidence))

    def commit(self, tokens: Sequence[Sequence[int]]) -> None:
        """Per row: the own token the step's proposal started from and the drafts accepted after it."""
        for row, row_tokens in enumerate(tokens):
            self._extend(row, row_tokens)

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None:
        """Cut each row's text back to lengths[row] tokens (a higher level rejected what its
        verifier had committed here); its n-grams leave the index. Nothing is proposed into the
        text, so without lengths there is nothing to forget."""
        for row, length in enumerate(lengths or []):
            text, index = self.texts[row], self._index[row]
            for end in range(len(text), int(length), -1):  # the newest n-grams end last in each list
                for n in range(self.min_ngram, self.max_ngram + 1):
                    if end >= n:
                        key = tuple(text[end - n:end])
                        index[key].pop()
                        if not index[key]:
                            del index[key]
            del text[int(length):]
