"""The cost-aware step length (drafting/verify_cost.py): a step verifies the depth with the most
expected tokens per unit of the measured verify cost at its context, within what the cutoff keeps."""

import numpy as np
import pytest

from mlx_specdec.drafting.tree import dedup_prefix
from mlx_specdec.drafting.verify_cost import CPU_CONTEXTS, CPU_COST, CostTable, shipped_table, verify_cost, worth_verifying

# The rule's cases below are worked out on the table first measured (a 2-core VM before the small-row
# GEMM, a 5-token verify after 150 tokens at 1.60), whatever table ships now.
FIRST_VM = CostTable(np.array([150.0, 2000.0, 6000.0]), np.array([
    [1.0, 1.18, 1.32, 1.47, 1.60], [1.0, 1.27, 1.44, 1.63, 1.78], [1.0, 1.34, 1.59, 1.88, 2.08]]), "test")


def worth(*args, **kwargs) -> int:
    return worth_verifying(*args, table=FIRST_VM, **kwargs)


def test_verify_cost_is_the_table_at_measured_contexts_interpolated_between_and_extended_past_it():
    assert verify_cost(1, 150) == 1.0
    assert verify_cost(3, int(CPU_CONTEXTS[-1])) == pytest.approx(CPU_COST[-1, 2])
    middle = int((CPU_CONTEXTS[0] + CPU_CONTEXTS[1]) / 2)
    assert verify_cost(2, middle) == pytest.approx((CPU_COST[0, 1] + CPU_COST[1, 1]) / 2)
    assert verify_cost(2, 100_000) == pytest.approx(CPU_COST[-1, 1])  # held flat past the last context
    step, width = CPU_COST[0, -1] - CPU_COST[0, -2], CPU_COST.shape[1]
    assert verify_cost(width + 2, 150) == pytest.approx(CPU_COST[0, -1] + 2 * step)
    for context in (150, 1000, 4000, 6000):  # more tokens never cost less
        costs = [verify_cost(t, context) for t in range(1, 9)]
        assert costs == sorted(costs)


def _chain(probs):
    """One row, one beam of len(probs) drafts: (probs (1, 1, L-1), owner (1, 1, L))."""
    beams = np.arange(len(probs) + 1, dtype=np.int32)[None, None]
    return np.array([[probs]], dtype=np.float32), dedup_prefix(beams, np)


def test_sure_drafts_are_all_verified_and_a_plain_step_is_kept_when_the_cutoff_leaves_none():
    probs, owner = _chain([0.95, 0.95, 0.95, 0.95])
    assert worth(probs, owner, kept=5, context=150) == 5
    assert worth(probs, owner, kept=5, context=6000) == 5
    assert worth(probs, owner, kept=1, context=150) == 1
    assert worth(probs, owner, kept=3, context=150) == 3  # never deeper than the cutoff allows


def test_a_doubtful_draft_worth_verifying_at_chat_length_is_not_worth_it_over_a_long_document():
    # One draft at 0.25: 1.25 expected tokens for 1.18 plain steps at 150 tokens of context (worth
    # it), for 1.34 at 6,000 (not: a plain step's 1 token per step is the better rate).
    probs, owner = _chain([0.25])
    assert worth(probs, owner, kept=2, context=150) == 2
    assert worth(probs, owner, kept=2, context=6000) == 1


def test_a_deep_draft_that_is_rarely_reached_is_cut_while_the_likely_first_is_kept():
    probs, owner = _chain([0.6, 0.1, 0.9])  # reach: 0.6, 0.06, 0.054
    assert worth(probs, owner, kept=4, context=150) == 2


def test_the_cost_counts_the_packed_tree_tokens_of_the_widest_row():
    # Two beams that differ from the first draft on: depth 1 packs 1 + 2 tokens, not 2.
    beams = np.array([[[5, 1, 2], [5, 3, 4]]], dtype=np.int32)
    owner = dedup_prefix(beams, np)
    probs = np.array([[[0.35, 0.5], [0.35, 0.5]]], dtype=np.float32)
    # 1.35 expected tokens for verify_cost(3) = 1.32 at chat length beats 1 token for 1; two drafts
    # deep, 1.525 for 5 tokens (1.60), does not.
    assert worth(probs, owner, kept=3, context=150) == 2
    assert worth(probs, owner, kept=2, context=6000) == 1  # 1.3 for 1.45: a plain step


def test_redrafter_verifies_nothing_where_every_draft_costs_more_than_it_can_return():
    """With a table where one more query token costs 10 plain steps, every step is a plain step:
    one forward per token, output still plain decoding's; with the rule off the same drafts are verified."""
    from mlx_specdec.drafting.verify_cost import CostTable, shipped_table
    from conftest import make_tiny_lm
    from test_redrafter import PROMPTS, engine_with, oracle_head, run

    lm = make_tiny_lm(seed=1)
    engine = engine_with(lm, oracle_head(lm, PROMPTS[:1], corrupt=0.0))
    engine._resources["verify_costs"] = shipped_table()  # on any device, whatever `calibrate` stored here
    want, _ = run(engine, PROMPTS[0], "ar", max_tokens=24)
    options = {"lookup": 0, "draft_cutoff": 0.01}
    drafted, on_default = run(engine, PROMPTS[0], "redrafter", max_tokens=24, options=options)
    engine._resources["verify_costs"] = CostTable(CPU_CONTEXTS, np.array([[1.0, 11.0, 21.0, 31.0, 41.0]] * 3), "dear")
    plain, on_dear = run(engine, PROMPTS[0], "redrafter", max_tokens=24, options=options)
    _, off = run(engine, PROMPTS[0], "redrafter", max_tokens=24, options={**options, "verify_cost": False})
    assert drafted == plain == want
    assert on_dear.forward_passes == len(want)  # a forward per token: nothing drafted was verified
    assert on_default.forward_passes < len(want) and off.forward_passes == on_default.forward_passes


def test_the_margin_rule_goes_deeper_on_a_sure_step_and_cuts_a_doubtful_draft_the_ratio_keeps():
    # Rate 1.25 tokens per unit of cost. Sure chain 0.9, 0.9, 0.3 (reach 0.9, 0.81, 0.243): the
    # third draft adds 0.243 tokens for 0.15 more cost (T 3 -> 4: 1.32 -> 1.47): worth it by the
    # margin (0.243 > 1.25 * 0.15), not by the step's ratio (2.953 / 1.47 < 2.71 / 1.32).
    probs, owner = _chain([0.9, 0.9, 0.3])
    assert worth(probs, owner, kept=4, context=150) == 3
    assert worth(probs, owner, kept=4, context=150, rate=1.25) == 4
    # One draft at 0.2: the ratio keeps it (1.2 / 1.18 > 1), the margin does not (0.2 < 1.25 * 0.18).
    probs, owner = _chain([0.2])
    assert worth(probs, owner, kept=2, context=150) == 2
    assert worth(probs, owner, kept=2, context=150, rate=1.25) == 1


def test_the_rate_meter_is_tokens_over_predicted_cost_from_its_prior():
    from mlx_specdec.drafting.verify_cost import RateMeter

    meter = RateMeter()
    assert meter.rate == pytest.approx(RateMeter.PRIOR_RATE)
    meter.add(3.0, step_tokens=3, context=150)  # 3 tokens for a 3-token verify (1.32)
    want = (RateMeter.PRIOR_RATE * RateMeter.PRIOR_COST + 3.0) / (RateMeter.PRIOR_COST + verify_cost(3, 150))
    assert meter.rate == pytest.approx(want)


def test_sampling_counts_w_tokens_a_depth_whatever_the_chains_drew():
    # Two sampled chains that drew the same first token pack 1 + 1 + 2 tokens, two that did not
    # 1 + 2 + 2: greedy counts what is packed, sampling 1 + 2k either way (fixed before the draws).
    probs = np.array([[[0.35, 0.5], [0.35, 0.5]]], dtype=np.float32)
    shared = dedup_prefix(np.array([[[5, 1, 2], [5, 1, 4]]], dtype=np.int32), np)
    apart = dedup_prefix(np.array([[[5, 1, 2], [5, 3, 4]]], dtype=np.int32), np)
    table = shipped_table()
    greedy = [worth_verifying(probs, owner, 2, 6000, table=table) for owner in (shared, apart)]
    sampled = [worth_verifying(probs, owner, 2, 6000, table=table, breadth=np.array([2])) for owner in (shared, apart)]
    assert greedy == [2, 1]  # 1.35 tokens for 1.23 (shared) or for 1.46 (apart)
    assert sampled == [1, 1]


def test_on_a_convex_table_the_first_peak_sampling_takes_is_greedy_s_argmax():
    rng = np.random.default_rng(0)
    for _ in range(300):
        steps = np.sort(rng.uniform(0.0, 0.4, size=7))  # convex: each more token costs at least the last
        table = CostTable(np.array([150.0]), np.concatenate([[1.0], 1.0 + np.cumsum(steps)])[None], "convex")
        probs, owner = _chain(rng.uniform(0.0, 1.0, size=5))
        rate = [None, float(rng.uniform(0.5, 2.0))][int(rng.integers(2))]
        kept = int(rng.integers(1, 7))
        assert worth_verifying(probs, owner, kept, 150, rate=rate, table=table, breadth=np.array([1])) == \
            worth_verifying(probs, owner, kept, 150, rate=rate, table=table)


def test_a_quantized_model_kept_packed_on_the_cpu_plans_no_drafts(tmp_path, monkeypatch):
    """MLX's CPU quantized matmul takes rows one at a time: the shipped table (float weights)
    does not describe such a model; the row-by-row table makes every extra token cost a forward."""
    from types import SimpleNamespace

    from mlx_specdec.drafting.cost_probe import cost_table_for
    from mlx_specdec.drafting.verify_cost import row_by_row_table
    from mlx_specdec.model.device import on_cpu

    if not on_cpu():
        pytest.skip("the CPU's tables")
    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path))  # no table calibrated for these
    packed = SimpleNamespace(name="q", bits=4, dequantized=False, dtype="float32", model=None)
    assert cost_table_for(packed).source == row_by_row_table().source
    assert cost_table_for(SimpleNamespace(**{**vars(packed), "dequantized": True})).source == shipped_table().source
    probs = np.full((1, 1, 4), 0.9)
    owner = np.zeros((1, 1, 5), dtype=int)
    assert worth_verifying(probs, owner, 5, 300, table=row_by_row_table()) == 1  # a plain step
    assert worth_verifying(probs, owner, 5, 300, table=shipped_table()) > 1
