"""A small draft model over a StreamingLLM cache: TriForce's bottom level.

A same-tokenizer model much smaller than the target drafts a chain of L-1 tokens after the
target's latest token. Its cache keeps only a sink and a recent window (`cache/streaming.py`),
so a draft token costs the same at 8K context as at 100. Greedy drafts are its argmax; sampled
ones are drawn from its own distribution under the target's sampling rule (temperature, top-p),
which is the q that the rejection rule divides by.

State: the text the caller committed (`begin`, `commit`, `rollback`), and the tokens the cache
holds. The cache may hold more than the text (the last proposal's drafts): at the next proposal
it is cut back to the longest common prefix with the text, so accepted drafts are not computed
twice. One host sync per proposal, after the whole chain is built lazily. Its confidence in a
draft is its own probability of it (computed only if read).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..acceptance import sample_probs, target_probs
from ..cache.prefix import common_prefix
from ..cache.streaming import StreamingKVCache
from .tree import dedup_prefix
from ..model.forward import forward
from .base import Proposal, ProposerDefaults


class ModelProposer(ProposerDefaults):
    width = 1
    keeps_text = True  # ReDrafter's loop commits each step's text before asking for drafts
    runners_up, stepwise = 0, False  # as ReDrafter's fallback: its greedy chain, drafted whole

    def __init__(self, model, length: int, vocab: int, sink: int = 16, window: int = 240,
                 temperature: float = 0.0, top_p: float = 1.0, chunk: int = 64):
        if length < 2:
            raise ValueError("ModelProposer needs length >= 2")
        if window < 2 * length:
            raise ValueError(f"the draft window ({window}) must hold at least two chains ({2 * length})")
        self.model, self.length, self.vocab = model, length, vocab
        self.sink, self.window, self.chunk = sink, window, max(1, min(chunk, window))
        self.temperature, self.top_p = temperature, top_p
        self.text: List[int] = []
        self.cache: Optional[StreamingKVCache] = None
        self.cached: List[int] = []  # the tokens whose keys the cache's positions hold, in order

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """One row: the prompt is the committed text. It is fed at the first proposal."""
        if len(prompts) != 1:
            raise ValueError("ModelProposer drafts for one sequence")
        self.text = [int(t) for t in prompts[0]]
        self.cache, self.cached = None, []

    def _reset(self) -> None:
        self.cache = StreamingKVCache.for_model(self.model, self.sink, self.window)
        self.cached = []

    def _feed(self, tokens: Sequence[int], last_logits: bool):
        """Run `tokens` through the draft model in chunks, evicting before each chunk (StreamingLLM's
        prefill); the logits after the last token when asked."""
        logits = None
        for start in range(0, len(tokens), self.chunk):
            self.cache.evict()
            piece = tokens[start : start + self.chunk]
            final = last_logits and start + self.chunk >= len(tokens)
            out = forward(self.model, mx.array([piece]), self.cache, logits_for="last" if final else "none")
            self.cached += piece
            if final:
                logits = out.logits[:, -1, :]  # (1, V)
            else:
                mx.eval(self.cache.state)  # deliberate sync per prefill chunk: bounds the graph
        return logits

    def _draw(self, logits: mx.array):
        """(1, V) -> (token (1,), q (1, V) or None)."""
        if self.temperature <= 0:
            return mx.argmax(logits, axis=-1), None
        q = target_probs(logits, self.temperature, self.top_p)
        return sample_probs(q), q

    def propose(self, token: mx.array, hidden: Optional[mx.array] = None) -> Proposal:
        """token (1,): the target's own latest token (read on the host). A chain (1, 1, L)."""
        context = self.text + [int(np.array(token).reshape(-1)[0])]  # host sync: the token's value
        if self.cache is None:
            self._reset()
        keep = min(common_prefix(self.cached, context), len(context) - 1)
        if len(self.cached) - keep > self.cache.stored - min(self.sink, self.cache.stored):
            self._reset()  # the divergence lies in evicted text: start over from the sink and window
            keep = 0
        self.cache.trim(len(self.cached) - keep)
        del self.cached[keep:]
        logits = self._feed(context[keep:], last_logits=True)
        drafts, probs, confidence = [], [], []
        for depth in range(self.length - 1):
            draft, q = self._draw(logits)
            drafts.append(draft)
            probs.append(q)
            own = q if q is not None else mx.softmax(logits.astype(mx.float32), axis=-1)  # (1, V)
            confidence.append(mx.take_along_axis(own, draft[:, None], axis=-1)[:, 0])  # lazy: not in the sync
            if depth < self.length - 2:  # the last draft is not fed: nothing follows it
                logits = forward(self.model, draft[None], self.cache, logits_for="last").logits[:, -1, :]
        chain = mx.concatenate([mx.array([context[-1]])] + drafts)  # (L,)
        mx.eval(chain, *(q for q in probs if q is not None))  # the one host sync of the chain
        values = [int(v) for v in np.array(chain)]
        self.cached += values[1:-1]
        beams = mx.array(values, dtype=mx.int32).reshape(1, 1, self.length)
        draft_probs = None if self.temperature <= 0 else mx.stack([q[0] for q in probs])[None, None]
        return Proposal(beams, dedup_prefix(beams), draft_probs,  # probs (1, 1, L-1, V)
                        mx.concatenate(confidence).reshape(1, 1, self.length - 1))

    def commit(self, tokens: Sequence[Sequence[int]]) -> None:
        """Row 0: the tokens that became text (the own token the proposal started from and the
        drafts its verifier accepted)."""
        self.text += [int(t) for t in tokens[0]]

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None:
        """Cut the committed text back to lengths[0] tokens (a higher level rejected the rest);
        the cache follows at the next proposal."""
        if lengths is not None:
            del self.text[int(lengths[0]):]
