"""Repetition penalties (penalties.py): the math is mlx-lm's processors' (repetition) and OpenAI's
(frequency, presence, over the answer so far); `ar` with penalties writes what a naive loop (a
full forward per token, penalize, argmax) writes; every lossless method writes `ar`'s answer with
the same penalties, token for token; a verified tree's every node is penalized by its own path;
a method that cannot apply a penalty refuses it in one line. TriForce's: test_triforce_penalties.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import make_tiny_lm
from mlx_specdec.decoding import GenerationParams, stream_events
from mlx_specdec.decoding.autoregressive import autoregressive
from mlx_specdec.decoding.continuous import ContinuousDecoder
from mlx_specdec.drafting.tree import dedup_prefix, pack_beams
from mlx_specdec.engine import Engine
from mlx_specdec.penalties import History, Penalties, TreePenalties, Unsupported, penalize, window_of

PENALTIES = [dict(frequency_penalty=0.7), dict(presence_penalty=1.5), dict(repetition_penalty=1.8),
             dict(repetition_penalty=1.3, repetition_context_size=3, frequency_penalty=0.4, presence_penalty=-0.5)]
PROMPTS = [[5, 17, 42, 3], [60, 61, 9, 9, 9, 33, 71], [88, 12]]


def tokens_of(events):
    return [t for e in events if e.kind == "token" for t in e.tokens]


def mlx_lm_reference(logits, prompt, answer, pen: Penalties):
    """mlx-lm's own processors: the repetition penalty over prompt + answer (as `generate_step`
    hands them), presence and frequency over the answer alone (OpenAI's count)."""
    from mlx_lm.sample_utils import make_logits_processors

    out = logits
    if pen.repetition != 1.0:
        for proc in make_logits_processors(repetition_penalty=pen.repetition, repetition_context_size=pen.window):
            out = proc(mx.array(prompt + answer), out)
    if answer:
        for proc in make_logits_processors(presence_penalty=pen.presence or None, presence_context_size=len(answer),
                                           frequency_penalty=pen.frequency or None,
                                           frequency_context_size=len(answer)):
            out = proc(mx.array(answer), out)
    return out


@pytest.mark.parametrize("fields", PENALTIES)
def test_the_penalty_math_is_mlx_lm_s_on_random_logits(fields):
    pen = Penalties.of(GenerationParams(**fields))
    rng = np.random.default_rng(0)
    for trial in range(20):
        V = 64
        prompt = [int(t) for t in rng.integers(0, V, int(rng.integers(1, 10)))]
        answer = [int(t) for t in rng.integers(0, V // 2, int(rng.integers(0, 30)))]
        logits = mx.array((3 * rng.normal(size=(1, V))).astype(np.float32))
        history = History(pen, prompt)
        history(logits)
        for t in answer:
            history.add(mx.array([t]))
        got = np.array(history(logits))
        want = np.array(mlx_lm_reference(logits, prompt, answer, pen))
        assert np.allclose(got, want, atol=1e-5), (trial, np.abs(got - want).max())


def test_every_penalty_off_is_no_penalty_at_all():
    assert Penalties.of(GenerationParams(temperature=0.7, repetition_context_size=5)) is None


def naive(lm, prompt, n, pen: Penalties):
    """A full forward over the whole text per token, the penalties from scratch, the argmax."""
    text = list(prompt)
    for _ in range(n):
        logits = lm.model(mx.array(text)[None])[:, -1, :]
        answer = text[len(prompt):]
        counts = mx.zeros(logits.shape).at[0, mx.array(answer)].add(1.0) if answer else mx.zeros(logits.shape)
        recent = mx.array(window_of(text, pen.window))[None]
        token = int(mx.argmax(penalize(logits, pen, counts, recent), axis=-1).item())
        if token in lm.eos_token_ids:
            break
        text.append(token)
    return text[len(prompt):]


@pytest.mark.parametrize("fields", PENALTIES)
def test_ar_greedy_with_penalties_equals_a_naive_loop(fields):
    lm = make_tiny_lm(seed=1, eos_id=0)  # no EOS in reach: the answers repeat tokens, the penalties bite
    pen = Penalties.of(GenerationParams(**fields))
    changed = False
    for prompt in PROMPTS:
        params = GenerationParams(max_tokens=24, temperature=0.0, **fields)
        got = tokens_of(stream_events(lm, prompt, autoregressive, params, "ar"))
        assert got == naive(lm, prompt, 24, pen)
        changed |= got != tokens_of(stream_events(lm, prompt, autoregressive, GenerationParams(max_tokens=24), "ar"))
    assert changed  # the penalties changed some answer


def engines(seed=3):
    from test_redrafter import engine_with, oracle_head, random_head

    lm = make_tiny_lm(seed=seed, eos_id=0)
    return lm, {"oracle": engine_with(lm, oracle_head(lm, PROMPTS)), "random": engine_with(lm, random_head(lm))}


#: redrafter's beam shapes with every draft verified, then the shipped defaults (the head's runners-up
#: beside its chain, the verify cost's cut), without and with prompt lookup
OPTIONS = [{"beam_width": 1, "beam_length": 5, "draft_cutoff": 0.0, "lookup": 0},
           {"beam_width": 3, "beam_length": 4, "draft_cutoff": 0.0, "lookup": 0}, {"lookup": 0}, {}]


@pytest.mark.parametrize("fields", PENALTIES)
def test_redrafter_greedy_with_penalties_equals_ar_token_for_token(fields):
    lm, heads = engines()
    changed, runners = False, 0
    for name, engine in heads.items():
        accepted = 0
        for options in OPTIONS:
            for prompt in PROMPTS:
                want = tokens_of(engine.generate_ids(prompt, "ar", GenerationParams(max_tokens=30, **fields)))
                changed |= want != tokens_of(engine.generate_ids(prompt, "ar", GenerationParams(max_tokens=30)))
                events = list(engine.generate_ids(prompt, "redrafter",
                                                  GenerationParams(max_tokens=30, options=options, **fields)))
                assert tokens_of(events) == want, (name, options, prompt)
                accepted += events[-1].stats.accepted
                runners += events[-1].stats.extra["runners_up_verified"]
        assert name == "random" or accepted > 0  # drafts were accepted: the paths were penalized
    assert changed and runners > 0  # ... and runner-up beams were verified beside the chains
    # batched: rows of one batch, each penalized by its own text
    engine = heads["oracle"]
    params = GenerationParams(max_tokens=20, options={"beam_width": 2, "beam_length": 4, "draft_cutoff": 0.0,
                                                      "lookup": 0}, **fields)
    events = list(engine.generate_ids_batch(PROMPTS, "redrafter", params))
    for row, prompt in enumerate(PROMPTS):
        got = [t for e in events if e.kind == "token" and e.thread_id == row for t in e.tokens]
        assert got == tokens_of(engine.generate_ids(prompt, "ar", GenerationParams(max_tokens=20, **fields)))


def test_redrafter_with_prompt_lookup_and_penalties_equals_ar():
    lm, heads = engines()
    fields = dict(repetition_penalty=1.5, frequency_penalty=0.5)
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]
    for engine in heads.values():
        want = tokens_of(engine.generate_ids(prompt, "ar", GenerationParams(max_tokens=30, **fields)))
        assert tokens_of(engine.generate_ids(prompt, "redrafter", GenerationParams(max_tokens=30, **fields))) == want


def test_continuous_batching_and_mlx_lm_s_repetition_penalty_write_ar_s_answer():
    """mlx-lm's repetition penalty is ours; its presence and frequency are not (the next test)."""
    lm = make_tiny_lm(seed=1, eos_id=0)
    engine = Engine(lm, drafter=None)
    rows = [dict(repetition_penalty=1.6), dict(frequency_penalty=0.8), {}]
    want = [tokens_of(engine.generate_ids(p, "ar", GenerationParams(max_tokens=16, **f)))
            for p, f in zip(PROMPTS, rows)]
    for prompt, fields, answer in zip(PROMPTS, rows, want):
        if "frequency_penalty" not in fields:
            assert tokens_of(engine.generate_ids(prompt, "mlx-lm", GenerationParams(max_tokens=16, **fields))) == answer
    decoder = ContinuousDecoder(lm)  # rows with different penalties in one batch
    idents = {decoder.join(p, GenerationParams(max_tokens=16, **f)): i for i, (p, f) in enumerate(zip(PROMPTS, rows))}
    got = {i: [] for i in idents.values()}
    while decoder.live:
        for event in decoder.step():
            if event.kind == "token":
                got[idents[event.thread_id]] += event.tokens
    assert [got[i] for i in range(len(PROMPTS))] == want


@pytest.mark.parametrize("fields", [dict(repetition_penalty=1.6), PENALTIES[-1]])
def test_the_mlx_lm_method_writes_mlx_lm_s_own_answer_with_its_own_penalties(fields):
    """`mlx-lm` runs mlx-lm's processors: its presence and frequency count the last 20 tokens of
    prompt + answer (ours, OpenAI's, count the answer)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    lm = make_tiny_lm(seed=1, eos_id=0)
    engine = Engine(lm, drafter=None)
    same_as_ar = []
    for prompt in PROMPTS:
        got = tokens_of(engine.generate_ids(prompt, "mlx-lm", GenerationParams(max_tokens=16, **fields)))
        steps = generate_step(mx.array(prompt), lm.model, max_tokens=16, logits_processors=make_logits_processors(**fields))
        assert got == [int(t) for t, _ in steps], prompt
        same_as_ar.append(got == tokens_of(engine.generate_ids(prompt, "ar", GenerationParams(max_tokens=16, **fields))))
    assert all(same_as_ar) == ("frequency_penalty" not in fields)  # a prompt's tokens counted: another answer


def test_the_mlx_lm_method_refuses_a_penalty_its_mlx_lm_lacks(monkeypatch):
    from mlx_lm import sample_utils

    monkeypatch.setattr(sample_utils, "make_logits_processors",
                        lambda logit_bias=None, repetition_penalty=None, repetition_context_size=20: [])
    engine = Engine(make_tiny_lm(), drafter=None)
    with pytest.raises(Unsupported, match=r"^presence_penalty: not supported by mlx-lm [0-9.]+$"):
        engine.generate_ids(PROMPTS[0], "mlx-lm", GenerationParams(presence_penalty=0.5))
    engine.generate_ids(PROMPTS[0], "mlx-lm", GenerationParams(repetition_penalty=1.2))  # one it has


def test_a_packed_tree_s_every_node_is_penalized_by_its_own_path():
    """Two branches after the own token: [own, 1, 2], [own, 1, 3], [own, 2, 1]. A node's logits
    are penalized by prompt + answer + its own path, whatever the other branches hold."""
    V, own = 8, 5
    prompt, answer = [4, 6, 1], [7, own]  # the answer so far, its own token last
    beams = np.array([[[own, 1, 2], [own, 1, 3], [own, 2, 1]]], dtype=np.int32)
    packed = [pack_beams(beams[0], dedup_prefix(beams, xp=np)[0])]
    N = len(packed[0].tokens)
    assert N == 6  # own, 1, 2 | 3 | 2, 1: the prefix [own, 1] shared
    logits = mx.array(np.random.default_rng(0).normal(size=(1, N, V)).astype(np.float32) * 3)
    pen = Penalties(frequency=0.6, presence=0.3, repetition=1.7, window=4)
    rows = TreePenalties(pen, [prompt], V)
    rows.commit([answer])
    got = np.array(rows.nodes(logits, beams, packed))[0]
    for w in range(3):
        for j in range(3):
            node = packed[0].index[w, j]
            path = [int(t) for t in beams[0, w, 1: j + 1]]
            history = History(pen, prompt)
            history(logits[:, node])
            for t in answer + path:
                history.add(mx.array([t]))
            assert np.allclose(got[node], np.array(history(logits[:, node]))[0], atol=1e-6), (w, j)


def test_runner_up_beams_penalize_their_nodes_by_their_own_paths():
    """A chain [own, 1, 2, 3] with runners-up at depths 1 and 2, one not verified: a runner-up
    beam's padding and an unverified runner's beam point at shallower nodes, whose paths are
    still their own."""
    from mlx_specdec.drafting.tree import with_runners_up

    V, own = 8, 5
    prompt, answer = [4, 6, 1], [7, own]
    chain = np.array([[[own, 1, 2, 3]]], dtype=np.int32)
    tree = pack_beams(chain[0], dedup_prefix(chain, xp=np)[0])
    beams, packed = with_runners_up(chain, [tree], np.array([[6, 4, 2]]), np.array([[True, True, False]]),
                                    depths=np.array([1, 2, 3]))
    N = len(packed[0].tokens)
    logits = mx.array(np.random.default_rng(1).normal(size=(1, N, V)).astype(np.float32) * 3)
    pen = Penalties(frequency=0.6, presence=0.3, repetition=1.7, window=4)
    rows = TreePenalties(pen, [prompt], V)
    rows.commit([answer])
    got = np.array(rows.nodes(logits, beams, packed))[0]
    for node in range(N):
        path, at = [], node
        while packed[0].parents[at] >= 0:  # the node's drafts, by its parents
            path.insert(0, int(packed[0].tokens[at]))
            at = packed[0].parents[at]
        history = History(pen, prompt)
        history(logits[:, node])
        for t in answer + path:
            history.add(mx.array([t]))
        assert np.allclose(got[node], np.array(history(logits[:, node]))[0], atol=1e-6), node


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_redrafter_samples_with_penalties(sampled_drafts):
    """Sampling with penalties runs both accept rules (the own token per node, rejection sampling
    over sampled chains) and a seed repeats the answer."""
    lm, heads = engines()
    params = GenerationParams(max_tokens=20, temperature=0.8, seed=3, repetition_penalty=1.4, presence_penalty=0.5,
                              options={"beam_width": 2, "beam_length": 4, "draft_cutoff": 0.0, "lookup": 0,
                                       "sampled_drafts": sampled_drafts})
    first = tokens_of(heads["oracle"].generate_ids(PROMPTS[0], "redrafter", params))
    assert len(first) > 3 and first == tokens_of(heads["oracle"].generate_ids(PROMPTS[0], "redrafter", params))
    greedy = tokens_of(heads["oracle"].generate_ids(PROMPTS[0], "redrafter", GenerationParams(max_tokens=20)))
    assert first != greedy


@pytest.mark.parametrize("method", ["apar"])
def test_a_method_that_cannot_apply_a_penalty_refuses_it(method):
    engine = Engine(make_tiny_lm(), drafter=None)
    with pytest.raises(Unsupported, match=f"^frequency_penalty: not supported by {method}$"):
        engine.generate_ids(PROMPTS[0], method, GenerationParams(frequency_penalty=0.5))


def test_refusals_are_one_line_on_the_cli_and_a_400_on_the_server(tmp_path):
    import subprocess
    import sys

    from conftest import save_tiny_model_dir
    from mlx_specdec.serve.requests import ApiError, parse

    model = save_tiny_model_dir(tmp_path / "tiny")
    for extra in (["--method", "apar"],):
        result = subprocess.run([sys.executable, "-m", "mlx_specdec.cli", "generate", "-m", str(model), "-p", "w5",
                                 "--repetition-penalty", "1.2", *extra], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        method = extra[1]
        assert result.stderr.strip() == f"error: repetition_penalty: not supported by {method}"

    class LM:
        context_length = 4096

        def encode_chat(self, messages, thinking=None):
            return [1, 2, 3]

    body = {"messages": [{"role": "user", "content": "hi"}], "method": "apar", "presence_penalty": 0.4}
    with pytest.raises(ApiError) as error:
        parse(body, LM(), "m", ["ar", "apar"], "ar", chat=True)
    assert error.value.status == 400 and error.value.param == "presence_penalty"
    assert error.value.message == "presence_penalty: not supported by apar"
    # a default penalty (the model's) is left out where the method cannot apply it, not refused
    request = parse({**body, "presence_penalty": None}, LM(), "m", ["ar", "apar"], "ar", chat=True,
                    defaults={"temperature": 0.5, "repetition_penalty": 1.2})
    assert request.params.temperature == 0.5 and request.params.repetition_penalty == 1.0


@pytest.mark.slow
def test_redrafter_greedy_with_penalties_equals_ar_on_the_default_model():
    engine = Engine.load("default")
    fields = dict(temperature=0.0, repetition_penalty=1.15, frequency_penalty=0.3, presence_penalty=0.2)
    for question in ("Give three tips for staying focused while studying.", "What is a prime number? Give a list."):
        prompt = engine.lm.encode_prompt(question)
        want = tokens_of(engine.generate_ids(prompt, "ar", GenerationParams(max_tokens=64, **fields)))
        events = list(engine.generate_ids(prompt, "redrafter", GenerationParams(max_tokens=64, **fields)))
        assert tokens_of(events) == want
        assert events[-1].stats.accepted > 0
