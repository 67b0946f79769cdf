"""Greedy chains drafted one depth at a time (drafting/head_source.py `stepwise`): the same drafts, the
same confidences and the same verified trees as the whole chain in one graph, minus drafts no
step could verify."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.redrafter_head.beam import beam_search, compiled_chain
from mlx_specdec.drafting import HeadProposer

from conftest import make_tiny_lm
from test_redrafter import PROMPTS, engine_with, oracle_head, random_head
from test_redrafter_lookup import REPEATING


def steps_of(engine, prompt, **options):
    """(tokens, [(drafted, accepted) per step]) of one greedy redrafter answer."""
    events = list(engine.generate_ids(prompt, "redrafter", GenerationParams(max_tokens=40, options=options)))
    tokens = [t for e in events if e.kind == "token" for t in e.tokens]
    return tokens, [(e.drafted, e.accepted) for e in events if e.kind == "token"]


@pytest.mark.parametrize("tau", [1.0, 1.3])
def test_the_chain_one_depth_at_a_time_is_beam_search_s_chain(tau):
    import dataclasses

    lm = make_tiny_lm(seed=2)
    head, embed = random_head(lm), lm.model.model.embed_tokens
    head.config = dataclasses.replace(head.config, confidence_temperature=tau)
    hidden = mx.random.normal((3, 64), key=mx.random.key(1))
    first = mx.array([5, 17, 60])
    want = beam_search(head, embed, hidden, first, 1, 5)
    start, deeper, _ = compiled_chain(head, embed)
    state, draft, score, confidence = start(hidden, first)
    drafts, confidences = [draft], [confidence]
    for _ in range(3):
        state, draft, score, confidence = deeper(state, hidden, draft, score)
        drafts.append(draft)
        confidences.append(confidence)
    assert np.array_equal(np.array(mx.stack(drafts, axis=-1)), np.array(want.beams[:, 0, 1:]))
    assert np.array_equal(np.array(mx.stack(confidences, axis=-1)), np.array(want.confidence[:, 0]))


def test_extend_drafts_only_while_wanted_and_pads_every_row_to_one_length():
    lm = make_tiny_lm(seed=2)
    head, embed = random_head(lm), lm.model.model.embed_tokens
    proposer = HeadProposer(head, embed, width=1, length=5, vocab=97, stepwise=True)
    hidden = mx.random.normal((2, 64), key=mx.random.key(3))
    first = mx.array([5, 17])
    full = beam_search(head, embed, hidden, first, 1, 5)
    proposal = proposer.propose(first, hidden)
    assert proposal.beams.shape == (2, 1, 2) and proposal.confidence.shape == (2, 1, 1)
    beams, confidence = np.array(proposal.beams), np.array(proposal.confidence)
    asked = []

    def two_deep(so_far):
        asked.append(so_far.shape[-1])
        return so_far.shape[-1] < 2

    rows = np.array([True, True])
    deeper, deeper_confidence = proposer.extend(beams, confidence, rows, two_deep)
    assert asked == [1, 2]  # asked after each depth, stopped when the test said no
    assert np.array_equal(deeper, np.array(full.beams[:, :, :3]))
    assert np.allclose(deeper_confidence, np.array(full.confidence[:, :, :2]))

    # A lookup row (not the head's) longer than the head's chain keeps its drafts; the head's row
    # is padded with its last token at confidence 0.
    proposal = proposer.propose(first, hidden)
    lookup_row = np.array([[[17, 1, 2, 3, 4]]], dtype=np.int32)
    beams = np.concatenate([np.concatenate([np.array(proposal.beams[:1]), np.repeat(np.array(proposal.beams[:1, :, -1:]), 3, axis=-1)], axis=-1), lookup_row])
    confidence = np.array([[[float(proposal.confidence[0, 0, 0]), 0, 0, 0]], [[0.6, 0.7, 0.8, 0.8]]], dtype=np.float32)
    deeper, deeper_confidence = proposer.extend(beams, confidence, np.array([True, False]), two_deep)
    assert np.array_equal(deeper[1], lookup_row[0]) and np.allclose(deeper_confidence[1], confidence[1])
    assert np.array_equal(deeper[0, 0, :3], np.array(full.beams[0, 0, :3]))
    assert (deeper[0, 0, 3:] == deeper[0, 0, 2]).all() and (deeper_confidence[0, 0, 2:] == 0).all()


def test_extend_that_is_never_wanted_returns_the_arrays_as_read():
    lm = make_tiny_lm(seed=2)
    proposer = HeadProposer(random_head(lm), lm.model.model.embed_tokens, width=1, length=4, vocab=97, stepwise=True)
    proposal = proposer.propose(mx.array([5]), mx.zeros((1, 64)))
    beams, confidence = np.array(proposal.beams), np.array(proposal.confidence)
    got = proposer.extend(beams, confidence, np.array([True]), lambda so_far: False)
    assert got[0] is beams and got[1] is confidence


def test_stepwise_is_only_for_greedy_single_chains():
    lm = make_tiny_lm(seed=2)
    head, embed = random_head(lm), lm.model.model.embed_tokens
    assert HeadProposer(head, embed, 1, 4, 97, stepwise=True).stepwise
    assert not HeadProposer(head, embed, 2, 4, 97, stepwise=True).stepwise  # beams: one graph
    assert not HeadProposer(head, embed, 1, 4, 97, temperature=1.0, stepwise=True).stepwise  # sampled
    assert not HeadProposer(head, embed, 1, 2, 97, stepwise=True).stepwise  # one draft: nothing to stop


@pytest.mark.parametrize("cutoff", [0.3, 0.9])
@pytest.mark.parametrize("lookup", [0, 3])
def test_stepwise_drafting_verifies_the_same_trees_as_the_whole_chain(cutoff, lookup):
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    cut_short = 0
    for prompt in PROMPTS + [REPEATING]:
        # deepen_reach 0: drafts as deep as the cutoff allows, as the whole chain does; the head's
        # first draft beside a lookup's is a runner-up, which only stepwise chains have
        options = {"beam_length": 5, "draft_cutoff": cutoff, "lookup": lookup, "verify_cost": False, "deepen_reach": 0.0,
                   "head_beside_lookup": False}
        whole = steps_of(engine, prompt, stepwise_draft=False, **options)
        stepwise = steps_of(engine, prompt, stepwise_draft=True, **options)
        assert stepwise == whole  # same tokens, same drafts verified and accepted at every step
        cut_short += sum(d < 4 for d, _ in whole[1][1:])
    assert cut_short > 0  # the cutoff did stop chains early: stepwise had drafts to skip


def test_batched_rows_draft_stepwise_as_deep_as_any_row_needs():
    lm = make_tiny_lm(seed=4, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.4))
    prompts = PROMPTS + [REPEATING, [7]]
    got = {}
    for stepwise in (False, True):
        rows = {}
        options = {"beam_length": 5, "draft_cutoff": 0.5, "lookup": 3, "stepwise_draft": stepwise, "deepen_reach": 0.0}
        for e in engine.generate_ids_batch(prompts, "redrafter", GenerationParams(max_tokens=30, options=options)):
            if e.kind == "token":
                rows.setdefault(e.thread_id, []).append((tuple(e.tokens), e.drafted, e.accepted))
        got[stepwise] = rows
    assert got[True] == got[False]


@pytest.mark.parametrize("lookup", [0, 3])
def test_eager_drafts_verify_the_same_trees_in_one_host_sync_a_step(monkeypatch, lookup):
    """--eager-drafts on: the whole chain in one graph, read with the acceptance, so a
    step makes one host sync, lookup or not; the same tokens and trees as lazy drafting, which
    syncs again for each deeper draft and for the head's drafts behind a lookup miss."""
    import importlib

    redrafter = importlib.import_module("mlx_specdec.decoding.redrafter_step")
    head_proposer = importlib.import_module("mlx_specdec.drafting.head_source")
    lookup_proposer = importlib.import_module("mlx_specdec.drafting.first_offer")

    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    syncs = {"n": 0}
    real_read = redrafter._read

    read = []  # every array read so far (kept alive, so that ids stay unique)

    def counted(*arrays):
        if not all(any(a is r for r in read) for a in arrays):  # re-reading evaluated arrays: no sync
            syncs["n"] += 1
        read.extend(arrays)
        return real_read(*arrays)

    monkeypatch.setattr(redrafter, "_read", counted)
    monkeypatch.setattr(head_proposer, "read_host", counted)
    monkeypatch.setattr(lookup_proposer, "read_host", counted)
    options = {"beam_length": 4, "draft_cutoff": 0.3, "lookup": lookup, "verify_cost": False, "deepen_reach": 0.0,
               "head_beside_lookup": False}  # a runner-up: lazy (stepwise) chains only
    for prompt in PROMPTS + [REPEATING]:
        got = {}
        for eager in (False, True):
            syncs["n"] = 0
            read.clear()
            got[eager] = steps_of(engine, prompt, eager_drafts=eager, **options) + (syncs["n"],)
        (lazy_tokens, lazy_steps, lazy_syncs), (tokens, steps, eager_syncs) = got[False], got[True]
        assert (tokens, steps) == (lazy_tokens, lazy_steps)
        # the first tokens, the first drafts (unless the lookup made them), then one a step: its
        # acceptance and the next drafts
        assert len(steps) <= eager_syncs <= len(steps) + 1
        assert lazy_syncs >= eager_syncs
    assert lazy_syncs > eager_syncs  # the repeating prompt's chains: lazy went deeper behind syncs


@pytest.mark.parametrize("reach", [0.5, 0.99])
def test_a_deepen_reach_drafts_deeper_only_behind_a_likely_chain_and_keeps_greedy_output(reach):
    """--deepen-reach r: a chain is drafted one depth deeper only while the product of its
    confidences so far is >= r: fewer drafts than the cutoff alone allows, the target's own output."""
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    drafted = {0.0: 0, reach: 0}
    for prompt in PROMPTS + [REPEATING]:
        want = [t for e in engine.generate_ids(prompt, "ar", GenerationParams(max_tokens=40))
                if e.kind == "token" for t in e.tokens]
        for r in drafted:
            options = {"beam_length": 5, "draft_cutoff": 0.1, "lookup": 0, "runners_up": 0,
                       "verify_cost": False, "draft_trust": False, "deepen_reach": r}
            tokens, steps = steps_of(engine, prompt, **options)
            assert tokens == want
            drafted[r] += sum(d for d, _ in steps)
    assert drafted[reach] < drafted[0.0]
