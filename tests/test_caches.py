"""KV caches: contiguous rollback, forkable thread pool (APAR), sparse view (TriForce).

Every cache is checked by what the model computes through it: logits after appending, trimming,
forking, freeing or viewing must equal a plain sequence that never saw the forgotten tokens.
"""

import functools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from mlx_specdec.cache import ContiguousKVCache, ForkableKVCache, SparseKVView
from mlx_specdec.cache import contiguous as contiguous_module
from mlx_specdec.model.forward import forward

from conftest import make_tiny_llama

PREFIX = [5, 17, 42, 3, 88, 11, 60]
LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 16  # hidden 64 / 4 query heads


@functools.lru_cache(maxsize=None)
def _model(seed: int = 0):
    """Shared read-only tiny model (untied head, as in decoding)."""
    return make_tiny_llama(seed=seed, layers=LAYERS, tie=False)


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _tokens(ids) -> mx.array:
    return mx.array(list(ids))[None]


def _prefilled(model, prefix) -> ContiguousKVCache:
    cache = ContiguousKVCache.for_model(model)
    forward(model, _tokens(prefix), cache, logits_for="none")
    mx.eval(cache.state)
    return cache


def _reference_logits(model, sequence) -> np.ndarray:
    """(len(sequence), V) logits of the whole sequence in one causal forward, no cache."""
    return _np(forward(model, _tokens(sequence)).logits[0])


def _assert_states_equal(got, want, exact=True):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if exact:
            assert mx.array_equal(g, w).item()
        else:
            np.testing.assert_allclose(_np(g), _np(w), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# ContiguousKVCache
# ---------------------------------------------------------------------------------------------

BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # K and V, float32


def test_contiguous_offset_state_and_nbytes_track_tokens():
    model = _model()
    cache = ContiguousKVCache.for_model(model)
    theirs = make_prompt_cache(model)
    assert len(cache.layers) == LAYERS
    assert cache.offset == 0 and cache.state == [] and cache.nbytes() == 0

    forward(model, _tokens(PREFIX), cache)
    model(_tokens(PREFIX), cache=theirs)
    sizes = [len(PREFIX)]
    for token in (7, 19, 2):
        forward(model, _tokens([token]), cache)
        model(_tokens([token]), cache=theirs)
        sizes.append(sizes[-1] + 1)
    assert cache.offset == sizes[-1] == 10

    state = cache.state
    assert len(state) == 2 * LAYERS
    for array in state:
        assert array.shape == (1, KV_HEADS, 10, HEAD_DIM)
        assert array.dtype == mx.float32
    # the state is exactly the keys/values mlx-lm's own cache holds for the same tokens
    want = [a for c in theirs for a in (c.keys[..., :10, :], c.values[..., :10, :])]
    _assert_states_equal(state, want)
    assert cache.nbytes() == 10 * BYTES_PER_TOKEN

    assert cache.trim(3) == 3
    assert cache.offset == 7
    assert all(a.shape == (1, KV_HEADS, 7, HEAD_DIM) for a in cache.state)
    assert cache.nbytes() == 7 * BYTES_PER_TOKEN
    _assert_states_equal(cache.state, [a[..., :7, :] for a in want])


def test_contiguous_float16_state_dtype_and_nbytes():
    model = make_tiny_llama(tie=False, dtype=mx.float16)
    cache = _prefilled(model, PREFIX)
    assert all(a.dtype == mx.float16 for a in cache.state)
    assert cache.nbytes() == len(PREFIX) * BYTES_PER_TOKEN // 2


@pytest.mark.parametrize("rejected", [4, 3, 1])
def test_trim_then_reforward_equals_never_seen(rejected):
    """Drafted tokens verified as one chunk, the last `rejected` dropped, then decoding goes on:
    logits and cache state equal a cache that only ever saw the accepted tokens."""
    model = _model()
    drafted = [30, 31, 32, 33]
    accepted = drafted[: len(drafted) - rejected]
    after = [44, 45, 46]

    spec = _prefilled(model, PREFIX)
    forward(model, _tokens(drafted), spec, logits_for="none")
    assert spec.trim(rejected) == rejected
    assert spec.offset == len(PREFIX) + len(accepted)
    got = [forward(model, _tokens([t]), spec).logits for t in after]

    plain = _prefilled(model, PREFIX)
    if accepted:  # same chunking as the verification step: the accepted keys were computed there
        forward(model, _tokens(accepted), plain, logits_for="none")
    want = [forward(model, _tokens([t]), plain).logits for t in after]

    # all-rejected: bit-identical; partial: the accepted K/V came from a longer chunk
    exact = not accepted
    for g, w in zip(got, want):
        if exact:
            assert mx.array_equal(g, w).item()
        else:
            np.testing.assert_allclose(_np(g), _np(w), atol=1e-5, rtol=1e-5)
    assert spec.offset == plain.offset
    _assert_states_equal(spec.state, plain.state, exact=exact)
    # and both equal a single causal pass over the kept sequence
    ref = _reference_logits(model, PREFIX + accepted + after)[-len(after):]
    np.testing.assert_allclose(np.concatenate([_np(g[0]) for g in got]), ref, atol=1e-4, rtol=1e-4)


def test_trim_into_prefill_chunk_then_reforward():
    """Trimming below the last chunk's start (into the prefill) also forgets exactly those tokens."""
    model = _model()
    cache = _prefilled(model, PREFIX)
    forward(model, _tokens([7, 8]), cache, logits_for="none")
    assert cache.trim(5) == 5
    assert cache.offset == 4
    got = forward(model, _tokens([90, 91]), cache).logits
    want = _reference_logits(model, PREFIX[:4] + [90, 91])[-2:]
    np.testing.assert_allclose(_np(got[0]), want, atol=1e-4, rtol=1e-4)
    assert cache.offset == 6


def test_rollback_to_saved_offset():
    model = _model()
    cache = _prefilled(model, PREFIX)
    saved = cache.offset
    for t in (1, 2, 3, 4):
        forward(model, _tokens([t]), cache, logits_for="none")
    assert cache.offset == saved + 4

    cache.rollback_to(cache.offset)  # to where it already is: nothing changes
    assert cache.offset == saved + 4

    with pytest.raises(ValueError, match=r"cannot roll back from 11 to 13"):
        cache.rollback_to(13)
    assert cache.offset == saved + 4

    cache.rollback_to(saved)
    assert cache.offset == saved
    got = [forward(model, _tokens([t]), cache).logits for t in (50, 51)]

    plain = _prefilled(model, PREFIX)
    want = [forward(model, _tokens([t]), plain).logits for t in (50, 51)]
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()
    _assert_states_equal(cache.state, plain.state)


def test_trim_more_than_cached_clamps_to_empty():
    model = _model()
    cache = _prefilled(model, PREFIX)
    assert cache.trim(0) == 0
    assert cache.offset == len(PREFIX)
    assert cache.trim(100) == len(PREFIX)  # returns what was actually dropped
    assert cache.offset == 0
    assert cache.nbytes() == 0
    assert all(a.shape == (1, KV_HEADS, 0, HEAD_DIM) for a in cache.state)
    assert cache.trim(1) == 0 and cache.offset == 0

    # the emptied cache behaves like a fresh one (stale buffer contents are never visible)
    got = forward(model, _tokens([9, 8, 7]), cache).logits
    want = forward(model, _tokens([9, 8, 7]), ContiguousKVCache.for_model(model)).logits
    assert mx.array_equal(got, want).item()


def test_negative_trim_does_not_roll_forward():
    model = _model()
    cache = _prefilled(model, PREFIX)
    try:
        dropped = cache.trim(-2)
    except ValueError:
        return
    assert dropped == 0 and cache.offset == len(PREFIX)


def test_growth_past_buffer_capacity_matches_mlx_lm():
    """Appends across several GROW_STEP boundaries (single tokens and chunks, and a trim back
    over a boundary) give bit-identical logits and state to mlx-lm's KVCache."""
    step = contiguous_module.GROW_STEP
    model = _model()
    ours = ContiguousKVCache.for_model(model)
    theirs = make_prompt_cache(model)
    rng = np.random.default_rng(0)

    def both(ids):
        got = forward(model, _tokens(ids), ours).logits
        want = model(_tokens(ids), cache=theirs)
        assert mx.array_equal(got, want).item()

    both(rng.integers(0, 97, step - 6).tolist())  # first allocation: one step
    assert ours.layers[0].capacity == step
    for t in rng.integers(0, 97, 10).tolist():  # single tokens across the first boundary
        both([t])
    assert ours.offset == step + 4
    assert ours.layers[0].capacity == 2 * step
    both(rng.integers(0, 97, step + 40).tolist())  # one chunk across the next boundary
    assert ours.offset == 2 * step + 44
    assert all(layer.capacity == 3 * step for layer in ours.layers)

    # trim back below a boundary in both caches, then grow again
    for c in theirs:
        c.trim(60)
    assert ours.trim(60) == 60
    for t in rng.integers(0, 97, 3).tolist():
        both([t])
    both(rng.integers(0, 97, 80).tolist())

    n = ours.offset
    assert n == theirs[0].offset == 2 * step - 16 + 3 + 80
    want = [a for c in theirs for a in (c.keys[..., :n, :], c.values[..., :n, :])]
    _assert_states_equal(ours.state, want)


# ---------------------------------------------------------------------------------------------
# ForkableKVCache (APAR)
# ---------------------------------------------------------------------------------------------


def _fork_step(model, cache, thread_ids, tokens):
    """One decoding step carrying `tokens` (one per entry of thread_ids); returns (V,) rows."""
    positions, mask = cache.begin_step(thread_ids)
    logits = forward(model, _tokens(tokens), cache, positions=positions, mask=mask).logits
    return positions, mask, _np(logits[0])


class _Threads:
    """Drives a ForkableKVCache and checks every logit row against each thread decoded alone."""

    def __init__(self, model):
        self.model = model
        self.cache = ForkableKVCache.for_model(model)
        self.seqs: dict[int, list[int]] = {}

    def new(self, tid):
        self.cache.new_thread(tid)
        self.seqs[tid] = []

    def fork(self, parent, child):
        self.cache.fork(parent, child)
        self.seqs[child] = list(self.seqs[parent])

    def free(self, tid):
        self.cache.free_thread(tid)
        del self.seqs[tid]

    def step(self, thread_ids, tokens):
        positions, mask, rows = _fork_step(self.model, self.cache, thread_ids, tokens)
        expected_pos = []
        for tid, tok in zip(thread_ids, tokens):
            expected_pos.append(len(self.seqs[tid]))
            self.seqs[tid].append(tok)
        assert positions.tolist() == [expected_pos]
        refs = {tid: _reference_logits(self.model, self.seqs[tid]) for tid in set(thread_ids)}
        for row, (tid, pos) in enumerate(zip(thread_ids, expected_pos)):
            np.testing.assert_allclose(rows[row], refs[tid][pos], atol=1e-4, rtol=1e-4)
        return positions, mask, rows

    def check_bookkeeping(self):
        cache = self.cache
        assert set(cache.paths) == set(self.seqs)
        for tid, seq in self.seqs.items():
            assert cache.length(tid) == len(seq)
            assert len(set(cache.paths[tid])) == len(cache.paths[tid])  # a path never repeats
        holders = np.zeros(cache.high_water, dtype=int)
        for path in cache.paths.values():
            for slot in path:
                holders[slot] += 1
        assert cache.refcount == holders.tolist()
        assert len(cache.free_slots) == len(set(cache.free_slots))
        assert sorted(cache.free_slots) == np.flatnonzero(holders == 0).tolist()
        assert cache.live_slots == int((holders > 0).sum())


def test_forked_threads_match_each_thread_decoded_alone():
    model = _model()
    t = _Threads(model)
    t.new(0)
    t.step([0] * len(PREFIX), PREFIX)  # prompt as one multi-token step of thread 0
    t.fork(0, 1)
    assert t.cache.paths[1] == t.cache.paths[0]  # slot ids shared, no K/V copied
    assert t.cache.high_water == len(PREFIX)

    for a, b in [(30, 60), (31, 61), (32, 62)]:
        t.step([0, 1], [a, b])
    t.step([0, 0, 1], [33, 34, 63])  # several tokens of one thread in the same step
    t.step([1, 0, 1], [64, 35, 65])  # interleaved order

    assert t.seqs[0] == PREFIX + [30, 31, 32, 33, 34, 35]
    assert t.seqs[1] == PREFIX + [60, 61, 62, 63, 64, 65]
    # the prefix is stored once: 7 shared + 6 + 6 own slots
    assert t.cache.high_water == len(PREFIX) + 12
    prefix_slots = t.cache.paths[0][: len(PREFIX)]
    assert t.cache.paths[1][: len(PREFIX)] == prefix_slots
    assert all(t.cache.refcount[s] == 2 for s in prefix_slots)
    own = t.cache.paths[0][len(PREFIX):] + t.cache.paths[1][len(PREFIX):]
    assert all(t.cache.refcount[s] == 1 for s in own)
    t.check_bookkeeping()


def test_fork_control_without_mask_threads_interfere():
    """Control: the same step under a plain causal mask over the pool gives different logits,
    so the equality above depends on each thread's mask."""
    model = _model()
    cache = ForkableKVCache.for_model(model)
    cache.new_thread(0)
    _fork_step(model, cache, [0] * len(PREFIX), PREFIX)
    cache.fork(0, 1)
    _fork_step(model, cache, [0, 1], [30, 60])
    positions, mask = cache.begin_step([0, 1])
    all_visible = mx.ones_like(mask)
    leaky = _np(forward(model, _tokens([31, 61]), cache, positions=positions, mask=all_visible).logits[0])
    want = _reference_logits(model, PREFIX + [30, 31])[-1]
    assert not np.allclose(leaky[0], want, atol=1e-2)


def test_begin_step_positions_and_mask_rows():
    cache = ForkableKVCache(num_layers=1)  # bookkeeping only: no forward needed
    cache.new_thread(0)
    positions, mask = cache.begin_step([0, 0, 0])  # slots 0, 1, 2
    assert positions.tolist() == [[0, 1, 2]]
    assert mask.dtype == mx.bool_
    assert mask.shape == (1, 1, 3, 3)
    assert np.array_equal(np.array(mask[0, 0]), np.tril(np.ones((3, 3), dtype=bool)))

    cache.fork(0, 1)
    cache.new_thread(2)
    positions, mask = cache.begin_step([0, 1, 1, 2])  # slots 3, 4, 5, 6
    assert positions.tolist() == [[3, 3, 4, 0]]  # each thread's own depth
    expected = np.zeros((4, 7), dtype=bool)
    expected[0, [0, 1, 2, 3]] = True  # thread 0: prefix + itself
    expected[1, [0, 1, 2, 4]] = True  # thread 1: shared prefix + itself, not thread 0's slot 3
    expected[2, [0, 1, 2, 4, 5]] = True  # thread 1's second token also sees its first
    expected[3, [6]] = True  # a new thread sees only itself
    assert mask.shape == (1, 1, 4, 7)
    assert np.array_equal(np.array(mask[0, 0]), expected)
    assert cache.paths == {0: [0, 1, 2, 3], 1: [0, 1, 2, 4, 5], 2: [6]}
    assert cache.refcount == [2, 2, 2, 1, 1, 1, 1]

    cache.free_thread(0)  # only slot 3 is thread 0's alone
    assert cache.free_slots == [3]
    assert cache.refcount == [1, 1, 1, 0, 1, 1, 1]
    assert cache.live_slots == 6

    cache.new_thread(3)
    positions, mask = cache.begin_step([3, 1])  # thread 3 reuses slot 3; thread 1 gets new slot 7
    assert positions.tolist() == [[0, 5]]
    assert cache.paths[3] == [3] and cache.paths[1] == [0, 1, 2, 4, 5, 7]
    assert cache.free_slots == [] and cache.high_water == 8
    expected = np.zeros((2, 8), dtype=bool)
    expected[0, [3]] = True
    expected[1, [0, 1, 2, 4, 5, 7]] = True
    assert np.array_equal(np.array(mask[0, 0]), expected)


def test_contiguous_shortcut_is_taken_only_for_a_lone_compact_thread_and_changes_no_logit():
    """`begin_step(allow_contiguous=True)` drops the explicit positions and mask (scalar RoPE
    offset, causal or no mask) only while one thread owns every slot; each step's logits
    equal the general path's, through prefill chunks, a fork, frees and slot reuse."""
    model = _model()
    fast, slow = ForkableKVCache.for_model(model), ForkableKVCache.for_model(model)

    def step(thread_ids, tokens):
        outs = []
        for cache, allow in ((fast, True), (slow, False)):
            positions, mask = cache.begin_step(thread_ids, allow_contiguous=allow)
            logits = forward(model, _tokens(tokens), cache, positions=positions, mask=mask).logits
            outs.append((positions, mask, _np(logits[0])))
        np.testing.assert_allclose(outs[0][2], outs[1][2], atol=1e-5, rtol=1e-5)
        assert outs[0][2].argmax(-1).tolist() == outs[1][2].argmax(-1).tolist()
        return outs[0][0] is None  # the shortcut was taken

    for cache in (fast, slow):
        cache.new_thread(0)
    assert step([0, 0, 0, 0], PREFIX[:4])  # first prefill chunk: "causal"
    assert step([0, 0, 0], PREFIX[4:])  # second chunk, after the first
    assert step([0], [9]) and step([0], [31])  # one-token decode steps: no mask
    for cache in (fast, slow):
        cache.fork(0, 1)
    assert not step([0, 1], [12, 13])  # two threads: positions and mask again
    assert not step([1], [14])  # thread 1 alone is live in the pool only after 0 is freed
    for cache in (fast, slow):
        cache.free_thread(1)
    # Thread 0 alone again, but thread 1's freed slot sits below the new one: its path is not
    # every slot, so the general path stays (and the reused slot is written by index).
    assert not step([0], [15])
    assert not step([0], [16])
    assert fast.paths == slow.paths


@pytest.mark.parametrize("live", [1, 2])
@pytest.mark.parametrize("allow_contiguous", [False, True])
def test_an_empty_step_allocates_nothing(live, allow_contiguous):
    """begin_step([]) (a step where no live thread writes) changes no bookkeeping and gives an
    empty positions/mask pair, with one live thread (it raised IndexError) as with several."""
    cache = ForkableKVCache(num_layers=1)
    cache.new_thread(0)
    cache.begin_step([0, 0, 0])
    if live == 2:
        cache.fork(0, 1)
    paths, high_water = {k: list(v) for k, v in cache.paths.items()}, cache.high_water
    positions, mask = cache.begin_step([], allow_contiguous=allow_contiguous)
    assert positions.shape == (1, 0) and mask.shape == (1, 1, 0, 3)
    assert cache.paths == paths and cache.high_water == high_water and cache.free_slots == []
    cache.undo_step([])
    assert cache.paths == paths


def test_thread_errors():
    cache = ForkableKVCache(num_layers=1)
    cache.new_thread(0)
    with pytest.raises(ValueError, match="thread 0 exists"):
        cache.new_thread(0)
    cache.new_thread(1)
    with pytest.raises(ValueError, match="thread 1 exists"):
        cache.fork(0, 1)
    with pytest.raises(TypeError, match="consecutive positions"):
        cache.layers[0].offset


def test_freed_slots_are_reused_with_correct_values():
    """A freed thread's slots go back to free_slots, the next thread's tokens land there, and
    the stale keys/values left in them never leak into anyone's attention."""
    model = _model()
    t = _Threads(model)
    t.new(0)
    t.step([0] * len(PREFIX), PREFIX)
    t.fork(0, 1)
    for a, b in [(30, 60), (31, 61), (32, 62)]:
        t.step([0, 1], [a, b])
    own_of_1 = t.cache.paths[1][len(PREFIX):]
    high = t.cache.high_water
    live = t.cache.live_slots

    t.free(1)
    assert sorted(t.cache.free_slots) == sorted(own_of_1)
    assert t.cache.live_slots == live - 3
    assert t.cache.high_water == high  # the pool never shrinks; its slots are recycled
    assert all(t.cache.refcount[s] == 1 for s in t.cache.paths[0][: len(PREFIX)])
    t.check_bookkeeping()

    t.new(2)  # a fresh thread with its own prompt; the step's first three tokens (of threads
    # 2, 2 and 0) take the three freed slots, the fourth grows the pool by one
    t.step([2, 2, 0, 2], [70, 71, 33, 72])
    assert t.cache.free_slots == []
    assert t.cache.high_water == high + 1  # 3 slots recycled, only one new
    assert set(own_of_1) <= set(t.cache.paths[2]) | set(t.cache.paths[0])
    t.step([2, 0], [73, 34])
    t.fork(2, 3)
    t.step([3, 2, 0], [80, 74, 35])
    t.check_bookkeeping()


def test_freeing_parent_keeps_shared_prefix_alive():
    model = _model()
    t = _Threads(model)
    t.new(0)
    t.step([0] * len(PREFIX), PREFIX)
    t.fork(0, 1)
    t.step([0, 1], [30, 60])
    prefix_slots = t.cache.paths[0][: len(PREFIX)]
    parent_own = t.cache.paths[0][len(PREFIX):]

    t.free(0)
    assert t.cache.free_slots == parent_own  # only the parent's own token is released
    assert all(t.cache.refcount[s] == 1 for s in prefix_slots)
    assert not set(prefix_slots) & set(t.cache.free_slots)
    assert t.cache.paths[1][: len(PREFIX)] == prefix_slots
    t.check_bookkeeping()

    # another thread takes the freed slot; the child still decodes its own sequence exactly
    t.new(2)
    t.step([2, 1], [40, 61])
    assert t.cache.paths[2] == parent_own
    t.step([1, 2, 1], [62, 41, 63])
    assert t.seqs[1] == PREFIX + [60, 61, 62, 63]

    t.free(1)  # last holder gone: now the prefix slots are free too
    assert set(prefix_slots) <= set(t.cache.free_slots)
    t.check_bookkeeping()


def test_pool_grows_past_its_first_allocation():
    model = _model()
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 97, 250).tolist()
    t = _Threads(model)
    t.new(0)
    t.step([0] * len(prompt), prompt)
    assert t.cache.capacity == 256
    t.fork(0, 1)
    for i in range(4):  # 8 more slots: 258 > 256
        t.step([0, 1], [10 + i, 20 + i])
    assert t.cache.high_water == 258
    assert t.cache.capacity == 512
    assert all(layer.keys.shape[2] == 512 for layer in t.cache.layers)
    t.check_bookkeeping()


# A random schedule of thread operations: ("new",), ("fork", parent), ("free", victim),
# ("step", [(thread, n_tokens), ...]); thread choices are indices into the live threads.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.integers(1, 3)),
        st.tuples(st.just("fork"), st.integers(0, 7)),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("step"), st.lists(st.tuples(st.integers(0, 7), st.integers(1, 2)),
                                            min_size=1, max_size=4)),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=20, deadline=None)
@given(ops=_ops, seed=st.integers(0, 2**16))
def test_random_fork_free_schedule_matches_threads_alone(ops, seed):
    model = _model()
    rng = np.random.default_rng(seed)
    t = _Threads(model)
    next_id = 0

    def live():
        return sorted(t.seqs)

    for op, arg in ops:
        if op == "new" or not live():
            t.new(next_id)  # every new thread gets a short prompt right away
            prompt = rng.integers(0, 97, arg if op == "new" else 1).tolist()
            t.step([next_id] * len(prompt), prompt)
            next_id += 1
        elif op == "fork":
            t.fork(live()[arg % len(live())], next_id)
            next_id += 1
        elif op == "free":
            t.free(live()[arg % len(live())])
        else:
            ids = []
            for choice, count in arg:
                ids += [live()[choice % len(live())]] * count
            t.step(ids, rng.integers(0, 97, len(ids)).tolist())
        t.check_bookkeeping()
    # finally every surviving thread takes one more token together
    if live():
        t.step(live(), rng.integers(0, 97, len(live())).tolist())


# ---------------------------------------------------------------------------------------------
# SparseKVView (TriForce)
# ---------------------------------------------------------------------------------------------

LONG_PREFIX = PREFIX + [12, 70, 33, 9, 41, 64, 27]  # 14 cached positions


def _indices(per_layer_per_head):
    """[[head0 positions, head1 positions], ...] per layer -> list of (1, Hkv, K) int32 arrays."""
    return [mx.array(heads, dtype=mx.int32)[None] for heads in per_layer_per_head]


def _snapshot(cache: ContiguousKVCache):
    """Whole K/V buffers (every allocated row, not only up to offset) and offsets, as numpy."""
    return ([np.array(l.keys) for l in cache.layers] + [np.array(l.values) for l in cache.layers],
            [l.offset for l in cache.layers])


def test_sparse_view_over_all_positions_equals_full_cache():
    model = _model()
    base = _prefilled(model, LONG_PREFIX)
    full = _prefilled(model, LONG_PREFIX)
    n = len(LONG_PREFIX)
    view = SparseKVView(base, _indices([[list(range(n))] * KV_HEADS] * LAYERS))
    assert view.offset == n and view.budget == n

    for chunk in ([7], [19], [2, 55, 31], [8]):
        got = forward(model, _tokens(chunk), view).logits
        want = forward(model, _tokens(chunk), full).logits
        np.testing.assert_allclose(_np(got), _np(want), atol=1e-5, rtol=1e-5)
    assert view.offset == full.offset == n + 6


def test_sparse_view_equals_cache_of_only_the_selected_positions():
    """Per-layer, per-head index sets: the view attends exactly to the gathered K/V (+ its own
    tokens), with new tokens rotated at their true positions."""
    model = _model()
    base = _prefilled(model, LONG_PREFIX)
    n = len(LONG_PREFIX)
    chosen = [[[0, 3, 4, 12, 13], [1, 2, 8, 9, 13]],  # layer 0: head 0, head 1
              [[0, 5, 6, 7, 10], [0, 1, 11, 12, 13]]]  # layer 1
    view = SparseKVView(base, _indices(chosen))
    assert view.budget == 5

    # reference: a contiguous cache holding only the selected rows, gathered independently in numpy
    ref = ContiguousKVCache.for_model(model)
    for layer, (base_layer, heads) in enumerate(zip(base.layers, chosen)):
        k = np.array(base_layer.keys[..., :n, :])
        v = np.array(base_layer.values[..., :n, :])
        idx = np.array(heads)[None, :, :, None]
        ref.layers[layer].update_and_fetch(mx.array(np.take_along_axis(k, idx, axis=2)),
                                           mx.array(np.take_along_axis(v, idx, axis=2)))
    assert ref.offset == 5

    pos = n
    for chunk in ([7], [19, 2, 55], [31]):
        got = forward(model, _tokens(chunk), view).logits
        positions = mx.arange(pos, pos + len(chunk))[None]
        want = forward(model, _tokens(chunk), ref, positions=positions).logits
        np.testing.assert_allclose(_np(got), _np(want), atol=1e-5, rtol=1e-5)
        pos += len(chunk)
    assert view.offset == pos

    # control: the full cache gives different logits, so the selection really matters
    full = forward(model, _tokens([7]), _prefilled(model, LONG_PREFIX)).logits
    sparse_first = forward(model, _tokens([7]), SparseKVView(base, _indices(chosen))).logits
    assert not np.allclose(_np(full), _np(sparse_first), atol=1e-2)


def test_sparse_view_equals_masked_full_attention():
    """The same index set for every head and layer equals full attention with the unselected
    prefix positions masked out: an independent reference that never touches the view."""
    model = _model()
    base = _prefilled(model, LONG_PREFIX)
    n = len(LONG_PREFIX)
    keep = [0, 1, 4, 9, 13]
    view = SparseKVView(base, _indices([[keep] * KV_HEADS] * LAYERS))
    full = _prefilled(model, LONG_PREFIX)

    prefix_visible = np.zeros(n, dtype=bool)
    prefix_visible[keep] = True
    new = 0
    for chunk in ([7], [19, 2], [55]):
        L = len(chunk)
        own = np.tril(np.ones((L, new + L), dtype=bool), k=new)  # causal over the view's own tokens
        mask = np.concatenate([np.tile(prefix_visible, (L, 1)), own], axis=1)[None, None]
        got = forward(model, _tokens(chunk), view).logits
        want = forward(model, _tokens(chunk), full, mask=mx.array(mask)).logits
        np.testing.assert_allclose(_np(got), _np(want), atol=1e-5, rtol=1e-5)
        new += L


def test_sparse_view_never_writes_the_base_cache():
    model = _model()
    base = _prefilled(model, LONG_PREFIX)
    before, offsets = _snapshot(base)
    view = SparseKVView(base, _indices([[[0, 2, 5, 13], [1, 3, 6, 12]]] * LAYERS))

    forward(model, _tokens([7, 19, 2]), view)
    forward(model, _tokens([55]), view)
    view.trim(2)
    forward(model, _tokens([31, 8]), view)
    mx.eval([l.own.keys for l in view.layers])

    after, offsets_after = _snapshot(base)
    assert offsets_after == offsets and base.offset == len(LONG_PREFIX)
    for b, a in zip(before, after):
        assert b.shape == a.shape and np.array_equal(a, b)  # bitwise, whole buffer
    # the view's tokens live in its own buffers
    assert all(l.own.offset == 4 for l in view.layers)
    for view_layer, base_layer in zip(view.layers, base.layers):
        assert view_layer.base is base_layer and view_layer.own.keys is not base_layer.keys

    # dropping the view leaves the base exactly as a cache that never had one
    got = forward(model, _tokens([40, 41]), base).logits
    want = forward(model, _tokens([40, 41]), _prefilled(model, LONG_PREFIX)).logits
    assert mx.array_equal(got, want).item()


def test_sparse_view_trim_only_forgets_its_own_tokens():
    model = _model()
    base = _prefilled(model, LONG_PREFIX)
    n = len(LONG_PREFIX)
    indices = _indices([[[0, 4, 8, 13], [2, 3, 10, 11]]] * LAYERS)
    view = SparseKVView(base, indices)
    assert view.offset == n and view.trim(3) == 0 and view.offset == n  # nothing of its own yet

    forward(model, _tokens([7, 19, 2]), view)
    assert view.offset == n + 3 and all(l.offset == n + 3 for l in view.layers)
    assert view.trim(2) == 2
    assert view.offset == n + 1
    assert view.trim(10) == 1  # clamps at its own tokens; the base's length is untouchable
    assert view.offset == n and base.offset == n

    # after trimming, decoding through the view equals a fresh view that never saw the tokens
    forward(model, _tokens([7]), view)
    got = forward(model, _tokens([50, 51]), view).logits
    fresh = SparseKVView(base, indices)
    forward(model, _tokens([7]), fresh)
    want = forward(model, _tokens([50, 51]), fresh).logits
    assert mx.array_equal(got, want).item()


def test_sparse_view_validates_indices():
    model = _model()
    base = _prefilled(model, PREFIX)
    with pytest.raises(ValueError, match="one index array per layer"):
        SparseKVView(base, _indices([[[0, 1], [0, 1]]]))
    with pytest.raises(ValueError, match=r"index past the cache length 7"):
        SparseKVView(base, _indices([[[0, 1], [0, 1]], [[0, 6], [7, 1]]]))
    SparseKVView(base, _indices([[[0, 6], [6, 1]]] * LAYERS))  # the last cached position is fine


def test_sparse_view_rejects_negative_indices():
    model = _model()
    base = _prefilled(model, PREFIX)
    with pytest.raises(ValueError):
        SparseKVView(base, _indices([[[0, -1], [1, 2]]] * LAYERS))
