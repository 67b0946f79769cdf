"""TriForce's retrieval cache (mlx_specdec/cache/retrieval.py): what it keeps, and that decoding
over its own small buffer equals full attention masked to the same positions."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.cache import ContiguousKVCache, QueryRecorder, RetrievalKVCache, SparseKVView
from mlx_specdec.cache.retrieval import CHUNK, attention_recall, choose_positions
from mlx_specdec.model.forward import forward

from conftest import make_tiny_llama

PROMPT = [(i * 37 + 11) % 90 + 3 for i in range(53)]  # 6 whole chunks of 8 and 5 tokens


def prefilled(model, prompt=PROMPT):
    """The prompt's full cache and every layer's post-RoPE queries of its last token."""
    full = ContiguousKVCache.for_model(model)
    forward(model, mx.array(prompt[:-1])[None], full, logits_for="none")
    recorder = QueryRecorder(full)
    forward(model, mx.array(prompt[-1:])[None], recorder, logits_for="none")
    mx.eval(full.state)
    return full, recorder.queries()


def test_the_buffer_equals_full_attention_masked_to_the_kept_positions():
    """One layer, so one mask says it all: the retrieval cache's logits for new tokens equal the
    full cache's with every prompt key it did not keep masked out (per KV head), over several
    appends (the new tokens see each other causally)."""
    model = make_tiny_llama(seed=2, layers=1, tie=False)
    full, queries = prefilled(model)
    retrieval = RetrievalKVCache.build(full, queries, budget=3 * CHUNK + 5)
    kept = retrieval.positions[0][0]  # (Hkv, budget)
    assert retrieval.budget == 29 and retrieval.offset == len(PROMPT)
    S, Hq, Hkv = len(PROMPT), 4, 2
    reference = ContiguousKVCache.for_model(model)
    forward(model, mx.array(PROMPT)[None], reference, logits_for="none")
    new = 0
    for chunk in ([7], [19, 2], [55]):
        T = len(chunk)
        mask = np.zeros((1, Hq, T, S + new + T), dtype=bool)
        for h in range(Hq):
            mask[0, h, :, kept[h // (Hq // Hkv)]] = True
        mask[0, :, :, S:] = np.tril(np.ones((T, new + T), dtype=bool), k=new)
        got = forward(model, mx.array(chunk)[None], retrieval).logits
        want = forward(model, mx.array(chunk)[None], reference, mask=mx.array(mask)).logits
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
        new += T
    assert retrieval.offset == S + new


def test_every_layer_keeps_its_own_positions_and_equals_the_sparse_view_over_them():
    model = make_tiny_llama(seed=3, layers=2, tie=False)
    full, queries = prefilled(model)
    retrieval = RetrievalKVCache.build(full, queries, budget=2 * CHUNK + 5)
    view = SparseKVView(full, [mx.array(p) for p in retrieval.positions])  # gathers every step
    for chunk in ([7], [19, 2]):
        got = forward(model, mx.array(chunk)[None], retrieval).logits
        want = forward(model, mx.array(chunk)[None], view).logits
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


def test_choose_keeps_the_sink_the_recent_tail_and_the_chunks_the_query_points_at():
    Hkv, Dh, S = 2, 4, 6 * CHUNK + 3
    keys = np.full((1, Hkv, S, Dh), 0.01, dtype=np.float32)
    keys[0, 0, 3 * CHUNK:4 * CHUNK] = [5, 0, 0, 0]  # head 0: chunk 3 lines up with the query
    keys[0, 1, 1 * CHUNK:2 * CHUNK] = [0, 5, 0, 0]  # head 1: chunk 1
    query = np.zeros((1, 2 * Hkv, Dh), dtype=np.float32)  # 2 query heads per KV head
    query[0, 0:2] = [1, 0, 0, 0]
    query[0, 2:4] = [0, 1, 0, 0]
    chosen = choose_positions(mx.array(query), mx.array(keys), budget=2 * CHUNK + 3)
    tail = list(range(6 * CHUNK, S))
    assert chosen[0, 0].tolist() == list(range(CHUNK)) + list(range(3 * CHUNK, 4 * CHUNK)) + tail
    assert chosen[0, 1].tolist() == list(range(2 * CHUNK)) + tail


def test_a_budget_past_the_prompt_keeps_everything_and_too_small_a_budget_is_refused():
    keys = mx.zeros((1, 2, 20, 4))
    query = mx.zeros((1, 4, 4))
    assert choose_positions(query, keys, budget=64).tolist() == [[list(range(20))] * 2]
    with pytest.raises(ValueError, match="holds no chunk"):
        choose_positions(query, keys, budget=5)  # 20 = 2 chunks + 4: 5 leaves 1 for a chunk of 8


def test_trim_forgets_only_the_tokens_decoded_through_it():
    model = make_tiny_llama(seed=2, layers=1, tie=False)
    full, queries = prefilled(model)
    retrieval = RetrievalKVCache.build(full, queries, budget=2 * CHUNK + 5)
    first = forward(model, mx.array([[7, 8]]), retrieval).logits
    assert retrieval.trim(10) == 2 and retrieval.offset == len(PROMPT) and retrieval.budget == 21
    again = forward(model, mx.array([[7, 8]]), retrieval).logits
    np.testing.assert_array_equal(np.array(first), np.array(again))
    assert full.offset == len(PROMPT)  # the full cache was never written


def test_attention_recall_grows_with_the_budget_and_is_whole_with_every_position():
    model = make_tiny_llama(seed=2, layers=2, tie=False)
    full, queries = prefilled(model)
    recalls = []
    for budget in (CHUNK + 5, 3 * CHUNK + 5, len(PROMPT)):
        retrieval = RetrievalKVCache.build(full, queries, budget=budget)
        recalls.append(attention_recall(queries, full, retrieval.positions))
    assert recalls[0] < recalls[1] < recalls[2] and recalls[2] == pytest.approx(1.0, abs=1e-5)
