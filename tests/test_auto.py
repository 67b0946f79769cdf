"""`--method auto`: which method the chooser takes per request, from its prediction and from what
it measured, and the engine's answers with it (the chosen method's, and they say so)."""

import numpy as np
import pytest

from mlx_specdec.auto import MARGIN, MethodChooser, band_of
from mlx_specdec.drafting.verify_cost import CostTable, shipped_table

CHEAP = CostTable(np.array([100.0, 8000.0]), np.array([[1.0, 1.02, 1.04, 1.06, 1.08]] * 2), "cheap")
DEAR = CostTable(np.array([100.0, 8000.0]), np.array([[1.0, 1.4, 1.8, 2.2, 2.6]] * 2), "dear")


def measure(chooser, method, rate, times=3, greedy=False, prompt=200):
    for _ in range(times):
        chooser.record(method, prompt, greedy, rate, tokens=96)


def test_without_a_head_or_for_a_request_redrafter_cannot_take_it_is_ar():
    assert MethodChooser(CHEAP, has_head=False).choose(200, True).method == "ar"
    choice = MethodChooser(CHEAP, has_head=True).choose(200, True, unsupported="no penalties")
    assert choice == ("ar", "no penalties")


def test_before_any_answer_the_verify_cost_table_predicts():
    assert MethodChooser(CHEAP, True).choose(200, False).method == "redrafter"
    dear = MethodChooser(DEAR, True)
    assert dear.choose(200, False).method == "ar"
    measure(dear, "ar", 20.0)
    assert dear.choose(200, False).method == "redrafter"  # the second answer tries the other
    measure(dear, "redrafter", 12.0)
    assert dear.choose(200, False).method == "ar"  # measured slower: plain decoding from now on
    # another band of the same sampling: the loss measured above is predicted there too
    measure(dear, "ar", 18.0, prompt=2000)
    assert dear.choose(2000, False).method == "ar"
    unknown = MethodChooser(None, True)  # no table: plain decoding first, then one try
    assert unknown.choose(200, True).method == "ar"
    measure(unknown, "ar", 20.0, greedy=True)
    assert unknown.choose(200, True).method == "redrafter"


def test_where_each_drafted_token_costs_a_forward_redrafter_is_never_tried():
    from mlx_specdec.drafting.verify_cost import row_by_row_table

    chooser = MethodChooser(row_by_row_table(), True)  # a quantized model kept packed on the CPU
    for _ in range(3):
        choice = chooser.choose(200, False)
        assert choice.method == "ar" and "cannot pay" in choice.why
        measure(chooser, "ar", 7.5)
    assert not MethodChooser(DEAR, True).cannot_pay(200, False)  # dear, but a draft still pays a little


def test_once_both_are_measured_the_faster_wins_and_a_tie_is_ar_s():
    chooser = MethodChooser(CHEAP, True)
    measure(chooser, "redrafter", 19.0)
    assert chooser.choose(200, False).method == "ar"  # measuring ar against it
    measure(chooser, "ar", 15.0)
    choice = chooser.choose(200, False)
    assert choice.method == "redrafter" and "1.27x" in choice.why
    measure(chooser, "ar", 19.0 / MARGIN * 1.001, times=7)  # within the margin: ar
    assert chooser.choose(200, False).method == "ar"
    assert chooser.choose(200, True).method == "redrafter"  # greedy is its own band, unmeasured
    long = chooser.choose(5000, False)  # so is a long prompt: predicted from the tie measured above
    assert long.method == "ar" and "other measurements" in long.why


def test_a_busy_server_and_short_answers():
    chooser = MethodChooser(CHEAP, True)
    assert chooser.choose(200, True, busy=True).method == "ar"
    chooser.record("redrafter", 200, True, 50.0, tokens=3)  # too short to say anything
    assert not chooser.rates[("redrafter", True, band_of(200))]


def test_what_a_machine_measured_is_kept_across_processes(tmp_path):
    store = tmp_path / "auto.json"
    first = MethodChooser(CHEAP, True, store)
    measure(first, "ar", 15.0)
    measure(first, "redrafter", 10.0)
    first.record("redrafter", 200, False, 10.0, tokens=96, acceptance=[0.2, 0.05])
    again = MethodChooser(CHEAP, True, store)  # a new process
    assert again.choose(200, False).method == "ar"
    assert again.acceptance[False] == [0.2, 0.05]
    store.write_text("{not json")
    assert MethodChooser(CHEAP, True, store).choose(200, False).method == "redrafter"  # unreadable: the prior


def test_the_prior_takes_this_machine_s_acceptance_and_step_overhead():
    chooser = MethodChooser(CHEAP, True)
    prior = chooser.predicted_speedup(300, True)
    chooser.record("redrafter", 300, True, 30.0, tokens=96, acceptance=[0.9, 0.8, 0.7, 0.6, 0.5])
    assert chooser.predicted_speedup(300, True) > prior  # likelier drafts: more tokens a step
    measure(chooser, "ar", 20.0, greedy=True, prompt=300)  # measured 1.5x in the short band
    assert chooser.predicted_speedup(300, True) == pytest.approx(1.5)
    assert chooser.predicted_speedup(6000, True) < 1.5 + 1e-9  # a dearer verify at a long context


def test_the_shipped_cpu_table_predicts_speculation_pays_on_a_short_prompt():
    chooser = MethodChooser(shipped_table(), True)
    assert chooser.predicted_speedup(200, True) > MARGIN


@pytest.mark.slow
def test_auto_answers_as_the_method_it_chose_and_says_which():
    from mlx_specdec.decoding import GenerationParams
    from mlx_specdec.engine import Engine

    engine = Engine.load("default")
    params = GenerationParams(max_tokens=24, temperature=0.0)
    plain = [e for e in engine.generate("Name three colours.", "ar", params)]
    for _ in range(3):
        events = list(engine.generate("Name three colours.", "auto", params))
        stats = events[-1].stats
        assert stats.extra["auto"]["chose"] == stats.method in ("ar", "redrafter")
        assert stats.extra["auto"]["why"]
        assert events[0].chosen == stats.extra["auto"]  # said from the first event on (the chat's status bar)
        assert all(e.chosen is None for e in events[1:])
        assert sum((e.tokens for e in events), []) == sum((e.tokens for e in plain), [])
    assert engine.chooser.rates  # every answer of ar and redrafter was measured
