"""Sampling exactness of ReDrafter's default sampled step: the likeliest tree (deterministic
drafts), accepted where each node's draft equals the target's own sample there.

`RedrafterLoop.accept` runs on a batch of identical rows (each row an independent draw) over a
tree whose beams share prefixes, and the first three emitted tokens (the step's, then plain
draws from the target where the step ended earlier) are tested against the target's exact joint
distribution with a chi-square test. 200,000 rows over 64 cells: a 1 % shift of mass between two
cells is far beyond the test's threshold, and a sampler that draws per beam instead of per node
(so two beams sharing a node can disagree on its token) is caught.
"""

from functools import lru_cache
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.acceptance import greedy_accept_targets, target_probs
from mlx_specdec.decoding.base import GenerationParams, make_sampler
from mlx_specdec.decoding.redrafter_step import RedrafterLoop, Tree
from mlx_specdec.drafting.tree import dedup_prefix, pack_beams
from mlx_specdec.penalties import NoPenalties

V, ROWS, POSITIONS = 4, 200_000, 3
OWN = 0
# Three beams sharing prefixes: nodes 0 -> {1 -> {2, 3}, 2 -> {1}}.
BEAMS = np.array([[OWN, 1, 2], [OWN, 1, 3], [OWN, 2, 1]], dtype=np.int32)


def logits(prefix):
    """The target's logits after the own token and `prefix` (any prefix: the next step's too)."""
    rng = np.random.default_rng([7] + [int(t) for t in prefix])
    return (1.6 * rng.normal(size=V)).astype(np.float32)


@lru_cache(maxsize=None)
def probs(prefix, temperature, top_p):
    p = np.array(target_probs(mx.array(logits(prefix)), temperature, top_p), dtype=np.float64)
    return p / p.sum()


def chi_square_threshold(df: int, z: float = 4.26) -> float:
    """The chi-square quantile at the normal quantile z (Wilson-Hilferty; z = 4.26: p = 1e-5)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def emitted(temperature, top_p, per_beam=False, seed=0):
    """(ROWS, POSITIONS) the first tokens each row emits: the real accept over the packed tree,
    then the target's own draws (the next steps', as `ar` would make them). per_beam: a wrong
    rule for contrast, the target's token drawn per beam token instead of per packed node."""
    mx.random.seed(seed)
    tree = pack_beams(BEAMS, dedup_prefix(BEAMS[None], np)[0])
    # The target's logits at each packed node: the node's prefix is its beam's tokens through it.
    node_logits = np.zeros((len(tree.tokens), V), dtype=np.float32)
    for w in range(BEAMS.shape[0]):
        for j in range(BEAMS.shape[1]):
            node_logits[tree.index[w, j]] = logits(tuple(BEAMS[w, 1: j + 1]))
    B, N = ROWS, len(tree.tokens)
    params = GenerationParams(temperature=temperature, top_p=top_p)
    loop = SimpleNamespace(s=SimpleNamespace(sampled_drafts=False), params=params, penalties=NoPenalties(),
                           ctx=SimpleNamespace(sampler=make_sampler(params)))
    loop.own_token = lambda x: RedrafterLoop.own_token(loop, x)
    index = mx.array(np.broadcast_to(tree.index.reshape(1, -1), (B, tree.index.size)).copy())
    beams = np.broadcast_to(BEAMS, (B,) + BEAMS.shape)
    out = SimpleNamespace(logits=mx.broadcast_to(mx.array(node_logits), (B, N, V)), hidden=mx.zeros((B, N, 1)))
    if per_beam:
        unpacked = mx.take_along_axis(out.logits, index[..., None], axis=1)  # (B, W*L, V)
        result = greedy_accept_targets(mx.array(beams), loop.own_token(unpacked).reshape(beams.shape))
    else:
        packed = Tree(beams, [tree] * B, None, None, None, index, None, np.zeros(B, dtype=np.int64),
                      np.zeros(0, dtype=np.int64))
        result, _ = RedrafterLoop.accept(loop, packed, BEAMS.shape[1], out)
    best, n, token = (np.array(a) for a in (result.beam, result.num_accepted, result.next_token))
    rows = np.full((B, POSITIONS), -1, dtype=np.int64)
    drafted = BEAMS[best, 1:]  # (B, L-1)
    for j in range(POSITIONS):
        take = n > j
        rows[take, j] = drafted[take, j] if j < drafted.shape[1] else -1
        rows[n == j, j] = token[n == j]
    rng = np.random.default_rng(seed)
    for j in range(POSITIONS):  # where the step ended earlier: the next steps' plain draws
        todo = rows[:, j] < 0
        for prefix in {tuple(r) for r in rows[todo, :j]}:
            these = todo & (rows[:, :j] == prefix).all(axis=1)
            cdf = np.cumsum(probs(prefix, temperature, top_p))
            rows[these, j] = np.minimum(np.searchsorted(cdf, rng.random(int(these.sum())) * cdf[-1]), V - 1)
    return rows


def chi_square(rows, temperature, top_p):
    want = np.zeros((V,) * POSITIONS)
    for cell in np.ndindex(*want.shape):
        want[cell] = np.prod([probs(cell[:i], temperature, top_p)[cell[i]] for i in range(POSITIONS)])
    got = np.zeros(want.shape)
    np.add.at(got, tuple(rows.T), 1)
    expected = want * len(rows)
    seen = expected > 0
    assert got[~seen].sum() == 0, "a token outside the target's support was emitted"
    return float((((got - expected) ** 2)[seen] / expected[seen]).sum()), int(seen.sum()) - 1


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 1.0), (0.7, 0.9), (1.0, 0.8)])
def test_the_first_three_tokens_of_a_matched_step_are_the_target_s(temperature, top_p):
    rows = emitted(temperature, top_p)
    accepted = (rows[:, :2] == BEAMS[0, 1:]).all(axis=1).mean()
    assert accepted > 0.01  # the tree's deepest path is taken: the step is more than one token
    statistic, df = chi_square(rows, temperature, top_p)
    assert statistic < chi_square_threshold(df), (statistic, df)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.8), (1.0, 0.6)])
def test_the_nucleus_from_the_likeliest_tokens_samples_the_target(temperature, top_p, monkeypatch):
    """The nodes' nucleus found among the 2 likeliest of 4 tokens (`acceptance.top_nucleus`):
    where those hold top-p of the mass and where they do not (the full sort then)."""
    from mlx_specdec import acceptance

    monkeypatch.setattr(acceptance, "NUCLEUS_TOP", 2)
    statistic, df = chi_square(emitted(temperature, top_p), temperature, top_p)
    assert statistic < chi_square_threshold(df), (statistic, df)


def test_the_chi_square_sees_a_target_drawn_per_beam():
    """A wrong rule for contrast: beams sharing the node 0 -> 1 each draw its token, and the
    longest match favours it (two chances to match): the test must reject it."""
    rows = emitted(1.0, 1.0, per_beam=True)
    statistic, df = chi_square(rows, 1.0, 1.0)
    assert statistic > chi_square_threshold(df), (statistic, df)


@pytest.mark.slow
def test_the_default_model_s_sampled_answers_start_as_its_own_samples():
    """End to end on the real model and head: 384 rows of one prompt in one redrafter batch at
    T = 0.7, top-p 0.9. The token after the likeliest first token comes from the first
    speculative step (the head drafted it, or lookup); its counts must fit the target's own
    p(. | prompt, first token), by a chi-square test over its likeliest tokens and the rest."""
    from mlx_specdec.decoding import GenerationParams as Params
    from mlx_specdec.engine import Engine

    engine = Engine.load("default")
    prompt = engine.lm.encode_prompt("Give me one tip for sleeping well.")
    params = Params(max_tokens=2, temperature=0.7, top_p=0.9, seed=3)
    rows = {}
    for event in engine.generate_ids_batch([prompt] * 384, "redrafter", params):
        if event.kind == "token":
            rows.setdefault(event.thread_id, []).extend(event.tokens)
    firsts = [tokens[0] for tokens in rows.values()]
    first = max(set(firsts), key=firsts.count)
    seconds = [tokens[1] for tokens in rows.values() if tokens[0] == first and len(tokens) > 1]
    assert len(seconds) >= 100, len(seconds)
    logits = engine.lm.model(mx.array(prompt + [first])[None])[0, -1]  # `ar`'s one forward, no cache
    p = np.array(target_probs(logits, 0.7, 0.9), dtype=np.float64)
    p /= p.sum()
    top = list(np.argsort(-p)[:4])
    want = np.array([p[t] for t in top] + [1 - sum(p[t] for t in top)]) * len(seconds)
    got = np.array([seconds.count(t) for t in top] + [sum(t not in top for t in seconds)])
    assert all(p[t] > 0 for t in seconds), "a token outside the nucleus"
    keep = want >= 5  # the chi-square's cells need expected counts of 5 or more
    rest = (~keep).any()
    want = np.append(want[keep], want[~keep].sum()) if rest else want
    got = np.append(got[keep], got[~keep].sum()) if rest else got
    statistic = float(((got - want) ** 2 / np.maximum(want, 1e-9)).sum())
    assert statistic < chi_square_threshold(len(want) - 1), (statistic, got.tolist(), want.round(1).tolist())
