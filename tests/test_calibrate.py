"""This machine's verify-cost table (`mlx-specdec calibrate`, drafting/cost_probe.py): measured,
stored per model and machine, read back by the engine for redrafter, ignored elsewhere."""

import json

import numpy as np
import pytest

from mlx_specdec.drafting import cost_probe
from mlx_specdec.drafting.verify_cost import CostTable, shipped_table, verify_cost

from conftest import make_tiny_lm, save_tiny_model_dir
from test_cli_errors import assert_one_line_error, cli


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_measured_table_starts_at_one_and_never_falls_with_more_tokens():
    lm = make_tiny_lm(seed=1)
    done = []
    table = cost_probe.measure_table(lm.model, [8, 40], max_tokens=4, rounds=2, progress=done.append)
    assert table.contexts.tolist() == [8, 40] and table.costs.shape == (2, 4)
    assert (table.costs[:, 0] == 1.0).all()
    assert (np.diff(table.costs, axis=1) >= 0).all()
    assert table.ratios.shape == (2, 4) and (table.ratios[:, 0] == 1.0).all()  # the medians, kept
    assert sum(done) == 2 * 2 * 4  # every timed forward reported


def test_the_fit_rises_with_every_token_where_the_noise_has_flat_runs_and_dips():
    # after 150 tokens on the 2-core VM: T = 5 and 6 both measured 1.10, T = 3 no dearer than T = 2
    measured = np.array([1.0, 1.03, 1.03, 1.07, 1.10, 1.10, 1.20, 1.27])
    fit = cost_probe.convex_fit(measured)
    assert fit[0] == 1.0 and (np.diff(fit) > 0).all() and (np.diff(fit, 2) >= -1e-12).all()
    assert fit[5] - fit[4] > 0.03  # the sixth token costs something
    assert np.abs(fit - measured).max() < 0.05  # and the fit stays within the noise
    # a straight line is kept as it is; costs that fall (noise on a free verify) stay at 1
    line = 1.0 + 0.2 * np.arange(6)
    assert np.allclose(cost_probe.convex_fit(line), line)
    assert np.allclose(cost_probe.convex_fit(np.array([1.0, 0.97, 0.99, 0.98])), 1.0)
    # a verify free up to a few tokens and dear after: the curved term carries it
    bend = np.array([1.0, 1.0, 1.01, 1.05, 1.2, 1.4])
    assert cost_probe.convex_fit(bend)[-1] > 1.3


def test_costs_pair_each_round_with_its_own_one_token_time():
    # round 2 is a slow spell (every forward 1.5x): per-round ratios do not see it
    one_round = np.array([30.0, 33.0, 36.0, 36.3])
    times = np.stack([one_round, one_round * 1.5, one_round * 1.01])
    assert np.allclose(cost_probe.median_ratios(times), one_round / 30.0)


def test_a_stored_table_is_read_back_for_this_model_on_this_machine_only(home):
    lm = make_tiny_lm(seed=1)
    assert cost_probe.load_table(lm) is None
    assert cost_probe.cost_table_for(lm) == shipped_table() or not cost_probe.on_cpu()
    table = CostTable(np.array([100.0, 1000.0]), np.array([[1.0, 1.1, 1.2], [1.0, 1.3, 1.6]]), "measured")
    path = cost_probe.save_table(lm, table, rounds=3)
    assert path.parent == home / "verify-cost"
    loaded = cost_probe.cost_table_for(lm)
    assert np.array_equal(loaded.costs, table.costs) and np.array_equal(loaded.contexts, table.contexts)
    assert str(path) in loaded.source
    assert verify_cost(3, 550, loaded) == pytest.approx(1.4)  # the rule reads this table, interpolated
    assert verify_cost(3, 550) != pytest.approx(1.4)  # not the shipped one

    record = json.loads(path.read_text())
    record["machine"]["cores"] = -1  # measured on another machine: not this one's
    path.write_text(json.dumps(record))
    assert cost_probe.load_table(lm) is None
    path.write_text("{not json")
    assert cost_probe.load_table(lm) is None


def test_a_stored_table_that_is_not_convex_is_refitted_from_its_medians(home):
    # a costly second token and free ones after it (an older fit, or a hand edit): the sampling
    # rule's first peak and greedy's argmax would part; read back, it is the convex fit of the medians
    lm = make_tiny_lm(seed=1)
    ratios = np.array([[1.0, 1.2, 1.21, 1.22, 1.5]])
    cost_probe.save_table(lm, CostTable(np.array([100.0]), ratios.copy(), "measured", ratios), rounds=1)
    loaded = cost_probe.load_table(lm)
    assert np.allclose(loaded.costs, cost_probe.convex_fit(ratios[0])[None]) and "refitted" in loaded.source
    assert cost_probe.is_convex(loaded.costs) and not cost_probe.is_convex(ratios)


def test_a_table_measured_over_weights_laid_out_otherwise_is_not_used(home):
    from mlx_specdec.model.cpu_layout import COLUMN, ROW, current_layout, store_layout

    lm = make_tiny_lm(seed=1)
    assert current_layout(lm.model) == ROW
    table = CostTable(np.array([100.0]), np.array([[1.0, 1.05]]), "measured")
    path = cost_probe.save_table(lm, table, rounds=1)
    assert json.loads(path.read_text())["layout"] == ROW and cost_probe.load_table(lm) is not None
    store_layout(lm.model, COLUMN)  # what a step costs changed with the layout
    assert cost_probe.load_table(lm) is None or not cost_probe.on_cpu()
    record = json.loads(path.read_text())
    del record["layout"]  # tables from before the layout was recorded: column-major on the CPU, row-major on a GPU
    path.write_text(json.dumps(record))
    assert (cost_probe.load_table(lm) is not None) == cost_probe.on_cpu()
    store_layout(lm.model, ROW)
    assert (cost_probe.load_table(lm) is not None) == (not cost_probe.on_cpu())


def test_the_engine_hands_redrafter_the_stored_table(home):
    from mlx_specdec.engine import Engine

    lm = make_tiny_lm(seed=1)
    table = CostTable(np.array([100.0]), np.array([[1.0, 1.05]]), "measured")
    cost_probe.save_table(lm, table, rounds=1)
    engine = Engine(lm, drafter=None)
    assert np.array_equal(engine._resources_for("redrafter")["verify_costs"].costs, table.costs)


def test_calibrate_measures_stores_and_shows_the_table(tmp_path):
    model = save_tiny_model_dir(tmp_path / "model", context=64)
    env = {"MLX_SPECDEC_HOME": str(tmp_path / "home")}
    result = cli("calibrate", "-m", str(model), "--contexts", "8,24", "--tokens", "3", "--rounds", "2", env=env)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 8 |") or line.startswith("| 24 |")]
    assert len(rows) == 2 and all(row.split("|")[2].strip() == "1.00" for row in rows)
    stored = list((tmp_path / "home" / "verify-cost").glob("*.json"))
    assert len(stored) == 1 and "wrote" in result.stderr
    if cost_probe.on_cpu():  # the weight layout is timed first, and the table is for the one kept
        layout = json.loads(next((tmp_path / "home" / "cpu-layout").glob("*.json")).read_text())
        assert layout["rounds"] == 5 and set(layout["ms"]) == {"row", "column"}
        assert json.loads(stored[0].read_text())["layout"] == layout["layout"]
        assert f"weights: {layout['layout']}-major" in result.stderr
    shown = cli("calibrate", "-m", str(model), "--show", env=env)
    assert shown.returncode == 0 and rows[0] in shown.stdout


def test_calibrate_refuses_bad_input_in_one_line(tmp_path):
    model = save_tiny_model_dir(tmp_path / "model", context=64)
    env = {"MLX_SPECDEC_HOME": str(tmp_path / "home")}
    assert_one_line_error(cli("calibrate", "-m", str(model), "--show", env=env), "no table measured", "calibrate")
    assert_one_line_error(cli("calibrate", "-m", str(model), "--contexts", "2000", env=env), "does not fit")
    assert_one_line_error(cli("calibrate", "-m", str(model), "--contexts", "30,10", env=env), "increasing")
    assert_one_line_error(cli("calibrate", "-m", str(model), "--tokens", "1", env=env), "at least 2")
    assert_one_line_error(cli("calibrate", "-m", str(model), "--layout-rounds", "-1", env=env), "--layout-rounds")


def test_bench_says_when_redrafter_runs_on_the_shipped_verify_costs(home, tmp_path):
    from mlx_specdec.redrafter_head.model import save_drafter
    from test_redrafter import random_head

    model = save_tiny_model_dir(tmp_path / "tiny", seed=5)
    head = save_drafter(random_head(None, draft_vocab=97), tmp_path / "head")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": "q1", "turns": ["w3 w5 w7 w9"]}) + "\n")
    args = ("bench", "-m", str(model), "--drafter", str(head), "--prompts", str(prompts), "--max-tokens", "4",
            "--format", "json", "--output", str(tmp_path / "out.json"))
    env = {"MLX_SPECDEC_HOME": str(home)}
    ran = cli(*args, "--methods", "ar,redrafter", env=env)
    assert ran.returncode == 0, ran.stderr
    assert ("`mlx-specdec calibrate`" in ran.stderr) == cost_probe.on_cpu()  # a GPU uses no table
    ran = cli(*args, "--methods", "ar", env=env)
    assert ran.returncode == 0 and "calibrate" not in ran.stderr


def test_a_gpu_never_calibrated_measures_on_first_use_and_keeps_it(home, monkeypatch, capsys):
    """No table for this model on a GPU: the first redrafter use measures a short table (the
    contexts that fit the window), saves it, and later uses read it instead of measuring."""
    lm = make_tiny_lm(seed=1)  # a 512-token window: only the 150-token context fits
    monkeypatch.setattr(cost_probe, "on_cpu", lambda: False)
    monkeypatch.setenv(cost_probe.NO_FIRST_USE_ENV, "1")
    assert cost_probe.cost_table_for(lm) is None  # switched off: every draft the cutoff keeps is verified
    monkeypatch.delenv(cost_probe.NO_FIRST_USE_ENV)
    table = cost_probe.cost_table_for(lm)
    assert "measuring what a verify costs" in capsys.readouterr().err
    assert table.contexts.tolist() == [150] and table.costs.shape == (1, cost_probe.DEFAULT_TOKENS)
    assert "first use" in table.source and (np.diff(table.costs, axis=1) >= 0).all()

    def measure_again(*args, **kwargs):
        raise AssertionError("measured twice")

    monkeypatch.setattr(cost_probe, "measure_table", measure_again)
    again = cost_probe.cost_table_for(lm)
    assert np.allclose(again.costs, table.costs, atol=1e-3) and "first use" not in again.source
