"""Dynamic tree attention: dedup_prefix, pack_beams and unpacking, on random beams."""

import mlx.core as mx
import numpy as np
from hypothesis import given, settings, strategies as st

from mlx_specdec import masks
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.drafting.tree import dedup_prefix, pack_beams
from mlx_specdec.model.forward import forward

from conftest import make_tiny_llama, tree_path


@st.composite
def beam_sets(draw, max_width=5, max_length=6, vocab=3):
    """Random beams over a tiny vocabulary so prefixes are often shared; all start with one token."""
    width = draw(st.integers(1, max_width))
    length = draw(st.integers(1, max_length))
    first = draw(st.integers(0, vocab - 1))
    rows = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=length - 1, max_size=length - 1),
                         min_size=width, max_size=width))
    return np.array([[first] + r for r in rows], dtype=np.int32)  # (W, L)


def _owner(beams: np.ndarray) -> np.ndarray:
    return np.array(dedup_prefix(mx.array(beams)[None])[0])



@settings(max_examples=200, deadline=None)
@given(beam_sets())
def test_dedup_owner_is_the_first_beam_with_the_same_prefix(beams):
    owner = _owner(beams)
    W, L = beams.shape
    for w in range(W):
        for j in range(L):
            same = [k for k in range(W) if np.array_equal(beams[k, : j + 1], beams[w, : j + 1])]
            assert owner[w, j] == same[0]


@settings(max_examples=200, deadline=None)
@given(beam_sets())
def test_packing_keeps_each_prefix_once_and_every_token_sees_exactly_its_path(beams):
    tree = pack_beams(beams, _owner(beams))
    W, L = beams.shape
    distinct = {tuple(beams[w, : j + 1]) for w in range(W) for j in range(L)}
    assert len(tree.tokens) == len(distinct)  # the compression is exactly the shared prefixes
    assert all(p < i for i, p in enumerate(tree.parents))  # topological
    mask = masks.tree_mask_np(tree.parents)
    for w in range(W):
        for j in range(L):
            i = tree.index[w, j]
            path = tree_path(tree.parents, i)
            assert [tree.tokens[k] for k in path] == list(beams[w, : j + 1])  # own prefix, in order
            assert tree.depths[i] == j
            assert set(np.flatnonzero(mask[i])) == set(path)  # sees its path and nothing else


PREFIX = [5, 17, 42, 3, 88]


@settings(max_examples=15, deadline=None)
@given(beam_sets(max_width=4, max_length=5, vocab=4))
def test_packed_verify_logits_equal_each_beam_run_alone(beams):
    model = make_tiny_llama(tie=False)
    beams = beams + 20  # ids inside the tiny vocabulary, away from the prefix tokens
    tree = pack_beams(beams, _owner(beams))
    cache = ContiguousKVCache.for_model(model)
    forward(model, mx.array(PREFIX)[None], cache, logits_for="none")
    positions = mx.array(tree.depths + len(PREFIX))[None]
    mask = masks.prefix_tree_mask(tree.parents, len(PREFIX))[None, None]
    packed = forward(model, mx.array(tree.tokens)[None], cache, positions=positions, mask=mask).logits
    unpacked = np.array(packed[0][mx.array(tree.index)])  # (W, L, V)
    for w in range(beams.shape[0]):
        alone = forward(model, mx.array(PREFIX + beams[w].tolist())[None]).logits[0, len(PREFIX):]
        np.testing.assert_allclose(unpacked[w], np.array(alone), atol=1e-4, rtol=1e-4)


def test_dedup_batch_rows_are_independent():
    a = np.array([[1, 2, 3], [1, 2, 4], [1, 5, 3]])
    b = np.array([[7, 7, 7], [7, 7, 7], [7, 8, 7]])
    owner = np.array(dedup_prefix(mx.array(np.stack([a, b]))))
    np.testing.assert_array_equal(owner[0], [[0, 0, 0], [0, 0, 1], [0, 2, 2]])
    np.testing.assert_array_equal(owner[1], [[0, 0, 0], [0, 0, 0], [0, 2, 2]])
    tree = pack_beams(a, owner[0])
    assert list(tree.tokens) == [1, 2, 3, 4, 5, 3] and list(tree.parents) == [-1, 0, 1, 1, 0, 4]
