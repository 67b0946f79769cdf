"""The APAR fork probe on a tiny random Llama: the original model writes until the first fork
(decided by one linear row on its hidden state), then the adapted model writes every thread."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_unflatten

from mlx_specdec.apar import ParagraphTree, restore_tokens, tree_from_events
from mlx_specdec.apar.adapter import load_apar_model, prepare_for_training, save_adapter, trainable_weights
from mlx_specdec.apar.config import LoraSettings
from mlx_specdec.apar.probe import (PROBE_FILE, ProbeExample, evaluate_probe, flatten_with_forks, probe_loss,
                                    save_fork_probe)
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.decoding import GenerationParams, stream_events
from mlx_specdec.decoding.apar import apar
from mlx_specdec.decoding.autoregressive import autoregressive
from mlx_specdec.errors import UserError
from mlx_specdec.model.forward import forward

from conftest import make_tiny_lm

V = 97
FORK, CHILD, EOS = V, V + 1, 2
PROMPT = [5, 17, 42, 3, 88, 11]


def adapter_dir(tmp_path, seed=0, fork_boost=0.0):
    """A saved full adapter with random (non-zero) LoRA and rows; fork_boost raises the adapted
    model's [Fork] row so that it forks on its own."""
    adapted, config = prepare_for_training(make_tiny_lm(seed=seed), LoraSettings(rank=4, scale=10.0))
    rng = np.random.default_rng(seed)
    moved = {k: mx.array(rng.normal(0, 0.3, v.shape).astype(np.float16)).astype(mx.float32)
             for k, v in trainable_weights(adapted.model).items()}
    if fork_boost:
        rows = moved["lm_head.extra"]
        rows[0] = rows[0] * fork_boost
        moved["lm_head.extra"] = rows
    adapted.model.update(tree_unflatten(list(moved.items())))
    save_adapter(adapted.model, config, tmp_path)
    return tmp_path


def with_probe(tmp_path, weight, bias, seed=0, fork_boost=0.0):
    """(base LoadedModel, adapted LoadedModel carrying the probe)."""
    directory = adapter_dir(tmp_path, seed, fork_boost)
    save_fork_probe(directory, mx.array(weight, dtype=mx.float32), mx.array(bias, dtype=mx.float32), {})
    base = make_tiny_lm(seed=seed)
    return base, load_apar_model(directory, base)


def tokens_of(events, thread=None):
    return [t for e in events if e.kind == "token" and (thread is None or e.thread_id == thread) for t in e.tokens]


def greedy_path(base, steps):
    """(largest logit, final hidden state) at each of the base model's first `steps` greedy steps."""
    cache = ContiguousKVCache.for_model(base.model)
    out = forward(base.model, mx.array(PROMPT)[None], cache, logits_for="last")
    highs, hidden = [], []
    for _ in range(steps):
        row = out.logits[0, -1]
        highs.append(float(row.max().item()))
        hidden.append(np.array(out.hidden[0, -1]))
        out = forward(base.model, mx.argmax(row).reshape(1, 1), cache, logits_for="last")
    return np.array(highs), np.stack(hidden)


def probe_firing_at_step_two_or_later(base, weight):
    """(bias, fire): a probe (weight, bias) that first beats the base's top logit at step fire >= 2
    of the base's greedy path."""
    highs, hidden = greedy_path(base, 12)
    margin = highs - hidden @ weight  # it fires at step i iff bias > margin[i]
    for bias in sorted(margin, reverse=True):
        bias = float(bias) + 1e-3
        fire = int(np.argmax(margin < bias))
        if fire >= 2 and np.all(margin[:fire] >= bias):
            return bias, fire
    raise AssertionError("no bias fires at step 2 or later")


def test_flatten_with_forks_is_the_restored_answer_with_its_fork_points():
    tree = ParagraphTree()
    tree.add(0, 1, 2)
    c1 = tree.fork(0)
    tree.add(c1, 3, 4)
    g = tree.fork(c1)
    tree.add(g, 5)
    tree.add(0, 6)
    c2 = tree.fork(0)
    tree.add(c2, 7)
    tokens, forks = flatten_with_forks(tree)
    assert tokens == tree.restore() == [1, 2, 3, 4, 5, 6, 7]
    assert forks == [1, 3, 5]  # after token 2, after token 4, after token 6


def test_probe_loss_is_the_cross_entropy_over_the_vocabulary_plus_the_fork_logit():
    rng = np.random.default_rng(0)
    T, D, vocab = 7, 5, 11
    hidden, logits = rng.normal(size=(T, D)), rng.normal(size=(T, vocab)) * 3
    targets, fork = rng.integers(0, vocab, T), np.array([0, 1, 0, 0, 1, 0, 0], bool)
    w, b = rng.normal(size=D), 0.3
    full = np.concatenate([logits, (hidden @ w + b)[:, None]], axis=1)  # (T, V + 1)
    log_p = full - np.log(np.exp(full).sum(axis=1, keepdims=True))
    want = -np.mean(np.where(fork, log_p[:, vocab], log_p[np.arange(T), targets]))
    lse = np.log(np.exp(logits).sum(axis=1))
    got = probe_loss(mx.array(w, dtype=mx.float32), mx.array(b, dtype=mx.float32), mx.array(hidden, dtype=mx.float32),
                     mx.array(lse, dtype=mx.float32), mx.array(logits[np.arange(T), targets], dtype=mx.float32),
                     mx.array(fork))
    assert math.isclose(got.item(), want, rel_tol=1e-5)


def test_evaluation_counts_where_the_greedy_decision_fires():
    hidden = np.array([[0, 0], [1, 0], [0, 0], [1, 0]], np.float16)
    example = lambda kind, fork: ProbeExample(hidden, np.zeros(4, np.float32), np.zeros(4, np.float32),
                                              np.full(4, 0.5, np.float32), np.array(fork), kind, "valid")
    examples = [example("list", [False, True, False, False]),  # fires at 1 (right) and 3 (wrong)
                example("unstructured", [False] * 4)]  # fires at 1: a negative that forks
    report = evaluate_probe(mx.array([1.0, 0.0]), mx.array(0.0), examples, "valid")
    assert (report["fork_points"], report["recall"], report["precision"]) == (1, 1.0, 0.25)
    assert (report["first_fire_on_a_fork_point"], report["negatives_that_fire"]) == (1, 1)


def test_a_probe_that_never_fires_writes_the_original_models_greedy_answer(tmp_path):
    """The adapted model is never run: the prompt and every token are the original model's."""
    base, adapted = with_probe(tmp_path, np.zeros(64), -1e4)
    assert adapted.model.fork_probe is not None
    params = GenerationParams(max_tokens=40)
    events = list(stream_events(adapted, list(PROMPT), apar, params, "apar"))
    plain = list(stream_events(base, list(PROMPT), autoregressive, params, "ar"))
    assert tokens_of(events) == tokens_of(plain)
    stats = events[-1].stats.extra
    assert stats["fork_probe"] and stats["base_model_tokens"] == len(tokens_of(events)) and stats["threads"] == 1
    # without the probe the (random) adapter writes something else
    off = list(stream_events(adapted, list(PROMPT), apar, GenerationParams(max_tokens=40, options={"fork_probe": False}), "apar"))
    assert tokens_of(off) != tokens_of(plain) and not off[-1].stats.extra["fork_probe"]


def decode_switching(base, adapted, sequence, switch, first):
    """Logits after feeding sequence[i] for i >= first, one contiguous cache: the original model
    feeds sequence[:switch], the adapted model the rest."""
    cache = ContiguousKVCache.for_model(base.model)
    rows = []
    for i, token in enumerate(sequence):
        model = base.model if i < switch else adapted.model
        out = forward(model, mx.array([[token]]), cache, logits_for="last")
        if i >= first:
            rows.append(np.array(out.logits[0, -1]))
    return rows


@pytest.mark.parametrize("seed", [0, 1])
def test_the_probes_first_fork_hands_every_thread_to_the_adapted_model(tmp_path, seed):
    """Before the first [Fork]: the original model's logits and the probe's [Fork] logit. From the
    [Fork] on (root and children): the adapted model over the original model's prompt KV."""
    base, adapted = with_probe(tmp_path, np.zeros(64), 0.0, seed=seed, fork_boost=4.0)
    weight = np.random.default_rng(seed).normal(0, 0.5, 64).astype(np.float32)
    bias, fire = probe_firing_at_step_two_or_later(base, weight)
    save_fork_probe(tmp_path, mx.array(weight), mx.array(bias), {})
    adapted = load_apar_model(tmp_path, base)

    runs = {}
    for speculate in (False, True):
        seen = {}

        def record(order, logits):
            for row, t in enumerate(order):
                seen.setdefault(t, []).append(np.array(logits[row]))
            return logits

        resources = {} if speculate else {"logits_processor": record}
        params = GenerationParams(max_tokens=60, options={"speculate": speculate})
        runs[speculate] = (list(stream_events(adapted, list(PROMPT), apar, params, "apar", resources=resources)), seen)
    events, seen = runs[False]
    strip = lambda evs: [(e.kind, e.thread_id, e.parent_id, e.tokens) for e in evs if e.kind != "done"]
    assert strip(runs[True][0]) == strip(events)  # the queued steps change nothing
    stats = events[-1].stats.extra
    assert stats["threads"] >= 2 and stats["base_model_tokens"] == fire
    assert runs[True][0][-1].stats.extra["dropped_steps"] == 1  # the original model's step behind the first fork

    tree = tree_from_events(events)
    root = tree.streams[0]
    fork_at = root.index(next(p for p in root if not isinstance(p, int)))
    assert fork_at == fire
    root_fed = PROMPT + [FORK if not isinstance(p, int) else p for p in root]
    switch = len(PROMPT) + fire  # the [Fork] is the adapted model's first token
    want = decode_switching(base, adapted, root_fed, switch, len(PROMPT) - 1)
    got = np.stack(seen[0])
    want = want[:len(got)]  # the last token sampled (EOS, or cut by max_tokens) was never fed
    np.testing.assert_allclose(got[:fire + 1, :V], np.stack(want[:fire + 1])[:, :V], atol=1e-4, rtol=1e-4)
    _, hidden = greedy_path(base, fire + 1)  # the root wrote the base's greedy tokens until it forked
    np.testing.assert_allclose(got[:fire + 1, FORK], hidden @ weight + bias, atol=1e-4, rtol=1e-4)
    assert np.all(got[:fire + 1, CHILD] == -np.inf)
    np.testing.assert_allclose(got[fire + 1:], np.stack(want[fire + 1:]), atol=1e-4, rtol=1e-4)
    child = tree.children(0)[0]
    path = root_fed[:switch + 1] + [CHILD] + [FORK if not isinstance(p, int) else p for p in tree.streams[child]]
    want_child = decode_switching(base, adapted, path, switch, switch + 1)
    np.testing.assert_allclose(np.stack(seen[child]), np.stack(want_child[:len(seen[child])]), atol=1e-4, rtol=1e-4)
    assert not {FORK, CHILD} & set(restore_tokens(events))


def test_a_bad_probe_file_is_one_clear_error(tmp_path):
    directory = adapter_dir(tmp_path)
    save_fork_probe(directory, mx.zeros((10,)), mx.array(0.0), {})  # the wrong width
    with pytest.raises(UserError, match="corrupt fork probe .*hidden size is 64"):
        load_apar_model(directory, make_tiny_lm())
    (directory / PROBE_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="corrupt fork probe"):
        load_apar_model(directory, make_tiny_lm())


def test_sampling_with_a_probe_keeps_the_rules_and_drops_at_most_the_handover_step(tmp_path):
    base, adapted = with_probe(tmp_path, np.zeros(64), 0.0, fork_boost=4.0)
    highs, _ = greedy_path(base, 12)
    save_fork_probe(tmp_path, mx.zeros((64,)), mx.array(float(np.median(highs))), {})
    adapted = load_apar_model(tmp_path, base)
    forked = 0
    for seed in range(4):
        params = GenerationParams(max_tokens=60, temperature=1.0, seed=seed)
        events = list(stream_events(adapted, list(PROMPT), apar, params, "apar"))
        stats = events[-1].stats.extra
        assert not {FORK, CHILD} & set(restore_tokens(events))
        assert stats["dropped_steps"] == (1 if stats["threads"] > 1 else 0)
        forked += stats["threads"] > 1
    assert forked >= 1


@pytest.mark.parametrize("options", [{"max_depth": 0}, {"max_threads": 1}])
def test_a_probe_that_may_not_fork_leaves_the_answer_to_the_original_model(tmp_path, options):
    base, adapted = with_probe(tmp_path, np.zeros(64), 1e4)  # it would fork at every step
    events = list(stream_events(adapted, list(PROMPT), apar, GenerationParams(max_tokens=30, options=options), "apar"))
    plain = list(stream_events(base, list(PROMPT), autoregressive, GenerationParams(max_tokens=30), "ar"))
    assert tokens_of(events) == tokens_of(plain) and events[-1].stats.extra["threads"] == 1
