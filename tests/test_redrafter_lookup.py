"""ReDrafter with prompt lookup in front of the head (`--lookup N`, drafting/lookup.py): greedy output
stays plain decoding's, rows mix lookup and head drafts, sampling stays exact."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.drafting.base import Proposal
from mlx_specdec.drafting.calibration import DraftTrust
from mlx_specdec.drafting.first_offer import FirstOffer
from mlx_specdec.drafting.lookup import (LOOKUP_CONFIDENCE, STREAK_CONFIDENCE, STREAK_LONGEST, PromptLookup,
                                         lookup_confidence)

from conftest import make_tiny_lm
from test_redrafter import (PROMPTS, check_second_token_distribution, engine_with, oracle_head, random_head, run,
                            run_batch)

# A prompt that repeats itself: after its last token (9) and almost any own token t <= 40, the bigram
# (9, t) was seen before, so the first step already drafts from the lookup: [9, t + 1, 9, ...].
REPEATING = [tok for t in range(41) for tok in (9, t)] + [9]


@pytest.mark.parametrize("width,length,lookup", [(1, 3, 4), (1, 5, 2), (2, 4, 6)])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_redrafter_with_lookup_equals_plain_decoding(width, length, lookup, seed):
    lm = make_tiny_lm(seed=seed, eos_id=96)
    engine = engine_with(lm, random_head(lm, seed=seed))
    lookups = 0
    for prompt in PROMPTS + [REPEATING]:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        got, stats = run(engine, prompt, "redrafter", max_tokens=40,
                         options={"beam_width": width, "beam_length": length, "draft_cutoff": 0.2, "lookup": lookup})
        assert got == want
        lookups += stats.extra["lookup_steps"]
    assert lookups > 0  # the lookup really drafted (tiny random models loop, and REPEATING repeats)


def test_lookup_drafts_are_accepted_on_a_looping_answer():
    """The tiny model's greedy answers fall into loops: once a loop is in the text, a lookup drafts
    its next turn whole, so lookup steps accept several tokens each and forwards drop below the
    head-only run's."""
    lm = make_tiny_lm(seed=2, eos_id=96)
    engine = engine_with(lm, random_head(lm))
    prompt = PROMPTS[0]  # a 5-token loop from the 12th token on
    want, _ = run(engine, prompt, "ar", max_tokens=60)
    got, stats = run(engine, prompt, "redrafter", max_tokens=60, options={"lookup": 6})
    _, head_only = run(engine, prompt, "redrafter", max_tokens=60, options={"lookup": 0})
    assert got == want
    assert stats.extra["lookup_accepted_per_step"] > 1
    assert stats.forward_passes < head_only.forward_passes


def test_a_streak_drafts_past_the_lookup_length_on_a_looping_answer_and_output_is_unchanged():
    """In the loop every lookup is accepted whole, so the rows draft 2, 4, then 8 tokens: a lookup
    step accepts more on average than --lookup 2 could ever propose."""
    lm = make_tiny_lm(seed=2, eos_id=96)
    engine = engine_with(lm, random_head(lm))
    want, _ = run(engine, PROMPTS[0], "ar", max_tokens=60)
    got, stats = run(engine, PROMPTS[0], "redrafter", max_tokens=60,
                     options={"lookup": 2, "draft_cutoff": 0.0})
    assert got == want
    assert stats.extra["lookup_accepted_per_step"] > 2


@pytest.mark.parametrize("width", [1, 3])
def test_batched_rows_with_lookup_each_equal_their_own_plain_decoding(width):
    lm = make_tiny_lm(seed=4, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.4))
    prompts = PROMPTS + [REPEATING, [7]]
    want = [run(engine, p, "ar", max_tokens=30)[0] for p in prompts]
    got, stats = run_batch(engine, prompts, max_tokens=30,
                           options={"beam_width": width, "beam_length": 4, "draft_cutoff": 0.0, "lookup": 3})
    assert got == want
    assert 0 < stats.extra["lookup_steps"] < 1  # rows drafted from both sources


@pytest.mark.parametrize("temperature,top_p,cutoff", [(1.0, 1.0, 0.3), (2.0, 0.3, 0.0)])
def test_sampling_with_lookup_samples_the_models_distribution(temperature, top_p, cutoff):
    """REPEATING makes the first step a lookup step for most first tokens: the second token then
    comes from a deterministic draft (accepted with the target's probability of it) or the residual."""
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.5))
    check_second_token_distribution(lm, engine, REPEATING, temperature, top_p,
                                    {"beam_width": 2, "beam_length": 3, "draft_cutoff": cutoff, "lookup": 3})


def lookup_first(drafts, vocab):
    """Prompt lookup in front of the head, as redrafter composes them (`--sources lookup,head`)."""
    return FirstOffer([PromptLookup(drafts, vocab)], vocab)


def _head_proposal(beams, confidence, probs=None):
    beams = mx.array(np.array(beams, dtype=np.int32))
    return Proposal(beams, mx.zeros(beams.shape, dtype=mx.int32), probs, mx.array(np.array(confidence, np.float32)))


def test_a_row_drafts_from_the_lookup_or_the_head_padded_to_one_length():
    lookup = lookup_first(4, 50)
    lookup.begin([[1, 2, 3, 4, 5, 1, 2], [10, 11, 12]])  # row 0: "1 2" then "3 4 5" seen before
    head = _head_proposal([[[3, 20, 21]], [[13, 30, 31]]], [[[0.9, 0.5]], [[0.6, 0.1]]])
    drafted = lookup.draft(head, np.array([3, 13]))  # row 0's suffix "2 3" was seen: a lookup
    assert drafted.from_host.tolist() == [True, False]
    assert drafted.beams[0, 0].tolist() == [3, 4, 5, 1, 2]  # what followed "2 3": 4 5 1 2
    assert drafted.confidence[0, 0].tolist() == pytest.approx(LOOKUP_CONFIDENCE[:4])  # measured, per depth
    assert drafted.beams[1, 0].tolist() == [13, 30, 31, 31, 31]  # the head's, its last token repeated
    assert drafted.confidence[1, 0].tolist() == pytest.approx([0.6, 0.1, 0, 0])
    assert np.array_equal(np.array(drafted.proposal.beams), drafted.beams)


def test_a_short_lookup_is_padded_and_padding_is_never_trusted():
    lookup = lookup_first(4, 50)
    lookup.begin([[7, 8, 9, 7]])  # after own token 8: "7 8" seen, followed by 9 7 (then the text ends)
    head = _head_proposal([[[8, 1, 2]]], [[[0.5, 0.5]]])
    drafted = lookup.draft(head, np.array([8]))
    assert drafted.beams[0, 0].tolist() == [8, 9, 7, 8]  # 9 7 8: the text after the match, + own token
    assert drafted.confidence[0, 0].tolist() == pytest.approx(LOOKUP_CONFIDENCE[:3])


LOOP = [1, 2, 3, 4, 5, 6, 7, 8] * 6  # a text that repeats with period 8: every lookup is right


def _loop_step(lookup, own, accepted, verified=None):
    """Draft after `own`, then commit `accepted` of the lookup's drafts (what the target kept)."""
    head = _head_proposal([[[own, 0, 0]]], [[[0.1, 0.1]]])
    drafted = lookup.draft(head, np.array([own]))
    follow = drafted.beams[0, 0, 1:].tolist()
    lookup.commit([[own] + follow[:accepted]], verified=verified)
    return drafted, follow


def test_a_lookup_accepted_whole_doubles_the_next_one_and_carries_the_streak_s_acceptance():
    lookup = lookup_first(2, 50)
    lookup.begin([LOOP])
    drafted, follow = _loop_step(lookup, 1, accepted=2)  # "8 1" seen: 2 3 drafted, both accepted
    assert follow == [2, 3] and drafted.confidence[0, 0].tolist() == pytest.approx(LOOKUP_CONFIDENCE[:2])
    assert lookup.sources[0].streak.tolist() == [True] and lookup.sources[0].allowed.tolist() == [4]
    drafted, follow = _loop_step(lookup, 4, accepted=4)
    assert follow == [5, 6, 7, 8]
    assert drafted.confidence[0, 0].tolist() == pytest.approx(STREAK_CONFIDENCE[:4])
    assert lookup.sources[0].allowed.tolist() == [2 * STREAK_LONGEST]  # 8: the longest a streak may draft
    drafted, follow = _loop_step(lookup, 1, accepted=3)  # a miss at the fourth draft ends the streak
    assert len(follow) == 2 * STREAK_LONGEST
    assert lookup.sources[0].streak.tolist() == [False] and lookup.sources[0].allowed.tolist() == [2]


def test_a_streak_counts_only_the_drafts_the_step_verified_and_a_head_step_ends_it():
    lookup = lookup_first(4, 50)
    lookup.begin([LOOP, [30, 31, 32]])
    head = _head_proposal([[[1, 0, 0]], [[33, 40, 41]]], [[[0.1, 0.1]], [[0.9, 0.9]]])
    drafted = lookup.draft(head, np.array([1, 33]))
    assert drafted.from_host.tolist() == [True, False]
    # The cost rule verified one draft: row 0's one was accepted (a streak), row 1's head draft too.
    lookup.commit([[1, 2], [33, 40]], verified=1)
    assert lookup.sources[0].streak.tolist() == [True, False] and lookup.sources[0].allowed.tolist() == [8, 4]


def test_lookup_rows_carry_one_hot_draft_probabilities_and_head_rows_the_head_s():
    lookup = lookup_first(2, 6)
    lookup.begin([[1, 2, 3, 1], [4, 5]])
    head_probs = mx.array(np.full((2, 1, 2, 6), 1 / 6, dtype=np.float32))
    head = _head_proposal([[[2, 0, 0]], [[5, 1, 1]]], [[[0.5, 0.5]], [[0.5, 0.5]]], probs=head_probs)
    drafted = lookup.draft(head, np.array([2, 5]))  # row 0: "1 2" seen -> 3; row 1: no lookup
    q = np.array(drafted.proposal.draft_probs)
    assert drafted.from_host.tolist() == [True, False]
    assert q[0, 0, 0].tolist() == [0, 0, 0, 1, 0, 0]  # the drafted 3, with probability 1
    assert np.allclose(q[1, 0], 1 / 6)


def test_lookup_rows_leave_the_head_s_trust_alone():
    trust = DraftTrust(2)
    beams = np.array([[[1, 2, 3]], [[1, 2, 3]]])
    confidence = np.array([[[0.9, 0.9]], [[0.9, 0.9]]])
    trust.update(beams, confidence, best=np.zeros(2, int), accepted=np.zeros(2, int), next_token=np.array([7, 7]),
                 verified=2, rows=np.array([True, False]))
    assert trust.trust[0] < 1.0 and trust.trust[1] == 1.0  # row 1 drafted from the lookup


@pytest.mark.parametrize("lookup", [0, 3])
def test_a_row_that_ends_on_its_first_token_leaves_the_batch(lookup):
    lm = make_tiny_lm(seed=4, eos_id=96)
    first = run(engine_with(lm, random_head(lm)), PROMPTS[0], "ar", max_tokens=1)[0][0]
    stopping = make_tiny_lm(seed=4, eos_id=first)  # row 0's first token is its EOS
    engine = engine_with(stopping, random_head(stopping))
    prompts = PROMPTS + [REPEATING]
    want = [run(engine, p, "ar", max_tokens=12)[0] for p in prompts]
    got, _ = run_batch(engine, prompts, max_tokens=12, options={"beam_length": 3, "lookup": lookup})
    assert got == want and want[0] == []  # EOS is not shown


def test_lookup_confidence_is_the_measured_acceptance_per_depth_and_the_last_beyond():
    assert lookup_confidence(2).tolist() == pytest.approx(LOOKUP_CONFIDENCE[:2])
    deep = lookup_confidence(len(LOOKUP_CONFIDENCE) + 2)
    assert deep[-3:].tolist() == pytest.approx([LOOKUP_CONFIDENCE[-1]] * 3)
