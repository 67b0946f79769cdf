"""Sampling exactness of ReDrafter's device step (`DeviceLoop`) by exact enumeration.

Two parts, each proved exactly and each shown to catch a biased variant:

1. The nucleus draw (`acceptance.nucleus_draws`): per node, a few draws from the whole tempered
   distribution, the first inside mlx-lm's top-p nucleus kept; a node none of whose draws fell
   inside is drawn again by the full rule (`sample_token`, as `DeviceLoop.settle` does). Every
   tuple of draws is enumerated on a small vocabulary (its uniforms scripted to land on chosen
   tokens), ties at the nucleus' edge included: the law of the result is the nucleus' to 1e-12.

2. The loop: the enumeration of test_sampling_exact_default.py run through `DeviceLoop` itself
   (`build_loop(ctx, cls=DeviceLoop)`: its plan, its one-upload pack with the device-built tree
   mask and padding, its penalties, its compiled accept, its settle). The node draws are scripted
   (a draw from each node's nucleus, computed by `sampling_logits` from the logits the loop gave),
   and so is the settle's full-rule draw. A node the script marks unheld (the flat node) returns
   a token outside its nucleus, as a real unheld draw does: only `settle` can make it right.
"""

import itertools
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec import acceptance
from mlx_specdec.decoding import redrafter_device
from mlx_specdec.decoding.base import DecodeContext, GenerationParams, GenerationStats, make_sampler
from mlx_specdec.decoding.redrafter import build_loop
from mlx_specdec.decoding.redrafter_device import DeviceLoop
from mlx_specdec.drafting.verify_cost import shipped_table

from conftest import make_tiny_lm
from test_redrafter import BigramOracle
from test_sampling_exact_default import (CHOICES, FLAT, OTHER, OWN, PARAMS, PROMPT, V, softmax, structure, target,
                                         target_logits)


class _MX:
    """mx for acceptance.py with some of mx.random scripted (the rest is mlx's own)."""

    def __init__(self, **scripted):
        self.random = SimpleNamespace(**{**{k: getattr(mx.random, k) for k in dir(mx.random) if not k[0] == "_"},
                                         **scripted})

    def __getattr__(self, name):
        return getattr(mx, name)

# -- 1. the nucleus draw ---------------------------------------------------------------------------

# probabilities whose nucleus at top_p 0.7 ends in a tie (0.2, 0.2: both kept), and a sharp one
ROWS = {"tie-at-the-edge": [0.3, 0.25, 0.2, 0.2, 0.05], "sharp": [0.05, 0.8, 0.1, 0.03, 0.02]}


def nucleus_law(probs, temperature, top_p):
    """The law `sampling_logits` draws from: the set mlx-lm's apply_top_p keeps (on the sorted
    vocabulary), each kept token weighted p^(1/T), in float64."""
    logprobs = mx.log(mx.array(np.array(probs, dtype=np.float32)))
    kept = np.array(acceptance.sampling_logits(logprobs, temperature, top_p)) > -np.inf
    weights = np.where(kept, np.array(probs, dtype=np.float64) ** (1.0 / temperature), 0.0)
    return weights / weights.sum()


def enumerate_draws(draw, probs, temperature, top_p, rounds, patch):
    """Every `rounds`-tuple of draws, each landed by its uniform on a chosen token -> the law of
    the node's final token: the kept draw where held, else the full rule's (nucleus_law)."""
    n = len(probs)
    tempered = np.exp(np.log(np.array(probs)) / temperature)
    cdf = np.cumsum(tempered) / tempered.sum()
    mid = (np.concatenate([[0.0], cdf[:-1]]) + cdf) / 2  # a uniform inside each token's interval
    law, full = np.zeros(n), nucleus_law(probs, temperature, top_p)
    logprobs = mx.log(mx.array(np.array(probs, dtype=np.float32)))[None]
    for tup in itertools.product(range(n), repeat=rounds):
        queue = list(mid[list(tup)])

        def uniform(shape, **_):  # the next uniforms of the tuple, in the order they are asked
            size = int(np.prod(shape))
            values, queue[:] = queue[:size], queue[size:]
            return mx.array(np.array(values, dtype=np.float32)).reshape(shape)

        patch.setattr(acceptance, "mx", _MX(uniform=uniform))
        token, held = (np.array(a)[0] for a in draw(logprobs, temperature, top_p, rounds))
        weight = np.prod(tempered[list(tup)] / tempered.sum())
        law += weight * (np.eye(n)[int(token)] if held else full)
    patch.undo()
    return law, full


def _shorter_nucleus(logprobs, temperature, top_p, rounds):
    return acceptance.nucleus_draws(logprobs, temperature, 0.75 * top_p, rounds)  # the tie left out


def _likeliest_inside(logprobs, temperature, top_p, rounds):  # a choice among the draws that looks at them
    real = acceptance.nucleus_draws
    tokens = [real(logprobs, temperature, top_p, 1) for _ in range(rounds)]
    best = tokens[0]
    for token, held in tokens[1:]:
        likelier = held & (mx.take_along_axis(logprobs, token[..., None], axis=-1)[..., 0] >
                           mx.take_along_axis(logprobs, best[0][..., None], axis=-1)[..., 0])
        best = (mx.where(likelier | ~best[1], token, best[0]), best[1] | held)
    return best


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_the_nucleus_draw_and_its_redraw_have_the_nucleus_law(row, temperature, monkeypatch):
    law, want = enumerate_draws(acceptance.nucleus_draws, ROWS[row], temperature, 0.7, 3, monkeypatch)
    assert np.abs(law - want).max() < 1e-12, (law, want)


@pytest.mark.parametrize("bias", [_shorter_nucleus, _likeliest_inside], ids=["nucleus-short", "likeliest-kept"])
def test_the_draw_enumeration_sees_a_biased_draw(bias, monkeypatch):
    law, want = enumerate_draws(bias, ROWS["tie-at-the-edge"], 0.7, 0.7, 3, monkeypatch)
    assert np.abs(law - want).max() > 1e-3, (law, want)


def test_the_nucleus_draw_keeps_what_apply_top_p_keeps_on_random_rows():
    """Membership as mlx-lm decides it: every draw inside is a token apply_top_p keeps, and every
    token it keeps is drawn inside somewhere (many draws, flat and sharp rows, ties)."""
    rng = np.random.default_rng(5)
    rows = [rng.normal(size=300) * s for s in (0.05, 1.0, 4.0)] + [np.repeat(rng.normal(size=30), 10)]
    logits = mx.array(np.stack(rows).astype(np.float32))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    kept = np.array(acceptance.sampling_logits(logprobs, 1.0, 0.8)) > -np.inf  # (4, 300)
    mx.random.seed(0)
    drawn, held = acceptance.nucleus_draws(mx.broadcast_to(logprobs, (4000, *logprobs.shape)), 1.0, 0.8, rounds=8)
    drawn, held = np.array(drawn), np.array(held)
    for r in range(len(rows)):
        inside = set(drawn[held[:, r], r].tolist())
        assert inside <= set(np.flatnonzero(kept[r]).tolist())
        if kept[r].sum() < 60:
            assert inside == set(np.flatnonzero(kept[r]).tolist())


# -- 2. the loop -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def device_loop():
    """As test_sampling_exact_default's `loop`, the device step's: the first token OWN, the
    drafts 900 -> {42 -> {1077 -> {900}, 17}, 1090, 311}."""
    lm = make_tiny_lm(seed=1, vocab_size=V)
    table = np.zeros((V, V), dtype=np.float32)
    for token, choices in CHOICES.items():
        table[token, list(choices)] = (9.0, 8.0, 7.5)
    head = BigramOracle(lm.model.model.embed_tokens.weight, mx.array(table), V)
    params = GenerationParams(max_tokens=64, options={"step": "device"}, **PARAMS)
    ctx = DecodeContext(lm, list(PROMPT), params, make_sampler(params), GenerationStats("redrafter"),
                        resources={"drafter": head, "verify_costs": shipped_table()}, prompts=[list(PROMPT)])
    loop = build_loop(ctx)
    assert isinstance(loop, DeviceLoop) and loop.s.runners_up == 2 and not loop.s.sampled_drafts
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(acceptance, "mx", _MX(categorical=lambda logits, **_: mx.full(logits.shape[:-1], OWN,
                                                                                   dtype=mx.uint32)))
        assert [step.tokens for step in loop.start()] == [[OWN]]
    return loop


def enumerate_device_step(loop, flat, patch):
    """The exact law of the device step's first token and, after each draft it may follow, of
    the second -> (first (V,), {draft: (V,)}, runs, total weight). A node's final draw is its
    nucleus draw where held, else the settle's; only those are asked (the others are discarded:
    the script gives them a token that would show if kept)."""
    run = SimpleNamespace(script={}, calls=[], held=None, made=set())

    def fake(k, n):
        return V + k * len(run.tokens) + n  # a token drawn outside the node's children: its law is kept apart

    def scripted(k, z):
        run.calls.append(z)
        return [run.tokens[o] if (o := run.script.get((k, n), OTHER)) != OTHER else fake(k, n)
                for n in range(len(run.tokens))]

    def draws(logprobs, temperature, top_p, rounds=None):  # DeviceLoop.node_draws' nucleus_draws
        z = np.array(acceptance.sampling_logits(logprobs.astype(mx.float32), temperature, top_p), dtype=np.float64)
        out = scripted(len(run.calls), z.reshape(-1, V))
        run.held = [not (flat and path == FLAT) for path in run.paths]
        out = [o if h else int(np.argmin(z.reshape(-1, V)[n])) for n, (o, h) in enumerate(zip(out, run.held))]  # unheld: outside
        return mx.array(np.array(out, dtype=np.uint32)[None]), mx.array(np.array(run.held)[None])

    def categorical(logits, axis=-1, **_):  # the settle's full rule (acceptance.sample_token)
        z = np.array(logits.astype(mx.float32), dtype=np.float64).reshape(-1, V)
        return mx.array(np.array(scripted(len(run.calls), z), dtype=np.uint32).reshape(logits.shape[:-1]))

    patch.setattr(redrafter_device, "nucleus_draws", draws)
    patch.setattr(acceptance, "mx", _MX(categorical=categorical))
    first, rows, total, runs = np.zeros(V), {}, 0.0, 0

    def explore(script):
        nonlocal total, runs
        run.script, run.calls = script, []
        plan = loop.plan()
        tree = loop.pack(plan)
        run.tokens, run.paths, parents = structure(tree)
        children = [[i for i, p in enumerate(parents) if p == n] for n in range(len(run.paths))]
        logits = np.stack([target_logits(path, flat) for path in run.paths]).astype(np.float32)
        out = SimpleNamespace(logits=mx.array(logits[None]), hidden=mx.zeros((1, len(run.paths), 1)))
        result, _ = loop.accept(tree, tree.device_beams.shape[-1], out)  # as DeviceLoop.step does ...
        if loop.unsettled(tree, np.array(loop.drawn[2])):  # ... after its one read
            result, _ = loop.settle(tree, out)
        beam, n, token = (int(np.array(x).reshape(-1)[0]) for x in result)
        probs = [[softmax(z[m]) for m in range(len(run.paths))] for z in run.calls]
        node = parents.index(-1)  # the final path: each node decided by its final draw
        while True:
            key = (1 if len(run.calls) > 1 and not run.held[node] else 0, node)
            o = script.get(key)
            if o is None:
                for o in children[node] + [OTHER]:
                    explore({**script, key: o})
                return
            if o == OTHER:
                break
            node = o
        weight = 1.0
        for (k, m), o in script.items():
            rest = np.delete(probs[k][m], [run.tokens[c] for c in children[m]])
            weight *= rest.sum() if o == OTHER else probs[k][m][run.tokens[o]]

        def law(t):
            if t < V:
                return np.eye(V)[t]
            k, m = divmod(t - V, len(run.paths))
            p = probs[k][m].copy()
            p[[run.tokens[c] for c in children[m]]] = 0.0
            return p / p.sum()

        emitted = [int(t) for t in tree.beams[0, beam, 1: n + 1]] + [token]
        total, runs = total + weight, runs + 1
        run.made.add(len(run.calls))
        first[...] += weight * law(emitted[0])
        if len(emitted) > 1:
            rows.setdefault(emitted[0], np.zeros(V))[...] += weight * law(emitted[1])

    explore({})
    return first, rows, (runs, run.made), total


def device_error(loop, flat, patch):
    first, rows, runs, total = enumerate_device_step(loop, flat, patch)
    assert abs(total - 1.0) < 1e-9, total
    want = target((OWN,), flat)
    worst = np.abs(first - want).max()
    for a, row in rows.items():
        worst = max(worst, np.abs(row - want[a] * target((OWN, a), flat)).max())
    return worst, runs, set(rows)


@pytest.mark.parametrize("flat,draws", [(False, {1}), (True, {2})], ids=["every-node-held", "flat-node-settled"])
def test_the_device_step_emits_its_first_two_tokens_as_the_target_samples_them(device_loop, flat, draws, monkeypatch):
    """Every node held: one draw each; the flat node unheld: the step settles (a second draw)."""
    worst, (runs, made), followed = device_error(device_loop, flat, monkeypatch)
    assert made == draws, made
    assert {42, 1090, 311} <= followed  # the chain's first draft and its runners-up followed
    assert worst < 1e-9, (worst, runs)


def _never_settle(patch):
    patch.setattr(DeviceLoop, "unsettled", staticmethod(lambda tree, held: False))


def _redraw_after_a_rejection(patch):
    real = DeviceLoop.node_draws

    def again(self, logits):  # the root drawn again when it did not take the first draft: looks at the draw
        own, held = real(self, logits)
        if int(np.array(own)[0, 0]) != int(self.beams[0, 0, 1]):
            own, held = real(self, logits)
        return own, held

    patch.setattr(DeviceLoop, "node_draws", again)


@pytest.mark.parametrize("flat,bias", [(True, _never_settle), (False, _redraw_after_a_rejection)],
                         ids=["unheld-draw-kept", "redraw-after-a-rejection"])
def test_the_device_enumeration_sees_a_biased_step(device_loop, flat, bias, monkeypatch):
    bias(monkeypatch)
    worst, runs, _ = device_error(device_loop, flat, monkeypatch)
    assert worst > 1e-6, (worst, runs)
