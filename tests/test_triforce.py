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
    monkeypatch.setattr(attention, "GROUPED_MIN_KEYS", 1)  # every forward takes the grouped path
    monkeypatch.setattr(attention, "EXACT_ATTENTION", False)
    engine = Engine(make_tiny_lm(seed=2, eos_id=96))
    want, _ = run(engine, "ar")
    got, stats = run(engine, "triforce", bottom="ngram", budget=24, gamma=5)
    assert got == want
    assert stats.extra["bottom_acceptance"] > 0  # the lookup drafted something the middle took


def test_triforce_refuses_bad_settings_in_one_line():
    engine = Engine(make_tiny_lm())
    with pytest.raises(UserError, match="--bottom"):
        list(engine.generate_ids(PROMPT, "triforce", GenerationParams(max_tokens=4, options={"bottom": "oracle"})))
    with pytest.raises(UserError, match="--draft-model"):
        list(engine.generate_ids(PROMPT, "triforce", GenerationParams(max_tokens=4, options={"bottom": "model"})))
    with pytest.raises(UserError, match="budget"):
        list(engine.generate_ids(PROMPT, "triforce", GenerationParams(max_tokens=4, options={"budget": 4})))
    with pytest.raises(UserError, match="--rebuild-below"):
        list(engine.generate_ids(PROMPT, "triforce", GenerationParams(max_tokens=4, options={"rebuild_below": 2.0})))
    with pytest.raises(UserError, match="tokenizer"):
        Engine(make_tiny_lm(), draft_model=make_tiny_lm(vocab_size=50))


def draft_engine(seed=3):
    """A target and a smaller draft model (1 layer, other weights) with the same tokenizer."""
    lm = make_tiny_lm(seed=seed, eos_id=96)
    return Engine(lm, drafter=None, draft_model=make_tiny_lm(seed=seed + 10, layers=1, eos_id=96))


@pytest.mark.parametrize("options", [
    dict(bottom="model", budget=24, gamma=5, draft_length=2),
    dict(bottom="model", budget=16, gamma=3, draft_length=4, draft_sink=4, draft_window=16),
    dict(bottom="redrafter", budget=24, gamma=4),
    dict(bottom="ngram", budget=24, gamma=4, rebuild_stride=5),
    dict(bottom="none", budget=24, gamma=3, rebuild_below=0.99),
    dict(bottom="ngram", budget=24, gamma=4, middle_cache="streaming"),
])
def test_every_bottom_rebuilds_and_the_streaming_middle_keep_plain_decoding(options):
    from test_redrafter import random_head

    engine = draft_engine()
    engine._resources["drafter"] = random_head(engine.lm)
    want, _ = run(engine, "ar")
    got, stats = run(engine, "triforce", **options)
    assert got == want
    extra = stats.extra
    if options["bottom"] != "none":
        assert extra["middle_forwards"] > 0 and 0.0 <= extra["bottom_acceptance"] <= 1.0
    if "rebuild_stride" in options:  # 40 tokens, a rebuild every >= 5 committed
        assert 3 <= extra["retrieval_rebuilds"] <= 8
    if "rebuild_below" in options:  # a random middle level falls below 0.99 at once
        assert extra["retrieval_rebuilds"] >= 1


def test_a_draft_model_that_is_the_target_is_accepted_by_the_middle_level():
    """With the target itself as the bottom (a window holding the whole text) and every prompt key
    retrieved, every bottom draft is the middle level's own choice."""
    lm = make_tiny_lm(seed=3, eos_id=96)
    lm.model.model.embed_tokens.weight = lm.model.model.embed_tokens.weight / 8
    engine = Engine(lm, drafter=None, draft_model=lm)
    got, stats = run(engine, "triforce", bottom="model", budget=4096, gamma=4, draft_length=3, draft_window=512)
    assert got == run(engine, "ar")[0]
    assert stats.extra["bottom_acceptance"] == 1.0 and stats.extra["middle_acceptance"] == 1.0


@pytest.mark.parametrize("bottom", ["ngram", "model"])
def test_sampled_triforce_draws_the_targets_distribution(bottom):
    """End to end at T = 1 with a middle level that differs from the target (16 of 140 prompt keys):
    the second token -- written by the middle level (an accepted bottom draft, the residual after
    a rejection, or its own sample) and accepted or corrected by the full-cache level -- follows
    plain sampling's marginal P(t2) = sum_t1 p(t1) p(t2 | t1) (chi-square, about p = 0.001).
    With the reference code's rule (on a middle rejection, sample p^ instead of the residual)
    the handed-up distribution is not p^ and the output drifts toward the bottom's drafts."""


    engine = draft_engine()
    ok, (chi2, df) = chi_square_below_critical(*sampled_second_tokens(engine, bottom=bottom))
    assert ok and df >= 5, (chi2, df)


def sampled_second_tokens(engine, presence: float = 0.0, bottom: str = "ngram"):
    """The target made flatter (more cells), 700 seeded triforce answers of two tokens at T = 1 with
    the middle level over 16 prompt keys -> (their second tokens, EOS for one that ended there;
    the exact marginal sum_t1 p(t1) p(t2 | t1), t1 not EOS, t1's logit lowered by `presence`
    after it was written)."""
    import numpy as np

    from test_acceptance import nucleus_reference

    lm = engine.lm
    lm.model.model.embed_tokens.weight = lm.model.model.embed_tokens.weight / 4  # a flatter p: more cells
    seconds = []
    for seed in range(700):
        params = GenerationParams(max_tokens=2, temperature=1.0, seed=seed, presence_penalty=presence,
                                  options=dict(bottom=bottom, budget=16, gamma=3, draft_length=2))
        tokens = [t for e in engine.generate_ids(PROMPT, "triforce", params) if e.kind == "token" for t in e.tokens]
        if tokens:
            seconds.append(tokens[1] if len(tokens) > 1 else 96)
    model = lm.model
    p_first = nucleus_reference(np.array(model(mx.array(PROMPT)[None])[0, -1]), 1.0, 1.0)
    p_first[96] = 0.0
    p_first /= p_first.sum()
    second_logits = np.array(model(mx.array([PROMPT + [t] for t in range(97)]))[:, -1])
    second_logits[np.arange(97), np.arange(97)] -= presence  # t1 was written: its presence
    p_second = np.stack([nucleus_reference(row, 1.0, 1.0) for row in second_logits])
    return seconds, (p_first[:, None] * p_second).sum(0)


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
    new_cache = triforce_module.prefilled_cache
    monkeypatch.setattr(triforce_module, "prefilled_cache",
                        lambda ctx, tokens: fulls.append(new_cache(ctx, tokens)) or fulls[-1])
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


def chi_square_below_critical(draws, probs):
    import numpy as np

    expected = np.asarray(probs, dtype=np.float64) * len(draws)
    observed = np.bincount(draws, minlength=len(expected)).astype(float)
    assert observed[expected == 0].sum() == 0, "drew a token of probability 0"
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if (~big).any() and expected[~big].sum() > 0:
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return df >= 3 and chi2 < df + 3.09 * np.sqrt(2 * df) + 3, (chi2, df)


@pytest.mark.parametrize("draft_kind", ["one-hot", "model"])
def test_a_level_writes_its_own_distribution_whatever_the_draft(draft_kind):
    """Line 13 of Algorithm 1 at one level: the token a level writes after x -- the draft d ~ q if
    accepted, else its correction -- is distributed as the level's own p^ (here the target over a
    16-key retrieval cache), so it can be handed up with p^ as its draft probability. A one-hot q
    on p^'s likeliest token is where the reference rule (resample p^ on a rejection) is furthest
    off: it writes that token with p^ + (1 - p^) p^ instead of p^."""
    import numpy as np

    from mlx_specdec.acceptance import target_probs
    from mlx_specdec.cache import ContiguousKVCache
    from mlx_specdec.decoding.base import GenerationParams as Params
    from mlx_specdec.drafting.middle import ChainVerifier
    from mlx_specdec.model.forward import forward

    temperature = 0.2  # p^'s likeliest token near 0.4 (the 16-key middle level is flat at T = 1)
    model = make_tiny_lm(seed=3, eos_id=96).model
    full = ContiguousKVCache.for_model(model)
    forward(model, mx.array([PROMPT[:-1]]), full, logits_for="none")
    from mlx_specdec.cache import QueryRecorder, RetrievalKVCache

    recorder = QueryRecorder(full)
    forward(model, mx.array([PROMPT[-1:]]), recorder, logits_for="none")
    middle = RetrievalKVCache.build(full, recorder.queries(), 16)
    x = 7
    p_hat = np.array(target_probs(forward(model, mx.array([[x]]), middle, logits_for="last").logits[0, -1],
                                  temperature))
    middle.trim(1)
    assert 0.1 < p_hat.max() < 0.9  # a likeliest token neither certain nor lost in the crowd
    if draft_kind == "one-hot":
        q = np.zeros_like(p_hat)
        q[int(p_hat.argmax())] = 1.0
    else:
        draft = make_tiny_lm(seed=20, layers=1).model
        q = np.array(target_probs(draft(mx.array([PROMPT + [x]]))[0, -1], temperature))
    level = ChainVerifier(model, middle, Params(temperature=temperature))
    mx.random.seed(0)
    rng = np.random.default_rng(0)
    written = []
    for _ in range(1500):
        d = int(rng.choice(len(q), p=q / q.sum()))
        n, token, rows, _ = level.verify([x, d], mx.array(q, dtype=mx.float32)[None])
        middle.trim(2)
        written.append(d if n >= 1 else token)
        assert rows.shape[0] == n + 1
    ok, figures = chi_square_below_critical(written, p_hat)
    assert ok, figures
