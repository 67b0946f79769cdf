"""Continuous batching for plain decoding (decoding/continuous.py): requests that join a running
batch at any step, of any length, leave it when they end, and each greedy row writes exactly the
tokens it writes alone; rows keep their own max_tokens, stop strings and sampling settings."""

from __future__ import annotations

import mlx.core as mx

from conftest import make_tiny_lm
from mlx_specdec.decoding import GenerationParams, stream_events
from mlx_specdec.decoding.autoregressive import autoregressive
from mlx_specdec.decoding.continuous import ContinuousDecoder

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [20], [30, 31], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def alone(lm, prompt, params):
    events = list(stream_events(lm, prompt, autoregressive, params, "ar"))
    return [t for e in events if e.kind == "token" for t in e.tokens], "".join(e.text for e in events if e.kind == "token")


def run(decoder, joins, params_of):
    """joins: {step: [prompt index]}; returns {prompt index: (tokens, text, stats)}."""
    ident_of, out, step = {}, {}, 0
    while step == 0 or decoder.live or any(s >= step for s in joins):
        for i in joins.get(step, []):
            ident_of[decoder.join(PROMPTS[i], params_of(i))] = i
        for event in decoder.step():
            i = ident_of[event.thread_id]
            tokens, text, _ = out.get(i, ([], "", None))
            if event.kind == "token":
                out[i] = (tokens + event.tokens, text + event.text, None)
            else:
                out[i] = (tokens, text, event.stats)
        step += 1
        assert step < 500
    return out


def test_rows_that_join_at_any_step_write_what_they_write_alone():
    lm = make_tiny_lm(seed=3, eos_id=96)
    limits = [12, 30, 7, 20, 16]
    params_of = lambda i: GenerationParams(max_tokens=limits[i])  # noqa: E731
    out = run(ContinuousDecoder(lm), {0: [0, 1], 3: [2], 4: [3], 15: [4]}, params_of)
    for i in range(len(PROMPTS)):
        tokens, text = alone(lm, PROMPTS[i], params_of(i))
        assert out[i][0] == tokens and out[i][1] == text, i
        assert out[i][2].generated_tokens == len(tokens) and out[i][2].finish_reason in ("length", "stop")


def test_a_row_s_stop_string_and_cancel_end_that_row_only():
    lm = make_tiny_lm(seed=3, eos_id=96)
    want_tokens, want_text = alone(lm, PROMPTS[1], GenerationParams(max_tokens=20))
    stop = want_text[len(want_text) // 2: len(want_text) // 2 + 4]
    decoder = ContinuousDecoder(lm)
    a = decoder.join(PROMPTS[1], GenerationParams(max_tokens=20, stop=(stop,)))
    b = decoder.join(PROMPTS[0], GenerationParams(max_tokens=20))
    c = decoder.join(PROMPTS[3], GenerationParams(max_tokens=20))
    texts, done = {a: "", b: "", c: ""}, {}
    for step in range(40):
        if step == 3:
            events = decoder.cancel(c)
            assert events[-1].kind == "done" and events[-1].stats.finish_reason == "cancelled"
            done[c] = events[-1].stats
        for event in decoder.step():
            if event.kind == "token":
                texts[event.thread_id] += event.text
            else:
                done[event.thread_id] = event.stats
        if not decoder.live:
            break
    assert texts[a] == want_text[: want_text.find(stop)] and done[a].finish_reason == "stop"
    assert texts[b] == alone(lm, PROMPTS[0], GenerationParams(max_tokens=20))[1]
    assert decoder.cache is None and decoder.live == 0  # everyone left: nothing kept


def test_the_cache_sheds_slots_no_row_uses():
    lm = make_tiny_lm(seed=3, eos_id=96, context=512)
    decoder = ContinuousDecoder(lm)
    first = decoder.join(PROMPTS[4], GenerationParams(max_tokens=120))
    for _ in range(100):
        decoder.step()
    decoder.join(PROMPTS[0], GenerationParams(max_tokens=3))
    width_with_both = decoder.valid.shape[1]
    decoder.cancel(first)  # the long row leaves: the slots only it used are cut off at once
    assert decoder.live == 1 and decoder.valid.shape[1] < width_with_both
    assert decoder.valid.any(axis=0)[0]  # no leading slot left that no row uses


def test_rows_with_different_temperatures_share_a_batch_and_sample_as_alone():
    """A sampled row beside a greedy one draws from the same random stream as it does alone (the
    greedy row draws nothing), so with the same seed it writes the same tokens: its distribution
    is the target's, exactly as plain decoding's. The greedy row is unchanged."""
    lm = make_tiny_lm(seed=3, eos_id=96)
    greedy_tokens, _ = alone(lm, PROMPTS[0], GenerationParams(max_tokens=6))
    for temperature, top_p, seed in [(0.8, 1.0, 7), (1.0, 0.9, 8), (0.7, 0.5, 9)]:
        sampled = GenerationParams(max_tokens=10, temperature=temperature, top_p=top_p, seed=seed)
        want, _ = alone(lm, PROMPTS[1], sampled)
        mx.random.seed(seed)
        decoder = ContinuousDecoder(lm)
        g = decoder.join(PROMPTS[0], GenerationParams(max_tokens=6))
        s = decoder.join(PROMPTS[1], sampled)
        got = {g: [], s: []}
        while decoder.live:
            for event in decoder.step():
                if event.kind == "token":
                    got[event.thread_id] += event.tokens
        assert got[g] == greedy_tokens and got[s] == want, (temperature, top_p)
        assert len(set(want)) > 3  # really sampled, not a fixed point
