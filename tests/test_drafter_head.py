"""ReDrafter draft head: shapes, save/load, refusing another model's head, training, resume."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import make_tiny_lm
from mlx_specdec.redrafter_head.data import Sequences
from mlx_specdec.redrafter_head.model import (DrafterConfig, DrafterHead, DrafterMismatch, load_drafter,
                                      save_drafter, tokenizer_hash)
from mlx_specdec.redrafter_head.teacher_forcing import evaluate_head
from mlx_specdec.redrafter_head.train import TrainConfig, train_head
from mlx_specdec.redrafter_head.vocab import draft_vocabulary
from mlx_specdec.errors import UserError


def tiny_config(lm, **kw):
    d = dict(llm_hidden_size=64, embed_size=64, vocab_size=97, draft_vocab_size=40,
             model_name="tiny", tokenizer_hash=tokenizer_hash(lm.tokenizer))
    d.update(kw)
    return DrafterConfig(**d)


def params(head):
    return {k: np.array(v) for k, v in tree_flatten(head.parameters())}


@pytest.fixture(scope="module")
def lm():
    return make_tiny_lm()


def test_shapes_and_vocab_maps(lm):
    head = DrafterHead(tiny_config(lm), draft_to_full=list(range(50, 90)))
    e = lm.model.model.embed_tokens(mx.array([[3, 4, 5], [6, 7, 8]]))  # (2, 3, 64)
    s = head.initial_state(e[:, 0])
    assert s.shape == (2, 64)
    s2 = head.next_state(s, e[:, 1])
    assert s2.shape == (2, 64)
    h = mx.random.normal((2, 64))
    assert head.logits(s2, h).shape == (2, 40)
    # beams: (B, W, E) states with one hidden per row broadcast
    sw = mx.broadcast_to(s2[:, None], (2, 3, 64))
    assert head.logits(sw, h[:, None]).shape == (2, 3, 40)
    assert head.draft_to_full.tolist() == list(range(50, 90))
    f2d = head.full_to_draft.tolist()
    assert f2d[50] == 0 and f2d[89] == 39 and f2d[0] == -1 and f2d[96] == -1
    # the maps are not parameters
    assert not any("draft" in k for k, _ in tree_flatten(head.parameters()))


def test_save_load_round_trip_exact(lm, tmp_path):
    head = DrafterHead(tiny_config(lm), draft_to_full=list(range(40)))
    save_drafter(head, tmp_path, dtype=mx.float32)
    loaded = load_drafter(tmp_path, lm)
    assert loaded.config == head.config
    a, b = params(head), params(loaded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert loaded.draft_to_full.tolist() == list(range(40))
    # the default fp16 save loads as float32
    save_drafter(head, tmp_path / "f16")
    loaded16 = load_drafter(tmp_path / "f16", lm)
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(loaded16.parameters()))


@pytest.mark.parametrize("field,value,words", [
    ("llm_hidden_size", 128, "hidden size 128"),
    ("vocab_size", 1000, "vocabulary size 1000"),
    ("tokenizer_hash", "0" * 64, "another tokenizer"),
])
def test_load_refuses_other_models_head(lm, tmp_path, field, value, words):
    cfg = tiny_config(lm)
    head = DrafterHead(cfg, draft_to_full=list(range(40)))
    save_drafter(head, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw[field] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterMismatch) as err:
        load_drafter(tmp_path, lm)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, UserError)


def test_missing_or_corrupt_files_are_user_errors(lm, tmp_path):
    with pytest.raises(UserError, match="no drafter directory"):
        load_drafter(tmp_path / "nope", lm)
    head = DrafterHead(tiny_config(lm), draft_to_full=list(range(40)))
    save_drafter(head, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="corrupt drafter weights"):
        load_drafter(tmp_path, lm)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt drafter config"):
        load_drafter(tmp_path, lm)


def synthetic_data(lm, n_seq=12, length=40, seed=0):
    """Answers following a fixed rule (next = 3*t+1 mod 97), hidden states from the tiny LM."""
    rng = np.random.default_rng(seed)
    toks, offs = [], [0]
    for _ in range(n_seq):
        t = int(rng.integers(3, 97))
        seq = []
        for _ in range(length):
            seq.append(t)
            t = (3 * t + 1) % 97
        toks += seq
        offs.append(len(toks))
    tokens = np.array(toks, np.int32)
    hidden = np.array(lm.model.model.embed_tokens(mx.array(tokens))).astype(np.float16)
    return Sequences(tokens, hidden, np.array(offs, np.int64), np.arange(n_seq))


def test_training_reduces_loss(lm):
    data = synthetic_data(lm)
    cfg = TrainConfig(draft_vocab_size=64, draft_length=3, batch_size=32, epochs=10, lr=3e-3,
                      checkpoint_every=1000)
    result = train_head(lm, data, cfg, progress=False, log=lambda *_: None)
    first, last = np.mean(result.losses[:3]), np.mean(result.losses[-3:])
    assert last < 0.5 * first, (first, last)
    report = evaluate_head(result.head, lm, data)
    assert report["acc"][0] > 0.5


def assert_resumes_to(straight, lm, data, base, checkpoint_dir):
    """Training resumed from the checkpoint to `straight`'s step ends with its parameters."""
    resumed = train_head(lm, data, TrainConfig(**base, max_steps=straight.steps), checkpoint_dir=checkpoint_dir,
                         progress=False, log=lambda *_: None)
    assert resumed.steps == straight.steps
    a, b = params(straight.head), params(resumed.head)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7)


def test_resume_continues_at_saved_step_with_identical_parameters(lm, tmp_path):
    data = synthetic_data(lm)
    base = dict(draft_vocab_size=64, draft_length=3, batch_size=32, epochs=2, checkpoint_every=3)
    straight = train_head(lm, data, TrainConfig(**base, max_steps=6), progress=False, log=lambda *_: None)
    part = train_head(lm, data, TrainConfig(**base, max_steps=3), checkpoint_dir=tmp_path,
                      progress=False, log=lambda *_: None)
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 3
    messages = []
    again = train_head(lm, data, TrainConfig(**base, max_steps=3), checkpoint_dir=tmp_path,
                       progress=False, log=messages.append)
    assert again.steps == 3 and "at step 3" in messages[0]
    a, b = params(part.head), params(again.head)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert_resumes_to(straight, lm, data, base, tmp_path)


def test_a_time_limit_stops_training_with_a_checkpoint_that_resumes_exactly(lm, tmp_path, monkeypatch):
    data = synthetic_data(lm)
    base = dict(draft_vocab_size=64, draft_length=3, batch_size=32, epochs=2, checkpoint_every=100)
    straight = train_head(lm, data, TrainConfig(**base, max_steps=6), progress=False, log=lambda *_: None)
    clock = iter(range(0, 10_000, 30))  # every reading of the clock 30 s after the one before
    monkeypatch.setattr("mlx_specdec.redrafter_head.train.time.perf_counter", lambda: next(clock))
    messages = []
    part = train_head(lm, data, TrainConfig(**base, max_steps=6, max_minutes=1.5), checkpoint_dir=tmp_path,
                      progress=False, log=messages.append)
    assert 0 < part.steps < 6 and f"stopped at step {part.steps}/" in messages[-1]
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == part.steps
    monkeypatch.undo()
    assert_resumes_to(straight, lm, data, base, tmp_path)


def test_draft_vocabulary_keeps_most_frequent_and_eos():
    tokens = np.array([5] * 10 + [7] * 5 + [9] * 3 + [11], np.int32)
    assert draft_vocabulary(tokens, 2, 20).tolist() == [5, 7]
    assert sorted(draft_vocabulary(tokens, 3, 20, always=[2]).tolist()) == [2, 5, 7]


def test_llm_head_output_scores_with_the_llms_own_rows(lm, tmp_path):
    """output="llm_head": logits = predicted hidden @ the LLM's output rows of the draft vocab;
    the rows are not stored but re-attached from the LLM on load (same logits after a round trip)."""
    from mlx_specdec.redrafter_head.model import llm_output_rows

    ids = mx.array(np.arange(3, 43))
    head = DrafterHead(tiny_config(lm, output="llm_head"), ids)
    head.attach_output_rows(llm_output_rows(lm, head.draft_to_full))
    s, h = mx.random.normal((2, 64)), mx.random.normal((2, 64))
    want = head.predict_hidden(s, h) @ lm.model.lm_head.weight[ids].T  # untied tiny model
    assert mx.allclose(head.logits(s, h), want, atol=1e-5).item()
    save_drafter(head, tmp_path / "d", dtype=mx.float32)
    assert "_output_rows" not in mx.load(str(tmp_path / "d" / "model.safetensors"))
    again = load_drafter(tmp_path / "d", lm)
    assert mx.allclose(again.logits(s, h), head.logits(s, h), atol=1e-6).item()


def test_llm_head_training_reduces_loss(lm):
    data = synthetic_data(lm)
    cfg = TrainConfig(draft_vocab_size=64, draft_length=3, batch_size=32, epochs=10, lr=3e-3,
                      checkpoint_every=1000, output="llm_head")
    result = train_head(lm, data, cfg, progress=False, log=lambda *_: None)
    assert np.mean(result.losses[-3:]) < 0.5 * np.mean(result.losses[:3])
    assert evaluate_head(result.head, lm, data)["acc"][0] > 0.5


def test_init_from_goes_on_from_a_saved_head(lm, tmp_path):
    """--init-from: training starts from the saved head's weights and draft vocabulary (zero steps
    give back the same head); a head of another shape is one clear error."""
    data = synthetic_data(lm)
    base = dict(draft_vocab_size=64, draft_length=3, batch_size=32, checkpoint_every=1000)
    first = train_head(lm, data, TrainConfig(**base, epochs=2), progress=False, log=lambda *_: None)
    save_drafter(first.head, tmp_path / "first", dtype=mx.float32)
    start = train_head(lm, data, TrainConfig(**dict(base, draft_vocab_size=16), epochs=1, max_steps=0,
                                             init_from=str(tmp_path / "first")),
                       progress=False, log=lambda *_: None)
    assert np.array_equal(np.array(start.head.draft_to_full), np.array(first.head.draft_to_full))
    a, b = params(first.head), params(start.head)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert evaluate_head(start.head, lm, data) == evaluate_head(first.head, lm, data)
    more = train_head(lm, data, TrainConfig(**base, epochs=1, lr=1e-4, init_from=str(tmp_path / "first")),
                      progress=False, log=lambda *_: None)
    assert np.mean(more.losses[:3]) < np.mean(first.losses[:3])  # it starts where the first left off
    for other in (dict(num_blocks=1), dict(output="llm_head")):
        with pytest.raises(UserError, match="pass the same --output-kind and at least as many --blocks"):
            train_head(lm, data, TrainConfig(**base, **other, init_from=str(tmp_path / "first")),
                       progress=False, log=lambda *_: None)


def test_init_from_grows_a_head_by_blocks_that_start_as_the_identity(lm, tmp_path):
    """--init-from with more --blocks: the old blocks keep their weights, the new ones start at zero
    (the grown head drafts exactly as the saved one) and then learn."""
    data = synthetic_data(lm)
    base = dict(draft_vocab_size=64, draft_length=3, batch_size=32, checkpoint_every=1000)
    first = train_head(lm, data, TrainConfig(**base, epochs=2), progress=False, log=lambda *_: None)
    save_drafter(first.head, tmp_path / "first", dtype=mx.float32)
    grown = train_head(lm, data, TrainConfig(**base, num_blocks=4, epochs=1, max_steps=0,
                                             init_from=str(tmp_path / "first")), progress=False, log=lambda *_: None)
    assert grown.head.config.num_blocks == 4
    a, b = params(first.head), params(grown.head)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert all(not b[k].any() for k in b if k.startswith(("blocks.2.", "blocks.3.")))
    assert evaluate_head(grown.head, lm, data) == evaluate_head(first.head, lm, data)
    trained = train_head(lm, data, TrainConfig(**base, num_blocks=4, epochs=1, lr=1e-3,
                                               init_from=str(tmp_path / "first")), progress=False, log=lambda *_: None)
    assert any(params(trained.head)[k].any() for k in b if k.startswith("blocks.3."))


def test_soft_targets_loss_is_the_cross_entropy_against_the_llms_own_distribution(lm):
    """soft_weight 1: the token loss is -sum p_llm log p_draft over the draft vocabulary, p_llm =
    softmax(the target's hidden state @ the LLM's output rows); a one-hot teacher gives the hard loss
    back; the weight mixes the two."""
    from mlx_specdec.redrafter_head.model import llm_output_rows
    from mlx_specdec.redrafter_head.teacher_forcing import Windows, llm_embedding_table, loss_fn, unroll

    data = synthetic_data(lm)
    head = DrafterHead(tiny_config(lm, draft_vocab_size=64, draft_length=3), np.arange(20, 84))
    toks, valid, hidden, following = Windows(data, 3).batch(np.arange(0, 64, 3))
    table = llm_embedding_table(lm)
    rows = llm_output_rows(lm, head.draft_to_full)
    hard = loss_fn(head, table, toks, valid, hidden, following)
    soft = loss_fn(head, table, toks, valid, hidden, following, teacher_rows=rows, soft_weight=1.0)
    logits = unroll(head, table[toks[:, :3]], hidden)  # (B, 3, K)
    logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    teacher = np.array(mx.softmax(following @ rows.T, axis=-1))
    inside = np.array(valid[:, 1:])
    want = -(teacher * logp).sum(-1)[inside].mean()
    assert abs(soft.item() - want) < 1e-4 * max(1.0, abs(want))
    assert soft.item() != pytest.approx(hard.item())
    half = loss_fn(head, table, toks, valid, hidden, following, teacher_rows=rows, soft_weight=0.5)
    assert half.item() == pytest.approx(0.5 * hard.item() + 0.5 * soft.item(), rel=1e-5)


def test_training_with_soft_targets_learns_the_rule_and_resumes_only_with_them(lm, tmp_path):
    data = synthetic_data(lm)
    base = dict(draft_vocab_size=64, draft_length=3, batch_size=32, lr=3e-3, checkpoint_every=5,
                output="llm_head")
    # (the tiny LM's own distribution is near uniform and knows nothing of the data's rule: half
    # hard labels still teach the rule; the soft half's floor is the teacher's entropy)
    result = train_head(lm, data, TrainConfig(**base, epochs=10, soft_targets=0.5), progress=False,
                        log=lambda *_: None)
    assert np.mean(result.losses[-3:]) < 0.8 * np.mean(result.losses[:3])
    assert evaluate_head(result.head, lm, data)["acc"][0] > 0.5
    train_head(lm, data, TrainConfig(**base, epochs=1, max_steps=5, soft_targets=0.5), checkpoint_dir=tmp_path,
               progress=False, log=lambda *_: None)
    with pytest.raises(UserError, match="other settings"):
        train_head(lm, data, TrainConfig(**base, epochs=1, max_steps=10), checkpoint_dir=tmp_path,
                   progress=False, log=lambda *_: None)
