"""The ReDrafter head's drafts: beam search (greedy) and sampled chains (sampling).

`beam_search` (greedy mode) and `sample_beams` (sampling mode) run the RNN draft head for L-1 steps
and return W candidate continuations, each starting with the token the target model just produced.
Both are one lazy MLX graph: no `.item()`, `.tolist()` or numpy inside. `compiled_chain` drafts a
greedy single chain one depth per call. Packing the beams into one tree to verify is the drafting
layer's (`drafting/tree.py`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx

Embed = Callable[[mx.array], mx.array]  # token ids (...,) -> embeddings (..., E): the LLM's own table


class Drafts(NamedTuple):
    beams: mx.array  # (B, W, L) int32 token ids; [:, :, 0] is the target's own token
    draft_probs: mx.array | None  # (B, W, L-1, K) draft-vocab distribution of each drafted token
    # (B, W, L-1) how likely each drafted position is, for the draft cutoff. Beam search: the head's
    # probability of the drafted token (at its config's confidence_temperature). Sampled chains: the
    # largest probability of the distribution the token was drawn from, which does not depend on the
    # token drawn (see `sample_beams`).
    confidence: mx.array | None = None


def _start(head, embed: Embed, hidden: mx.array, first_token: mx.array, width: int):
    B = first_token.shape[0]
    state = head.initial_state(embed(first_token))  # (B, E)
    state = mx.broadcast_to(state[:, None, :], (B, width, state.shape[-1]))  # (B, W, E)
    hidden = mx.broadcast_to(hidden[:, None, :], (B, width, hidden.shape[-1]))  # (B, W, D)
    beams = mx.broadcast_to(first_token[:, None, None], (B, width, 1)).astype(mx.int32)  # (B, W, 1)
    return state, hidden, beams


def beam_search(head, embed: Embed, hidden: mx.array, first_token: mx.array, width: int, length: int) -> Drafts:
    """hidden (B, D): the target's last hidden state; first_token (B,): its own next token.

    Beam 0 starts at log-probability 0 and the others far below, so the first expansion takes W
    distinct children of the one real start instead of W copies of the best one.
    """
    B = first_token.shape[0]
    K = head.config.draft_vocab_size
    state, hidden, beams = _start(head, embed, hidden, first_token, width)
    scores = mx.broadcast_to(mx.array([0.0] + [-1e9] * (width - 1)), (B, width))  # (B, W)
    steps = mx.zeros((B, width, 0))  # (B, W, j) each beam's per-token log-probabilities so far
    tau = head.config.confidence_temperature  # the confidences only: beams are chosen at tau 1
    for _ in range(length - 1):
        logits = head.logits(state, hidden).astype(mx.float32)  # (B, W, K)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        candidates = (scores[..., None] + logprobs).reshape(B, width * K)  # (B, W*K)
        if width == 1:
            top = mx.argmax(candidates, axis=-1, keepdims=True)  # (B, 1)
        else:
            top = mx.argpartition(-candidates, kth=width - 1, axis=-1)[:, :width]  # (B, W) unordered
            order = mx.argsort(-mx.take_along_axis(candidates, top, axis=-1), axis=-1)
            top = mx.take_along_axis(top, order, axis=-1)  # best first: beam 0 is the best beam
        parent, draft_token = top // K, top % K  # (B, W)
        new_scores = mx.take_along_axis(candidates, top, axis=-1)
        step = new_scores - mx.take_along_axis(scores, parent, axis=-1)  # (B, W) the new token's log-prob
        if tau != 1.0:  # its log-prob at the head's calibrated temperature instead
            step = _tempered_logprob(logits.reshape(B, width * K), top, tau, K)  # (B, W)
        steps = mx.concatenate([mx.take_along_axis(steps, parent[..., None], axis=1), step[..., None]], axis=-1)
        scores = new_scores
        token = head.draft_to_full[draft_token]  # (B, W) full-vocabulary ids
        beams = mx.concatenate([mx.take_along_axis(beams, parent[..., None], axis=1), token[..., None]], axis=-1)
        state = mx.take_along_axis(state, parent[..., None], axis=1)  # (B, W, E)
        state = head.next_state(state, embed(token))
    return Drafts(beams, None, mx.exp(steps))


_COMPILED: dict = {}  # compiled graphs, by head and shape


def greedy_chain_step(head, state: mx.array, hidden: mx.array, score: mx.array, runners_up: int = 0):
    """One depth of `beam_search` at W=1, written with its ops so the numbers are the same.

    state (B, E), hidden (B, D), score (B,) the chain's log-probability so far -> the drafted
    token (B,) in the full vocabulary, the new score, and the token's confidence (B,); with
    runners_up = S > 0 also the head's next S choices after its top one (B, S) and theirs (B, S)."""
    logits = head.logits(state, hidden).astype(mx.float32)  # (B, K)
    candidates = score[:, None] + (logits - mx.logsumexp(logits, axis=-1, keepdims=True))  # (B, K)
    top = mx.argmax(candidates, axis=-1, keepdims=True)  # (B, 1)
    new_score = mx.take_along_axis(candidates, top, axis=-1)[:, 0]
    step = new_score - score  # (B,) as beam_search takes the token's log-prob
    tau = head.config.confidence_temperature
    if tau != 1.0:
        step = _tempered_logprob(logits, top, tau, logits.shape[-1])[:, 0]
    out = (head.draft_to_full[top[:, 0]], new_score, mx.exp(step))
    if runners_up <= 0:
        return out
    # ranks 2..S+1 (a tie with the top one may repeat it: the caller drops a runner-up equal to the
    # draft): the S+1 best found in linear time, then only they are sorted
    best = mx.argpartition(-logits, runners_up, axis=-1)[:, : runners_up + 1]  # (B, S+1) any order
    best = mx.take_along_axis(best, mx.argsort(-mx.take_along_axis(logits, best, axis=-1), axis=-1), axis=-1)
    order = best[:, 1:]  # (B, S)
    if tau != 1.0:
        runner_logprob = _tempered_logprob(logits, order, tau, logits.shape[-1])
    else:
        runner_logprob = mx.take_along_axis(candidates - score[:, None], order, axis=-1)
    return out + (head.draft_to_full[order], mx.exp(runner_logprob))


def _tempered_logprob(logits: mx.array, top: mx.array, tau: float, K: int) -> mx.array:
    """logits (B, W*K): W draft-vocabulary rows side by side; top (B, n) indices into them ->
    (B, n) each chosen token's log-probability within its own row at temperature tau."""
    B = logits.shape[0]
    sharp = logits.reshape(B, -1, K) / tau
    sharp = (sharp - mx.logsumexp(sharp, axis=-1, keepdims=True)).reshape(B, -1)
    return mx.take_along_axis(sharp, top, axis=-1)


def compiled_chain(head, embed: Embed, runners_up: int = 0, deeper_runners_up: bool = False):
    """The greedy W=1 chain one depth per call, for drafting only as deep as a step can verify
    (`drafting.head_source.HeadProposer` stepwise): (first, deeper, deeper_alone), each compiled once per head.

    first(hidden (B, D), token (B,)) -> state, draft (B,), score, confidence: depth 1 (and, with
    runners_up = S, the head's next S choices there and their confidences, (B, S) each)
    deeper(state, hidden, draft, score) -> the same one depth further (with its runners-up where
    deeper_runners_up); deeper_alone: the same without runners-up, for depths that want none"""
    key = (id(head), id(embed), "chain", runners_up, deeper_runners_up)
    if key not in _COMPILED:
        def first(hidden, token):
            state = head.initial_state(embed(token))  # (B, E)
            return (state,) + greedy_chain_step(head, state, hidden, mx.zeros(token.shape, dtype=mx.float32),
                                                runners_up)

        def deeper_with(runners: int):
            def deeper(state, hidden, draft, score):
                state = head.next_state(state, embed(draft))
                return (state,) + greedy_chain_step(head, state, hidden, score, runners)
            return mx.compile(deeper)

        _COMPILED[key] = (mx.compile(first), deeper_with(runners_up if deeper_runners_up else 0), deeper_with(0))
    return _COMPILED[key]


def sample_beams(head, embed: Embed, hidden: mx.array, first_token: mx.array, width: int, length: int,
                 temperature: float, key: mx.array | None = None) -> Drafts:
    """W independent draft chains sampled from the head at `temperature` (sampling mode: the
    acceptance rule needs drafts drawn from q, not chosen by beam search)."""
    state, hidden, beams = _start(head, embed, hidden, first_token, width)
    keys = mx.random.split(key, length) if key is not None else [None] * length
    probs, peaks = [], []
    for step in range(length - 1):
        logits = head.logits(state, hidden).astype(mx.float32) / temperature  # (B, W, K)
        probs.append(mx.softmax(logits, axis=-1))
        index = mx.random.categorical(logits, key=keys[step])  # (B, W) draft-vocabulary index
        # Not q(token): a cutoff on the drawn token's own probability keeps a draft more often when q
        # overrates it, which biases the output (q = (0.9, 0.1), p = (0.5, 0.5), cutoff 0.2: the
        # second token comes out 45 % of the time, not 50 %). A cutoff on max q is decided before
        # the draw, so each verified depth is plain rejection sampling and each cut one samples p.
        peaks.append(probs[-1].max(axis=-1))  # (B, W)
        token = head.draft_to_full[index]  # (B, W)
        beams = mx.concatenate([beams, token[..., None]], axis=-1)
        state = head.next_state(state, embed(token))
    return Drafts(beams, mx.stack(probs, axis=2), mx.stack(peaks, axis=2))  # (B, W, L-1, K), (B, W, L-1)
