"""Sampling exactness of ReDrafter's default sampled step by exact enumeration (draw-and-follow).

The default path (`--sampled-drafts off`): the head drafts its likeliest tree (a stepwise chain,
with its runners-up beside the first drafts), fixed before any draw; at every packed node the
target's own token is drawn (`RedrafterLoop.own_token`: the nucleus from the 1,024 likeliest
tokens, or a full sort where they do not hold it), and the step follows the drafts equal to the
draws and emits the draw at the first node whose draw is none of its children.

The loop is the real one (`build_loop` on a tiny model with a 1,100-token vocabulary, a bigram
stand-in head, the shipped verify-cost table, a repetition and a presence penalty); its real
`plan`, `pack` and `accept` run once per enumerated outcome, only the verify's logits replaced
by a fixed function of each node's path (read from the tree's mask), and `mx.random.categorical`
(the draw) by a script. A draw is grouped per node: one of its children (follow it) or anything
else (a token outside the children, drawn from the rest of that node's distribution); a node
is asked only where the draw it makes is on that draw's followed path, so a step's outcomes are
a few dozen runs, each weighted by the product of its outcomes' probabilities read back from
the logits the draw was given. Every draw counts, a discarded one too (the first of a fallback):
a step that decided anything on a draw it then threw away would show.

Summed, that is the exact distribution of the first token and, where the step follows a draft,
of the second: compared to the target's own p (penalties in numpy, then `ar`'s sampling logits
with the nucleus over the full sort), to 1e-9. Where the step ends after its first token a, the
second is the next step's first draw, from p(. | a) in both, so its error is at most a's.
"""

from functools import lru_cache
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec import acceptance
from mlx_specdec.decoding.base import DecodeContext, GenerationParams, GenerationStats, make_sampler
from mlx_specdec.decoding.redrafter import build_loop
from mlx_specdec.decoding.redrafter_step import RedrafterLoop
from mlx_specdec.drafting.verify_cost import shipped_table

from conftest import make_tiny_lm
from test_redrafter import BigramOracle

V = 1100  # past acceptance.NUCLEUS_TOP: the nucleus may lie outside the 1,024 likeliest tokens
PROMPT = [5, 17, 42, 3, 1050, 77]
OWN = 900  # the first token (drawn before the step: scripted), not in the prompt (no lookup)
# The head's first three choices after each token (a bigram head): the chain 900 42 1077 900 ...
# repeats a prompt token (42) and the answer's own (900), and a runner-up (17) is a prompt token.
CHOICES = {900: (42, 1090, 311), 42: (1077, 17, 640), 1077: (900, 1003, 12)}
PARAMS = dict(temperature=0.7, top_p=0.95, repetition_penalty=2.0, presence_penalty=0.5)  # exact in float32
FLAT = (OWN, 42)  # the node made flat where the nucleus must pass the 1,024 likeliest
OTHER = -1  # a draw that is none of the node's children


@lru_cache(maxsize=None)
def target_logits(path, flat):
    """The target's logits after `path` (the answer so far, OWN first): multiples of 2^-10, so
    the penalties' halving and subtracting 0.5 are exact in float32."""
    rng = np.random.default_rng([3] + list(path))
    if flat and path == FLAT:  # near uniform: the 1,024 likeliest hold ~0.93 < top-p
        x = 0.05 * rng.normal(size=V)
        x[CHOICES[path[-1]][0]] += 4.0
    else:
        x = rng.normal(size=V)
        for token, boost in zip(CHOICES.get(path[-1], ()), (7.0, 5.5, 5.0)):
            x[token] += boost  # the head is often right
    return np.round(x * 1024) / 1024


@lru_cache(maxsize=None)
def target(path, flat):
    """p after `path` as plain sampling (`ar`) draws it: penalties, then the sampling logits."""
    logits = target_logits(path, flat).copy()
    for t in set((PROMPT + list(path))[-20:]):  # repetition: the last 20 tokens of prompt + answer
        logits[t] = logits[t] * 2.0 if logits[t] < 0 else logits[t] / 2.0
    logits[list(set(path))] -= 0.5  # presence: the answer's tokens
    x = mx.array(logits.astype(np.float32))
    z = np.array(acceptance.sampling_logits(x - mx.logsumexp(x, axis=-1, keepdims=True),
                                            PARAMS["temperature"], PARAMS["top_p"]), dtype=np.float64)
    return softmax(z)


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


class _Draws:
    """mx.random for acceptance.py with `categorical` scripted (the rest is mx.random's)."""

    def __init__(self, categorical):
        self.categorical = categorical

    def __getattr__(self, name):
        return getattr(mx.random, name)


class _MX:
    def __init__(self, categorical):
        self.random = _Draws(categorical)

    def __getattr__(self, name):
        return getattr(mx, name)


@pytest.fixture(scope="module")
def loop():
    """A loop after its first token (OWN), its first drafts made: 900 -> {42 -> {1077 -> {900},
    17}, 1090, 311} (chain three deep, runners-up beside its first two drafts)."""
    lm = make_tiny_lm(seed=1, vocab_size=V)
    table = np.zeros((V, V), dtype=np.float32)
    for token, choices in CHOICES.items():
        table[token, list(choices)] = (9.0, 8.0, 7.5)
    head = BigramOracle(lm.model.model.embed_tokens.weight, mx.array(table), V)
    params = GenerationParams(max_tokens=64, **PARAMS)
    ctx = DecodeContext(lm, list(PROMPT), params, make_sampler(params), GenerationStats("redrafter"),
                        resources={"drafter": head, "verify_costs": shipped_table()}, prompts=[list(PROMPT)])
    loop = build_loop(ctx)
    assert loop.s.stepwise and loop.s.runners_up == 2 and not loop.s.sampled_drafts  # the defaults
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(acceptance, "mx", _MX(lambda logits, **_: mx.full(logits.shape[:-1], OWN, dtype=mx.uint32)))
        assert [step.tokens for step in loop.start()] == [[OWN]]
    return loop


def structure(tree):
    """The verified tree as its mask draws it: each node's path (OWN first) and parent."""
    tokens = np.array(tree.tokens)[0].tolist()
    N = len(tokens)
    seen = np.tril(np.ones((N, N), dtype=bool)) if tree.mask is None else np.array(tree.mask)[0, 0, :, -N:]
    ancestors = [np.flatnonzero(seen[i, :N]) for i in range(N)]  # self included
    paths = [tuple(tokens[j] for j in sorted(a, key=lambda j: len(ancestors[j]))) for a in ancestors]
    parents = [max((j for j in a if j != i), key=lambda j: len(ancestors[j]), default=-1)
               for i, a in enumerate(ancestors)]
    return tokens, paths, parents


def enumerate_step(loop, flat, patch):
    """The exact distribution of the step's first token (V,) and, for each draft it may follow
    first, of (that draft, the second token) (V,) -> (first, {draft: row}, runs, draws per run,
    total weight)."""
    run = SimpleNamespace(script={}, calls=[])

    def categorical(logits, axis=-1, **_):
        z = np.array(logits.astype(mx.float32), dtype=np.float64).reshape(-1, V)  # (N, V) the draw's logits
        k, N = len(run.calls), len(run.tokens)
        run.calls.append(z)
        out = [run.tokens[o] if (o := run.script.get((k, n), OTHER)) != OTHER else V + k * N + n for n in range(N)]
        return mx.array(np.array(out, dtype=np.uint32).reshape(logits.shape[:-1]))

    patch.setattr(acceptance, "mx", _MX(categorical))
    first, rows, leaves, total = np.zeros(V), {}, [], 0.0

    def explore(script):
        run.script, run.calls = script, []
        plan = loop.plan()
        tree = loop.pack(plan)
        run.tokens, paths, parents = structure(tree)
        children = [[i for i, p in enumerate(parents) if p == n] for n in range(len(paths))]
        logits = np.stack([target_logits(path, flat) for path in paths]).astype(np.float32)
        out = SimpleNamespace(logits=mx.array(logits[None]), hidden=mx.zeros((1, len(paths), 1)))
        result, _ = loop.accept(tree, plan.step_length, out)
        beam, n, token = (int(x) for x in (result.beam, result.num_accepted, result.next_token))
        probs = [[softmax(z[m]) for m in range(len(paths))] for z in run.calls]
        for k in range(len(run.calls)):  # draw k's path: ask its first node not yet scripted
            node = parents.index(-1)
            while (o := script.get((k, node))) not in (None, OTHER):
                node = o
            if o is None:
                for o in children[node] + [OTHER]:
                    explore({**script, (k, node): o})
                return
        weight = 1.0
        for (k, m), o in script.items():
            rest = np.delete(probs[k][m], [run.tokens[c] for c in children[m]])
            weight *= rest.sum() if o == OTHER else probs[k][m][run.tokens[o]]

        def law(t):  # an emitted token: a draft, or a draw outside a node's children
            if t < V:
                return np.eye(V)[t]
            k, m = divmod(t - V, len(paths))
            p = probs[k][m].copy()
            p[[run.tokens[c] for c in children[m]]] = 0.0
            return p / p.sum()

        nonlocal total
        emitted = [int(t) for t in tree.beams[0, beam, 1: n + 1]] + [token]
        total += weight
        first[...] += weight * law(emitted[0])
        if len(emitted) > 1:
            rows.setdefault(emitted[0], np.zeros(V))[...] += weight * law(emitted[1])
        leaves.append(len(run.calls))

    explore({})
    return first, rows, len(leaves), set(leaves), total


def error(loop, flat, patch):
    """The enumeration's largest difference from the target's first two tokens -> (error, runs, draws per run)."""
    first, rows, runs, draws, total = enumerate_step(loop, flat, patch)
    want = target((OWN,), flat)
    assert abs(total - 1.0) < 1e-9, total
    assert {42, 1090, 311} <= set(rows), rows.keys()  # the chain's first draft and its runners-up followed
    worst = np.abs(first - want).max()
    for a, row in rows.items():
        worst = max(worst, np.abs(row - want[a] * target((OWN, a), flat)).max())
    return worst, runs, draws


@pytest.mark.parametrize("flat,draws", [(False, {1}), (True, {2})], ids=["nucleus-in-top-1024", "full-sort-fallback"])
def test_a_default_sampled_step_emits_its_first_two_tokens_as_the_target_samples_them(loop, flat, draws, monkeypatch):
    """With every node's nucleus among its 1,024 likeliest tokens one draw; with one flat node,
    whose nucleus is not, the tree's draw is discarded and drawn again by the full sort."""
    worst, runs, made = error(loop, flat, monkeypatch)
    assert made == draws, made
    assert worst < 1e-9, (worst, runs)


def _nucleus_one_token_short(patch):
    real = acceptance.top_nucleus

    def short(logprobs, top_p, k=None):
        cut, valid = real(logprobs, top_p, k)
        least = mx.min(mx.where(cut == -float("inf"), float("inf"), cut), axis=-1, keepdims=True)
        return mx.where(cut <= least, -float("inf"), cut), valid

    patch.setattr(acceptance, "top_nucleus", short)


def _second_draw_after_a_rejection(patch):
    real = RedrafterLoop.own_token

    def again(self, logits):  # the depth decided after seeing the draw: a rejected root draws again
        tokens = real(self, logits)
        if logits.ndim == 3 and int(tokens[0, 0]) != int(self.beams[0, 0, 1]):
            tokens = real(self, logits)
        return tokens

    patch.setattr(RedrafterLoop, "own_token", again)


def _no_fallback(patch):
    real = acceptance.top_nucleus
    patch.setattr(acceptance, "top_nucleus",
                  lambda logprobs, top_p, k=None: (real(logprobs, top_p, k)[0], mx.ones(logprobs.shape[:-1], mx.bool_)))


@pytest.mark.parametrize("flat,bias", [(False, _nucleus_one_token_short), (False, _second_draw_after_a_rejection),
                                       (True, _no_fallback)],
                         ids=["nucleus-one-token-short", "second-draw-after-a-rejection", "flat-nucleus-cut-to-1024"])
def test_the_enumeration_sees_a_biased_step(loop, flat, bias, monkeypatch):
    bias(monkeypatch)
    worst, runs, _ = error(loop, flat, monkeypatch)
    assert worst > 1e-6, (worst, runs)
