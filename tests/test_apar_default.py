"""APAR with the shipped adapter on the real default model (slow).

The adapter changes the model, so APAR's answer is not plain decoding's. What must hold is that
the tree decoding is exact for the model it runs: every thread writes what the adapted model
writes greedily when it is given that thread's root path alone (one contiguous sequence, no
other thread in the batch), under the same rules ([Child] never sampled; no [Fork] right after a
control token or below the depth limit).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.apar import control_tokens_for, tree_from_events
from mlx_specdec.apar.tree import Fork
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.decoding.apar import DEFAULT_MAX_DEPTH
from mlx_specdec.engine import MODELS_DIR, Engine
from mlx_specdec.model.forward import forward

pytestmark = pytest.mark.slow

LIST_PROMPT = "Give me 5 tips for staying healthy."
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


def test_a_list_answer_forks_and_every_thread_is_its_root_path_decoded_alone(engine):
    lm = engine.apar_lm
    control = control_tokens_for(lm)
    events = list(engine.generate(LIST_PROMPT, "apar", GenerationParams(max_tokens=160)))
    tree = tree_from_events(events)
    assert len(tree.threads) >= 3, "the adapter should fork a list answer"
    prompt = lm.encode_prompt(LIST_PROMPT)
    for thread in tree.threads:
        path = tree.root_path(thread, control.fork, control.child)
        stream = tree.streams[thread]
        start = len(prompt) + len(path) - len(stream)  # the first position the thread writes
        sequence = list(prompt) + path
        cache = ContiguousKVCache.for_model(lm.model)
        forward(lm.model, mx.array(sequence[: start - 1])[None], cache, logits_for="none")
        for i in range(start - 1, len(sequence) - 1):
            logits = np.array(forward(lm.model, mx.array([[sequence[i]]]), cache, logits_for="last").logits[0, -1])
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
