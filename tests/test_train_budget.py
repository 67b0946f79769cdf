"""`train-drafter --budget-minutes` and `--data-batch auto`: the plan's arithmetic, the batch choice,
the cost model's arithmetic, one-line errors, and a tiny budgeted run end to end."""

import json
import os
import subprocess
import sys

import pytest

from conftest import make_tiny_lm, save_tiny_model_dir
from mlx_specdec.redrafter_head import budget, cost_model
from mlx_specdec.redrafter_head.budget import DATA_SHARE, block_order, plan_blocks, plan_training, reserve_seconds
from mlx_specdec.redrafter_head.cost_model import Mac, Target, decode_seconds, estimate_mac, head_train_flops, pick_batch
from mlx_specdec.redrafter_head.progress import Progress


def test_auto_batch_picks_the_most_tokens_per_second_and_the_smaller_on_a_tie():
    assert pick_batch({8: 120.0, 16: 210.0, 32: 260.5, 64: 240.0}) == 32
    assert pick_batch({8: 300.0, 16: 300.0, 64: 100.0}) == 8
    with pytest.raises(ValueError):
        pick_batch({})


def test_measure_batches_times_every_batch_on_its_own_prompts():
    lm = make_tiny_lm()
    ticks = iter(range(0, 1000, 2))  # every batch takes 2 fake seconds
    table = budget.measure_batches(lm, [[5, 6, 7], [8, 9]], batches=(2, 3), max_new_tokens=4,
                                   clock=lambda: next(ticks))
    assert set(table) == {2, 3}
    # at most B x 4 tokens in 2 s, at least one token a row
    assert 1.0 <= table[2] <= 4.0 and 1.5 <= table[3] <= 6.0


def test_blocks_interleave_the_files_in_proportion_and_keep_each_files_order():
    # a block's place is (i + 0.5) / its file's blocks: 4 blocks at 1/8, 3/8, ..; 2 at 1/4, 3/4; 1 at 1/2
    assert block_order([4 * 64, 2 * 64, 10]) == [(0, 0), (1, 0), (0, 1), (2, 0), (0, 2), (1, 1), (0, 3)]
    assert block_order([130], block=64) == [(0, 0), (0, 1), (0, 2)]


def test_plan_fills_half_the_budget_at_the_measured_rate():
    sizes = [64] * 20
    # 10 min budget: data gets 300 s; 60 s spent (model load and the first block), 1 prompt/s:
    # 240 more prompts fit, i.e. 3 whole blocks after the first one
    assert DATA_SHARE == 0.5
    assert plan_blocks(600, 60, sizes, done=1, prompts_per_s=1.0) == 1 + 3
    assert plan_blocks(600, 60, sizes, done=1, prompts_per_s=100.0) == 20  # capped by the prompt set
    assert plan_blocks(600, 400, sizes, done=1, prompts_per_s=1.0) == 1  # over time: only what is done
    assert plan_blocks(600, 60, [64, 64, 10], done=1, prompts_per_s=73.9 / 240) == 2  # 73.9 prompts fit: not 64 + 10
    assert plan_blocks(600, 60, [64, 64, 10], done=1, prompts_per_s=74.1 / 240) == 3  # the short last block fits too


def test_training_plan_fits_the_time_left_and_caps_the_epochs():
    assert plan_training(100.0, 2.0, steps_per_epoch=1000) == (190, 0.19)  # 95% of 100 s at 2 steps/s
    assert plan_training(1e6, 2.0, steps_per_epoch=10, max_epochs=8) == (80, 8.0)
    assert plan_training(-5.0, 2.0, steps_per_epoch=10) == (1, 0.1)  # always at least one step
    assert reserve_seconds(1800) == 72.0 and reserve_seconds(60) == 30.0


def test_cost_model_arithmetic():
    mac = Mac("test", bandwidth=100e9, flops=10e12)
    target = Target(weight_bytes=4e9, params=5e9, kv_bytes_per_token=1e5)
    # batch 1: 4 GB + 1 x 100 keys x 100 kB = 4.01 GB at 100 GB/s = 40.1 ms > 1 x 10 GFLOP / 10 TFLOP/s
    assert decode_seconds(1, 100, target, mac) == pytest.approx(0.0401)
    # batch 64: the matmuls, 64 x 10 GFLOP / 10 TFLOP/s = 64 ms, outlast the 4.64 GB read (46.4 ms)
    assert decode_seconds(64, 100, target, mac) == pytest.approx(0.064)
    # head: D = E = 4, K = 8, 1 block, T = 2, batch 3; multiply-adds per position:
    # U, W 2 x 16 + block 8 x 8 + to_hidden 8 x 4 + output 4 x 8 = 160; x 2 x 3 x T x batch
    assert head_train_flops(4, 4, 8, 1, 2, 3) == 160 * 2 * 3 * 2 * 3
    assert head_train_flops(4, 4, 8, 1, 2, 3, output="draft_vocab") == (32 + 64 + 64) * 2 * 3 * 2 * 3
    est = estimate_mac(data_tokens=60_000, context=100, train_steps=1000, draft_vocab=8, blocks=1,
                       draft_length=2, batch_size=3, output="llm_head", target=target, mac=mac,
                       batches=(1, 64))
    rate64 = 64 / 0.064  # 1000 tokens/s beats 1 / 0.0401 = 24.9
    assert est["data_batch"] == 64 and est["data_tokens_per_s"] == pytest.approx(rate64)
    assert est["data_minutes"] == pytest.approx(60_000 / rate64 / 60, abs=0.05)
    step_s = 160 * 2 * 3 * 2 * 3 / (cost_model.TRAIN_EFFICIENCY * 10e12)
    assert est["train_minutes"] == pytest.approx(1000 * step_s / 60, abs=0.05)
    assert est["hidden_state_gb"] == pytest.approx(60_000 * 4096 * 2 / 1e9, abs=0.01)


def test_progress_writes_periodic_lines_with_an_eta_when_not_on_a_terminal():
    now = [0.0]
    lines = []
    bar = Progress(10, "distill", "prompt", every=30, log=lines.append, tty=False, clock=lambda: now[0])
    for _ in range(4):
        now[0] += 10
        bar.update(1)
    bar.set_postfix(tok_s="12.0")
    bar.close()
    # one line at 30 s (3 done at 0.1/s: 70 s to go) and one at the end
    assert len(lines) == 2 and "3/10 prompts" in lines[0] and "ETA 1:10" in lines[0]
    assert "4/10 prompts" in lines[1] and "ETA 1:00" in lines[1] and "tok_s=12.0" in lines[1]
    lines.clear()
    bar = Progress(2, "train", "step", every=5, log=lines.append, tty=False, clock=lambda: now[0])
    now[0] += 10
    bar.update(2)
    bar.close()
    assert len(lines) == 1 and "2/2 steps" in lines[0]  # the last update's line is not written again


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mlx_specdec.cli", *args], capture_output=True,
                          text=True, env=dict(os.environ, **(env or {})), timeout=300)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_budget_that_is_not_positive_is_one_line(value):
    result = cli("train-drafter", "--budget-minutes", value)
    assert result.returncode == 1 and result.stderr.strip() == "error: --budget-minutes must be positive"


def test_bad_data_batch_and_clashing_flags_are_one_line():
    result = cli("train-drafter", "--data-batch", "0")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "--data-batch" in result.stderr
    result = cli("train-drafter", "--budget-minutes", "5", "--max-minutes", "2")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "leave out --max-minutes" in result.stderr


def test_a_budgeted_run_makes_a_head_that_loads_and_resumes_its_plan(tmp_path):
    from mlx_specdec.engine import Engine
    from mlx_specdec.redrafter_head.model import load_drafter

    model = save_tiny_model_dir(tmp_path / "model", context=64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i % 90 + 3} w{i % 70 + 5}"})
                                 for i in range(1, 201)))
    out, data = tmp_path / "head", tmp_path / "data"
    args = ["train-drafter", "-m", str(model), "--prompts", str(prompts), "-o", str(out), "--data-dir", str(data),
            "--budget-minutes", "1.5", "--max-new-tokens", "8", "--draft-vocab", "32", "--batch-size", "16"]
    result = cli(*args, env={"MLX_SPECDEC_HOME": str(tmp_path / "home")})
    assert result.returncode == 0, result.stderr
    assert "data batch auto" in result.stderr and "plan: distil" in result.stderr and "plan: train" in result.stderr
    report = json.loads((out / "training.json").read_text())
    plan = json.loads((data / "budget.json").read_text())
    assert report["budget"]["blocks"] == plan["blocks"] >= 1 and plan["data_batch"] in cost_model.AUTO_BATCHES
    assert report["train"]["steps"] >= 1 and report["cost"]["here"]["data_tokens"] > 0
    assert [e["mac"] for e in report["cost"]["estimate_7b_4bit"]] == ["M2 Pro", "M3 Max"]
    assert report["cost"]["here"]["total_minutes"] <= 1.5 + 0.5  # inside the budget, give or take loading
    lm = Engine.load(str(model), drafter=None, apar_adapter=None).lm
    assert load_drafter(str(out), lm).config.draft_vocab_size <= 32

    # the same command again: the plan and the data are kept, nothing is generated or measured again
    result = cli(*args, env={"MLX_SPECDEC_HOME": str(tmp_path / "home")})
    assert result.returncode == 0, result.stderr
    assert "data batch auto" not in result.stderr and "plan: distil" not in result.stderr
    assert json.loads((data / "budget.json").read_text())["data"] == plan["data"]
    # another budget on the same data directory is one line
    result = cli(*[a if a != "1.5" else "3" for a in args], env={"MLX_SPECDEC_HOME": str(tmp_path / "home")})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1 and "budget.json" in errors[0]
    assert "Traceback" not in result.stderr
