"""Plain decoding's rate by context and sampling mode (plain_rate.py), and the engine stating each
answer's speed-up against it (engine_measured.py): the chat's ×-figure and the API's."""

import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.plain_rate import PlainRates, mean_context, mode_of


def test_the_mode_is_what_changes_plain_decoding_s_cost():
    assert mode_of(GenerationParams()) == "greedy"
    assert mode_of(GenerationParams(top_p=0.5)) == "greedy"  # an argmax sorts nothing
    assert mode_of(GenerationParams(temperature=0.7, top_p=0.9)) == "top-p"
    assert mode_of(GenerationParams(temperature=0.7)) == "sampled"
    assert mode_of(GenerationParams(temperature=0.7, repetition_penalty=1.1)) == "sampled+penalties"
    assert mean_context(40, 200) == 140


def test_only_points_near_the_context_in_the_same_mode_count():
    rates = PlainRates()
    rates.record("top-p", 100, 65, 20.0)  # mean context 132
    assert rates.tps_at("top-p", 132) == pytest.approx(20.0)
    assert rates.tps_at("top-p", 250) == pytest.approx(20.0)  # within a factor of 2
    assert rates.tps_at("top-p", 300) is None  # too far: no figure rather than a wrong one
    assert rates.tps_at("top-p", 60) is None
    assert rates.tps_at("greedy", 132) is None  # another mode's cost is not this one's
    rates.record("greedy", 100, 5, 30.0)  # too short to say anything
    assert rates.tps_at("greedy", 102) is None


def test_a_spread_of_contexts_is_fitted_as_a_line():
    rates = PlainRates()
    for context, ms in ((100, 40.0), (150, 45.0), (200, 50.0)):  # 10 ms more per 100 tokens
        rates.record("greedy", context - 50, 100, 1000.0 / ms)
    assert 1000.0 / rates.tps_at("greedy", 175) == pytest.approx(47.5)
    assert 1000.0 / rates.tps_at("greedy", 199) == pytest.approx(49.9)
    assert 1000.0 / rates.tps_at("greedy", 300) == pytest.approx(47.5)  # two points near 300: their median
    falling = PlainRates()  # a slope below zero is noise: the median
    for context, ms in ((100, 50.0), (150, 45.0), (200, 40.0)):
        falling.record("greedy", context - 50, 100, 1000.0 / ms)
    assert 1000.0 / falling.tps_at("greedy", 150) == pytest.approx(45.0)


def test_points_are_kept_across_processes_and_a_broken_file_is_ignored(tmp_path):
    store = tmp_path / "plain.json"
    PlainRates(store).record("top-p", 40, 129, 25.0)
    assert PlainRates(store).tps_at("top-p", 104) == pytest.approx(25.0)
    store.write_text("{not json")
    assert PlainRates(store).tps_at("top-p", 104) is None


@pytest.mark.slow
def test_the_engine_states_each_answer_s_speedup_over_plain_at_its_context(tmp_path, monkeypatch):
    from mlx_specdec.engine import Engine
    from mlx_specdec.engine_measured import WARM_PROMPT
    from mlx_specdec.jsonstore import MEASURED_DIR_ENV

    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))  # nothing measured yet
    engine = Engine.load("default")
    params = GenerationParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=3)
    assert engine.warm_up("auto", params) > 0
    mode = mode_of(params)
    assert [mode] == list(engine.plain_rates.points)  # the warm-up measured this mode's plain rate once
    warm_points = len(engine.plain_rates.points[mode])
    engine.warm_up("auto", params)
    assert len(engine.plain_rates.points[mode]) == warm_points  # and not again
    assert not engine.chooser.rates  # what the warm-up decoded is not taken as an answer

    prompt = "Plan my week: " + WARM_PROMPT  # a first turn's length, as the warm-up's
    events = list(engine.generate(prompt, "redrafter", params))
    stats = events[-1].stats
    context = mean_context(stats.prompt_tokens, stats.generated_tokens)
    assert events[0].plain_tps and events[0].plain_tps == pytest.approx(engine.plain_tps(mean_context(stats.prompt_tokens, 40), params))
    assert stats.extra["plain_tps"] == pytest.approx(engine.plain_tps(context, params), rel=1e-3)
    assert stats.extra["speedup_vs_plain"] == pytest.approx(stats.decode_tps / stats.extra["plain_tps"], rel=1e-3)

    plain = list(engine.generate(prompt, "ar", params))
    assert plain[0].plain_tps is None and "speedup_vs_plain" not in plain[-1].stats.extra
    assert len(engine.plain_rates.points[mode]) == warm_points + 1  # a plain answer is a point

    greedy = list(engine.generate(prompt, "redrafter", GenerationParams(max_tokens=40)))
    assert "plain_tps" not in greedy[-1].stats.extra  # no greedy plain rate measured: no figure
