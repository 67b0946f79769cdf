"""Prefix reuse between requests (cache/prefix.py): a follow-up resumes from the longest common
token prefix, prefills only the rest, and decodes exactly what a fresh engine decodes."""

import pytest

from mlx_specdec.cache.prefix import PrefixStore
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine

from conftest import make_tiny_lm

DOCUMENT = [(i * 7) % 50 + 3 for i in range(90)] + [(i * 13) % 40 + 5 for i in range(40)]


def run(engine, prompt, method="ar", **options):
    events = list(engine.generate_ids(prompt, method, GenerationParams(max_tokens=12, options=options)))
    return [t for e in events if e.kind == "token" for t in e.tokens], events[-1].stats


@pytest.mark.parametrize("method,options", [("ar", {}), ("triforce", dict(budget=24, gamma=4))])
def test_a_follow_up_prefills_only_what_is_new_and_decodes_as_a_fresh_engine(method, options):
    lm = make_tiny_lm(seed=3, eos_id=96)
    fresh, reusing = Engine(lm), Engine(lm, reuse_prefix=True)
    first = DOCUMENT + [60, 61]
    answer, stats = run(reusing, first, method, **options)
    assert stats.extra["prefix_reused"] == 0
    follow_up = first + answer + [70, 71, 72]
    got, stats = run(reusing, follow_up, method, **options)
    assert stats.extra["prefix_reused"] == len(first) - 1  # the whole earlier prompt but its last token
    assert got == run(fresh, follow_up, method, **options)[0]


def test_a_changed_earlier_message_cuts_the_reuse_back_to_the_change():
    lm = make_tiny_lm(seed=3, eos_id=96)
    fresh, reusing = Engine(lm), Engine(lm, reuse_prefix=True)
    run(reusing, DOCUMENT + [60, 61])
    edited = DOCUMENT[:50] + [9] + DOCUMENT[51:] + [60, 62]
    got, stats = run(reusing, edited)
    assert stats.extra["prefix_reused"] == 50
    assert got == run(fresh, edited)[0]
    # the other method reads the same store; an unrelated prompt reuses nothing
    got, stats = run(reusing, [11, 12, 13, 14], "triforce", budget=16)
    assert stats.extra["prefix_reused"] == 0 and got == run(fresh, [11, 12, 13, 14])[0]


def test_the_store_holds_one_cache_for_one_model_and_is_taken_exclusively():
    lm, other = make_tiny_lm(seed=3), make_tiny_lm(seed=4)
    store = PrefixStore()
    cache, reused = store.take(lm.model, [1, 2, 3])
    assert reused == 0
    from mlx_specdec.model.forward import forward
    import mlx.core as mx

    forward(lm.model, mx.array([[1, 2, 3, 4, 5]]), cache, logits_for="none")
    store.put(lm.model, [1, 2, 3], cache)
    assert cache.offset == 3 and store.held_tokens == 3
    assert store.take(other.model, [1, 2, 3])[1] == 0  # another model: a fresh cache...
    assert store.take(lm.model, [1, 2, 3])[1] == 0  # ...and the store was emptied by the take
    store.put(lm.model, [1, 2, 3], cache)
    again, reused = store.take(lm.model, [1, 2, 9])
    assert again is cache and reused == 2 and cache.offset == 2
    store.put(lm.model, [1, 2, 3, 4, 5, 6], cache)  # stopped before its prefill ended: not kept
    assert store.held_tokens == 0
