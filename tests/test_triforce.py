"""TriForce, greedy: on tiny random models its output is `ar`'s token for token, whatever the
budget, the bottom level and γ; its per-level statistics; and what it refuses."""

import mlx.core as mx
import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine
from mlx_specdec.errors import UserError
from mlx_specdec.model import attention

from conftest import make_tiny_lm

# A long prompt that repeats itself (so prompt lookup finds continuations) with varied stretches.
PROMPT = [(i * 7) % 50 + 3 for i in range(60)] + [(i * 13) % 40 + 5 for i in range(50)] + \
         [(i * 7) % 50 + 3 for i in range(30)]


def run(engine, method, **options):
    params = GenerationParams(max_tokens=40, options=options)
    events = list(engine.generate_ids(PROMPT, method, params))
    return [t for e in events if e.kind == "token" for t in e.tokens], events[-1].stats


@pytest.mark.parametrize("bottom", ["ngram", "none"])
@pytest.mark.parametrize("budget,gamma", [(16, 1), (21, 4), (64, 6), (1024, 3)])
def test_greedy_triforce_equals_plain_decoding(bottom, budget, gamma):
    engine = Engine(make_tiny_lm(seed=3, eos_id=96))
    want, _ = run(engine, "ar")
    got, stats = run(engine, "triforce", bottom=bottom, budget=budget, gamma=gamma)
    assert got == want and len(got) == 40
    extra = stats.extra
    assert extra["bottom"] == bottom and extra["gamma"] == gamma
    kept = extra["budget"]  # whole chunks of 8 plus the prompt's unfinished last chunk
    assert kept == len(PROMPT) if budget >= len(PROMPT) else budget - 8 < kept <= budget
    assert 0.0 <= extra["middle_acceptance"] <= 1.0 and extra["tokens_per_full_forward"] >= 1.0
    assert stats.forward_passes < len(got) or extra["middle_acceptance"] == 0.0


def test_a_retrieval_cache_of_the_whole_prompt_is_accepted_whole():
    """With every prompt key retrieved the middle level is the target itself: every draft is
    accepted, γ + 1 tokens per full-cache forward. The model's embeddings are at their init scale
    so that its argmax depends on the context (the shared tiny models' x8 embeddings make it
    follow the last token alone): a middle cache that lost earlier committed tokens disagrees."""
    lm = make_tiny_lm(seed=3, eos_id=96)
    lm.model.model.embed_tokens.weight = lm.model.model.embed_tokens.weight / 8
    engine = Engine(lm)
    got, stats = run(engine, "triforce", bottom="none", budget=4096, gamma=4)
    assert stats.extra["middle_acceptance"] == 1.0
    assert stats.extra["tokens_per_full_forward"] == 5.0


def test_greedy_triforce_equals_plain_decoding_with_the_grouped_attention(monkeypatch):
    monkeypatch.setattr(attention, "GROUPED_MIN_KEYS", 1)  # every forward takes the CPU path
    engine = Engine(make_tiny_lm(seed=2, eos_id=96))
    want, _ = run(engine, "ar")
    got, stats = run(engine, "triforce", bottom="ngram", budget=24, gamma=5)
    assert got == want
    assert stats.extra["bottom_acceptance"] > 0  # the lookup drafted something the middle took


def test_triforce_refuses_sampling_and_bad_settings_in_one_line():
    engine = Engine(make_tiny_lm())
    with pytest.raises(UserError, match="greedily"):
        list(engine.generate_ids(PROMPT, "triforce", GenerationParams(max_tokens=4, temperature=0.7)))
    with pytest.raises(UserError, match="--bottom"):
        list(engine.generate_ids(PROMPT, "triforce", GenerationParams(max_tokens=4, options={"bottom": "model"})))
    with pytest.raises(UserError, match="budget"):
        list(engine.generate_ids(PROMPT, "triforce", GenerationParams(max_tokens=4, options={"budget": 4})))


def test_both_caches_hold_the_same_text_after_every_round(monkeypatch):
    """After each full-cache verify the retrieval cache holds its retrieved prompt keys followed
    by exactly the full cache's entries of every committed token (not only this round's)."""
    import importlib

    from mlx_specdec.cache import retrieval

    triforce_module = importlib.import_module("mlx_specdec.decoding.triforce")  # the package exports the function

    built = []
    original = retrieval.RetrievalKVCache.build.__func__

    def capture(cls, *args, **kwargs):
        built.append(original(cls, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(retrieval.RetrievalKVCache, "build", classmethod(capture))
    fulls = []
    new_cache = triforce_module.new_contiguous_cache
    monkeypatch.setattr(triforce_module, "new_contiguous_cache", lambda ctx: fulls.append(new_cache(ctx)) or fulls[-1])
    engine = Engine(make_tiny_lm(seed=3, eos_id=96))
    params = GenerationParams(max_tokens=40, options={"bottom": "ngram", "budget": 24, "gamma": 4})
    rounds = 0
    for event in engine.generate_ids(PROMPT, "triforce", params):
        if event.kind != "token" or not event.drafted:
            continue
        rounds += 1
        middle, full = built[0], fulls[0]
        assert middle.offset == full.offset
        for mid, top in zip(middle.layers, full.layers):
            own = mid.keys[..., mid.retrieved:mid.retrieved + mid.own, :]
            assert mx.array_equal(own, top.keys[..., len(PROMPT):full.offset, :]).item()
    assert rounds >= 3
