"""Skeleton APAR adapters on a tiny random Llama: per-token LoRA gate, save/load, training layout,
and decoding where children and unforked answers are exactly the base model."""

import sys
from collections import defaultdict

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_specdec.apar import ParagraphTree, control_tokens_for, tree_from_events
from mlx_specdec.apar.adapter import load_apar_model, prepare_for_training, save_adapter, trainable_weights
from mlx_specdec.apar.config import LoraSettings, read_adapter_config
from mlx_specdec.apar.losses import sequence_loss, set_lora_gate
from mlx_specdec.apar.samples import collate, layout_skeleton, lora_gates
from mlx_specdec.apar.tree import Fork
from mlx_specdec.decoding import GenerationParams, stream_events
from mlx_specdec.decoding.apar import apar
from mlx_specdec.model.forward import forward

from conftest import make_tiny_lm

V = 97
FORK, CHILD, EOS = V, V + 1, 2
NL = 50  # plays the line-break token (patched in): where a child ends
PROMPT = [5, 17, 42, 3, 88, 11]


def skeleton_lm(seed: int = 0):
    """(base LoadedModel, skeleton-adapted LoadedModel with random non-zero LoRA and rows, config)."""
    base = make_tiny_lm(seed=seed)
    adapted, config = prepare_for_training(make_tiny_lm(seed=seed), LoraSettings(rank=4, scale=10.0),
                                           mode="skeleton")
    rng = np.random.default_rng(seed)
    moved = [(k, mx.array(rng.normal(0, 0.3, v.shape).astype(np.float16)).astype(mx.float32))
             for k, v in trainable_weights(adapted.model).items()]  # float16-exact: saved losslessly
    adapted.model.update(tree_unflatten(moved))
    mx.eval(adapted.model.parameters())
    return base, adapted, config


def gated_logits(model, tokens, gate_from=None, gate_to=None):
    """Logits (L, V') of one causal forward; LoRA on for positions in [gate_from, gate_to)
    (gate_from None: off everywhere; gate_to None: to the end)."""
    gates = None
    if gate_from is not None:
        where = np.arange(len(tokens))
        on = (where >= gate_from) & (where < (len(tokens) if gate_to is None else gate_to))
        gates = mx.array(on.astype(np.float32))[None, :, None]
    set_lora_gate(model, gates)
    try:
        return np.array(forward(model, mx.array(tokens)[None]).logits[0])
    finally:
        set_lora_gate(model, None)


TOKENS = [5, 17, 42, 3, 88, FORK, 9, 30]


def test_gate_off_is_exactly_the_base_model_and_gate_on_acts_only_from_its_position():
    base, adapted, config = skeleton_lm()
    assert config.mode == "skeleton" and adapted.config["apar"]["mode"] == "skeleton"
    want = gated_logits(base.model, TOKENS[:5])
    np.testing.assert_array_equal(gated_logits(adapted.model, TOKENS[:5])[:, :V], want)
    gated = gated_logits(adapted.model, TOKENS, gate_from=5)
    # causal: tokens before the gate are the base's (a longer sequence: matmul rounding only)
    np.testing.assert_allclose(gated[:5, :V], want, atol=1e-5)
    ungated = gated_logits(adapted.model, TOKENS)
    assert np.abs(gated[5:] - ungated[5:]).max() > 1e-2  # from the gate on, the LoRA acts


def test_saved_skeleton_adapter_loads_unfused_and_gated(tmp_path):
    _, adapted, config = skeleton_lm()
    save_adapter(adapted.model, config, tmp_path)
    assert read_adapter_config(tmp_path).mode == "skeleton"
    want = gated_logits(adapted.model, TOKENS, gate_from=5)
    loaded = load_apar_model(tmp_path, make_tiny_lm())
    assert getattr(loaded.model, "lora_gate", None) is not None
    np.testing.assert_allclose(gated_logits(loaded.model, TOKENS, gate_from=5), want, atol=1e-5)
    assert loaded.config["apar"]["mode"] == "skeleton"


def test_skeleton_layout_is_the_root_stream_with_the_gate_from_its_first_fork():
    tree: ParagraphTree = ParagraphTree()
    tree.add(0, 10, 11)
    tree.fork(0)
    tree.add(0, 12)
    tree.fork(0)
    tree.add(0, 13)
    tree.add(1, 20, 21)
    tree.add(2, 22)
    control = control_tokens_for(skeleton_lm()[1])
    sample = layout_skeleton(PROMPT, tree, control, EOS, "list")
    assert sample.tokens.tolist() == PROMPT + [10, 11, FORK, 12, FORK, 13, EOS]
    assert sample.gate_from == len(PROMPT) + 2 and sample.forks == 2
    assert sample.targets.tolist() == [-1] * 5 + [10, 11, FORK, 12, FORK, 13, EOS, -1]
    unforked = ParagraphTree()
    unforked.add(0, 10, 11)
    flat = layout_skeleton(PROMPT, unforked, control, EOS, "unstructured")
    assert flat.gate_from == len(flat.tokens)
    gates = np.array(lora_gates([sample, flat], 32))
    assert gates.shape == (2, 32, 1)
    n = len(sample.tokens)
    assert gates[0, :, 0].tolist() == [0.0] * sample.gate_from + [1.0] * (n - sample.gate_from) + [0.0] * (32 - n)
    assert not gates[1].any()


def test_training_an_unforked_answer_moves_only_the_fork_row():
    _, adapted, _ = skeleton_lm()
    model = adapted.model
    tree = ParagraphTree()
    tree.add(0, 10, 11, 12, 13)
    control = control_tokens_for(adapted)
    batch = [layout_skeleton(PROMPT, tree, control, EOS, "unstructured")]
    arrays = collate(batch)
    set_lora_gate(model, lora_gates(batch, arrays[0].shape[1]))
    _, grads = nn.value_and_grad(model, sequence_loss)(model, *arrays)
    set_lora_gate(model, None)
    grads = dict(tree_flatten(grads))
    assert all(float(mx.abs(g).max()) == 0.0 for k, g in grads.items() if "lora" in k)
    assert float(mx.abs(grads["lm_head.extra"]).max()) > 0.0  # the untied output rows of [Fork]/[Child]


class Script:
    """Logits processor: plan {(thread, k): token or (token, runner-up)} forces `token` at the
    k-th row of `thread`;
    [Fork], EOS and the line break are suppressed elsewhere. Records each thread's raw logits."""

    def __init__(self, plan):
        self.plan, self.calls, self.logits = dict(plan), defaultdict(int), defaultdict(list)

    def __call__(self, order, logits):
        raw = np.array(logits)
        bias = np.zeros_like(raw)
        bias[:, [FORK, EOS, NL]] = -1e4
        for row, thread in enumerate(order):
            k = self.calls[thread]
            self.calls[thread] += 1
            self.logits[thread].append(raw[row])
            want = self.plan.get((thread, k), ())
            for rank, token in enumerate(want if isinstance(want, tuple) else (want,)):
                bias[row, token] = 2e4 / (rank + 1)  # a tuple: the token, then the runner-up
        return logits + mx.array(bias)


def run(lm, plan, monkeypatch, max_tokens=200, **options):
    module = sys.modules["mlx_specdec.decoding.apar"]  # (the package's `apar` is the function)
    monkeypatch.setattr(module, "newline_token_ids", lambda tokenizer: frozenset({NL}))
    script = Script(plan)
    params = GenerationParams(max_tokens=max_tokens, options=options)
    events = list(stream_events(lm, list(PROMPT), apar, params, "apar", resources={"logits_processor": script}))
    return events, script


# Root forks at its rows 1 and 3 and ends at 6; each child ends with a line break at its row 2.
PLAN = {(0, 1): FORK, (0, 3): FORK, (0, 6): EOS, (1, 2): NL, (2, 2): NL}


def test_children_are_the_base_model_on_their_path_and_end_at_a_line_break(monkeypatch):
    base, adapted, _ = skeleton_lm()
    events, script = run(adapted, PLAN, monkeypatch)
    assert [(e.thread_id, e.parent_id) for e in events if e.kind == "thread_start"] == [(1, 0), (2, 0)]
    assert sorted(e.thread_id for e in events if e.kind == "thread_end") == [0, 1, 2]
    tree = tree_from_events(events)
    root = tree.streams[0]
    assert all(NL not in tree.own(t) and FORK not in tree.own(t) for t in tree.threads)
    assert [len(tree.own(t)) for t in (1, 2)] == [3, 3]  # its start, rows 0 and 1, then the line break (row 2)

    # The root fed its stream with [Fork] for each marker; LoRA on from the first [Fork].
    root_fed = PROMPT + [FORK if isinstance(p, Fork) else p for p in root]
    first_fork = len(PROMPT) + root.index(Fork(1))
    want_root = gated_logits(adapted.model, root_fed, gate_from=first_fork)[len(PROMPT) - 1:]
    np.testing.assert_allclose(np.stack(script.logits[0]), want_root, atol=1e-4, rtol=1e-4)

    for child in (1, 2):
        cut = root.index(Fork(child))  # the child shares the root's path up to its fork, not the [Fork]
        shared = PROMPT + [FORK if isinstance(p, Fork) else p for p in root[:cut]]
        # its first token is what the root would have written there without [Fork]
        fork_row = script.logits[0][cut]
        masked = fork_row.copy()
        masked[[FORK, CHILD, EOS, NL]] = -np.inf
        assert tree.own(child)[0] == int(np.argmax(masked))
        path = shared + tree.own(child)
        # LoRA on only for the root's skeleton (from its first [Fork]) on this path; child 1's
        # path has none, so child 1 is exactly the base model on the plain root text
        want = gated_logits(adapted.model, path, gate_from=min(first_fork, len(shared)), gate_to=len(shared))
        got = np.stack(script.logits[child])
        np.testing.assert_allclose(got, want[len(shared):], atol=1e-4, rtol=1e-4)
        if child == 1:  # the untouched base model, on the plain text before the first fork
            np.testing.assert_allclose(got[:, :V], gated_logits(base.model, path)[len(shared):], atol=1e-4)
    stats = events[-1].stats.extra
    assert stats["threads"] == 3 and stats["control_tokens"] == 2
    assert adapted.model.lora_gate.value is None  # the root's skeleton set it; reset after decoding


@pytest.mark.parametrize("seed", [0, 1])
def test_an_answer_that_never_forks_is_the_base_models_greedy_answer(seed):
    base, adapted, _ = skeleton_lm(seed)
    control = control_tokens_for(adapted)

    def no_fork(order, logits):
        logits[:, control.fork] = -float("inf")
        return logits

    params = GenerationParams(max_tokens=24)
    events = list(stream_events(adapted, list(PROMPT), apar, params, "apar", resources={"logits_processor": no_fork}))
    got = [t for e in events if e.kind == "token" for t in e.tokens]
    from mlx_specdec.decoding.autoregressive import autoregressive
    plain = list(stream_events(base, list(PROMPT), autoregressive, params, "ar"))
    assert got == [t for e in plain if e.kind == "token" for t in e.tokens]


def test_a_fork_where_the_base_would_break_the_line_gives_an_empty_child(monkeypatch):
    _, adapted, _ = skeleton_lm()
    events, _ = run(adapted, {(0, 1): (FORK, NL), (0, 4): EOS}, monkeypatch)
    kinds = [(e.kind, e.thread_id) for e in events if e.thread_id == 1]
    assert kinds == [("thread_start", 1), ("thread_end", 1)]
    tree = tree_from_events(events)
    assert tree.own(1) == [] and len(tree.own(0)) == 3
    stats = events[-1].stats.extra
    assert stats["threads"] == 1 and not stats["forked"]  # an empty child wrote nothing: not a thread


@pytest.mark.parametrize("seed,boost", [(1, 2.0), (2, 2.0), (3, 2.5)])  # 3: empty children too
def test_speculated_next_steps_change_nothing_with_the_gate(seed, boost, monkeypatch):
    """The pipelined loop (next step queued with the gates of the guess that nobody forks or ends)
    writes exactly what the step-by-step loop writes, with forks, empty children and line-break
    ends happening on their own ([Fork], EOS and the line-break rows of the head scaled up)."""
    _, adapted, _ = skeleton_lm(seed)
    module = sys.modules["mlx_specdec.decoding.apar"]
    monkeypatch.setattr(module, "newline_token_ids", lambda tokenizer: frozenset({NL}))
    head = adapted.model.lm_head  # the base head plus the control rows ([Fork] is extra row 0)
    extra = mx.array(head.extra)
    extra[FORK - V] = extra[FORK - V] * boost
    head.extra = extra
    weight = mx.array(head.base.weight)
    for row in (EOS, NL):
        weight[row] = weight[row] * boost
    head.base.weight = weight
    runs = {}
    for speculate in (False, True):
        params = GenerationParams(max_tokens=120, options={"speculate": speculate})
        runs[speculate] = list(stream_events(adapted, list(PROMPT), apar, params, "apar"))
        assert adapted.model.lora_gate.value is None
    strip = lambda events: [(e.kind, e.thread_id, e.parent_id, e.tokens) for e in events if e.kind != "done"]
    assert strip(runs[True]) == strip(runs[False])
    assert sum(e.kind == "thread_start" for e in runs[True]) >= 2  # the loop did fork
    for key in ("decode_steps", "max_cached_tokens", "attended_tokens_mean", "threads"):
        assert runs[True][-1].stats.extra[key] == runs[False][-1].stats.extra[key], key


def test_line_breaks_are_whitespace_tokens_only():
    """A child ends at a pure line-break token (unwritten); a token that merges text with the
    break would lose its text there, so it does not count."""
    from mlx_specdec.apar.tokens import newline_token_ids

    class Tokenizer:
        pieces = ["a", "\n", ".\n", " \n", "\n\n", "b", "\r\n", ":\n  "]

        def __len__(self):
            return len(self.pieces)

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)

    assert newline_token_ids(Tokenizer()) == {1, 3, 4, 6}
