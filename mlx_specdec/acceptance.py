"""Speculative acceptance: the one place the verify-then-accept math lives.

Every speculative method drafts candidate continuations, runs the target model once over them,
and keeps the longest prefix the target model agrees with, plus one token of the target's own.
All functions here are lazy MLX graphs (no host sync); the caller syncs once per step.

Greedy (temperature 0) -- output is token for token the target's greedy output:
    target[w, j] = argmax p(. | prefix, beam w up to depth j)
    draft token beams[w, j+1] is accepted while it equals target[w, j];
    pick the beam with the longest accepted run n; the next token is target[w, n]
    (the target's own choice after the last accepted draft: the "bonus" token).

Sampling -- output is distributed exactly as the target's samples (Leviathan et al.; with several
candidates per node, SpecInfer's multi-candidate rule). At a node with target distribution p and
candidates x_1..x_m drawn independently from the draft distribution q:
    for each candidate x_i in turn:
        accept x_i with probability min(1, p(x_i) / q(x_i))      (U < p/q)
        otherwise p <- max(p - q, 0) / sum(max(p - q, 0))       (the residual)
    if none is accepted: sample the next token from the final residual p and stop;
    if all drafted depths are accepted: sample a bonus token from the deepest node's p.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx

from .host_traffic import read_host

_TINY = 1e-20  # guards p/q and the residual's normaliser against 0/0


class Accepted(NamedTuple):
    beam: mx.array  # () index of the beam whose prefix was accepted
    num_accepted: mx.array  # () accepted draft tokens (0 .. L-1)
    next_token: mx.array  # () the target's own token after them (bonus or resampled)


def sampling_logits(logprobs: mx.array, temperature: float, top_p: float = 1.0) -> mx.array:
    """(..., V) log-probabilities at T = 1 -> the logits plain sampling (`ar`) draws from.

    Exactly mlx-lm's sampler (`make_sampler(temp, top_p)`), written once for every method:
        1. the nucleus is cut on the T = 1 distribution (mlx-lm's `apply_top_p`: the fewest
           most-likely tokens whose mass reaches top_p, ties at the threshold kept); the rest -> -inf
        2. what is left is scaled by 1/T and drawn from: p(x) ∝ exp(logit(x) / T) on the nucleus.
    The order matters: cutting after dividing by T (T > 1 flattens p) keeps a wider nucleus."""
    if 0.0 < top_p < 1.0:
        from mlx_lm.sample_utils import apply_top_p

        logprobs = apply_top_p(logprobs, top_p)
    return logprobs * (1.0 / temperature)


NUCLEUS_TOP = 1024  # `top_nucleus` looks for the nucleus among this many likeliest tokens


def top_nucleus(logprobs: mx.array, top_p: float, k: Optional[int] = None):
    """`sampling_logits`' nucleus cut (mlx-lm's `apply_top_p`) from the k likeliest tokens alone,
    without sorting the vocabulary: (..., V) -> (cut log-probs, valid (...) bool). Where the k
    hold at least top_p of the mass (valid), every token the full rule keeps is among them and
    the cut is the full rule's (the same threshold; the total mass summed in another order, so
    a tie with top_p is settled to float rounding); elsewhere the caller uses the full rule."""
    k = NUCLEUS_TOP if k is None else k
    if not 0.0 < top_p < 1.0 or k >= logprobs.shape[-1]:
        return sampling_logits(logprobs, 1.0, top_p), mx.ones(logprobs.shape[:-1], dtype=mx.bool_)
    top = mx.sort(mx.topk(logprobs, k, axis=-1), axis=-1)  # (..., k) ascending
    probs = mx.exp(top.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)  # the mass above each, as the full rule's
    total = mx.exp(logprobs.astype(mx.float32)).sum(axis=-1, keepdims=True)
    dropped = (above >= top_p * total).sum(axis=-1, keepdims=True)  # within the k
    threshold = mx.take_along_axis(top, dropped, axis=-1)
    valid = (probs.sum(axis=-1) >= top_p * total[..., 0])  # the k hold the nucleus
    return mx.where(logprobs < threshold, -float("inf"), logprobs), valid


def sample_top_nucleus(logprobs: mx.array, temperature: float, top_p: float, full) -> mx.array:
    """A draw from `sampling_logits` with the nucleus found by `top_nucleus`: one sync reads
    whether the k likeliest held it everywhere; where not (rare: a very flat distribution),
    full(logprobs) draws by the full sort instead. The draw is discarded or kept on a property
    of the logits alone, never of the draw, so the result is a draw from the same distribution."""
    cut, valid = top_nucleus(logprobs, top_p)
    tokens = mx.random.categorical(cut * (1.0 / temperature))
    _, held = read_host(tokens, valid)  # deliberate sync: valid decides the rule
    return tokens if bool(held.all()) else full(logprobs)


NUCLEUS_DRAWS = 4  # draws per node `nucleus_draws` makes; all outside the nucleus: about (1-top_p)^4


def nucleus_draws(logprobs: mx.array, temperature: float, top_p: float, rounds: int = NUCLEUS_DRAWS):
    """A draw from `sampling_logits` at every row of (..., V) log-probabilities, with no sort and a
    fixed amount of work: (tokens (...), held (...) bool).

    Each of `rounds` draws comes from the whole tempered distribution exp(logprob / T) (inverse
    CDF: one uniform and one pass each); a draw x is in mlx-lm's nucleus exactly when the mass of
    the tokens likelier than x is below top_p of the total (`apply_top_p` keeps the fewest likeliest
    tokens whose mass reaches top_p, ties with the last one kept: that set). The first draw in the
    nucleus is kept. A draw from p restricted to a set, given that it fell in the set, is a draw
    from p on the set: the nucleus at T = 1 cut, then scaled by 1/T, as `sampling_logits` draws.
    Where no draw fell in the nucleus (held False: rare, each draw lands in it with at least about
    top_p), the caller draws that row again by the full rule (`sample_token`), which is exact
    because whether a row is redrawn depends only on draws it then discards.

    The comparisons are made on `logprobs` as given (mlx-lm's ties); the masses are summed in
    float32 in another order than the sorted cumulative sum, so only a mass within rounding of
    top_p can be judged differently."""
    probs = mx.exp(logprobs.astype(mx.float32))  # (..., V) at T = 1: the nucleus is cut on these
    total = probs.sum(axis=-1, keepdims=True)
    cdf = mx.cumsum(mx.exp(logprobs.astype(mx.float32) * (1.0 / temperature)), axis=-1)  # tempered, unnormalised
    u = mx.random.uniform(shape=(*logprobs.shape[:-1], rounds)) * cdf[..., -1:]  # (..., R)
    drawn = (cdf[..., None, :] <= u[..., None]).sum(axis=-1)  # (..., R) the first token whose cdf passes u
    drawn = mx.minimum(drawn, logprobs.shape[-1] - 1).astype(mx.uint32)
    value = mx.take_along_axis(logprobs, drawn, axis=-1)  # (..., R)
    likelier = mx.where(logprobs[..., None, :] > value[..., None], probs[..., None, :], 0.0).sum(axis=-1)
    inside = likelier < top_p * total  # (..., R) each draw in the nucleus
    first = mx.argmax(inside, axis=-1)  # the first draw inside (0 where none is: held says so)
    return mx.take_along_axis(drawn, first[..., None], axis=-1)[..., 0], inside.any(axis=-1)


def target_probs(logits: mx.array, temperature: float, top_p: float = 1.0) -> mx.array:
    """The distribution plain sampling draws from (`sampling_logits`), as probabilities (float32)."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.softmax(sampling_logits(logprobs, temperature, top_p), axis=-1)


def sample_token(logprobs: mx.array, temperature: float, top_p: float = 1.0) -> mx.array:
    """Draw from `sampling_logits` (what `ar` does at temperature > 0)."""
    return mx.random.categorical(sampling_logits(logprobs, temperature, top_p))


def greedy_accept(beams: mx.array, beam_logits: mx.array) -> Accepted:
    """beams (..., W, L) with the target's own token at depth 0; beam_logits (..., W, L, V): the
    target's logits after each beam token. Longest accepted run over the beams (per batch row)."""
    return greedy_accept_targets(beams, mx.argmax(beam_logits, axis=-1))


def greedy_accept_targets(beams: mx.array, target: mx.array) -> Accepted:
    """greedy_accept from the target's own token after each beam token, target (..., W, L): a tree
    verify takes the argmax once per packed token and unpacks the tokens, not the logits."""
    matches = (beams[..., 1:] == target[..., :-1]).astype(mx.int32)  # (..., W, L-1)
    run = mx.cumprod(matches, axis=-1).sum(axis=-1)  # (..., W) accepted drafts per beam
    beam = mx.argmax(run, axis=-1)  # (...) first beam among the longest: the better-scored one
    num_accepted = mx.take_along_axis(run, beam[..., None], axis=-1)[..., 0]
    best = mx.take_along_axis(target, beam[..., None, None], axis=-2)[..., 0, :]  # (..., L)
    next_token = mx.take_along_axis(best, num_accepted[..., None], axis=-1)[..., 0]
    return Accepted(beam, num_accepted, next_token)


def sample_probs(probs: mx.array, key: Optional[mx.array] = None) -> mx.array:
    """Draw from a distribution given as probabilities (..., V) (zeros are never drawn)."""
    return mx.random.categorical(mx.log(mx.maximum(probs, _TINY)), key=key)


def sampling_accept(beams: mx.array, target: mx.array, draft: mx.array,
                    key: Optional[mx.array] = None) -> Accepted:
    """Multi-candidate rejection sampling over independently sampled draft beams.

    beams  (W, L)    depth 0 is the target's own token, shared by all beams
    target (W, L, V) the target's distribution after each beam token (p), equal for equal prefixes
    draft  (W, L-1, V) the draft distribution each beam's token at depth j+1 was drawn from (q)

    Unrolled over depths and beams (W and L are small), with `where` instead of branches so the
    whole rule stays one lazy graph.
    """
    W, L = beams.shape
    keys = mx.random.split(key, W * (L - 1) + 1) if key is not None else [None] * (W * (L - 1) + 1)
    uniforms = mx.random.uniform(shape=(L - 1, W), key=keys[0])  # one U per (depth, candidate)

    alive = mx.ones((W,), dtype=mx.bool_)  # beams whose prefix equals the accepted prefix so far
    beam = mx.array(0)  # a beam on the accepted prefix (beam 0 at depth 0: all share the token)
    num_accepted = mx.array(0)
    stopped = mx.array(False)
    next_token = mx.array(0)
    for depth in range(L - 1):
        residual = target[beam, depth]  # (V,) p at the current node
        accepted_here = mx.array(False)
        chosen = beam
        for w in range(W):
            candidate = beams[w, depth + 1]
            q = draft[w, depth]  # (V,)
            eligible = alive[w] & ~stopped & ~accepted_here
            ratio = residual[candidate] / mx.maximum(q[candidate], _TINY)
            accept = eligible & (uniforms[depth, w] < ratio)
            reject = eligible & ~accept
            leftover = mx.maximum(residual - q, 0.0)
            leftover = leftover / mx.maximum(leftover.sum(), _TINY)
            residual = mx.where(reject, leftover, residual)
            chosen = mx.where(accept, w, chosen)
            accepted_here = accepted_here | accept
        # no candidate accepted at this depth: the next token comes from the residual
        rejected_all = ~stopped & ~accepted_here
        resampled = sample_probs(residual, keys[1 + depth * W])
        next_token = mx.where(rejected_all, resampled, next_token)
        stopped = stopped | rejected_all
        num_accepted = num_accepted + accepted_here.astype(mx.int32)
        beam = mx.where(accepted_here, chosen, beam)
        alive = alive & mx.where(accepted_here, beams[:, depth + 1] == beams[chosen, depth + 1], True)
    bonus = sample_probs(target[beam, L - 1], keys[-1])
    next_token = mx.where(stopped, next_token, bonus)
    return Accepted(beam, num_accepted, next_token)
