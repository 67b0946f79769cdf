"""Acceptance rules: greedy longest-prefix, and rejection sampling that preserves the target's
distribution exactly (checked with a chi-square test at a fixed seed)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.acceptance import greedy_accept, sampling_accept, target_probs
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.decoding.base import make_sampler

from conftest import make_tiny_llama

# chi-square critical values at p = 0.001 (df -> value); a correct sampler fails 1 in 1000 seeds
CHI2_CRITICAL_001 = {2: 13.82, 3: 16.27, 4: 18.47}


def one_hot_logits(targets, vocab=10):
    logits = np.full(targets.shape + (vocab,), -5.0, dtype=np.float32)
    np.put_along_axis(logits, targets[..., None], 5.0, axis=-1)
    return mx.array(logits)


@pytest.mark.parametrize("beams,targets,want", [
    # beams (W, L) start with the target's own token; targets[w, j] = target argmax after beam token j
    ([[1, 2, 3, 4]], [[2, 3, 4, 9]], (0, 3, 9)),  # all drafts accepted, bonus token 9
    ([[1, 2, 3, 4]], [[2, 7, 4, 9]], (0, 1, 7)),  # second draft rejected: target's 7 replaces it
    ([[1, 5, 3, 4]], [[2, 3, 4, 9]], (0, 0, 2)),  # nothing accepted: one token per step
    ([[1, 2, 5, 6], [1, 2, 3, 4]], [[2, 3, 0, 0], [2, 3, 4, 8]], (1, 3, 8)),  # the longer beam wins
    ([[1, 2, 3, 0], [1, 2, 3, 4]], [[2, 3, 5, 0], [2, 3, 5, 0]], (0, 2, 5)),  # tie -> the first beam
])
def test_greedy_accept(beams, targets, want):
    result = greedy_accept(mx.array(beams), one_hot_logits(np.array(targets)))
    assert (result.beam.item(), result.num_accepted.item(), result.next_token.item()) == want


def test_target_probs_top_p_keeps_the_nucleus():
    logits = mx.log(mx.array([0.5, 0.3, 0.15, 0.05]))
    probs = np.array(target_probs(logits, 1.0, top_p=0.75))
    np.testing.assert_allclose(probs, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=1e-6)
    np.testing.assert_allclose(np.array(target_probs(logits, 1.0)), [0.5, 0.3, 0.15, 0.05], atol=1e-6)


def nucleus_reference(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """mlx-lm's sampling rule written out in numpy (independent of the code under test): the
    nucleus is the fewest most-likely tokens, at T = 1, whose mass reaches top_p (every token as
    likely as the last one kept stays too); the draw is softmax(logits / T) over the nucleus."""
    logits = logits.astype(np.float64)
    p1 = np.exp(logits - logits.max())
    p1 /= p1.sum()
    desc = np.sort(p1)[::-1]
    mass_before = np.cumsum(desc) - desc
    threshold = desc[mass_before < top_p].min()
    scaled = np.where(p1 >= threshold * (1 - 1e-6), logits / temperature, -np.inf)
    out = np.exp(scaled - scaled.max())
    return out / out.sum()


def flat_tiny_logits(prompt=(5, 17, 42, 3)) -> mx.array:
    """(V,) next-token logits of a tiny random Llama at its plain init scale (the shared tiny
    models scale embeddings x8 so the argmax is clear; here the nucleus should hold many tokens)."""
    model = make_tiny_llama(seed=1)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight / 8
    return model(mx.array(prompt)[None])[0, -1]


def test_target_probs_is_the_distribution_ar_samples_at_t_ne_1_with_top_p():
    """T = 2, top-p 0.5: the nucleus is cut on the T = 1 distribution, then T flattens it (the
    other order keeps a wider nucleus: 29 tokens against 17 here before the fix)."""
    logits = flat_tiny_logits()
    want = nucleus_reference(np.array(logits), 2.0, 0.5)
    got = np.array(target_probs(logits, 2.0, top_p=0.5))
    assert int((got > 0).sum()) == int((want > 0).sum())
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("temperature,top_p", [(2.0, 0.5), (0.7, 0.9), (1.0, 1.0)])
def test_ar_draws_exactly_what_mlx_lm_draws(temperature, top_p):
    """`ar`'s sampler (built from the one rule) draws mlx-lm's tokens at the same seed."""
    from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

    logits = mx.stack([flat_tiny_logits((5, 17, 42, t)) for t in range(12)])  # (12, V)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ours = make_sampler(GenerationParams(temperature=temperature, top_p=top_p))
    theirs = mlx_lm_make_sampler(temp=temperature, top_p=top_p)
    for seed in range(20):
        mx.random.seed(seed)
        a = ours(logprobs).tolist()
        mx.random.seed(seed)
        assert a == theirs(logprobs).tolist()


VOCAB = 4


def _table(seed, sharp):
    """A distribution for every prefix (over VOCAB tokens): p or q as a fixed random function."""
    rng = np.random.default_rng(seed)
    cache = {}

    def dist(prefix):
        key = tuple(prefix)
        if key not in cache:
            logits = rng.normal(size=VOCAB) * sharp
            cache[key] = np.exp(logits) / np.exp(logits).sum()
        return cache[key]

    return dist


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("width", [1, 3])
def test_sampling_accept_reproduces_the_target_distribution(width):
    """Draft W chains of length L from q, accept with the multi-candidate rule, and check that the
    first emitted token is distributed as p(.|x) and the second (when the step emits it) as
    p(.|x, first)."""
    p, q = _table(1, 1.0), _table(2, 1.5)  # a mismatched draft: plenty of rejections
    length, runs = 3, 3000
    rng = np.random.default_rng(0)
    mx.random.seed(0)
    first_counts = np.zeros(VOCAB)
    second_counts = {a: np.zeros(VOCAB) for a in range(VOCAB)}
    x = 0
    for _ in range(runs):
        beams = np.zeros((width, length), dtype=np.int32)
        draft = np.zeros((width, length - 1, VOCAB), dtype=np.float32)
        for w in range(width):
            for j in range(length - 1):
                qd = q(beams[w, : j + 1])
                draft[w, j] = qd
                beams[w, j + 1] = rng.choice(VOCAB, p=qd)
        target = np.array([[p(beams[w, : j + 1]) for j in range(length)] for w in range(width)],
                          dtype=np.float32)
        r = sampling_accept(mx.array(beams), mx.array(target), mx.array(draft))
        beam, n, nxt = r.beam.item(), r.num_accepted.item(), r.next_token.item()
        emitted = list(beams[beam, 1 : n + 1]) + [nxt]
        first_counts[emitted[0]] += 1
        if len(emitted) >= 2:
            second_counts[emitted[0]][emitted[1]] += 1
    assert _chi2(first_counts, p([x])) < CHI2_CRITICAL_001[VOCAB - 1]
    for a, counts in second_counts.items():
        if counts.sum() >= 200:
            assert _chi2(counts, p([x, a])) < CHI2_CRITICAL_001[VOCAB - 1], a


def test_sampling_accept_takes_drafts_the_target_agrees_with():
    """Draft == target: every draft is accepted (p/q = 1), then a bonus token."""
    beams = mx.array([[0, 1, 2]])
    dist = mx.array([[[0.1, 0.2, 0.3, 0.4]] * 3])
    r = sampling_accept(beams, dist, dist[:, :2])
    assert r.num_accepted.item() == 2


def test_the_nucleus_from_the_likeliest_tokens_is_the_full_sort_s():
    """`top_nucleus` against mlx-lm's `apply_top_p` on sharp and flat rows: where it says valid
    the cut is the same, and it says invalid only where the k likeliest miss top_p of the mass."""
    from mlx_lm.sample_utils import apply_top_p

    from mlx_specdec.acceptance import top_nucleus

    rng = np.random.default_rng(0)
    V, k = 5000, 256
    scales = np.repeat([6.0, 3.0, 1.0, 0.3, 0.05], 40)[:, None]  # sharp rows first, nearly uniform last
    logits = mx.array((rng.standard_normal((len(scales), V)) * scales).astype(np.float32))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for top_p in (0.5, 0.9, 0.95):
        fast, valid = top_nucleus(logprobs, top_p, k)
        full = apply_top_p(logprobs, top_p)
        valid = np.array(valid)
        same = np.array((mx.isinf(fast) == mx.isinf(full)).all(axis=-1))
        assert same[valid].all() and valid[:40].all()
        mass = np.sort(np.exp(np.array(logprobs)), axis=-1)[:, -k:].sum(axis=-1)
        assert (valid == (mass >= top_p - 1e-6)).all()
        assert not valid[-40:].all()  # nearly uniform rows: the nucleus lies past the k
