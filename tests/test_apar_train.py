"""APAR training on a tiny random Llama: the packed-tree layout, its equivalence with the
reference's one-sequence-per-stream layout, training steps, checkpoints and resume, the CLI."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.apar import ControlTokens, ParagraphTree
from mlx_specdec.apar.adapter import prepare_for_training, save_adapter, trainable_weights
from mlx_specdec.apar.config import LoraSettings
from mlx_specdec.apar.evaluate import evaluate
from mlx_specdec.apar.extract import extract
from mlx_specdec.apar.losses import base_log_probs, sequence_loss, soft_positions
from mlx_specdec.apar.samples import collate, epoch_samples, layout_streams, layout_tree, linear_sample, token_tree
from mlx_specdec.apar.train import AparTrainConfig, load_initial_adapter, plan_batches, train_adapter
from mlx_specdec.model.forward import forward
from mlx_specdec.model.loader import LoadedModel

from conftest import make_tiny_llama, make_tiny_tokenizer

V = 97
CONTROL = ControlTokens(V, V + 1)  # the rows an adapter appends to the tiny model
EOS = 2
PROMPT = [40, 41, 42]


def small_tree():
    """root: 10 11 [F1] 12 [F2] 13 ; child 1: 20 [F3] 21 ; child 2: 30 31 ; grandchild 3: 50"""
    tree = ParagraphTree()
    tree.add(0, 10, 11)
    c1 = tree.fork(0)
    tree.add(0, 12)
    c2 = tree.fork(0)
    tree.add(0, 13)
    tree.add(c1, 20)
    g = tree.fork(c1)
    tree.add(c1, 21)
    tree.add(c2, 30, 31)
    tree.add(g, 50)
    return tree


def test_tree_layout_tokens_parents_and_targets():
    F, C = CONTROL.fork, CONTROL.child
    s = layout_tree(PROMPT, small_tree(), CONTROL, EOS, "list")
    #          prompt      | root: 10 11 F 12 F 13 E      | c1: C 20 F 21 E   | c2: C 30 31 E  | g: C 50 E
    idx = list(range(len(s)))
    assert s.tokens.tolist() == [40, 41, 42, 10, 11, F, 12, F, 13, EOS, C, 20, F, 21, EOS, C, 30, 31, EOS, C, 50, EOS]
    assert s.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8,
                                  5, 10, 11, 12, 13,  # child 1 hangs off the root's first [Fork] (5)
                                  7, 15, 16, 17,  # child 2 off the second [Fork] (7)
                                  12, 19, 20]  # the grandchild off child 1's [Fork] (12)
    assert s.targets.tolist() == [-1, -1, 10, 11, F, 12, F, 13, EOS, -1,
                                  20, F, 21, EOS, -1,
                                  30, 31, EOS, -1,
                                  50, EOS, -1]
    assert C not in s.targets.tolist()  # [Child] is never predicted
    assert s.forks == 3 and s.prompt_len == 3 and len(idx) == 22


def test_streams_layout_is_the_reference_format():
    F, C = CONTROL.fork, CONTROL.child
    streams = layout_streams(PROMPT, small_tree(), CONTROL, EOS)
    seqs = [t.tolist() for t, _ in streams]
    assert seqs[0] == PROMPT + [10, 11, F, 12, F, 13, EOS]
    assert seqs[1] == PROMPT + [10, 11, F, C, 20, F, 21, EOS]
    assert seqs[2] == PROMPT + [10, 11, F, 12, F, C, 30, 31, EOS]
    assert seqs[3] == PROMPT + [10, 11, F, C, 20, F, C, 50, EOS]
    # loss masked up to (and including the prediction of) the last [Child]
    assert streams[1][1].tolist() == [-1] * 6 + [20, F, 21, EOS, -1]
    assert streams[0][1].tolist() == [-1, -1, 10, 11, F, 12, F, 13, EOS, -1]


def _tiny_adapted(seed=0):
    model = make_tiny_llama(seed=seed, layers=2, tie=True)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight / 8  # undo the x8: a learnable start
    config = {"model_type": "llama", "max_position_embeddings": 512, "vocab_size": V}
    lm = LoadedModel(model, make_tiny_tokenizer(), Path("."), "tiny-llama", config, "float32", None)
    adapted, _ = prepare_for_training(lm, LoraSettings(rank=4, scale=10.0), seed=seed)
    # move LoRA off zero so the adapted model differs from the base
    rng = np.random.default_rng(seed)
    from mlx.utils import tree_unflatten
    adapted.model.update(tree_unflatten([(k, mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32)))
                                         for k, v in trainable_weights(adapted.model).items()]))
    return adapted


def _tiny_config(rank=4):
    model = make_tiny_llama(seed=0, layers=2, tie=True)
    config = {"model_type": "llama", "max_position_embeddings": 512, "vocab_size": V}
    lm = LoadedModel(model, make_tiny_tokenizer(), Path("."), "tiny-llama", config, "float32", None)
    return prepare_for_training(lm, LoraSettings(rank=rank, scale=10.0))[1]


def test_packed_tree_loss_equals_one_sequence_per_stream():
    """Same targets in the same contexts: the packed tree's token losses are exactly the
    reference layout's, each computed once instead of once per stream that repeats the prefix."""
    model = _tiny_adapted().model
    tree = small_tree()
    packed = layout_tree(PROMPT, tree, CONTROL, EOS)
    ce_tree = np.array(sequence_loss(model, *collate([packed]), reduce="none"))
    streams = [linear_sample(t, y) for t, y in layout_streams(PROMPT, tree, CONTROL, EOS)]
    ce_streams = np.concatenate([np.array(sequence_loss(model, *collate([s]), reduce="none")) for s in streams])
    assert len(ce_tree) == len(ce_streams) == (packed.targets >= 0).sum()
    np.testing.assert_allclose(np.sort(ce_tree), np.sort(ce_streams), rtol=1e-4, atol=1e-5)
    # and batched with padding (another, shorter sample in the same batch) changes nothing
    other = layout_tree(PROMPT, ParagraphTree(), CONTROL, EOS)
    ce_batched = np.array(sequence_loss(model, *collate([packed, other]), reduce="none"))
    np.testing.assert_allclose(ce_batched[: len(ce_tree)], ce_tree, rtol=1e-4, atol=1e-5)
    computed_tree = len(packed)
    computed_streams = sum(len(s) for s in streams)
    assert computed_tree < computed_streams  # 22 tokens vs 38


def _synthetic_samples(n=24, seed=0):
    """Trees over word ids with a fixed shape, plus unstructured negatives."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        tree = ParagraphTree()
        kind = "list" if i % 3 else "unstructured"
        for item in range(3 if kind == "list" else 0):
            tree.add(0, 60 + 2 * item, 61 + 2 * item)
            child = tree.fork(0)
            tree.add(child, *rng.integers(10, 20, 4).tolist())
        tree.add(0, *rng.integers(20, 30, 3).tolist())
        samples.append(layout_tree([40 + i % 5, 41, 42], tree, CONTROL, EOS, kind))
        samples[-1].answer = i
    return samples


def test_negatives_are_sampled_one_to_one():
    samples = _synthetic_samples(30)
    rng = np.random.default_rng(0)
    chosen = epoch_samples(samples, 1.0, rng)
    kinds = [samples[i].kind for i in chosen]
    assert kinds.count("list") == 20 and kinds.count("unstructured") == 20  # 10 negatives, reused
    assert epoch_samples(samples, 0.0, rng) == [i for i, s in enumerate(samples) if s.kind == "list"]


def test_training_lowers_the_loss_and_learns_to_fork():
    model = _tiny_adapted().model
    samples = _synthetic_samples()
    cfg = AparTrainConfig(lr=1e-3, rows_lr=1e-2, epochs=12, tokens_per_batch=256, checkpoint_every=1000)
    before = evaluate(model, samples, CONTROL)
    result = train_adapter(model, samples, cfg, progress=False)
    after = evaluate(model, samples, CONTROL)
    assert result.steps == len(plan_batches(samples, cfg))
    assert np.mean(result.losses[-5:]) < 0.6 * np.mean(result.losses[:5])
    assert after["loss"] < before["loss"]
    assert before["fork_recall"] == 0.0
    assert after["fork_recall"] == 1.0 and after["fork_precision"] == 1.0
    assert after["negatives_with_a_fork"] == "0/8"


def test_resume_from_a_checkpoint_matches_an_uninterrupted_run(tmp_path):
    samples = _synthetic_samples()
    cfg = AparTrainConfig(lr=1e-3, rows_lr=1e-2, epochs=2, tokens_per_batch=256, checkpoint_every=2)
    straight = _tiny_adapted().model
    train_adapter(straight, samples, cfg, progress=False)

    interrupted = _tiny_adapted().model
    first = train_adapter(interrupted, samples, AparTrainConfig(**{**cfg.__dict__, "max_steps": 3}),
                          checkpoint_dir=tmp_path, progress=False)
    assert first.steps == 3
    resumed = _tiny_adapted(seed=0).model  # a fresh process: same init, then the checkpoint
    messages = []
    train_adapter(resumed, samples, cfg, checkpoint_dir=tmp_path, progress=False, log=messages.append)
    assert "resumed" in messages[0] and "at step 3/" in messages[0]
    a, b = trainable_weights(straight), trainable_weights(resumed)
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), rtol=1e-4, atol=1e-6)
    with pytest.raises(Exception, match="other settings"):
        train_adapter(_tiny_adapted().model, samples, AparTrainConfig(**{**cfg.__dict__, "lr": 5e-4}),
                      checkpoint_dir=tmp_path, progress=False)


def test_base_log_probs_are_the_original_models_with_the_lora_restored_after():
    """The KL teacher is the model before the adapter: same logits as the untouched tiny model,
    and the adapted model computes its own (different) logits again afterwards."""
    adapted = _tiny_adapted().model
    original = make_tiny_llama(seed=0, layers=2, tie=True)
    original.model.embed_tokens.weight = original.model.embed_tokens.weight / 8
    sample = layout_tree(PROMPT, ParagraphTree(), CONTROL, EOS)
    sample.tokens[len(PROMPT):len(PROMPT) + 1] = 11  # a text token, no control token fed
    tokens, positions, mask, rows, cols, targets = collate([sample])
    teacher = base_log_probs(adapted, tokens, positions, mask, rows, cols, V)
    logits = forward(original, tokens, None, positions=positions, mask=mask).logits[rows, cols]
    expected = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.array(teacher), np.array(expected), rtol=1e-5, atol=1e-5)
    after = forward(adapted, tokens, None, positions=positions, mask=mask).logits[rows, cols, :V]
    assert not np.allclose(np.array(after), np.array(logits), atol=1e-3)  # LoRA is back on


def test_the_teacher_reads_each_threads_path_as_plain_text():
    """Child 2 of small_tree (30 31) hangs off the root path 10 11 [F1] 12 [F2] [Child]: its
    teacher must be the untouched model continuing 10 11 12 as plain text."""
    from mlx_specdec.apar.losses import teacher_log_probs

    adapted = _tiny_adapted().model
    original = make_tiny_llama(seed=0, layers=2, tie=True)
    original.model.embed_tokens.weight = original.model.embed_tokens.weight / 8
    packed = layout_tree(PROMPT, small_tree(), CONTROL, EOS)
    arrays = collate([packed])
    teacher = np.array(teacher_log_probs(adapted, [packed], arrays, CONTROL))
    cols = np.array(arrays[4])
    at = int(np.flatnonzero(packed.tokens == 30)[0])  # the position that predicts 31
    flat = mx.array([PROMPT + [10, 11, 12, 30]])
    logits = forward(original, flat, None).logits[0, -1]
    expected = np.array(logits - mx.logsumexp(logits))
    np.testing.assert_allclose(teacher[list(cols).index(at)], expected, rtol=1e-4, atol=1e-4)


def test_soft_positions_keep_every_control_decision_hard():
    packed = layout_tree(PROMPT, small_tree(), CONTROL, EOS)
    tokens, positions, mask, rows, cols, targets = collate([packed])
    soft = np.array(soft_positions(tokens, rows, cols, targets, CONTROL, [EOS]))
    fed = packed.tokens[np.array(cols)]
    wanted = np.array(targets)
    hard = (wanted == CONTROL.fork) | (wanted == EOS) | (fed == CONTROL.fork) | (fed == CONTROL.child)
    assert (soft == ~hard).all()
    # root: 42->10, 10->11 soft; 11->[F] hard; [F]->12 hard (the next sibling starts); 13->EOS hard ...
    assert soft.sum() == 3 and hard.sum() == 13  # soft: 42->10, 10->11, 30->31


def test_kl_training_learns_to_fork_and_keeps_the_base_models_text():
    """Hard labels only where the data forks or ends; elsewhere the base model's distribution.
    Starting from a LoRA that moved the text away from the base, KL training brings the argmax
    back to the base's on text positions while it still learns every fork; cross-entropy on the
    same data learns the forks but writes the data, not the base."""
    samples = _synthetic_samples()
    cfg = AparTrainConfig(lr=1e-3, rows_lr=1e-2, epochs=12, tokens_per_batch=256, checkpoint_every=1000)
    results = {}
    for weight in (0.0, 1.0):
        model = _tiny_adapted().model
        before = evaluate(model, samples, CONTROL, eos_ids=[EOS])
        train_adapter(model, samples, AparTrainConfig(**{**cfg.__dict__, "kl_weight": weight}), progress=False,
                      control=CONTROL, eos_ids=[EOS])
        results[weight] = evaluate(model, samples, CONTROL, eos_ids=[EOS])
    # (a random tiny model's distributions are flat, so its argmax is fragile; measured: agreement
    # 0.16 at the start, 0.14 after cross-entropy, 0.43 after KL; KL 0.44, 1.33, 0.33)
    assert before["base_argmax_agreement"] < 0.3
    for after in results.values():
        assert after["fork_recall"] == 1.0 and after["fork_precision"] == 1.0
        assert after["negatives_with_a_fork"] == "0/8"
    assert results[1.0]["base_argmax_agreement"] > max(0.3, 2 * results[0.0]["base_argmax_agreement"])
    assert results[1.0]["base_kl"] < before["base_kl"]
    assert results[1.0]["base_kl"] < results[0.0]["base_kl"] / 3
    with pytest.raises(ValueError, match="control tokens"):
        train_adapter(_tiny_adapted().model, samples, AparTrainConfig(kl_weight=1.0), progress=False)


def test_init_adapter_starts_from_saved_weights_and_refuses_other_lora(tmp_path):
    trained = _tiny_adapted(seed=3)
    save_adapter(trained.model, _tiny_config(), tmp_path / "a", dtype=mx.float32)
    fresh = _tiny_adapted(seed=0)
    load_initial_adapter(fresh.model, _tiny_config(), tmp_path / "a")
    a, b = trainable_weights(trained.model), trainable_weights(fresh.model)
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]))
    other = _tiny_config(rank=8)
    with pytest.raises(Exception, match="same --rank"):
        load_initial_adapter(fresh.model, other, tmp_path / "a")


def test_token_tree_tokenises_each_piece():
    tok = make_tiny_tokenizer()
    e = extract("1. w5: w6 w7 w8 w9 w10\n2. w11: w12 w13 w14 w15\n3. w16: w17 w18 w19 w20")
    assert e.kind == "list"
    tree = token_tree(e, tok)
    assert tree.streams[1] == [6, 7, 8, 9, 10]
    assert tree.depth[3] == 1


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mlx_specdec.cli", *args], capture_output=True,
                          text=True, env=dict(os.environ, **(env or {})), timeout=300)


def test_train_apar_bad_input(tmp_path):
    result = cli("train-apar", "--prompts", str(tmp_path / "none.jsonl"))
    assert result.returncode == 1 and "error: no prompt file" in result.stderr
    assert "Traceback" not in result.stderr
    result = cli("train-apar", "--prompts", "benchmarks/prompts.jsonl")
    assert result.returncode == 1 and "never train on it" in result.stderr
    result = cli("train-apar", "--rank", "0")
    assert result.returncode == 1 and "--rank must be positive" in result.stderr
    result = cli("train-apar", "--init-adapter", str(tmp_path))
    assert result.returncode == 1 and "no APAR adapter there" in result.stderr
    result = cli("train-apar", "--kl-weight", "-1")
    assert result.returncode == 1 and "--kl-weight must be >= 0" in result.stderr
    result = cli("train-apar", "--layout", "zigzag")
    assert result.returncode == 1 and "tree, streams or skeleton" in result.stderr
    result = cli("train-apar", "--layout", "skeleton", "--kl-weight", "1")
    assert result.returncode == 1 and "trains without --kl-weight" in result.stderr
    result = cli("train-apar", "--help")
    assert result.returncode == 0 and "usage: mlx-specdec train-apar" in result.stdout
    result = cli("generate", "-p", "hi", "--method", "apar", "--max-depth", "-1")
    assert result.returncode == 1 and "--max-depth takes a whole number from 0 to 8, not '-1'" in result.stderr
