"""TriForce's middle level as a proposer: the target model over a small cache (the retrieval
cache, or a StreamingLLM one for comparison) drafts γ2 tokens for the same target over its full
cache, with a lower proposer (the bottom level) drafting for it in turn.

    collect(token, hidden) -> (γ2 tokens after `token`, the distribution each was written from
                               (γ2, V), or None when greedy)
    commit(tokens)         the top level kept `tokens` (its own token and the accepted drafts):
                           the small cache forgets what this round wrote and takes those tokens'
                           keys and values from the full cache (as the reference code copies
                           them), so both caches hold the same text; the bottom's text is cut back
                           to the same point
    use_cache(cache)       a rebuilt small cache (it holds the full cache's whole text)

`propose` wraps `collect` in the drafting interface's shapes (one beam), so any verifier of
`Proposal`s can stack this level; TriForce's loop calls `collect` (it works in host ints). Its
confidence is the running acceptance rate of its chains at the level above (`judged`).

`Bottom` puts any drafting source under this level: host-side sources draft after a token on the
host (a lookup with no match drafts nothing), the others through `propose`; a source that needs
the target's hidden state drafts nothing before the level's first forward of a round has one.

`ChainVerifier` is one level's verify: the target over one cache, one chain of drafts, greedy
or exact sampling through the shared acceptance rule. TriForce's top level uses it too.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..acceptance import greedy_accept, sample_probs, sampling_accept, target_probs
from ..host_traffic import read_host, read_list, to_device
from ..model.forward import forward
from ..penalties import ChainPenalties
from .base import Proposal, Proposer, ProposerDefaults, RunningRate, one_hot_probs


class Bottom:
    """A drafting source as the middle level's drafter, for one sequence in host ints:

        draft(x, hidden) -> (up to γ1 tokens after x, their draft distributions (k, V) or None)

    None when greedy (only the tokens matter); when sampling, each row is the distribution its
    token was drawn from (q): one-hot for deterministic (host-side) drafts, the source's own
    distribution otherwise. `commit` and `rollback` keep the source's text equal to what the
    level above holds; `judged` hands it the level's verdict on its drafts."""

    def __init__(self, source: Proposer, vocab: int, sampling: bool):
        self.source, self.vocab, self.sampling = source, vocab, sampling

    def begin(self, prompt: Sequence[int]) -> None:
        self.source.begin([prompt])

    def draft(self, x: int, hidden: Optional[mx.array]) -> Tuple[List[int], Optional[mx.array]]:
        if self.source.host_side:
            chain = self.source.draft_after([x])[0]
            tokens = [] if chain is None else list(chain.tokens)
            if not tokens or not self.sampling:
                return tokens, None
            return tokens, one_hot_probs(to_device([[[x] + tokens]]), self.vocab)[0, 0]
        if hidden is None and self.source.needs_hidden:
            return [], None  # the round's first middle forward has no hidden state yet
        proposal = self.source.propose(to_device([x]), hidden)
        tokens = [int(t) for t in read_list(proposal.beams[0, 0, 1:])]  # host sync (the drafts' values)
        probs = None if proposal.draft_probs is None else proposal.draft_probs[0, 0]
        return tokens, probs

    def commit(self, tokens: Sequence[int]) -> None:
        self.source.commit([list(tokens)])

    def rollback(self, length: int) -> None:
        self.source.rollback([length])

    def judged(self, verified: int, accepted: int) -> None:
        self.source.judged([verified], [accepted])


class ChainVerifier:
    """The target model over one cache, verifying a chain: greedy or exact sampling."""

    def __init__(self, model, cache, params, penalties: Optional[ChainPenalties] = None):
        self.model, self.cache, self.penalties = model, cache, penalties
        self.greedy, self.temperature, self.top_p = params.greedy, params.temperature, params.top_p

    def verify(self, fed: List[int], draft_probs: Optional[mx.array], text: Sequence[int] = ()):
        """One forward of `fed` (the last token, then k drafts) over the cache; `text` (the prompt
        and the answer, fed[0] last) is what the penalties, if any, count. Returns (drafts
        accepted n, the next token, the distributions of the n + 1 tokens written (k+1, V) or
        None when greedy, the hidden states (1, k+1, D)). The one host sync of a verify."""
        beams = to_device([fed])  # (1, k+1): one beam of k + 1 tokens, the forward's input too
        out = forward(self.model, beams, self.cache, logits_for="all")  # logits (1, k+1, V)
        logits = out.logits if self.penalties is None else self.penalties.chain(out.logits, text, fed)
        if self.greedy:
            accepted, probs = greedy_accept(beams, logits), None
            num_accepted, next_token = accepted.num_accepted, accepted.next_token
        else:
            probs = target_probs(logits[0], self.temperature, self.top_p)  # (k+1, V): p at each depth
            if len(fed) == 1:  # nothing drafted: the level's own sample
                num_accepted, next_token = mx.array(0), sample_probs(probs[0])
            else:
                accepted = sampling_accept(beams, probs[None], draft_probs[None])
                num_accepted, next_token = accepted.num_accepted, accepted.next_token
        n, following = read_host(num_accepted, next_token)  # host sync
        n = int(n)
        return n, int(following), None if probs is None else probs[: n + 1], out.hidden


class MiddleLevelProposer(RunningRate, ProposerDefaults):
    """The target over `cache` drafting `gamma` tokens per round for the target over `full`;
    `bottom` (a `Bottom`) drafts for this level."""

    width = 1

    def __init__(self, model, full, cache, bottom, gamma: int, params,
                 penalties: Optional[ChainPenalties] = None):
        self.full, self.bottom, self.gamma = full, bottom, gamma
        self.level = ChainVerifier(model, cache, params, penalties)
        self.text: List[int] = []  # the prompt and what the top level committed
        self.length = gamma + 1
        self.forwards = self.drafted = self.accepted = 0  # the bottom's drafts at this level
        self._round_own = 0  # the small cache's own tokens when this round began (all committed)
        self._round_base = full.offset  # the full cache's text when this round began

    @property
    def cache(self):
        return self.level.cache

    def use_cache(self, cache) -> None:
        self.level.cache = cache

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """One row: the prompt (the small cache holds it already) is the bottom's text."""
        self.text = list(prompts[0])
        self.bottom.begin(prompts[0])

    def collect(self, token: int, hidden: Optional[mx.array]) -> Tuple[List[int], Optional[mx.array]]:
        """γ2 tokens after `token` written by the target over the small cache, with the bottom's
        drafts verified γ1 at a time, and the distribution each was written from."""
        self._round_own, self._round_base = self.cache.layers[0].own, self.full.offset
        drafts: List[int] = []
        rows: List[mx.array] = []
        x = token
        text = self.text + [x]  # this level's text, x last
        while len(drafts) < self.gamma:
            candidates, q = self.bottom.draft(x, hidden)
            n, own, probs, states = self.level.verify([x] + candidates, q, text)
            text += candidates[:n] + [own]
            self.forwards += 1
            self.drafted += len(candidates)
            self.accepted += n
            self.cache.trim(len(candidates) - n)  # fed x and the candidates: keep x and the accepted
            self.bottom.judged(len(candidates), n)
            self.bottom.commit([x] + candidates[:n])
            drafts += candidates[:n] + [own]
            if probs is not None:
                rows.append(probs)
            x, hidden = own, states[:, n]  # the state that wrote `own` (the ReDrafter head reads it)
        return drafts[: self.gamma], (mx.concatenate(rows)[: self.gamma] if rows else None)

    def propose(self, token: mx.array, hidden: Optional[mx.array]) -> Proposal:
        drafts, probs = self.collect(int(token.reshape(-1)[0].item()), hidden)  # host sync: the chain is host-driven
        beams = mx.array([[[int(token.reshape(-1)[0].item())] + drafts]], dtype=mx.int32)  # (1, 1, γ2+1)
        confidence = mx.array(self.rate_confidence(len(drafts)))[None, None]  # (1, 1, γ2)
        return Proposal(beams, mx.zeros_like(beams), None if probs is None else probs[None, None], confidence)

    def commit(self, tokens: Sequence[Sequence[int]]) -> None:
        """tokens[0]: what the top level kept this round (the full cache already holds it)."""
        kept = list(tokens[0])
        self.text += kept
        self.bottom.rollback(self._round_base)  # the bottom's text: what the top level committed
        self.bottom.commit(kept)
        self.cache.trim(self.cache.layers[0].own - self._round_own)
        end = self.full.offset
        for mid, layer in zip(self.cache.layers, self.full.layers):
            mid.update_and_fetch(layer.keys[..., end - len(kept):end, :], layer.values[..., end - len(kept):end, :])
        if self.cache.offset != self.full.offset:  # both hold the prompt and every committed token
            raise RuntimeError(f"triforce: middle cache at {self.cache.offset}, full cache at {self.full.offset}")

    def rollback(self, lengths: Optional[Sequence[int]] = None) -> None:
        """Forget what this round wrote (nothing of it was committed)."""
        self.cache.trim(self.cache.layers[0].own - self._round_own)
        self.bottom.rollback(self._round_base)
