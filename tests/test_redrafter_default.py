"""ReDrafter with the shipped draft head on the real default model (slow)."""

import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import MODELS_DIR, Engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "Give me three tips for staying healthy.",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
    "List five animals that live in the ocean.",
]


@pytest.fixture(scope="module")
def engine():
    engine = Engine.load("default")
    assert engine.drafter is not None, f"no shipped drafter for the default model in {MODELS_DIR}"
    return engine


def tokens_of(events):
    return [t for e in events if e.kind == "token" for t in e.tokens]


@pytest.mark.parametrize("width,length", [(1, 5), (2, 5), (4, 4)])
def test_greedy_redrafter_equals_plain_decoding(engine, width, length):
    params = GenerationParams(max_tokens=48, options={"beam_width": width, "beam_length": length, "draft_cutoff": 0.0})
    for prompt in PROMPTS:
        want = tokens_of(engine.generate(prompt, "ar", GenerationParams(max_tokens=48)))
        events = list(engine.generate(prompt, "redrafter", params))
        assert tokens_of(events) == want, prompt
        stats = events[-1].stats
        assert stats.tokens_per_forward > 1.0  # the shipped head's drafts are accepted


def test_greedy_redrafter_with_runners_up_equals_plain_decoding(engine):
    """The shipped defaults (cutoff, trust, lookup, verify-cost rule) with the head's runners-up."""
    params = GenerationParams(max_tokens=48, options={"runners_up": 3})
    verified = 0
    for prompt in PROMPTS:
        want = tokens_of(engine.generate(prompt, "ar", GenerationParams(max_tokens=48)))
        events = list(engine.generate(prompt, "redrafter", params))
        assert tokens_of(events) == want, prompt
        verified += events[-1].stats.extra["runners_up_verified"]
    assert verified > 0


def test_batched_redrafter_equals_plain_decoding(engine):
    want = [tokens_of(engine.generate(p, "ar", GenerationParams(max_tokens=32))) for p in PROMPTS]
    rows = {}
    for e in engine.generate_batch(PROMPTS, "redrafter", GenerationParams(max_tokens=32)):
        if e.kind == "token":
            rows.setdefault(e.thread_id, []).extend(e.tokens)
    assert [rows.get(i, []) for i in range(len(PROMPTS))] == want


def test_shipped_head_refuses_another_model(tmp_path):
    from conftest import make_tiny_lm
    from mlx_specdec.redrafter_head.model import DrafterMismatch, load_drafter

    with pytest.raises(DrafterMismatch, match="hidden size"):
        load_drafter(MODELS_DIR / "drafter-smollm2-135m", make_tiny_lm())
