"""Runners-up (`redrafter --runners-up N`): the head's next choices for a chain's first draft,
verified as its siblings in the same forward; greedy output stays the target's."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.acceptance import greedy_accept
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.redrafter_head.beam import compiled_chain
from mlx_specdec.drafting.tree import pack_beams, with_runners_up
from mlx_specdec.drafting.verify_cost import CostTable, runners_up_worth

from conftest import make_tiny_lm
from test_redrafter import PROMPTS, BigramOracle, engine_with, random_head, run


def test_runners_up_are_children_of_the_root_accepted_one_deep_where_the_first_draft_is_not():
    x0, a, b, r1, r2 = 7, 11, 12, 21, 22
    beams = np.array([[[x0, a, b]]], dtype=np.int32)  # (B=1, W=1, L=3): one chain
    trees = [pack_beams(beams[0], np.zeros((1, 3), dtype=np.int32))]
    wide, packed = with_runners_up(beams, trees, np.array([[r1, r2]]), np.array([[True, False]]))
    tree = packed[0]
    assert tree.tokens.tolist() == [x0, a, b, r1]  # the chain, then r1 beside a; r2 not verified
    assert tree.parents.tolist() == [-1, 0, 1, 0]
    assert tree.depths.tolist() == [0, 1, 2, 1]
    assert tree.index.tolist() == [[0, 1, 2], [0, 3, 3], [0, 0, 0]]
    assert wide[0].tolist() == [[x0, a, b], [x0, r1, -1], [x0, -1, -1]]

    # The target's argmax at each packed position: after x0 comes r1 (not a), after r1 comes 30.
    V = 40
    logits = np.zeros((1, 4, V), dtype=np.float32)
    for position, target in enumerate([r1, b, 5, 30]):
        logits[0, position, target] = 1.0
    beam_logits = mx.take_along_axis(mx.array(logits), mx.array(tree.index.reshape(1, -1))[..., None], axis=1)
    result = greedy_accept(mx.array(wide), beam_logits.reshape(1, 3, 3, V))
    assert (int(result.beam[0]), int(result.num_accepted[0]), int(result.next_token[0])) == (1, 1, 30)

    # Where the first draft is right the chain wins, however the runner-up fares.
    logits[0, 0] = 0.0
    logits[0, 0, a] = 1.0
    beam_logits = mx.take_along_axis(mx.array(logits), mx.array(tree.index.reshape(1, -1))[..., None], axis=1)
    result = greedy_accept(mx.array(wide), beam_logits.reshape(1, 3, 3, V))
    assert (int(result.beam[0]), int(result.num_accepted[0])) == (0, 2)


def test_runners_up_are_verified_only_while_they_raise_tokens_per_unit_of_cost():
    free = CostTable(np.array([150.0]), np.array([[1.0, 1.1, 1.2, 1.2, 1.2, 1.2]]), "test")
    dear = CostTable(np.array([150.0]), np.array([[1.0, 1.1, 1.2, 1.5, 1.8, 2.1]]), "test")
    probs = np.array([0.2, 0.1, 0.05])
    # a 3-token chain expecting 1.6 tokens: 1.6 / 1.2 now
    assert runners_up_worth(1.6, 3, probs, 150, free) == 3  # each adds tokens at no cost
    assert runners_up_worth(1.6, 3, probs, 150, dear) == 0  # 1.8 / 1.5 < 1.6 / 1.2
    assert runners_up_worth(1.6, 3, np.zeros(3), 150, free) == 0  # nothing to gain


def test_the_chain_s_runners_up_are_the_head_s_next_choices_with_their_probabilities():
    lm = make_tiny_lm(seed=2)
    head, embed = random_head(lm), lm.model.model.embed_tokens
    hidden = mx.random.normal((3, 64), key=mx.random.key(1))
    first = mx.array([5, 17, 60])
    plain = compiled_chain(head, embed)[0](hidden, first)
    state, draft, score, confidence, runners, runner_conf = compiled_chain(head, embed, 2)[0](hidden, first)
    for got, want in zip((state, draft, score, confidence), plain):  # the chain itself unchanged
        assert np.array_equal(np.array(got), np.array(want))
    probs = np.array(mx.softmax(head.logits(head.initial_state(embed(first)), hidden).astype(mx.float32), axis=-1))
    order = np.argsort(-probs, axis=-1, kind="stable")
    d2f = np.array(head.draft_to_full)
    assert np.array_equal(np.array(draft), d2f[order[:, 0]])
    assert np.array_equal(np.array(runners), d2f[order[:, 1:3]])
    np.testing.assert_allclose(np.array(runner_conf), np.take_along_axis(probs, order[:, 1:3], axis=-1), rtol=1e-5)


def second_guess_head(lm, prompts):
    """A head whose first choice is always wrong and whose second is the target's greedy successor
    (logit 21 for a wrong token, 20 for the right one): every step's chain is rejected at once and
    a runner-up is what gets accepted."""
    table = np.random.default_rng(0).normal(size=(97, 97)).astype(np.float32)
    engine = engine_with(lm, None)
    for prompt in prompts:
        seq = prompt + run(engine, prompt, "ar", max_tokens=40)[0]
        for a, b in zip(seq, seq[1:]):
            table[a, b], table[a, (b + 1) % 97] = 20.0, 21.0
    return BigramOracle(lm.model.model.embed_tokens.weight, mx.array(table), 97)


def answer_oracle(lm, prompts):
    """A head that knows the target's greedy successors in its answers (not in the prompts, whose
    bigrams a lookup would find): where a lookup proposes the prompt's pattern, it is right."""
    table = np.random.default_rng(0).normal(size=(97, 97)).astype(np.float32)
    engine = engine_with(lm, None)
    for prompt in prompts:
        seq = prompt[-1:] + run(engine, prompt, "ar", max_tokens=40)[0]
        for a, b in zip(seq, seq[1:]):
            table[a, b] = 20.0
    return BigramOracle(lm.model.model.embed_tokens.weight, mx.array(table), 97)


@pytest.mark.parametrize("runners_up", [1, 3])
def test_greedy_redrafter_with_runners_up_equals_plain_decoding_and_accepts_them(runners_up):
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, second_guess_head(lm, PROMPTS))
    options = {"beam_length": 4, "draft_cutoff": 0.2, "draft_trust": False, "lookup": 0,
               "verify_cost": False, "runners_up": runners_up}
    for prompt in PROMPTS:
        want, plain_stats = run(engine, prompt, "ar", max_tokens=40)
        without, stats_without = run(engine, prompt, "redrafter", max_tokens=40, options={**options, "runners_up": 0})
        got, stats = run(engine, prompt, "redrafter", max_tokens=40, options=options)
        assert got == want == without
        assert stats.extra["runners_up_accepted"] > 0 and stats_without.extra["runners_up_verified"] == 0
        assert stats.forward_passes < stats_without.forward_passes  # the runners-up saved forwards


@pytest.mark.parametrize("depths", [1, 2])
def test_batched_rows_with_runners_up_each_equal_their_own_plain_decoding(depths):
    lm = make_tiny_lm(seed=4, eos_id=96)
    prompts = PROMPTS + [[7], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    engine = engine_with(lm, (second_guess_head if depths == 1 else alternating_head)(lm, prompts))
    want = [run(engine, p, "ar", max_tokens=30)[0] for p in prompts]
    rows, accepted = {}, 0
    params = GenerationParams(max_tokens=30, options={"beam_length": 3 + depths, "draft_cutoff": 0.2,
                                                      "draft_trust": False, "lookup": 0, "verify_cost": False,
                                                      "runners_up": 2, "runners_up_depths": depths})
    for e in engine.generate_ids_batch(prompts, "redrafter", params):
        if e.kind == "token":
            rows.setdefault(e.thread_id, []).extend(e.tokens)
        if e.stats is not None:
            accepted = e.stats.extra.get("runners_up_accepted", 0)
    assert [rows.get(i, []) for i in range(len(prompts))] == want
    assert accepted > 0


def test_deeper_runners_up_are_children_of_the_chain_accepted_where_its_own_draft_there_is_not():
    x0, a, b, c, r1, r2 = 7, 11, 12, 13, 21, 22
    beams = np.array([[[x0, a, b, c]]], dtype=np.int32)
    trees = [pack_beams(beams[0], np.zeros((1, 4), dtype=np.int32))]
    # r1 beside a (depth 1), r2 beside b (depth 2: a child of a)
    wide, packed = with_runners_up(beams, trees, np.array([[r1, r2]]), np.array([[True, True]]), np.array([1, 2]))
    tree = packed[0]
    assert tree.tokens.tolist() == [x0, a, b, c, r1, r2]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 1]
    assert tree.depths.tolist() == [0, 1, 2, 3, 1, 2]
    assert tree.index.tolist() == [[0, 1, 2, 3], [0, 4, 4, 4], [0, 1, 5, 5]]
    assert wide[0].tolist() == [[x0, a, b, c], [x0, r1, -1, -1], [x0, a, r2, -1]]
    # The target says a, then r2 (not b), then 40: the depth-2 runner-up carries two drafts.
    V = 48
    logits = np.zeros((1, 6, V), dtype=np.float32)
    for position, target in enumerate([a, r2, 5, 5, 5, 40]):
        logits[0, position, target] = 1.0
    beam_logits = mx.take_along_axis(mx.array(logits), mx.array(tree.index.reshape(1, -1))[..., None], axis=1)
    result = greedy_accept(mx.array(wide), beam_logits.reshape(1, 3, 4, V))
    assert (int(result.beam[0]), int(result.num_accepted[0]), int(result.next_token[0])) == (2, 2, 40)


def alternating_head(lm, prompts):
    """A head right first at every other greedy bigram and right second at the others (logits 21
    and 20.5): chains break at their second draft half the time, where a depth-2 runner-up is right."""
    table = np.random.default_rng(1).normal(size=(97, 97)).astype(np.float32)
    engine = engine_with(lm, None)
    for prompt in prompts:
        seq = prompt + run(engine, prompt, "ar", max_tokens=40)[0]
        for i, (x, y) in enumerate(zip(seq, seq[1:])):
            right, wrong = (21.0, 20.5) if i % 2 == 0 else (20.5, 21.0)
            table[x, y], table[x, (y + 1) % 97] = right, wrong
    return BigramOracle(lm.model.model.embed_tokens.weight, mx.array(table), 97)


def test_runners_up_beside_the_second_draft_keep_greedy_output_and_are_accepted():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, alternating_head(lm, PROMPTS))
    options = {"beam_length": 4, "draft_cutoff": 0.2, "draft_trust": False, "lookup": 0,
               "verify_cost": False, "runners_up": 2, "runners_up_depths": 1}
    deeper = 0
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        first_only, stats_first = run(engine, prompt, "redrafter", max_tokens=40, options=options)
        got, stats = run(engine, prompt, "redrafter", max_tokens=40, options={**options, "runners_up_depths": 2})
        assert got == want == first_only
        assert stats_first.extra["runners_up_deeper_accepted"] == 0
        deeper += stats.extra["runners_up_deeper_accepted"]
    assert deeper > 0


def test_a_wider_beam_s_second_chain_is_a_chain_not_a_runner_up():
    """With W = 2 (no runners-up), the second beam winning is a chain's acceptance: it counts for the
    head's trust as such and is not tallied as a runner-up."""
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, alternating_head(lm, PROMPTS))
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        got, stats = run(engine, prompt, "redrafter", max_tokens=40,
                         options={"beam_width": 2, "beam_length": 4, "lookup": 0, "runners_up": 2})
        assert got == want
        assert stats.extra["runners_up_verified"] == stats.extra["runners_up_accepted"] == 0


def test_chain_drafts_and_runners_up_compete_for_the_verify_s_tokens_likeliest_first():
    from mlx_specdec.drafting.runners_up import plan_step

    rising = CostTable(np.array([150.0]), np.array([[1.0, 1.02, 1.04, 1.06, 1.08, 1.5]]), "test")
    reach = np.array([[0.9, 0.6, 0.3, 0.12]])  # the chain's drafts 1..4 reached
    runners = np.array([[0.08, 0.2, 0.02]])  # depths 1, 1, 2
    depths = np.array([1, 1, 2])
    # Four nodes fit before the cost jumps: 0.9, 0.6, 0.3 and the 0.2 runner-up, not the chain's 0.12.
    step_length, verify = plan_step(reach, runners, depths, 150, rising)
    assert step_length == 4 and verify.tolist() == [[False, True, False]]
    # (Chain first: 4 drafts, 2.92 tokens over 1.08, then the runner-up not worth a sixth token at 1.5.)
    free = CostTable(np.array([150.0]), np.array([[1.0] * 8]), "test")
    step_length, verify = plan_step(reach, runners, depths, 150, free)  # every node with a gain pays
    assert step_length == 5 and verify.tolist() == [[True, True, True]]
    dear = CostTable(np.array([150.0]), np.array([[1.0, 3.0]]), "test")
    step_length, verify = plan_step(reach, runners, depths, 150, dear)  # a plain step
    assert step_length == 1 and not verify.any()


def test_a_planned_batch_shares_one_forward_and_rows_with_short_chains_keep_their_best_runners_up():
    from mlx_specdec.drafting.runners_up import plan_step

    table = CostTable(np.array([150.0]), np.array([[1.0, 1.0, 1.0, 1.0, 2.0]]), "test")  # 4 tokens: 3 nodes
    reach = np.array([[0.9, 0.8, 0.7], [0.5, 0.0, 0.0]])
    runners = np.array([[0.05, 0.0], [0.3, 0.2]])
    step_length, verify = plan_step(reach, runners, np.array([1, 1]), 150, table)
    # row 0 takes its chain's 3 drafts; row 1 its 0.5 draft and both runners-up, but the batch's
    # chains are 3 deep, which leaves row 1 no room: 4 tokens a row at most
    assert step_length == 4
    assert verify.tolist() == [[False, False], [False, False]]
    table = CostTable(np.array([150.0]), np.array([[1.0, 1.0, 1.0, 1.0, 1.0, 3.0]]), "test")  # 5 tokens
    step_length, verify = plan_step(reach, runners, np.array([1, 1]), 150, table)
    # four nodes a row: row 0 adds its 0.05 runner-up, row 1 only its 0.3 one beside a 3-deep chain
    assert step_length == 4 and verify.tolist() == [[True, False], [True, False]]


@pytest.mark.parametrize("depths", [1, 2])
def test_greedy_redrafter_with_competing_runners_up_equals_plain_decoding(depths):
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, (second_guess_head if depths == 1 else alternating_head)(lm, PROMPTS))
    options = {"beam_length": 4, "draft_cutoff": 0.2, "draft_trust": False, "lookup": 0, "runners_up": 2,
               "runners_up_depths": depths, "runners_compete": True}
    verified = 0
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        got, stats = run(engine, prompt, "redrafter", max_tokens=40, options=options)
        assert got == want
        verified += stats.extra["runners_up_accepted"]
    assert verified > 0


def test_beside_a_lookup_s_chain_the_head_s_first_choices_are_offered_discounted_at_depth_1_only():
    from mlx_specdec.drafting.runners_up import HEAD_BESIDE_LOOKUP, runner_columns

    tokens = np.array([[[11, 12], [21, 22]], [[31, 7], [41, 42]], [[51, 52], [61, 62]]])  # (B, D, S)
    confidence = np.full((3, 2, 2), 0.2)
    chains = np.array([[1, 10, 20], [2, 7, 40], [3, 50, 60]])  # row 0 the head's; rows 1-2 lookups
    judged = np.full((3, 2), 0.5)
    head_rows = np.array([True, False, False])
    first = (np.array([10, 30, 50]), np.array([0.6, 0.6, 0.6]))  # row 2's head agrees with its lookup
    got, gains, depths = runner_columns(tokens, confidence, chains, judged, 3, head_rows, lambda c: c, first)
    assert depths.tolist() == [1, 1, 1, 2, 2]
    assert got.tolist() == [[10, 11, 12, 21, 22], [30, 31, 7, 41, 42], [50, 51, 52, 61, 62]]
    d = HEAD_BESIDE_LOOKUP
    np.testing.assert_allclose(gains, [
        [0.0, 0.2, 0.2, 0.1, 0.1],  # the head's row: its chain's first is not a runner-up of itself
        [d * 0.6, d * 0.2, 0.0, 0.0, 0.0],  # a lookup's row: the head's first, its runner-up 31 (7 is the lookup's)
        [0.0, 0.0, 0.0, 0.0, 0.0]])  # the head agrees with the lookup: nothing beside it
    without, plain_gains, plain_depths = runner_columns(tokens, confidence, chains, judged, 3, head_rows, lambda c: c)
    assert without.tolist() == got[:, 1:].tolist() and plain_depths.tolist() == [1, 1, 2, 2]
    np.testing.assert_allclose(plain_gains, [[0.2, 0.2, 0.1, 0.1], [0.0] * 4, [0.0] * 4])


def every_pair(symbols):
    """A text holding every ordered pair of the symbols (an Eulerian circuit of the complete digraph
    with loops): after it, any two of them in a row were seen before, so a lookup always drafts."""
    out = {a: list(symbols) for a in symbols}
    stack, path = [symbols[0]], []
    while stack:
        if out[stack[-1]]:
            stack.append(out[stack[-1]].pop())
        else:
            path.append(stack.pop())
    return path[::-1]


@pytest.mark.parametrize("compete", [True, False])
def test_greedy_redrafter_with_the_head_beside_lookups_equals_plain_decoding_and_rescues_them(compete):
    """A prompt of every pair of 17 tokens: the answer's first steps draft from lookups that follow
    the prompt, not the model; the head (which knows the answer's bigrams) is right beside them."""
    lm = make_tiny_lm(seed=2, eos_id=96)
    symbols = sorted(set(run(engine_with(lm, None), PROMPTS[0], "ar", max_tokens=40)[0]))
    prompt = every_pair(symbols)
    assert len(prompt) == len(symbols) ** 2 + 1
    engine = engine_with(lm, answer_oracle(lm, [prompt]))
    options = {"beam_length": 4, "draft_cutoff": 0.2, "lookup": 4, "runners_up": 2, "runners_compete": compete}
    want, _ = run(engine, prompt, "ar", max_tokens=40)
    got, beside = run(engine, prompt, "redrafter", max_tokens=40, options={**options, "head_beside_lookup": True})
    alone, lookup_alone = run(engine, prompt, "redrafter", max_tokens=40, options={**options, "head_beside_lookup": False})
    assert got == alone == want
    assert beside.extra["lookup_steps"] == lookup_alone.extra["lookup_steps"] == 1.0  # every step a lookup's
    assert lookup_alone.extra["runners_up_verified"] == 0 < beside.extra["runners_up_accepted"]
    assert beside.forward_passes < lookup_alone.forward_passes


def test_a_runner_up_likelier_than_its_lookup_sibling_is_verified_with_the_chain_s_first_draft():
    """The head beside a lookup can be likelier than the lookup's first draft. A tree of the head's
    draft alone cannot be packed (runners-up hang beside a chain), so the chain's first comes too:
    one token wider than planned, rather than a plain step."""
    from mlx_specdec.drafting.runners_up import plan_step

    table = CostTable(np.array([150.0]), np.array([[1.0, 1.0, 2.0, 3.0]]), "test")  # a second token is free
    step_length, verify = plan_step(np.array([[0.3, 0.1]]), np.array([[0.6]]), np.array([1]), 150, table)
    assert step_length == 2 and verify.tolist() == [[True]]
    # in a batch, a row whose chain the planner took keeps its own plan
    step_length, verify = plan_step(np.array([[0.3, 0.1], [0.9, 0.8]]), np.array([[0.6], [0.05]]), np.array([1]), 150,
                                    table)
    assert step_length == 2 and verify.tolist() == [[True], [False]]
