"""Masks and positions for causal prefill and token-tree verification."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_specdec import masks


@st.composite
def trees(draw, max_size=24):
    """Random parent lists in topological order: parents[i] in [-1, i)."""
    n = draw(st.integers(min_value=1, max_value=max_size))
    return [draw(st.integers(min_value=-1, max_value=i - 1)) for i in range(n)]


def ancestors_or_self(parents, i):
    seen = set()
    while i >= 0:
        seen.add(i)
        i = parents[i]
    return seen


@settings(max_examples=200, deadline=None)
@given(trees())
def test_tree_mask_rows_are_exactly_ancestors_and_self(parents):
    mask = masks.tree_mask_np(parents)
    n = len(parents)
    assert mask.shape == (n, n) and mask.dtype == bool
    for i in range(n):
        assert set(np.flatnonzero(mask[i]).tolist()) == ancestors_or_self(parents, i)
    assert not np.triu(mask, k=1).any()  # topological order: nothing sees a later token


@settings(max_examples=200, deadline=None)
@given(trees())
def test_tree_depths_are_path_lengths(parents):
    depths = masks.tree_depths_np(parents)
    assert depths.tolist() == [len(ancestors_or_self(parents, i)) - 1 for i in range(len(parents))]
    # a token's depth is the number of ancestors its mask row holds
    assert (masks.tree_mask_np(parents).sum(axis=1) - 1).tolist() == depths.tolist()


@settings(max_examples=200, deadline=None)
@given(trees(), st.data())
def test_hidden_tokens_are_seen_by_no_one_and_take_no_position(parents, data):
    """The APAR KL teacher's view: a path read without its control tokens."""
    n = len(parents)
    hidden = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    mask = masks.tree_mask_np(parents, hidden)
    depths = masks.tree_depths_np(parents, hidden)
    for i in range(n):
        seen = {j for j in ancestors_or_self(parents, i) if not hidden[j]} | {i}
        assert set(np.flatnonzero(mask[i]).tolist()) == seen
        assert depths[i] == len([j for j in ancestors_or_self(parents, i) if j != i and not hidden[j]])


@settings(max_examples=100, deadline=None)
@given(trees(), st.integers(min_value=0, max_value=50))
def test_prefix_tree_mask_and_positions(parents, prefix_len):
    n = len(parents)
    full = np.array(masks.prefix_tree_mask(parents, prefix_len))
    assert full.shape == (n, prefix_len + n)
    assert full[:, :prefix_len].all()
    assert np.array_equal(full[:, prefix_len:], masks.tree_mask_np(parents))
    positions = np.array(masks.tree_positions(parents, prefix_len))
    assert positions.shape == (1, n)
    assert positions[0].tolist() == (masks.tree_depths_np(parents) + prefix_len).tolist()


def test_chain_tree_is_causal():
    """A tree that is a single chain is just a causal block."""
    parents = [-1, 0, 1, 2, 3]
    assert np.array_equal(masks.tree_mask_np(parents), np.tril(np.ones((5, 5), dtype=bool)))
    assert np.array(masks.prefix_tree_mask(parents, 3)).tolist() == np.array(masks.causal_mask(5, 3)).tolist()
    assert np.array(masks.tree_positions(parents, 3)).tolist() == [[3, 4, 5, 6, 7]]


def test_sibling_roots_see_only_themselves():
    mask = masks.tree_mask_np([-1, -1, -1])
    assert np.array_equal(mask, np.eye(3, dtype=bool))
    assert masks.tree_depths_np([-1, -1, -1]).tolist() == [0, 0, 0]


def test_causal_mask_shape_and_values():
    m = masks.causal_mask(3, 2)
    assert m.dtype == mx.bool_
    assert m.shape == (3, 5)
    assert np.array(m).tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    assert np.array(masks.causal_mask(1, 0)).tolist() == [[True]]
    assert np.array(masks.causal_mask(1, 4)).all()  # one new token sees everything
    np.testing.assert_array_equal(np.array(masks.causal_mask(4, 0)), np.tril(np.ones((4, 4), dtype=bool)))


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-1, 0, 5]])
def test_non_topological_parents_rejected(parents):
    with pytest.raises(ValueError, match="topological"):
        masks.tree_mask_np(parents)
    with pytest.raises(ValueError, match="topological"):
        masks.prefix_tree_mask(parents, 4)


def test_empty_tree():
    assert masks.tree_mask_np([]).shape == (0, 0)
    assert masks.tree_depths_np([]).shape == (0,)
    assert masks.prefix_tree_mask([], 3).shape == (0, 3)


def test_tree_positions_reject_non_topological_parents():
    with pytest.raises(ValueError):
        masks.tree_positions([-1, 2, 0], 4)


def test_padded_causal_mask_hides_pads_and_is_causal():
    valid = np.array([[True, True, True, True], [False, False, True, True]])  # row 1: left-padded
    m = np.array(masks.padded_causal_mask(valid, 0, 4))
    assert m.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(m[0, 0], np.tril(np.ones((4, 4), dtype=bool)))
    assert m[1, 0].tolist() == [[True, False, False, False], [False, True, False, False],  # pads: self only
                                [False, False, True, False], [False, False, True, True]]
    # a later chunk: queries at slots 2..3 see every earlier valid slot
    np.testing.assert_array_equal(np.array(masks.padded_causal_mask(valid, 2, 4)), m[:, :, 2:4])
    # one decoding query at the last slot sees exactly the row's valid slots
    np.testing.assert_array_equal(np.array(masks.padded_causal_mask(valid, 3, 4))[:, 0, 0], valid)


def test_path_mask_sees_exactly_each_rows_slots():
    m = np.array(masks.path_mask([[0, 1, 4], [0, 2], []], 5))
    assert m.shape == (1, 1, 3, 5)
    assert m[0, 0].tolist() == [[True, True, False, False, True], [True, False, True, False, False],
                                [False] * 5]
