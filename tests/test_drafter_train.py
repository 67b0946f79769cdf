"""Distillation data (batched greedy == plain greedy) and the `train-drafter` command end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_tiny_lm, save_tiny_model_dir
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.drafter.data import DataConfig, batched_greedy, generate_data, is_validation, load_split
from mlx_specdec.engine import Engine


def greedy_reference(lm, ids, n):
    out = []
    for ev in Engine(lm).generate_ids(ids, "ar", GenerationParams(max_tokens=n)):
        if ev.kind == "token":
            out += ev.tokens
    return out


@pytest.mark.parametrize("eos_id", [2, 96])  # 96: random tiny model rarely stops; 2: it does
def test_batched_greedy_matches_plain_greedy(eos_id):
    lm = make_tiny_lm(eos_id=eos_id)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20], [30, 31, 32, 33, 34]]
    results = batched_greedy(lm, prompts, 12)
    for ids, (answer, hidden) in zip(prompts, results):
        ref = greedy_reference(lm, ids, 12)
        body = answer[:-1] if answer[-1] == eos_id else answer  # the stream leaves EOS out
        assert body == ref
        assert hidden.shape == (len(answer), 64) and hidden.dtype == np.float16


def test_generate_data_is_resumable(tmp_path):
    lm = make_tiny_lm()
    lm.tokenizer._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 1}"}) for i in range(1, 41)))
    cfg = DataConfig(prompts=prompts, out=tmp_path / "data", max_new_tokens=6, batch_size=8, shard_prompts=8)
    counts = generate_data(lm, cfg, log=lambda *_: None)
    # every prompt lands in exactly one split, the validation one by the id hash (ids 4 and 22 here)
    split_ids = {split: sorted(int(i) for f in sorted((tmp_path / "data" / split).glob("shard-*.npz"))
                               for i in np.load(f)["prompt_ids"]) for split in ("train", "valid")}
    assert split_ids["valid"] == [i for i in range(1, 41) if is_validation(i)] == [4, 22]
    assert split_ids["train"] == [i for i in range(1, 41) if i not in (4, 22)]
    assert counts["valid"] == load_split(tmp_path / "data", "valid").offsets[-1] > 0
    files = sorted((tmp_path / "data").rglob("shard-*.npz"))
    stamps = [f.stat().st_mtime_ns for f in files]
    messages = []
    assert generate_data(lm, cfg, log=messages.append) == counts
    assert "already done" in messages[0] and [f.stat().st_mtime_ns for f in files] == stamps
    train = load_split(tmp_path / "data", "train")
    assert len(train.tokens) == len(train.hidden) == train.offsets[-1] == counts["train"]


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mlx_specdec.cli", *args], capture_output=True,
                          text=True, env=dict(os.environ, **(env or {})), timeout=300)


def test_train_drafter_command_end_to_end(tmp_path):
    model = save_tiny_model_dir(tmp_path / "model", context=64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 3}"}) for i in range(1, 61)))
    out = tmp_path / "head"
    args = ["train-drafter", "-m", str(model), "--prompts", str(prompts), "-o", str(out),
            "--max-new-tokens", "8", "--draft-vocab", "32", "--batch-size", "16", "--epochs", "1",
            "--checkpoint-every", "2", "--skip-k-measure"]
    result = cli(*args, env={"MLX_SPECDEC_HOME": str(tmp_path / "home")})
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "training.json").read_text())
    assert report["train"]["steps"] >= 1 and len(report["valid"]["acc"]) == 5
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert (tmp_path / "home" / "drafter-checkpoints" / "head" / "checkpoint.json").exists()


def test_train_drafter_bad_input(tmp_path):
    result = cli("train-drafter", "--prompts", str(tmp_path / "none.jsonl"))
    assert result.returncode == 1 and "error: no prompt file" in result.stderr
    assert "Traceback" not in result.stderr
    result = cli("train-drafter", "--draft-vocab", "0")
    assert result.returncode == 1 and "must be positive" in result.stderr
    result = cli("train-drafter", "--prompts", "benchmarks/prompts.jsonl")
    assert result.returncode == 1 and "never train on it" in result.stderr
    result = cli("train-drafter", "--help")
    assert result.returncode == 0 and "usage: mlx-specdec train-drafter" in result.stdout
