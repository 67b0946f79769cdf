"""Distillation data (batched greedy == plain greedy) and the `train-drafter` command end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny_lm, save_tiny_model_dir
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.redrafter_head.data import DataConfig, batched_greedy, generate_data, is_validation, load_split
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


def test_generate_data_is_resumable(tmp_path, monkeypatch):
    import pathlib

    written, rename = [], pathlib.Path.rename

    def recording_rename(self, target):  # a shard is finished when its temporary file is renamed
        written.append(f"{pathlib.Path(target).parent.name}/{pathlib.Path(target).stem}")
        return rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", recording_rename)
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
    # the splits are written interleaved: a run stopped half-way already has held-out answers
    assert written == ["train/shard-0000", "train/shard-0001", "train/shard-0002", "valid/shard-0000",
                       "train/shard-0003", "train/shard-0004"]
    messages = []
    assert generate_data(lm, cfg, log=messages.append) == counts
    assert "already done" in messages[0] and [f.stat().st_mtime_ns for f in files] == stamps
    train = load_split(tmp_path / "data", "train")
    assert len(train.tokens) == len(train.hidden) == train.offsets[-1] == counts["train"]


def test_no_generate_trains_on_the_shards_a_stopped_run_left(tmp_path):
    """generate=False: prompt files without shards yet are left out (said in the log); a split with
    no shards at all is not evaluated; nothing is generated; no train shards at all is one error."""
    from mlx_specdec.redrafter_head.train import TrainConfig, run_pipeline
    from mlx_specdec.errors import UserError

    lm = make_tiny_lm()
    lm.tokenizer._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 1}"}) for i in range(1, 41)))
    second.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 2}"}) for i in range(41, 81)))
    data = tmp_path / "data"
    generate_data(lm, DataConfig(prompts=first, out=data / "first", max_new_tokens=6, batch_size=8),
                  log=lambda *_: None)
    for f in (data / "first" / "valid").glob("shard-*.npz"):
        f.unlink()  # stopped before its first held-out shard
    cfg = TrainConfig(draft_vocab_size=32, draft_length=3, batch_size=16, epochs=1, checkpoint_every=1000)
    log = []
    report = run_pipeline(lm, [first, second], data, tmp_path / "head", tmp_path / "ck", cfg,
                          measure_k=False, log=log.append, generate=False)
    assert report["data"]["train_answers"] == 38 and report["valid"] is None
    assert any("second: no train shards yet, left out" in m for m in log)
    assert any("no held-out shards yet" in m for m in log)
    assert not (data / "second").exists()  # nothing generated
    assert (tmp_path / "head" / "model.safetensors").exists()
    with pytest.raises(UserError, match="no distillation shards"):
        run_pipeline(lm, [second], data, tmp_path / "head2", tmp_path / "ck2", cfg, measure_k=False,
                     log=lambda *_: None, generate=False)


def test_a_report_keeps_follow_up_ids_beside_numeric_ones(tmp_path):
    """Held-out ids of a first-turn file (numbers) and a follow-up file ("<id>+followup") are
    concatenated as strings; training.json keeps the numbers as numbers and the rest as text."""
    from mlx_specdec.redrafter_head.train import TrainConfig, run_pipeline

    lm = make_tiny_lm()
    lm.tokenizer._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 1}"}) for i in range(1, 41)))
    second.write_text("\n".join(json.dumps({"id": f"{i}+followup", "messages": [
        {"role": "user", "content": f"w{i}"}, {"role": "assistant", "content": f"w{i + 1}"},
        {"role": "user", "content": f"w{i + 2}"}]}) for i in range(1, 41)))
    cfg = TrainConfig(draft_vocab_size=32, draft_length=3, batch_size=16, epochs=1, checkpoint_every=1000, max_steps=2)
    run_pipeline(lm, [first, second], tmp_path / "data", tmp_path / "head", tmp_path / "ck", cfg,
                 max_new_tokens=4, data_batch=8, measure_k=False, log=lambda *_: None)
    report = json.loads((tmp_path / "head" / "training.json").read_text())
    ids = report["data"]["valid_prompt_ids"]
    expected = [i for i in range(1, 41) if is_validation(i)] + [f"{i}+followup" for i in range(1, 41)
                                                                if is_validation(f"{i}+followup")]
    assert sorted(map(str, ids)) == sorted(map(str, expected)) and {type(i) for i in ids} == {int, str}


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
    result = cli("train-drafter", "--max-minutes", "0")
    assert result.returncode == 1 and "--max-minutes must be positive" in result.stderr
    result = cli("train-drafter", "--prompts", "benchmarks/prompts.jsonl")
    assert result.returncode == 1 and "never train on it" in result.stderr
    result = cli("train-drafter", "--data-only", "--no-generate")
    assert result.returncode == 1 and "would do nothing" in result.stderr and "Loading" not in result.stderr
    result = cli("train-drafter", "--help")
    assert result.returncode == 0 and "usage: mlx-specdec train-drafter" in result.stdout


def test_multi_turn_rows_distil_the_answer_to_the_last_turn_after_the_models_own_first_answer(tmp_path):
    """data/make_followups.py: first-turn answers from the training split become the assistant's
    turn of a conversation with a follow-up; generate_data encodes the whole conversation."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "data"))
    from make_followups import FOLLOWUPS, main as make_followups

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    model = save_tiny_model_dir(tmp_path / "model", context=128)
    lm = make_tiny_lm(context=128)
    lm.tokenizer._tokenizer.chat_template = template
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 1}"}) for i in range(1, 25)))
    generate_data(lm, DataConfig(prompts=prompts, out=tmp_path / "first", max_new_tokens=5, batch_size=8),
                  log=lambda *_: None)
    followups = tmp_path / "f.jsonl"
    assert make_followups(["--data-dir", str(tmp_path / "first"), "--prompts", str(prompts),
                           "--out", str(followups), "--model", str(model)]) == 0
    rows = [json.loads(line) for line in followups.read_text().splitlines()]
    first = load_split(tmp_path / "first", "train")
    def answer_of(i):
        return first.tokens[first.offsets[i]:first.offsets[i + 1]].tolist()

    answered = [int(pid) for i, pid in enumerate(first.prompt_ids)
                if lm.tokenizer.decode(answer_of(i), skip_special_tokens=True).strip()]  # an empty answer has no follow-up
    assert sorted(int(r["id"].split("+")[0]) for r in rows) == sorted(answered) and len(answered) > 15
    assert all(not is_validation(pid) for pid in answered)
    row = rows[0]
    pid = int(row["id"].split("+")[0])
    index = list(first.prompt_ids).index(pid)
    answer = answer_of(index)
    user, assistant, followup = row["messages"]
    assert user == {"role": "user", "content": f"w{pid} w{pid + 1}"}
    assert assistant["content"] == lm.tokenizer.decode(answer, skip_special_tokens=True).strip()
    assert followup["role"] == "user" and any(followup["content"] in v for v in FOLLOWUPS.values())
    counts = generate_data(lm, DataConfig(prompts=followups, out=tmp_path / "second", max_new_tokens=5, batch_size=8),
                           log=lambda *_: None)
    second = load_split(tmp_path / "second", "train")
    assert counts["train"] > 0 and len(second.prompt_ids) > 0
    lengths = np.load(sorted((tmp_path / "second" / "train").glob("shard-*.npz"))[0])["prompt_lengths"]
    assert lengths.min() > len(lm.encode_chat([user]))  # the conversation, not the first turn alone
    limited = tmp_path / "f5.jsonl"
    assert make_followups(["--data-dir", str(tmp_path / "first"), "--prompts", str(prompts),
                           "--out", str(limited), "--model", str(model), "--limit", "5"]) == 0
    some = [json.loads(line) for line in limited.read_text().splitlines()]
    assert len(some) == 5 and some == [rows[(i * len(rows)) // 5] for i in range(5)]


def test_a_row_without_a_prompt_or_a_conversation_is_one_line(tmp_path):
    from mlx_specdec.redrafter_head.data import load_train_prompts
    from mlx_specdec.errors import UserError

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match="bad.jsonl:1 has no 'prompt' field and no 'messages'"):
        load_train_prompts(bad)


def test_near_copies_finds_a_reworded_prompt_and_not_a_different_one():
    from mlx_specdec.redrafter_head.data import near_copies

    bench = ["What are 5 tips for getting a better night's sleep?"]
    found = near_copies(["what are 5 tips for getting a better night's sleep, please",
                         "Write a haiku about a lighthouse in fog."], bench)
    assert [f[0] for f in found] == ["what are 5 tips for getting a better night's sleep, please"]
    assert found[0][2] >= 0.5


def test_training_leaves_out_the_answers_of_prompts_that_nearly_copy_a_bench_prompt():
    """The bench measures the head on prompts it never saw. A handful of generated training prompts
    nearly copy bench prompts (a Python palindrome or prime checker, the pros and cons of a used car):
    their answers are generated (the prompt files stay as they are, so a stopped data run resumes with
    the same shards) and left out of training."""
    from mlx_specdec.redrafter_head.data import Sequences, bench_questions, keep_prompts, training_prompt_ids

    root = Path(__file__).resolve().parents[1]
    bench = bench_questions(root)
    assert "Write a Python function that checks whether a number is prime." in bench
    ids = set(training_prompt_ids([root / "data" / "train_prompts_large.jsonl"], bench))
    assert 106449 not in ids and 110033 not in ids  # "...checks whether a number is prime. Explain...", used car
    assert 104737 in ids and len(ids) > 10000  # "What is 5% of 802? Explain."
    seqs = Sequences(np.arange(6, dtype=np.int32), np.arange(12, dtype=np.float16).reshape(6, 2),
                     np.array([0, 2, 5, 6]), np.array([7, 106449, 9]))
    kept = keep_prompts(seqs, ids | {7, 9})
    assert kept.tokens.tolist() == [0, 1, 5] and kept.offsets.tolist() == [0, 2, 3]
    assert kept.hidden.tolist() == [[0, 1], [2, 3], [10, 11]] and kept.prompt_ids.tolist() == [7, 9]
