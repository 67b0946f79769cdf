"""The running trust in a proposer's confidence (drafting/calibration.py): what counts as evidence,
and, end to end, that it stops a sure-but-wrong head from costing verifies without changing a token."""

import numpy as np
import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.drafting.calibration import PRIOR, DraftTrust

from conftest import make_tiny_lm
import mlx.core as mx

from test_redrafter import PROMPTS, BigramOracle, engine_with, oracle_head, run


def one_row(confidences, drafts):
    beams = np.array([[[7] + list(drafts)]])  # (1, 1, L): the target's own token, then the drafts
    return beams, np.array([[confidences]], dtype=float)


def test_trust_starts_at_one_so_the_cutoff_is_the_measured_one():
    trust = DraftTrust(3)
    confidence = np.random.default_rng(0).random((3, 2, 4))
    np.testing.assert_array_equal(trust.calibrated(confidence), confidence)


def test_accepted_drafts_and_the_first_rejected_one_are_the_evidence_deeper_ones_are_not():
    trust = DraftTrust(1)
    beams, confidence = one_row([0.9, 0.8, 0.7], [11, 12, 13])
    # verified all 3, accepted 1: depth 1 accepted, depth 2 rejected, depth 3 never reached
    trust.update(beams, confidence, best=np.array([0]), accepted=np.array([1]), next_token=np.array([99]), verified=3)
    assert trust.events == 2 and trust.free_events == 0
    assert trust.trust[0] == pytest.approx((1 + PRIOR) / (0.9 + 0.8 + PRIOR))


def test_a_cut_draft_is_judged_for_free_against_the_target_s_next_token():
    beams, confidence = one_row([0.5, 0.5], [11, 12])
    right, wrong = DraftTrust(1), DraftTrust(1)
    # nothing verified (a plain step): the target's token equals the cut draft, or not
    right.update(beams, confidence, best=np.array([0]), accepted=np.array([0]), next_token=np.array([11]), verified=0)
    wrong.update(beams, confidence, best=np.array([0]), accepted=np.array([0]), next_token=np.array([40]), verified=0)
    assert right.free_events == wrong.free_events == 1
    assert right.trust[0] == pytest.approx((1 + PRIOR) / (0.5 + PRIOR)) and right.trust[0] > 1
    assert wrong.trust[0] == pytest.approx(PRIOR / (0.5 + PRIOR)) and wrong.trust[0] < 1


def test_a_row_that_accepts_every_draft_judges_no_deeper_one():
    trust = DraftTrust(1)
    beams, confidence = one_row([0.6, 0.6], [11, 12])
    trust.update(beams, confidence, best=np.array([0]), accepted=np.array([2]), next_token=np.array([5]), verified=2)
    assert trust.events == 2 and trust.free_events == 0


def test_rows_keep_their_own_trust_when_the_batch_shrinks():
    trust = DraftTrust(3)
    beams = np.array([[[7, 11]], [[7, 12]], [[7, 13]]])
    confidence = np.full((3, 1, 1), 0.9)
    trust.update(beams, confidence, best=np.zeros(3, int), accepted=np.array([1, 0, 1]),
                 next_token=np.array([1, 2, 3]), verified=1)
    before = trust.trust.copy()
    trust.select_rows(np.array([1, 2]))
    np.testing.assert_array_equal(trust.trust, before[[1, 2]])


def drafted_and_output(engine, prompt, trust, max_tokens=40):
    params = GenerationParams(max_tokens=max_tokens, options={"beam_width": 1, "beam_length": 4,
                                                              "draft_cutoff": 0.2, "draft_trust": trust,
                                                              "lookup": 0})  # the head's drafts alone
    events = list(engine.generate_ids(prompt, "redrafter", params))
    tokens = [t for e in events if e.kind == "token" for t in e.tokens]
    return sum(e.drafted for e in events if e.kind == "token"), tokens, events[-1].stats


def compare(engine):
    """Each prompt decoded with trust off and on: (drafted off, drafted on, stats off, stats on) summed."""
    totals = np.zeros(4)
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        drafted_off, got_off, off = drafted_and_output(engine, prompt, False)
        drafted_on, got_on, on = drafted_and_output(engine, prompt, True)
        assert got_on == got_off == want
        totals += [drafted_off, drafted_on, off.forward_passes, on.forward_passes]
    return totals, on


def test_trust_stops_a_sure_but_wrong_head_from_drafting_and_keeps_every_token():
    lm = make_tiny_lm(seed=3, eos_id=96)
    right = oracle_head(lm, PROMPTS, corrupt=0.0)
    # the same near-certainty about each token's successor, shifted to the next token id: wrong
    engine = engine_with(lm, BigramOracle(right._embed, mx.roll(right._table, 1, axis=1), 97))
    (drafted_off, drafted_on, _, _), last = compare(engine)
    assert drafted_on < drafted_off / 3, (drafted_on, drafted_off)
    assert last.extra["judged_for_free"] > 0 and all(t < 0.5 for t in last.extra["draft_trust"])


def test_trust_keeps_a_head_that_is_right_drafting():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.0))
    (drafted_off, drafted_on, forwards_off, forwards_on), _ = compare(engine)
    assert drafted_on >= 0.8 * drafted_off and forwards_on <= forwards_off + 3, (drafted_on, drafted_off)
