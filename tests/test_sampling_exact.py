"""Sampling exactness of ReDrafter's step by exact enumeration: no sampling noise, so the emitted
distribution must be the target's to 1e-9 (a chi-square test sees a 1 % bias at best).

One step over a 3-token vocabulary: W chains of D drafts are drawn from the head's q; for every
possible draw (with its probability) the real planner (`RedrafterLoop.plan`: the cutoff and the
verify-cost rule) chooses the depth, and the real acceptance rule (`acceptance.sampling_accept`)
runs on the tree cut to it, its uniforms scripted: at each node of the accepted path, candidate i
is accepted after candidates 1..i-1 were rejected (probability prod (1 - r) * r_i, r the rule's
own min(1, p/q) there, read back from the run) or all are rejected, and its draws from a residual
or the bonus are read back as distributions. Summed, that is the exact distribution of the
emitted tokens, which must be the target's p: the first token, and the first two (a step that
ends after one token leaves the second to the next step, which draws it from p).
"""

from functools import lru_cache
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec import acceptance
from mlx_specdec.decoding.redrafter_step import RedrafterLoop, Settings
from mlx_specdec.drafting.calibration import DraftTrust
from mlx_specdec.drafting.tree import dedup_prefix
from mlx_specdec.drafting.verify_cost import CostTable, shipped_table

V = 3
OWN = 0  # the target's own token the step starts from
ROOT_P, ROOT_Q = (0.1, 0.3, 0.6), (0.45, 0.35, 0.2)  # at T = 1: the head overrates token 0
# After each drafted token the head is sure, unsure or lost, so a chain's next confidence (the peak
# of its q) depends on the token drawn before it.
HEAD_SHARPNESS = (4.0, 1.0, 0.1)
# Costly first extra token, nearly free ones after it: not convex (a stored table like it is refitted).
BENT = CostTable(np.array([150.0, 6000.0]), np.array([[1.0, 1.02, 1.04, 1.06, 1.08, 1.10],
                                                       [1.0, 1.60, 1.62, 1.64, 1.66, 1.68]]), "bent")


def _logits(prefix, salt):
    rng = np.random.default_rng([salt] + [int(t) for t in prefix])
    return rng.normal(size=V)


@lru_cache(maxsize=None)
def target(prefix, temperature, top_p):
    """p after the own token and the drafts `prefix`: what plain sampling draws from."""
    logits = np.log(ROOT_P) if not prefix else 1.5 * _logits(prefix, 1)
    p = np.array(acceptance.target_probs(mx.array(logits, dtype=mx.float32), temperature, top_p), dtype=np.float64)
    return p / p.sum()  # to float64's precision: the rule below runs in float64


@lru_cache(maxsize=None)
def head(prefix, temperature):
    """q the head draws the next draft from (`sample_beams`: softmax(logits / T), no nucleus)."""
    logits = np.log(ROOT_Q) if not prefix else HEAD_SHARPNESS[prefix[-1]] * _logits(prefix, 2)
    z = np.exp((logits - logits.max()) / temperature)
    return z / z.sum()


class _ScriptedUniforms:
    """The rule's uniforms: `uniforms[d, w] < ratio` answers from a script and keeps the ratio."""

    def __init__(self, accept):
        self.accept, self.ratios = accept, {}

    def __getitem__(self, index):
        script = self

        class Comparison:
            def __lt__(self, ratio):
                script.ratios[index] = ratio
                return mx.array(index in script.accept)

        return Comparison()


class _Random:
    def __init__(self, uniforms):
        self.uniforms = uniforms

    def uniform(self, shape, key=None):
        return self.uniforms

    def __getattr__(self, name):
        return getattr(mx.random, name)


class _MX:  # mlx.core, but for the rule's uniforms
    def __init__(self, uniforms):
        self.random = _Random(uniforms)

    def __getattr__(self, name):
        return getattr(mx, name)


def scripted_accept(beams, p, q, accept, monkeypatch):
    """sampling_accept on one row with the uniforms at `accept` below their ratio, the others above,
    lazily: -> a function that reads the emitted tokens (a draw from a distribution as that
    distribution) and the ratios {(d, w): r}, and the arrays to evaluate first."""
    draws = []

    def sample_probs(probs, key=None):
        draws.append(probs)
        return mx.array(V + len(draws) - 1, dtype=mx.int32)  # names the draw

    uniforms = _ScriptedUniforms(accept)
    with monkeypatch.context() as patch, mx.stream(mx.cpu):  # float64: the CPU's
        patch.setattr(acceptance, "mx", _MX(uniforms))
        patch.setattr(acceptance, "sample_probs", sample_probs)
        result = acceptance.sampling_accept(mx.array(beams), mx.array(p, dtype=mx.float64),
                                            mx.array(q, dtype=mx.float64))

    def read():
        beam, n, token = (int(x) for x in (result.beam, result.num_accepted, result.next_token))
        ratios = {k: min(1.0, max(0.0, float(r))) for k, r in uniforms.ratios.items()}
        emitted = [int(t) for t in beams[beam, 1: n + 1]]
        emitted.append(token if token < V else np.array(draws[token - V], dtype=np.float64))
        return emitted, ratios

    return read, [result, list(uniforms.ratios.values()), draws]


def step_distribution(beams, p, q, positions, after, monkeypatch):
    """The exact distribution of the first `positions` (1 or 2) emitted tokens of one verify of
    `beams` (W, L) with p (W, L, V) and q (W, L-1, V): shape (V,) or (V, V). after(a): p after the
    first token a, which the next step draws the second from where this one ends after one token.
    Depth by depth along the accepted path, the candidates are the beams that share it."""
    W, L = beams.shape
    out, leaves = np.zeros((V,) * positions), []

    def as_distribution(token):
        return token if isinstance(token, np.ndarray) else np.eye(V)[token]

    def explore(depth, alive, accept, decisive):
        if depth == min(L - 1, positions):  # the tokens asked for are settled: deeper, all rejected
            return leaves.append((scripted_accept(beams, p, q, accept, monkeypatch), decisive))
        for i in range(len(alive) + 1):  # accept alive[i] after rejecting those before it, or none
            rejected = [((depth, w), False) for w in alive[:i]]
            if i == len(alive):
                leaves.append((scripted_accept(beams, p, q, accept, monkeypatch), decisive + rejected))
                continue
            w = alive[i]
            sharing = [v for v in alive if beams[v, depth + 1] == beams[w, depth + 1]]
            explore(depth + 1, sharing, accept | {(depth, w)}, decisive + rejected + [((depth, w), True)])

    explore(0, list(range(W)), frozenset(), [])
    mx.eval([arrays for (_, arrays), _ in leaves])  # one evaluation for the step's runs
    for (read, _), decisive in leaves:
        emitted, ratios = read()
        weight = np.prod([ratios[k] if taken else 1.0 - ratios[k] for k, taken in decisive])
        first = as_distribution(emitted[0])
        if positions == 1:
            out[...] += weight * first
        elif len(emitted) == 1:  # the step ended on its first token
            out[...] += weight * first[:, None] * np.stack([after(a) for a in range(V)])
        else:
            out[emitted[0]] += weight * as_distribution(emitted[1])
    return out


def planner(width, drafts, context, table, margin, rows):
    """A stand-in loop holding what `RedrafterLoop.plan` reads: the head drafts the last row, a
    host-side source (a lookup's chain) the others."""
    s = Settings(width=width, length=drafts + 1, cutoff=0.1, use_trust=True, cost_table=table, cost_aware=True,
                 margin=margin, eager=True, stepwise=False, runners_up=0, runner_depths=0, deepen_reach=0.0,
                 compete=False, beside_host=False, prompt_draft=False, sampled_drafts=True, profile=False)
    fallback = int(rows > 1)
    loop = SimpleNamespace(s=s, source=np.arange(rows), fallback=fallback,
                           trusts=[DraftTrust(rows) for _ in range(fallback + 1)], head=SimpleNamespace(runners_up=0),
                           runners=SimpleNamespace(compete=False), lengths=np.full(rows, context),
                           meter=SimpleNamespace(rate=1.25) if margin else None, params=SimpleNamespace(greedy=False))
    loop.calibrated = lambda confidence: RedrafterLoop.calibrated(loop, confidence)
    return loop


def emitted_distribution(width, drafts, temperature, top_p, context, table, margin, positions, monkeypatch,
                         lookup=None):
    """Every draw of `width` chains of `drafts` drafts, planned and accepted by the real code: the
    distribution of the first `positions` tokens emitted. lookup: the confidences of a host-side
    chain in a second row of the batch, beside the head's (its tokens are fixed: not enumerated)."""
    rows = 1 if lookup is None else 2
    loop = planner(width, drafts, context, table, margin, rows)
    total, seen = np.zeros((V,) * positions), {}
    for draw in np.ndindex(*(V,) * (width * drafts)):
        chains = np.array(draw).reshape(width, drafts)
        beams = np.concatenate([np.full((width, 1), OWN), chains], axis=1).astype(np.int32)
        probability, q, p = 1.0, np.zeros((width, drafts, V)), np.zeros((width, drafts + 1, V))
        for w in range(width):
            for j in range(drafts + 1):
                p[w, j] = target(tuple(chains[w, :j]), temperature, top_p)
            for j in range(drafts):
                q[w, j] = head(tuple(chains[w, :j]), temperature)
                probability *= q[w, j, chains[w, j]]
        confidence = q.max(axis=-1).astype(np.float32)  # the peak of each q (`sample_beams`)
        if lookup is None:
            loop.beams, loop.confidence = beams[None], confidence[None]
        else:  # the lookup's row first: every beam its one chain (`FirstOffer.draft`)
            chain = np.broadcast_to(np.arange(drafts + 1, dtype=np.int32) % V, beams.shape)
            loop.beams = np.stack([chain, beams])
            loop.confidence = np.stack([np.broadcast_to(np.float32(lookup), confidence.shape), confidence])
        loop.owner = dedup_prefix(loop.beams, np)
        n = RedrafterLoop.plan(loop).step_length
        key = (beams[:, :n].tobytes(), n)
        if key not in seen:
            seen[key] = step_distribution(beams[:, :n], p[:, :n], q[:, : n - 1], positions,
                                          lambda a: target((a,), temperature, top_p), monkeypatch)
        total += probability * seen[key]
    return total


def expected(temperature, top_p, positions):
    first = target((), temperature, top_p)
    if positions == 1:
        return first
    return first[:, None] * np.stack([target((a,), temperature, top_p) for a in range(V)])


SAMPLING = [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9)]  # (temperature, top_p)


@pytest.mark.parametrize("context", [150, 6000])
@pytest.mark.parametrize("width,temperature,top_p", [(w, t, p) for w in (1, 2) for t, p in SAMPLING] +
                         [(3, *SAMPLING[0]), (3, *SAMPLING[3])])  # W = 3: 729 draws, ~6 s where all are verified
def test_the_first_token_of_a_sampled_step_is_the_target_s_exactly(width, temperature, top_p, context, monkeypatch):
    """The shipped table's long-context band (6,000 tokens) is where the packed tree's token count
    decided the depth: with two chains, verifying depth 1 only where both drew the same token."""
    got = emitted_distribution(width, 2, temperature, top_p, context, shipped_table(), False, 1, monkeypatch)
    want = expected(temperature, top_p, 1)
    assert np.abs(got - want).max() < 1e-9, (got.round(6).tolist(), want.round(6).tolist())


@pytest.mark.parametrize("lookup", [(0.9, 0.3), (0.35, 0.9)])
def test_the_head_s_row_beside_a_lookup_s_row_samples_the_target_exactly(lookup, monkeypatch):
    """A batch shares one depth: the lookup's row (one chain, its confidences fixed by the text)
    moves the depth the head's row gets, never with the head's draws."""
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        got = emitted_distribution(2, 2, temperature, top_p, 6000, shipped_table(), False, 1, monkeypatch, lookup)
        want = expected(temperature, top_p, 1)
        assert np.abs(got - want).max() < 1e-9, (temperature, top_p, got.round(6).tolist(), want.round(6).tolist())


@pytest.mark.parametrize("table", [shipped_table(), BENT], ids=["shipped", "bent"])
@pytest.mark.parametrize("margin", [False, True], ids=["ratio", "margin"])
@pytest.mark.parametrize("width,drafts", [(1, 2), (1, 3), (2, 2)])
def test_the_first_two_tokens_of_a_sampled_step_are_the_target_s_exactly(width, drafts, margin, table, monkeypatch):
    """Deeper positions too, with either rule, on a table whose first extra token is dear and the
    next ones nearly free (there the argmax over depths looks at the second draft's confidence,
    which depends on the first token drawn)."""
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        got = emitted_distribution(width, drafts, temperature, top_p, 6000, table, margin, 2, monkeypatch)
        want = expected(temperature, top_p, 2)
        assert np.abs(got - want).max() < 1e-9, (temperature, top_p, got.round(6).tolist(), want.round(6).tolist())


def test_a_stored_table_that_is_not_convex_is_refitted_and_sampling_on_it_is_exact(tmp_path, monkeypatch):
    from mlx_specdec.drafting import cost_probe

    from conftest import make_tiny_lm

    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path / "home"))
    lm = make_tiny_lm(seed=1)
    cost_probe.save_table(lm, BENT, rounds=1)
    loaded = cost_probe.load_table(lm)
    got = emitted_distribution(1, 2, 1.0, 1.0, 6000, loaded, False, 1, monkeypatch)  # one chain
    assert np.abs(got - expected(1.0, 1.0, 1)).max() < 1e-9, got.round(6).tolist()
    assert (np.diff(loaded.costs, n=2, axis=1) >= -1e-9).all(), loaded.costs
    assert (loaded.costs[:, 0] == 1.0).all() and (np.diff(loaded.costs, axis=1) >= 0).all()
    convex = CostTable(np.array([150.0]), np.array([[1.0, 1.1, 1.25, 1.45]]), "convex")
    cost_probe.save_table(lm, convex, rounds=1)
    assert np.array_equal(cost_probe.load_table(lm).costs, convex.costs)  # a convex table is read as stored
