"""Prefix reuse between requests (cache/prefix.py): a follow-up resumes from the entry sharing
the longest token prefix, prefills only the rest, and decodes exactly what a fresh engine decodes;
the store keeps several conversations, least recently used out first, within its bytes."""

import mlx.core as mx
import pytest

from mlx_specdec.cache.contiguous import ContiguousKVCache
from mlx_specdec.cache.prefix import PrefixStore, cache_nbytes
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine

from mlx_specdec.model.forward import forward

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
    assert stats.extra["prefix_reused"] == stats.cached_tokens == 0
    follow_up = first + answer + [70, 71, 72]
    got, stats = run(reusing, follow_up, method, **options)
    assert stats.cached_tokens == len(first) - 1  # the whole earlier prompt but its last token
    assert stats.extra["prefix_reused"] == stats.cached_tokens  # the chat app reads it there
    assert f"({stats.cached_tokens} cached)" in stats.summary()
    assert got == run(fresh, follow_up, method, **options)[0]


def test_a_changed_earlier_message_cuts_the_reuse_back_to_the_change():
    lm = make_tiny_lm(seed=3, eos_id=96)
    fresh, reusing = Engine(lm), Engine(lm, reuse_prefix=True)
    run(reusing, DOCUMENT + [60, 61])
    edited = DOCUMENT[:50] + [9] + DOCUMENT[51:] + [60, 62]
    got, stats = run(reusing, edited)
    assert stats.cached_tokens == 50
    assert got == run(fresh, edited)[0]
    # the other method reads the same store; an unrelated prompt reuses nothing
    got, stats = run(reusing, [11, 12, 13, 14], "triforce", budget=16)
    assert stats.cached_tokens == 0 and got == run(fresh, [11, 12, 13, 14])[0]


def test_interleaved_conversations_each_resume_from_their_own_entry():
    """Two conversations with the same opening (a system prompt) take turns: each turn resumes from
    its own conversation's last prompt, not just the shared opening, and writes what it writes fresh."""
    lm = make_tiny_lm(seed=3, eos_id=96)
    fresh, reusing = Engine(lm), Engine(lm, reuse_prefix=True)
    system = DOCUMENT[:40]
    history = {"a": system + [60, 61, 62], "b": system + [70, 71]}
    last = {}  # each conversation's last prompt
    for name in ("a", "b"):
        answer, stats = run(reusing, history[name])
        assert stats.cached_tokens == (0 if name == "a" else len(system))  # b: the shared opening
        last[name], history[name] = history[name], history[name] + answer
    for turn in range(2):
        for name, message in (("a", [80 + turn]), ("b", [85 + turn, 86])):
            prompt = history[name] + message
            got, stats = run(reusing, prompt)
            assert stats.cached_tokens == len(last[name]) - 1, (name, turn)  # its own last prompt
            assert got == run(fresh, prompt)[0]
            last[name], history[name] = prompt, prompt + got
    assert reusing.prefix_store.entries == 2


def filled(lm, store, tokens):
    """A cache taken from the store for `tokens` and filled with them (plus two answer tokens)."""
    cache, reused = store.take(lm.model, tokens)
    forward(lm.model, mx.array([list(tokens)[reused:] + [1, 2]]), cache, logits_for="none")
    mx.eval(cache.state)
    return cache, reused


def test_least_recently_used_entries_leave_first_and_the_bytes_stay_bounded():
    lm = make_tiny_lm(seed=3)
    unbounded = PrefixStore(max_bytes=1 << 40, max_entries=100)
    cache, _ = filled(lm, unbounded, [5] * 300)
    unbounded.put(lm.model, [5] * 300, cache)
    one = cache_nbytes(cache)
    # 300 tokens in 2 layers x (keys, values) x 2 KV heads x 16 dims x 4 B, in whole 256-slot steps
    assert one == unbounded.nbytes == 2 * 2 * 2 * 512 * 16 * 4
    store = PrefixStore(max_bytes=3 * one, max_entries=100)
    for first in (10, 20, 30):
        store.put(lm.model, [first] + [5] * 299, filled(lm, store, [first] + [5] * 299)[0])
    assert store.entries == 3 and store.nbytes == 3 * one
    assert store.take(lm.model, [10] + [5] * 299 + [7])[1] == 300  # taken: out of the store...
    assert store.entries == 2
    store.put(lm.model, [10] + [5] * 299, filled(lm, PrefixStore(), [10] + [5] * 299)[0])  # ...back, most recent
    store.put(lm.model, [40] + [5] * 299, filled(lm, PrefixStore(), [40] + [5] * 299)[0])  # one over: 20 leaves
    assert store.entries == 3 and store.nbytes <= 3 * one
    assert store.take(lm.model, [20] + [5] * 299)[1] == 0
    for first in (30, 10, 40):
        assert store.take(lm.model, [first] + [5] * 298 + [9])[1] == 299  # a partial match: a copy
    assert store.entries == 3
    capped = PrefixStore(max_bytes=1 << 40, max_entries=2)
    for first in (10, 20, 30):
        capped.put(lm.model, [first, 7, 7], filled(lm, capped, [first, 7, 7])[0])
    assert capped.entries == 2 and capped.take(lm.model, [10, 7, 7, 9])[1] == 0
    long_answer, _ = filled(lm, PrefixStore(), [5] * 308)  # 10 prompt tokens and a 300-token answer
    PrefixStore().put(lm.model, [5] * 10, long_answer)
    assert cache_nbytes(long_answer) == one // 2  # copied down to one 256-slot step
    tiny = PrefixStore(max_bytes=one - 1)
    tiny.put(lm.model, [5] * 300, filled(lm, tiny, [5] * 300)[0])
    assert tiny.entries == 0 and tiny.nbytes == 0  # over the whole bound: not kept


def test_the_store_hands_a_whole_entry_over_and_copies_a_part():
    lm, other = make_tiny_lm(seed=3), make_tiny_lm(seed=4)
    store = PrefixStore()
    cache, reused = filled(lm, store, [1, 2, 3])
    assert reused == 0
    store.put(lm.model, [1, 2, 3], cache)
    assert cache.offset == 3 and store.held_tokens == 3
    assert store.take(other.model, [1, 2, 3])[1] == 0  # another model's entry: a fresh cache
    part, reused = store.take(lm.model, [1, 2, 9])  # part of the entry: a copy; the entry stays
    assert part is not cache and reused == 2 and part.offset == 2 and store.entries == 1
    assert mx.array_equal(part.layers[0].keys[..., :2, :], cache.layers[0].keys[..., :2, :])
    whole, reused = store.take(lm.model, [1, 2, 3, 4])  # all of it: handed over, out of the store
    assert whole is cache and reused == 3 and store.entries == 0
    assert store.take(lm.model, [1, 2, 3, 4])[1] == 0  # a concurrent request: a fresh cache
    store.put(lm.model, [1, 2, 3, 4, 5, 6, 7], whole)  # stopped before its prefill ended: not kept
    assert store.entries == 0
    store.put(lm.model, [1, 2, 3], whole)
    store.put(lm.model, [1, 2], part)  # what an entry already holds is not kept twice
    assert store.entries == 1 and store.held_tokens == 3
    longer, _ = filled(lm, PrefixStore(), [1, 2, 3, 4, 5])
    store.put(lm.model, [1, 2, 3, 4, 5], longer)  # the longer one makes the shorter redundant
    assert store.entries == 1 and store.held_tokens == 5
    store.put(lm.model, [7, 8], filled(lm, PrefixStore(), [7, 8])[0])
    assert store.take(lm.model, [7, 8, 9])[1] == 2 and store.entries == 1  # not the oldest: handed over too


def test_a_row_of_the_continuous_batch_resumes_its_conversation():
    """The server's `ar` path: a row joining the batch takes its conversation's entry, and its
    greedy tokens are those of a fresh engine; its stats say what it resumed."""
    lm = make_tiny_lm(seed=3, eos_id=96)
    fresh, reusing = Engine(lm), Engine(lm, reuse_prefix=True)
    first = DOCUMENT + [60, 61]
    answer, _ = run(reusing, first)
    follow_up = first + answer + [70, 71]
    decoder = reusing.continuous_decoder("ar")
    row = decoder.join(follow_up, GenerationParams(max_tokens=12))
    events = []
    while decoder.live:
        events += decoder.step()
    got = [t for e in events if e.thread_id == row and e.kind == "token" for t in e.tokens]
    assert got == run(fresh, follow_up)[0]
    assert events[-1].stats.cached_tokens == len(first) - 1


def test_of_entries_sharing_as_much_the_most_recent_is_taken():
    lm = make_tiny_lm(seed=3)

    def marked(value, n=4):  # a cache whose keys say which entry it came from
        cache = ContiguousKVCache.for_model(lm.model)
        for layer in cache.layers:
            layer.update_and_fetch(mx.full((1, 2, n, 16), value), mx.full((1, 2, n, 16), value))
        return cache

    store = PrefixStore()
    store.put(lm.model, [1, 2, 3, 4], marked(1.0))
    store.put(lm.model, [1, 2, 3, 5], marked(2.0))
    copy, reused = store.take(lm.model, [1, 2, 3, 6])
    assert reused == 3 and copy.layers[0].keys[0, 0, 0, 0].item() == 2.0
    whole, _ = store.take(lm.model, [1, 2, 3, 4, 9])  # the other one, used again: now the most recent
    store.put(lm.model, [1, 2, 3, 4], whole)
    assert store.take(lm.model, [1, 2, 3, 6])[0].layers[0].keys[0, 0, 0, 0].item() == 1.0
