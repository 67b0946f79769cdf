"""The grouped CPU attention (mlx_specdec/model/attention.py) computes what MLX's fused attention
computes: every mask kind, GQA groups, batches; MLX's attention as `exact_attention` has its bits;
a masked key adds exactly nothing; the fast exp's error; and on a tiny model with the path forced
on, every method's greedy output is still `ar`'s."""

import math
import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.model import attention
from mlx_specdec.model.attention import fast_exp, grouped_attention

from conftest import make_tiny_lm


def fused(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)


def random_qkv(B, Hq, Hkv, T, S, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((B, Hq, T, 64)), mx.random.normal((B, Hkv, S, 64)),
            mx.random.normal((B, Hkv, S, 64)))


def mask_of(kind, B, Hq, T, S):
    rng = np.random.default_rng(1)
    if kind in (None, "causal"):
        return kind
    heads = 1 if kind == "bool, one head" else Hq
    keep = rng.random((B, heads, T, S)) > 0.4
    keep[..., 0] = True  # every query sees a key
    if kind == "additive":
        return mx.array(np.where(keep, 0.0, -1e9).astype(np.float32))
    return mx.array(keep)


@pytest.mark.parametrize("Hq,Hkv", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("T,S", [(1, 40), (6, 40), (6, 1500), (3, 3)])
@pytest.mark.parametrize("kind", [None, "causal", "bool, one head", "bool, every head", "additive"])
def test_grouped_attention_equals_fused_attention(Hq, Hkv, T, S, kind):
    """(No mask with several queries never reaches attention: the forward makes it "causal".)"""
    q, k, v = random_qkv(2, Hq, Hkv, T, S)
    mask = mask_of(kind, 2, Hq, T, S)
    got, want = grouped_attention(q, k, v, 0.125, mask), fused(q, k, v, mask)
    assert got.shape == want.shape == (2, Hq, T, 64)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def same_bits(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and np.array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


exact_here = pytest.mark.skipif(not attention.EXACT_ATTENTION or mx.default_device() != mx.cpu,
                                reason="exact_attention copies MLX's CPU arithmetic on x86-64 only")


@exact_here
@pytest.mark.parametrize("Hq,Hkv", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("B,T,S", [(1, 2, 2), (2, 5, 40), (1, 6, 300), (1, 64, 700), (2, 1, 40), (1, 5, 2000)])
@pytest.mark.parametrize("kind", [None, "causal", "bool, one head", "bool, every head", "additive"])
def test_exact_attention_has_the_bits_of_mlxs_attention(Hq, Hkv, B, T, S, kind):
    """MLX's attention op on the CPU, the same bits: every mask kind, GQA groups, batches."""
    q, k, v = random_qkv(B, Hq, Hkv, T, S, seed=T * S)
    q, k = q * 3, k * 3  # peaked rows too: large score differences
    mask = mask_of(kind, B, Hq, T, S)
    assert same_bits(attention.exact_attention(q, k, v, 0.125, mask), fused(q, k, v, mask))


@exact_here
def test_exact_attention_runs_for_two_or_more_float32_queries_on_the_cpu_short_of_the_grouped_path(monkeypatch):
    on_cpu = mx.default_device() == mx.cpu
    assert attention._exact_for(2, 40) == on_cpu and attention._exact_for(6, 1023) == on_cpu
    assert not attention._exact_for(1, 40)  # one query over few keys: MLX's op is as fast
    assert attention._exact_for(1, attention.EXACT_ONE_QUERY_MIN_KEYS) == on_cpu
    assert attention._exact_for(6, 6000) == on_cpu and attention._exact_for(1, 6000) == on_cpu  # any length
    q, k, v = random_qkv(1, 9, 3, 5, attention.GROUPED_MIN_KEYS + 10)
    assert not attention.use_grouped(q, k)  # float32: exact_attention, not the grouped path
    assert not attention._exact_for(6, 40, mx.float16)  # MLX's softmax accumulates float16 in float32
    assert np.array_equal(np.array(attention._causal(3, 10)), np.tril(np.ones((3, 10), bool), 7))
    causal = attention._causal(3, 10)  # one mask for a forward's layers: stacked per KV head once
    rows = attention._mask_as_rows(causal, 3, 3)
    assert rows.shape == (1, 1, 9, 10) and attention._mask_as_rows(causal, 3, 3) is rows
    assert np.array_equal(np.array(rows), np.tile(np.array(causal), (3, 1))[None, None])
    assert attention._mask_as_rows(attention._causal(3, 11), 3, 3).shape[-1] == 11  # another mask: made anew
    monkeypatch.setattr(attention, "EXACT_ATTENTION", False)
    assert not attention._exact_for(6, 40)
    q, k, v = random_qkv(1, 9, 3, 4, 30)
    assert same_bits(attention.attention_over_cache(q, k, v, 0.125, "causal"), fused(q, k, v, "causal"))


def test_a_masked_key_adds_exactly_nothing():
    q, k, v = random_qkv(1, 9, 3, 4, 300)
    keep = np.array(mask_of("bool, every head", 1, 9, 4, 300))
    hidden = np.zeros(300, dtype=bool)
    hidden[100:150] = True  # keys no query of any head may see
    keep[..., hidden] = False
    mask = mx.array(keep)
    v2 = np.array(v)
    v2[:, :, hidden] = 1e6
    k2 = np.array(k)
    k2[:, :, hidden] = -1e3
    a = grouped_attention(q, k, v, 0.125, mask)
    b = grouped_attention(q, mx.array(k2), mx.array(v2), 0.125, mask)
    assert np.array_equal(np.array(a), np.array(b))


def test_fast_exp_relative_error():
    x = mx.linspace(-87, 0, 200_001)
    got, want = np.array(fast_exp(x), np.float64), np.exp(np.array(x, np.float64))
    assert np.max(np.abs(got - want) / want) < 2e-7
    assert float(fast_exp(mx.array([-1e30]))[0]) < 1e-37  # far below: clamped, never NaN or inf
    assert float(fast_exp(mx.array([0.0]))[0]) == 1.0


def test_the_grouped_path_is_used_only_on_the_cpu_over_a_long_cache(monkeypatch):
    q, k, v = random_qkv(1, 9, 3, 1, 8)
    assert not attention.use_grouped(q, k)  # 8 keys: the fused path (short-context parity)
    monkeypatch.setattr(attention, "GROUPED_MIN_KEYS", 8)
    assert attention.use_grouped(q, k) == (mx.default_device() == mx.cpu)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool_tail", "additive"])
def test_on_cuda_a_verify_pads_its_keys_to_a_bucket_and_attends_the_same(fake_cuda_gpu, mask_kind):
    """MLX-CUDA's fused attention builds a cuDNN graph per (queries, keys) shape, and a verify's key
    count grows every step: a verify's keys are padded (masked out) to a multiple of the bucket.
    One-token steps and long prefills keep their own shapes."""
    T, S = 3, 300
    q, k, v = random_qkv(1, 9, 3, T, S)
    tail = mx.array(np.tril(np.ones((T, T), dtype=bool)))
    mask = {"none": None, "causal": "causal", "bool_tail": tail,
            "additive": mx.where(tail, 0.0, -math.inf).astype(mx.float32)}[mask_kind]
    keys, values, padded_mask = attention.bucket_keys(q, k, v, mask)
    assert keys.shape[2] == values.shape[2] == 2 * attention.CUDA_KEY_BUCKET
    assert padded_mask.shape[-1] == keys.shape[2]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=attention.full_width(mask, q, k))
    got = attention.attention_over_cache(q, k, v, 0.125, mask)
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)
    for queries in (1, attention.CUDA_VERIFY_MAX_QUERIES + 1):
        assert not attention._verify_on_cuda(queries)
    assert attention._verify_on_cuda(2) and not attention.use_grouped(q, k)


@pytest.mark.parametrize("method,options", [("redrafter", {"beam_width": 2, "beam_length": 4, "draft_cutoff": 0.0}), ("ar", {})])
def test_methods_keep_greedy_identity_with_the_grouped_path(monkeypatch, method, options):
    """Forced on from the first key: `ar` with the grouped path equals `ar` with the fused one on
    this tiny model (its argmax margins are wide), and ReDrafter's multi-token verify over it
    equals `ar` over it."""
    from test_redrafter import PROMPTS, engine_with, oracle_head

    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS))

    def tokens(name, opts):
        events = engine.generate_ids(PROMPTS[1], name, GenerationParams(max_tokens=40, options=opts))
        return [t for e in events if e.kind == "token" for t in e.tokens]

    plain = tokens("ar", {})
    monkeypatch.setattr(attention, "GROUPED_MIN_KEYS", 1)
    monkeypatch.setattr(attention, "EXACT_ATTENTION", False)  # float32 takes exact_attention otherwise
    assert tokens(method, options) == plain


@pytest.mark.parametrize("kind", ["bool, one head", "bool, every head", "additive"])
@pytest.mark.parametrize("T,S,M", [(6, 1500, 6), (4, 40, 10), (1, 300, 1)])
def test_a_tail_mask_masks_the_last_keys_and_shows_every_earlier_one(kind, T, S, M):
    """A mask narrower than the keys covers the last M keys; the first S - M are seen by every
    query: grouped with the tail mask == fused with the mask widened by ones (and the fused path
    of attention_over_cache widens it itself)."""
    q, k, v = random_qkv(1, 9, 3, T, S)
    tail = mask_of(kind, 1, 9, T, M)
    widened = attention.full_width(tail, q, k)
    assert widened.shape[-1] == S
    head = np.array(widened)[..., : S - M]
    assert (head if widened.dtype == mx.bool_ else head == 0).all()
    want = fused(q, k, v, widened)
    np.testing.assert_allclose(np.array(grouped_attention(q, k, v, 0.125, tail)), np.array(want), atol=2e-6, rtol=1e-5)
    got = attention.attention_over_cache(q, k, v, 0.125, tail)  # S < GROUPED_MIN_KEYS: the fused path
    if S < attention.GROUPED_MIN_KEYS:
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)


def test_redrafter_tree_tail_mask_equals_its_full_ragged_mask():
    from mlx_specdec import masks

    trees = [[-1, 0, 0, 1], [-1, 0]]
    valid = np.ones((2, 7), dtype=bool)
    full = np.array(masks.ragged_tree_mask(valid, trees, 4))
    tail = np.array(masks.tree_tail_mask(trees, 4))
    assert tail.shape == (2, 1, 4, 4)
    np.testing.assert_array_equal(full[:, :, :2, 7:], tail[:, :, :2])  # real tokens: the same tree
    np.testing.assert_array_equal(full[0, :, :, 7:], tail[0])  # a full row: the same everywhere
    assert full[0, 0, :, :7].all() and full[1, 0, :2, :7].all()  # real tokens see every cached slot
    np.testing.assert_array_equal(tail[1, 0, 2:, 2:], np.eye(2, dtype=bool))  # padding sees itself


@pytest.mark.parametrize("tree", [False, True])
def test_on_cuda_a_verify_reads_its_bucket_of_keys_from_the_cache_buffer(request, monkeypatch, tree):
    """On CUDA a verify's forward builds the bucketed mask once and reads every layer's keys that
    far straight from the contiguous cache's buffer (past the offset: zeros, masked out), with no
    per-layer padding copy; the logits are the ones the plain rules give."""
    from mlx_specdec import masks
    from mlx_specdec.cache.contiguous import ContiguousKVCache
    from mlx_specdec.model.forward import forward

    model = make_tiny_lm(seed=5).model
    prompt = mx.array([[3 + (i * 7) % 90 for i in range(300)]])
    parents = [-1, 0, 0] if tree else [-1, 0, 1]  # two drafts at depth 1, or a chain of two
    draft = mx.array([[11, 12, 13]])
    positions = masks.ragged_tree_positions(np.array([300]), [parents], 3) if tree else None
    mask = masks.tree_tail_mask([parents], 3) if tree else None

    def verify():
        cache = ContiguousKVCache.for_model(model)
        forward(model, prompt, cache, logits_for="none")
        out = forward(model, draft, cache, positions=positions, mask=mask)
        mx.eval(out.logits)
        assert cache.offset == 303
        return np.array(out.logits)

    want = verify()
    request.getfixturevalue("fake_cuda_gpu")
    seen = []
    sdpa = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((q.shape[2], k.shape[2], getattr(kw.get("mask"), "shape", None)))
                        or sdpa(q, k, v, **kw))
    monkeypatch.setattr(mx, "pad", lambda *a, **kw: pytest.fail("a per-layer padding copy"))
    got = verify()
    verifies = [s for s in seen if s[0] == 3]  # one masked attention per layer over the bucket of keys
    assert len(verifies) == len(model.model.layers)
    assert all(keys == 2 * attention.CUDA_KEY_BUCKET and mask_shape[-1] == keys for _, keys, mask_shape in verifies)
    assert np.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("options", [{"beam_width": 1, "beam_length": 4, "draft_cutoff": 0.0},
                                     {"beam_width": 2, "beam_length": 4, "draft_cutoff": 0.0}])
def test_redrafter_on_cuda_rules_keeps_greedy_identity(fake_cuda_gpu, options):
    """With the CUDA rules (a verify attends a bucket of keys read from the cache buffer under a mask
    built once), ReDrafter's greedy answer is still `ar`'s, for a chain and for a tree."""
    from test_redrafter import PROMPTS, engine_with, oracle_head

    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.2))

    def tokens(name, opts):
        events = engine.generate_ids(PROMPTS[1], name, GenerationParams(max_tokens=40, options=opts))
        return [t for e in events if e.kind == "token" for t in e.tokens]

    assert tokens("redrafter", options) == tokens("ar", {})
