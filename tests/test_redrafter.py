"""ReDrafter decoding on tiny random Llamas: greedy output identical to plain decoding, for a
random draft head (few acceptances) and a bigram "oracle" head (many), across beam shapes. The
head alone (`"lookup": 0`): prompt lookup in front of it is tested in test_redrafter_lookup.py."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.redrafter_head.model import DrafterConfig, DrafterHead
from mlx_specdec.engine import Engine
from mlx_specdec.errors import UserError

from conftest import make_tiny_lm

PROMPTS = [[5, 17, 42, 3], [60, 61, 9, 9, 9, 33, 71], [88, 12]]


def run(engine, prompt, method, **params):
    events = list(engine.generate_ids(prompt, method, GenerationParams(**params)))
    tokens = [t for e in events if e.kind == "token" for t in e.tokens]
    return tokens, events[-1].stats


def random_head(lm, draft_vocab=50, seed=0):
    mx.random.seed(seed)
    config = DrafterConfig(llm_hidden_size=64, embed_size=64, vocab_size=97, draft_vocab_size=draft_vocab)
    ids = np.random.default_rng(seed).permutation(97)[:draft_vocab]
    head = DrafterHead(config, mx.array(ids))
    mx.eval(head.parameters())
    return head


class BigramOracle(nn.Module):
    """A stand-in head with the DrafterHead interface that knows the model's greedy bigrams.

    The state is the last token's embedding; `logits` recovers the token (embeddings are scaled up,
    so the nearest row is the token itself) and looks its successor up in a table built from the
    target's own greedy output -- right most of the time, wrong where a token recurs with different
    successors or the table was corrupted on purpose.
    """

    def __init__(self, embed_weight, table, vocab):
        super().__init__()
        self.config = DrafterConfig(64, 64, vocab, vocab)
        self._embed, self._table = embed_weight, table  # (V, E), (V, V) logits
        self.draft_to_full = mx.arange(vocab)

    def initial_state(self, e):
        return e

    def next_state(self, state, e):
        return e

    def logits(self, state, hidden):
        token = mx.argmax(state @ self._embed.T, axis=-1)
        return self._table[token]


def oracle_head(lm, prompts, corrupt=0.2, seed=0):
    engine = Engine(lm, drafter=None)
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(97, 97)).astype(np.float32)
    for prompt in prompts:
        tokens, _ = run(engine, prompt, "ar", max_tokens=40)
        seq = prompt + tokens
        for a, b in zip(seq, seq[1:]):
            if rng.random() > corrupt:
                table[a, b] = 20.0
    return BigramOracle(lm.model.model.embed_tokens.weight, mx.array(table), 97)


def engine_with(lm, head):
    engine = Engine(lm, drafter=None)
    engine._resources["drafter"] = head
    return engine


def check_acceptance_per_position(events, length):
    """Acceptance per draft position k is the share of verify steps that accepted >= k + 1
    drafts, as the steps themselves report it (non-increasing in k). A step that wrote only EOS
    emits no token event (EOS after accepted drafts does): its acceptance is unseen here, at most
    one count per position."""
    stats = events[-1].stats
    accepted = np.array([e.accepted for e in events if e.kind == "token" and e.drafted])
    unseen = stats.extra["steps"] - len(accepted)
    assert unseen in ((0,) if stats.finish_reason == "length" else (0, 1))
    counts = np.round(np.array(stats.extra["acceptance_per_position"]) * stats.extra["steps"])
    seen = np.array([(accepted >= k + 1).sum() for k in range(length - 1)])
    assert np.all((counts >= seen) & (counts <= seen + unseen))
    assert list(counts) == sorted(counts, reverse=True)
    return seen


@pytest.mark.parametrize("width,length", [(1, 2), (1, 5), (2, 4), (4, 3), (3, 6)])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_redrafter_equals_plain_decoding_with_a_random_head(width, length, seed):
    lm = make_tiny_lm(seed=seed, eos_id=96)
    engine = engine_with(lm, random_head(lm, seed=seed))
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=30)
        params = GenerationParams(max_tokens=30, options={"beam_width": width, "beam_length": length, "draft_cutoff": 0.0, "lookup": 0})
        events = list(engine.generate_ids(prompt, "redrafter", params))
        got = [t for e in events if e.kind == "token" for t in e.tokens]
        assert got == want
        check_acceptance_per_position(events, length)


@pytest.mark.parametrize("width,length", [(1, 5), (2, 4), (4, 5)])
def test_greedy_redrafter_equals_plain_decoding_with_accepted_drafts(width, length):
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS))
    accepted = 0
    deep = 0
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        params = GenerationParams(max_tokens=40, options={"beam_width": width, "beam_length": length, "draft_cutoff": 0.0, "lookup": 0})
        events = list(engine.generate_ids(prompt, "redrafter", params))
        stats = events[-1].stats
        assert [t for e in events if e.kind == "token" for t in e.tokens] == want
        assert stats.forward_passes < stats.generated_tokens  # drafts were really accepted
        deep += check_acceptance_per_position(events, length)[-1]  # steps that took every draft
        accepted += stats.accepted
        if width > 1:
            assert stats.extra["tree_tokens_after_dedup"] < stats.extra["tree_tokens_before_dedup"]
    assert accepted > 0 and deep > 0


def test_eos_and_max_tokens_inside_an_accepted_run():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.0))
    want, _ = run(engine, PROMPTS[0], "ar", max_tokens=40)
    for n in (1, 2, 3, 7, 11):
        got, stats = run(engine, PROMPTS[0], "redrafter", max_tokens=n, options={"beam_length": 5, "draft_cutoff": 0.0, "lookup": 0})
        assert got == want[:n] and stats.finish_reason == "length"
    eos = want[6]
    stopping = make_tiny_lm(seed=3, eos_id=eos)
    got, stats = run(engine_with(stopping, oracle_head(lm, PROMPTS, corrupt=0.0)), PROMPTS[0],
                     "redrafter", max_tokens=40, options={"beam_length": 5, "draft_cutoff": 0.0, "lookup": 0})
    assert got == want[: want.index(eos)] and stats.finish_reason == "stop"


def test_stopping_early_leaves_the_engine_reusable():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS))
    stream = engine.generate_ids(PROMPTS[1], "redrafter", GenerationParams(max_tokens=40))
    next(e for e in stream if e.kind == "token")
    stream.close()
    want, _ = run(engine, PROMPTS[1], "ar", max_tokens=20)
    got, _ = run(engine, PROMPTS[1], "redrafter", max_tokens=20)
    assert got == want


def test_seeded_sampling_is_reproducible():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS))
    options = {"beam_width": 2, "beam_length": 4, "draft_cutoff": 0.0, "lookup": 0}
    a, _ = run(engine, PROMPTS[0], "redrafter", max_tokens=25, temperature=1.0, seed=7, options=options)
    b, _ = run(engine, PROMPTS[0], "redrafter", max_tokens=25, temperature=1.0, seed=7, options=options)
    assert a == b and len(a) == 25


def test_redrafter_without_a_head_drafts_by_lookup_and_writes_ar_s_answer():
    """No head: prompt lookup drafts where the text repeats, the other steps are plain, and the
    answer is `ar`'s, token for token; the stats say which source drafted."""
    lm = make_tiny_lm(seed=4, eos_id=96)  # its answer to PROMPTS[1] falls into a loop: lookup drafts it
    engine = Engine(lm, drafter=None)
    prompt = PROMPTS[1]
    want, _ = run(engine, prompt, "ar", max_tokens=40)
    got, stats = run(engine, prompt, "redrafter", max_tokens=40)
    assert got == want
    assert set(stats.extra["source_steps"]) == {"lookup", "none"}
    assert stats.extra["source_steps"]["lookup"] > 0 and stats.extra["lookup_accepted_per_step"] > 0
    assert sum(stats.extra["source_steps"].values()) == stats.extra["steps"]


def run_batch(engine, prompts, **params):
    events = list(engine.generate_ids_batch(prompts, "redrafter", GenerationParams(**params)))
    per_row = {}
    for e in events:
        if e.kind == "token":
            per_row.setdefault(e.thread_id, []).extend(e.tokens)
    return [per_row.get(b, []) for b in range(len(prompts))], events[-1].stats


def test_kept_length_is_the_deepest_leading_run_at_or_above_the_cutoff():
    from mlx_specdec.drafting.verify_cost import kept_length

    confidence = np.array([[[0.9, 0.2, 0.8], [0.6, 0.7, 0.1]], [[0.1, 0.9, 0.9], [0.95, 0.5, 0.5]]])  # (B, W, L-1)
    assert kept_length(confidence, 0.0) == 4  # every draft
    assert kept_length(confidence, 0.55) == 3  # row 0 beam 1: two leading drafts
    assert kept_length(confidence, 0.92) == 2  # row 1 beam 1: one
    assert kept_length(confidence, 0.99) == 1  # none: a plain step


@pytest.mark.parametrize("cutoff", [0.3, 0.9])
@pytest.mark.parametrize("width,length", [(1, 5), (2, 4)])
def test_greedy_redrafter_with_a_draft_cutoff_equals_plain_decoding_and_verifies_fewer_drafts(width, length, cutoff):
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    shorter = 0
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        params = GenerationParams(max_tokens=40, options={"beam_width": width, "beam_length": length,
                                                          "draft_cutoff": cutoff, "lookup": 0})
        events = list(engine.generate_ids(prompt, "redrafter", params))
        assert [t for e in events if e.kind == "token" for t in e.tokens] == want
        drafted = [e.drafted for e in events if e.kind == "token"][1:]  # the first token is the prefill's
        assert all(0 <= d <= length - 1 for d in drafted)
        shorter += sum(d < length - 1 for d in drafted)
        stats = events[-1].stats
        assert stats.forward_passes < stats.generated_tokens  # confident drafts were still accepted
    assert shorter > 0  # the cutoff cut some steps short


@pytest.mark.parametrize("width,length", [(1, 4), (3, 5)])
def test_batched_prompts_each_equal_their_own_plain_decoding(width, length):
    """Rows of different prompt lengths accept different numbers of tokens each step (a ragged
    cache with holes); every row must still equal its prompt decoded alone."""
    lm = make_tiny_lm(seed=4, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.4))
    prompts = PROMPTS + [[7], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    want = [run(engine, p, "ar", max_tokens=30)[0] for p in prompts]
    got, stats = run_batch(engine, prompts, max_tokens=30,
                           options={"beam_width": width, "beam_length": length, "draft_cutoff": 0.0, "lookup": 0})
    assert got == want
    assert stats.forward_passes < sum(len(w) for w in want) / len(prompts)  # speculation worked


def test_batch_rows_stop_on_their_own():
    lm = make_tiny_lm(seed=4, eos_id=96)
    free = engine_with(lm, random_head(lm))
    long_answer, _ = run(free, PROMPTS[0], "ar", max_tokens=20)
    eos = long_answer[4]  # row 0 stops after 4 tokens; other rows run to max_tokens
    stopping = make_tiny_lm(seed=4, eos_id=eos)
    engine = engine_with(stopping, random_head(stopping))
    prompts = [PROMPTS[0], PROMPTS[1]]
    want = [run(engine, p, "ar", max_tokens=12)[0] for p in prompts]
    got, _ = run_batch(engine, prompts, max_tokens=12, options={"beam_width": 2, "beam_length": 3, "draft_cutoff": 0.0, "lookup": 0})
    assert got == want and len(got[0]) == 4


def test_only_redrafter_decodes_batches():
    from mlx_specdec.errors import UserError

    with pytest.raises(UserError, match="decodes one prompt at a time"):
        Engine(make_tiny_lm(), drafter=None).generate_ids_batch([[5], [6]], "ar")


@pytest.mark.parametrize("temperature,top_p,cutoff", [(1.0, 1.0, 0.0), (2.0, 0.3, 0.0), (1.0, 1.0, 0.3)])
def test_sampling_redrafter_samples_the_models_distribution(temperature, top_p, cutoff):
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.5))
    check_second_token_distribution(lm, engine, PROMPTS[0], temperature, top_p,
                                    {"beam_width": 2, "beam_length": 3, "draft_cutoff": cutoff, "lookup": 0})


def check_second_token_distribution(lm, engine, prompt, temperature, top_p, options, draws=800):
    """End to end: the second token (produced by draft-verify-accept: an accepted draft, a
    resample or a bonus token) follows the marginal of plain sampling (mlx-lm's rule: nucleus cut
    at T = 1, then softmax(logits / T) over it) P(t2) = sum_t1 p(t1) p(t2 | t1) (chi-square,
    about p = 0.001). At T = 2 with top-p < 1 a nucleus cut after the temperature keeps tokens
    plain sampling never draws."""
    from test_acceptance import nucleus_reference

    seconds = []
    for seed in range(draws):
        tokens, _ = run(engine, prompt, "redrafter", max_tokens=2, temperature=temperature, top_p=top_p,
                        seed=seed, options=options)
        if not tokens:  # the first token was EOS: no second token
            continue
        seconds.append(tokens[1] if len(tokens) > 1 else 96)  # a 1-token answer ended with EOS (96)
    model = lm.model
    p_first = nucleus_reference(np.array(model(mx.array(prompt)[None])[0, -1]), temperature, top_p)
    p_first[96] = 0.0  # runs that start with EOS were skipped
    p_first /= p_first.sum()
    batch = mx.array([prompt + [t] for t in range(97)])
    second_logits = np.array(model(batch)[:, -1])  # (97, V): logits of t2 given t1
    p_second = np.stack([nucleus_reference(row, temperature, top_p) for row in second_logits])
    expected = (p_first[:, None] * p_second).sum(0) * len(seconds)
    observed = np.bincount(seconds, minlength=97).astype(float)
    assert observed[expected == 0].sum() == 0, "drew a token outside plain sampling's nucleus"
    big = expected >= 5  # pool the rare tokens into one cell
    obs, exp = observed[big], expected[big]
    if (~big).any() and expected[~big].sum() > 0:
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    critical = df + 3.09 * np.sqrt(2 * df) + 3  # ~ the 0.001 quantile (normal approx., generous for small df)
    assert df >= 5 and chi2 < critical, (chi2, df)


def test_the_registry_and_the_cli_help_state_the_strategy_s_own_defaults():
    import importlib

    from mlx_specdec.cli import build_parser
    from mlx_specdec.settings import METHODS

    r = importlib.import_module("mlx_specdec.decoding.redrafter")  # the module, not the strategy function
    spec = METHODS["redrafter"]
    for name in ("beam_width", "beam_length", "draft_cutoff", "deepen_reach", "lookup", "draft_trust"):
        assert spec.setting(name).default == getattr(r, "DEFAULT_" + name.upper()), name
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    helps = {a.dest: a.help for a in generate._actions}
    assert f"default: {r.DEFAULT_BEAM_WIDTH})" in helps["beam_width"]
    assert f"default: {r.DEFAULT_DRAFT_CUTOFF})" in helps["draft_cutoff"]
    assert f"default: {'on' if r.DEFAULT_DRAFT_TRUST else 'off'})" in dict(generate.expert_help)["--draft-trust"]


def test_drafter_none_from_the_command_line_means_no_head(tmp_path):
    from conftest import save_tiny_model_dir

    engine = Engine.load(str(save_tiny_model_dir(tmp_path / "tiny")), drafter="none")
    assert engine.drafter is None
    _, stats = run(engine, PROMPTS[0], "redrafter", max_tokens=8)
    assert "head" not in stats.extra["source_steps"]


def _second_token_after_a_cut(confidence_of, trials=4000, cutoff=0.2):
    """One verify step over a 2-token vocabulary with the real cutoff rule (`kept_length`) and the
    real rejection sampler: the draft x ~ q = (0.9, 0.1) is verified only where `confidence_of(q, x)`
    clears the cutoff, otherwise the token after the target's own comes from p = (0.5, 0.5).
    Returns how often that token is 1 (exactness: 0.5)."""
    from mlx_specdec.acceptance import sampling_accept
    from mlx_specdec.drafting.verify_cost import kept_length

    q, p = np.array([0.9, 0.1], dtype=np.float32), np.array([0.5, 0.5], dtype=np.float32)
    rng = np.random.default_rng(0)
    mx.random.seed(0)
    ones = 0
    for _ in range(trials):
        x = int(rng.choice(2, p=q))
        n = kept_length(np.array([[[confidence_of(q, x)]]]), cutoff)  # 1: cut, 2: verified
        result = sampling_accept(mx.array([[0, x]])[:, :n], mx.array(np.stack([p, p])[None])[:, :n],
                                 mx.array(q[None, None])[:, : n - 1])
        ones += (x if int(result.num_accepted) == 1 else int(result.next_token)) == 1
    return ones / trials


def test_a_cutoff_on_the_drawn_token_s_probability_biases_sampling_and_one_on_max_q_does_not():
    """Why sampled drafts report max q as their confidence: cutting a draft because of the token that
    was drawn changes which drafts reach the rejection sampler (0.45 instead of 0.5 here); cutting it
    on its distribution alone decides before the draw, so the output is p exactly."""
    drawn = _second_token_after_a_cut(lambda q, x: q[x])
    peak = _second_token_after_a_cut(lambda q, x: q.max())
    assert abs(drawn - 0.45) < 0.025, drawn  # 4,000 trials: sd 0.008
    assert abs(peak - 0.5) < 0.025, peak


def test_sampled_drafts_report_the_peak_of_their_distribution_as_confidence():
    from mlx_specdec.redrafter_head.beam import sample_beams

    lm = make_tiny_lm(seed=3)
    head = random_head(lm, draft_vocab=97)
    embed = lm.model.model.embed_tokens
    drafts = sample_beams(head, embed, mx.random.normal((2, 64)), mx.array([5, 9]), 3, 4, 1.0,
                          key=mx.random.key(1))
    np.testing.assert_allclose(np.array(drafts.confidence), np.array(drafts.draft_probs).max(axis=-1), rtol=1e-6)


@pytest.mark.parametrize("width", [1, 3])
def test_a_confidence_temperature_changes_the_confidences_not_the_beams(width):
    """config.confidence_temperature tau (fitted by benchmarks/drafter_calibration.py): beam search
    picks the same beams, and each drafted token's confidence is softmax(logits / tau) at it."""
    import dataclasses

    from mlx_specdec.redrafter_head.beam import beam_search

    lm = make_tiny_lm(seed=3)
    embed = lm.model.model.embed_tokens
    plain = random_head(lm, draft_vocab=97)
    hidden, first = mx.random.normal((2, 64), key=mx.random.key(4)), mx.array([5, 9])
    base = beam_search(plain, embed, hidden, first, width, 4)
    tau = 0.5
    sharp = random_head(lm, draft_vocab=97)
    sharp.config = dataclasses.replace(sharp.config, confidence_temperature=tau)
    drafts = beam_search(sharp, embed, hidden, first, width, 4)
    np.testing.assert_array_equal(np.array(drafts.beams), np.array(base.beams))
    # the confidence of beam 0's first draft, by hand: the head's distribution after the first token
    state = sharp.initial_state(embed(first))
    logits = sharp.logits(state, hidden) / tau
    want = mx.softmax(logits, axis=-1)[mx.arange(2), sharp.full_to_draft[drafts.beams[:, 0, 1]]]
    np.testing.assert_allclose(np.array(drafts.confidence[:, 0, 0]), np.array(want), rtol=1e-5)
    assert (np.array(drafts.confidence[:, 0, 0]) > np.array(base.confidence[:, 0, 0])).all()  # sharper


def test_redrafter_with_a_draft_model_in_the_head_s_place_writes_ar_s_answer():
    """No head, a same-tokenizer draft model (here the target itself, so it drafts what the target
    writes): its chains are verified as the head's are, greedy and sampled with the same seed."""
    lm = make_tiny_lm(seed=4, eos_id=96)
    engine = Engine(lm, drafter=None, draft_model=make_tiny_lm(seed=4, eos_id=96))
    want, _ = run(engine, PROMPTS[0], "ar", max_tokens=30)
    got, stats = run(engine, PROMPTS[0], "redrafter", max_tokens=30)
    assert got == want
    assert stats.extra["source_steps"]["model"] > 0 and stats.tokens_per_forward > 2.0
    with pytest.raises(UserError, match="one request at a time"):
        list(engine.generate_ids_batch([PROMPTS[0], PROMPTS[1]], "redrafter", GenerationParams(max_tokens=4)))
    plain = Engine(lm, drafter=None)
    with pytest.raises(UserError, match="needs a draft model"):
        run(plain, PROMPTS[0], "redrafter", options={"sources": "lookup,model"})
