"""APAR with the shipped adapter on the real default model (slow).

What must hold is that the tree decoding is exact for the model it runs: every thread writes
what the adapted model writes greedily when it is given that thread's root path alone (one
contiguous sequence, no other thread in the batch), under the same rules ([Child] never sampled;
no [Fork] right after a control token or below the depth limit).

A `full` adapter changes the model, so its answer is not plain decoding's; with its fork probe
(shipped next to it) the original model writes until the root's first [Fork], so an answer that
never forks is plain decoding's, token for token, and a forked one starts with it. A
`skeleton` adapter (LoRA only on a thread after it forks) must also give plain decoding's answer
wherever the base model writes: an answer that never forks is the original model's greedy answer,
and the first fork's child continues the original model's own greedy answer.
"""


import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.apar import control_tokens_for, tree_from_events
from mlx_specdec.apar.tokens import newline_token_ids
from mlx_specdec.apar.losses import set_lora_gate
from mlx_specdec.apar.tree import Fork
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.decoding.apar import DEFAULT_MAX_DEPTH
from mlx_specdec.engine import MODELS_DIR, Engine
from mlx_specdec.model.forward import forward

pytestmark = pytest.mark.slow

LIST_PROMPT = "What are 5 tips for getting a better night's sleep?"  # its original answer has 'phrase:' heads
CODE_PROMPT = "Write a Python function that checks whether a number is prime."


@pytest.fixture(scope="module")
def engine():
    engine = Engine.load("default")
    assert engine.apar_lm is not None, f"no shipped APAR adapter for the default model in {MODELS_DIR}"
    return engine


def test_the_shipped_adapter_is_small_and_has_its_card():
    directory = MODELS_DIR / "apar-smollm2-135m"
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    assert size < 30e6 and (directory / "CARD.md").exists()


def mode(engine) -> str:
    return engine.apar_lm.config["apar"].get("mode", "full")


def tokens_of(events):
    return [t for e in events if e.kind == "token" for t in e.tokens]


def test_a_list_answer_forks_and_every_thread_is_its_root_path_decoded_alone(engine):
    """Each thread's path fed alone, one token at a time on a contiguous cache: with the fork
    probe, the original model (and the probe's [Fork] logit) up to the root's first [Fork], the
    adapted model from it on; without one, the adapted model throughout."""
    if mode(engine) == "skeleton":
        pytest.skip("a skeleton adapter's threads: see the skeleton test below")
    lm = engine.apar_lm
    probe = getattr(lm.model, "fork_probe", None)
    control = control_tokens_for(lm)
    events = list(engine.generate(LIST_PROMPT, "apar", GenerationParams(max_tokens=160)))
    tree = tree_from_events(events)
    assert len(tree.threads) >= 3, "the adapter should fork a list answer"
    assert events[-1].stats.extra["fork_probe"] == (probe is not None)
    prompt = lm.encode_prompt(LIST_PROMPT)
    root = [control.fork if isinstance(p, Fork) else p for p in tree.streams[0]]
    switch = len(prompt) + root.index(control.fork) if probe is not None else 0  # the root's first [Fork]
    for thread in tree.threads:
        path = tree.root_path(thread, control.fork, control.child)
        stream = tree.streams[thread]
        start = len(prompt) + len(path) - len(stream)  # the first position the thread writes
        sequence = list(prompt) + path
        cache = ContiguousKVCache.for_model(lm.model)
        for i in range(0, len(sequence) - 1):
            if i < switch:  # the original model's forward, and the probe's [Fork] logit
                out = forward(probe.model, mx.array([[sequence[i]]]), cache, logits_for="last")
                row = probe.logits_with_control(out.hidden[0, -1:], out.logits[0, -1:])[0]
            else:
                row = forward(lm.model, mx.array([[sequence[i]]]), cache, logits_for="last").logits[0, -1]
            if i < start - 1:
                continue
            logits = np.array(row)
            logits[control.child] = -np.inf
            if sequence[i] in (control.fork, control.child) or tree.depth[thread] >= DEFAULT_MAX_DEPTH:
                logits[control.fork] = -np.inf
            written = stream[i + 1 - start]
            want = control.fork if isinstance(written, Fork) else written
            assert int(np.argmax(logits)) == want, (thread, i)


def test_a_coding_answer_does_not_fork(engine):
    events = list(engine.generate(CODE_PROMPT, "apar", GenerationParams(max_tokens=96)))
    assert not any(e.kind == "thread_start" for e in events)
    assert events[-1].stats.extra["threads"] == 1
    probe = getattr(engine.apar_lm.model, "fork_probe", None)
    if mode(engine) == "skeleton" or probe is not None:  # the base model's own answer, token for token
        if probe is not None:
            assert events[-1].stats.extra["base_model_tokens"] == len(tokens_of(events))
        plain = list(engine.generate(CODE_PROMPT, "ar", GenerationParams(max_tokens=96)))
        assert tokens_of(events) == tokens_of(plain)


def _greedy_on_path(lm, control, sequence, start, gate_from, gate_to, may_fork):
    """Feed sequence one token at a time (contiguous cache, LoRA gate on for positions in
    [gate_from, gate_to)); return the argmax after each position >= start - 1."""
    cache = ContiguousKVCache.for_model(lm.model)
    forward(lm.model, mx.array(sequence[: start - 1])[None], cache, logits_for="none")  # before any gate
    out = []
    for i in range(start - 1, len(sequence)):
        set_lora_gate(lm.model, mx.ones((1, 1, 1)) if gate_from <= i < gate_to else None)
        logits = np.array(forward(lm.model, mx.array([[sequence[i]]]), cache, logits_for="last").logits[0, -1])
        logits[control.child] = -np.inf
        if not may_fork(i):
            logits[control.fork] = -np.inf
        out.append(int(np.argmax(logits)))
    set_lora_gate(lm.model, None)
    return out


def test_skeleton_threads_are_their_paths_decoded_alone_and_the_base_writes_the_text(engine):
    if mode(engine) != "skeleton":
        pytest.skip("the shipped adapter is not a skeleton adapter")
    lm = engine.apar_lm
    control = control_tokens_for(lm)
    line_breaks = newline_token_ids(lm.tokenizer)
    events = list(engine.generate(LIST_PROMPT, "apar", GenerationParams(max_tokens=160)))
    tree = tree_from_events(events)
    assert len(tree.threads) >= 3, "the adapter should fork a list answer"
    prompt = list(lm.encode_prompt(LIST_PROMPT))
    root = tree.streams[0]
    as_fed = [control.fork if isinstance(p, Fork) else p for p in root]
    first_fork = len(prompt) + as_fed.index(control.fork)
    finished = {e.thread_id for e in events if e.kind == "thread_end"}

    # the root: its own stream (the [Fork]s included), LoRA on from its first [Fork]
    sequence = prompt + as_fed
    greedy = _greedy_on_path(lm, control, sequence, len(prompt), first_fork, len(sequence),
                             lambda i: sequence[i] != control.fork)
    assert greedy[:len(as_fed)] == as_fed

    for child in tree.children(0):
        cut = root.index(Fork(child))
        shared = prompt + as_fed[:cut]
        own = tree.own(child)
        sequence = shared + own
        greedy = _greedy_on_path(lm, control, sequence, len(shared), first_fork, len(shared),
                                 lambda i: i >= len(shared) and tree.depth[child] < DEFAULT_MAX_DEPTH)
        # its first token is what the root would have written there without [Fork]
        assert greedy[: len(own)] == own, child
        if child in finished and not tree.children(child):  # it stopped at a line break (or EOS)
            assert greedy[len(own)] in line_breaks | set(lm.eos_token_ids), child

    # before the first fork and in the first child, the text is the original model's own answer
    first_child = tree.children(0)[0]
    restored_head = [p for p in root[: root.index(Fork(first_child))]] + tree.own(first_child)
    plain = tokens_of(engine.generate(LIST_PROMPT, "ar", GenerationParams(max_tokens=160)))
    assert plain[: len(restored_head)] == restored_head
