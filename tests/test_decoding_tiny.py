"""Plain decoding on a tiny random Llama: exact greedy parity, stopping rules, the event stream."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine, UnknownMethod
from mlx_specdec.errors import ContextOverflow

from conftest import make_tiny_lm

PROMPTS = [[5, 17, 42, 3], [60, 61, 9, 9, 9, 33, 71], [88]]


def run(engine, prompt, method="ar", **params):
    events = list(engine.generate_ids(prompt, method, GenerationParams(**params)))
    tokens = [t for e in events if e.kind == "token" for t in e.tokens]
    text = "".join(e.text for e in events if e.kind == "token")
    done = events[-1]
    assert done.kind == "done" and done.stats is not None
    return tokens, text, done.stats


def naive_greedy(model, prompt, n):
    """Reference: recompute the whole sequence every step, no cache, argmax."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(mx.argmax(model(mx.array(seq)[None])[0, -1]).item()))
    return seq[len(prompt):]


def mlx_lm_greedy(model, prompt, n):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, -1))
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_mlx_lm_and_naive_loop(seed, prompt):
    lm = make_tiny_lm(seed=seed, eos_id=96 if seed else 2)
    n = 24
    want = mlx_lm_greedy(lm.model, prompt, n)
    assert want == naive_greedy(lm.model, prompt, n)
    want = want[: want.index(min(lm.eos_token_ids))] if min(lm.eos_token_ids) in want else want
    engine = Engine(lm)
    for method in ("ar", "mlx-lm"):
        tokens, _, stats = run(engine, prompt, method, max_tokens=n)
        assert tokens == want, method
        assert stats.generated_tokens == len(tokens)


def test_ar_counts_one_forward_per_token(tiny_lm):
    tokens, _, stats = run(Engine(tiny_lm), PROMPTS[0], max_tokens=16)
    assert stats.forward_passes == stats.generated_tokens == len(tokens)
    assert stats.tokens_per_forward == 1.0
    assert stats.prompt_tokens == len(PROMPTS[0])


def test_max_tokens_stops_exactly(tiny_lm):
    for n in (1, 2, 7):
        tokens, _, stats = run(Engine(tiny_lm), PROMPTS[1], max_tokens=n)
        assert len(tokens) == n and stats.finish_reason == "length"


def test_eos_stops_before_the_eos_token():
    free = make_tiny_lm(eos_id=96)
    tokens, _, _ = run(Engine(free), PROMPTS[0], max_tokens=20)
    eos = tokens[5]
    assert eos not in tokens[:5]
    stopped = make_tiny_lm(eos_id=eos)
    got, _, stats = run(Engine(stopped), PROMPTS[0], max_tokens=20)
    assert got == tokens[:5]
    assert stats.finish_reason == "stop"


def test_text_deltas_concatenate_to_the_decoded_tokens(tiny_lm):
    tokens, text, _ = run(Engine(tiny_lm), PROMPTS[2], max_tokens=12)
    assert text == tiny_lm.tokenizer.decode(tokens)


def test_stop_string_cuts_text_and_stops(tiny_lm):
    engine = Engine(tiny_lm)
    tokens, text, _ = run(engine, PROMPTS[0], max_tokens=20)
    words = text.split(" ")
    stop = " " + words[4]
    expected = text[: text.find(stop)]
    got_tokens, got_text, stats = run(engine, PROMPTS[0], max_tokens=20, stop=[stop])
    assert got_text == expected
    assert stats.finish_reason == "stop"
    assert len(got_tokens) < len(tokens)


def test_seeded_sampling_is_reproducible(tiny_lm):
    engine = Engine(tiny_lm)
    a, _, _ = run(engine, PROMPTS[0], max_tokens=20, temperature=1.5, seed=3)
    b, _, _ = run(engine, PROMPTS[0], max_tokens=20, temperature=1.5, seed=3)
    c, _, _ = run(engine, PROMPTS[0], max_tokens=20, temperature=1.5, seed=4)
    greedy, _, _ = run(engine, PROMPTS[0], max_tokens=20)
    assert a == b
    assert a != c and a != greedy  # at temperature 1.5 over 97 tokens, a collision is vanishingly rare


def test_prompt_past_context_window_is_refused():
    lm = make_tiny_lm(context=16)
    with pytest.raises(ContextOverflow, match="prompt has 16 tokens but the context window"):
        list(Engine(lm).generate_ids(list(range(3, 19)), "ar"))


def test_max_tokens_is_clamped_to_the_context_window():
    lm = make_tiny_lm(context=16, eos_id=96)
    tokens, _, stats = run(Engine(lm), list(range(3, 13)), max_tokens=100)
    assert len(tokens) <= 6 and stats.finish_reason == "length"


def test_unknown_method_is_a_user_error(tiny_lm):
    with pytest.raises(UnknownMethod, match="unknown method 'nope'"):
        Engine(tiny_lm).generate_ids([5], "nope")


def test_closing_the_stream_early_is_clean(tiny_lm):
    engine = Engine(tiny_lm)
    stream = engine.generate_ids(PROMPTS[0], "ar", GenerationParams(max_tokens=50))
    first = next(e for e in stream if e.kind == "token")
    stream.close()
    assert first.tokens
    # the engine is reusable afterwards and still exact
    tokens, _, _ = run(engine, PROMPTS[0], max_tokens=8)
    assert tokens == mlx_lm_greedy(tiny_lm.model, PROMPTS[0], 8)[: len(tokens)]
