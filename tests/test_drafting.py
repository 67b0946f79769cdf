"""The drafting layer: every proposer's drafts and draft probabilities, and its state.

The ReDrafter head proposer is exercised end to end by tests/test_redrafter.py (the method now
drafts through it); here its sampled distributions are checked against the head's own."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.acceptance import sampling_accept
from mlx_specdec.redrafter_head.beam import sample_beams
from mlx_specdec.drafting import HeadProposer, NgramProposer, one_hot_probs, select_rows

from conftest import make_tiny_lm

V = 97


def beams_of(proposal):
    return np.array(proposal.beams).tolist()


def test_ngram_drafts_the_continuation_of_the_longest_earlier_match():
    # text: 5 6 7 8 9 | 1 6 7 3 | 6 7 ; the next own token is 8: the suffix 6 7 8 occurred at the
    # start (followed by 9 1 6), while 7 8 alone and 8 alone point at the same place
    p = NgramProposer(width=1, length=4, vocab=V, max_ngram=3)
    p.begin([[5, 6, 7, 8, 9, 1, 6, 7, 3, 6, 7]])
    assert beams_of(p.propose(mx.array([8]))) == [[[8, 9, 1, 6]]]


def test_ngram_prefers_the_longer_match_over_a_more_recent_shorter_one():
    p = NgramProposer(width=1, length=3, vocab=V, max_ngram=3)
    p.begin([[1, 2, 3, 40, 41, 9, 3, 50, 51, 1, 2]])  # after "... 1 2" comes 3: "1 2 3" -> 40 41
    assert beams_of(p.propose(mx.array([3]))) == [[[3, 40, 41]]]  # not "3" -> 50 51 (more recent)


def test_ngram_width_takes_distinct_continuations_most_recent_first_and_dedups():
    p = NgramProposer(width=3, length=3, vocab=V, max_ngram=1)
    p.begin([[7, 10, 11, 7, 20, 21, 7, 10, 11]])
    proposal = p.propose(mx.array([7]))
    # "7" was followed by 10 11 (latest), 20 21, and 10 11 again (not repeated): the third beam
    # has no continuation and stays the token repeated
    assert beams_of(proposal) == [[[7, 10, 11], [7, 20, 21], [7, 7, 7]]]
    owner = np.array(proposal.owner)[0]
    assert owner[:, 0].tolist() == [0, 0, 0]  # every beam shares the first token
    assert owner[1, 1] == 1 and owner[2, 1] == 2


def test_ngram_without_a_match_repeats_the_token_and_commit_extends_the_text():
    p = NgramProposer(width=1, length=3, vocab=V, max_ngram=2)
    p.begin([[1, 2, 3], [4, 5]])
    assert beams_of(p.propose(mx.array([9, 4]))) == [[[9, 9, 9]], [[4, 5, 4]]]  # row 1: "4" -> 5 4 (periodic)
    p.commit([[9, 60, 61], [4]])  # row 0 wrote 9 and accepted 60 61
    assert p.texts == [[1, 2, 3, 9, 60, 61], [4, 5, 4]]
    assert beams_of(p.propose(mx.array([9, 5])))[0] == [[9, 60, 61]]
    p.rollback()  # nothing was committed since: the texts stay
    assert p.texts[0] == [1, 2, 3, 9, 60, 61]


def test_ngram_sampling_probabilities_are_one_hot_and_accept_with_the_targets_probability():
    p = NgramProposer(width=1, length=2, vocab=4, max_ngram=1, sampling=True)
    p.begin([[0, 2, 0]])
    proposal = p.propose(mx.array([0]))  # "0" was followed by 2
    assert beams_of(proposal) == [[[0, 2]]]
    np.testing.assert_array_equal(np.array(proposal.draft_probs)[0, 0, 0], [0, 0, 1, 0])
    target = mx.array([[[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]])  # p after 0, after 2
    mx.random.seed(0)
    accepted = [sampling_accept(proposal.beams[0], target, proposal.draft_probs[0]).num_accepted.item()
                for _ in range(2000)]
    assert abs(np.mean(accepted) - 0.3) < 0.04  # min(1, p/q) = p(2) = 0.3


def test_one_hot_probs_and_select_rows():
    beams = mx.array([[[1, 2, 3]], [[4, 5, 6]]])
    probs = np.array(one_hot_probs(beams, 8))
    assert probs.shape == (2, 1, 2, 8) and probs.sum() == 4 and probs[1, 0, 1, 6] == 1
    p = NgramProposer(width=1, length=3, vocab=8, sampling=True)
    p.begin([[1], [2]])
    kept = select_rows(p.propose(mx.array([1, 2])), np.array([1]))
    assert kept.beams.shape == (1, 1, 3) and kept.draft_probs.shape == (1, 1, 2, 8)


def test_bad_ngram_settings_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(width=1, length=3, vocab=V, max_ngram=1, min_ngram=2)


def test_head_proposer_sampled_drafts_carry_the_heads_own_distribution():
    """Temperature > 0: the beams and draft-vocabulary probabilities are sample_beams' (same key),
    spread onto the full vocabulary at the head's ids (zero elsewhere), each summing to 1."""
    from test_redrafter import random_head

    lm = make_tiny_lm()
    head = random_head(lm, draft_vocab=50)
    embed = lm.model.model.embed_tokens
    proposer = HeadProposer(head, embed, width=2, length=4, vocab=V, temperature=0.7)
    hidden, token = mx.random.normal((1, 64)), mx.array([5])
    mx.random.seed(3)
    proposal = proposer.propose(token, hidden)
    mx.random.seed(3)
    own = sample_beams(head, embed, hidden, token, 2, 4, 0.7)
    np.testing.assert_array_equal(np.array(proposal.beams), np.array(own.beams))
    full = np.array(proposal.draft_probs)  # (1, 2, 3, V)
    ids = np.array(head.draft_to_full)
    np.testing.assert_allclose(full[..., ids], np.array(own.draft_probs), atol=1e-7)
    outside = np.setdiff1d(np.arange(V), ids)
    assert (full[..., outside] == 0).all()
    np.testing.assert_allclose(full.sum(-1), 1.0, atol=1e-5)


def test_ngram_rollback_leaves_the_index_a_fresh_proposer_would_build():
    from mlx_specdec.drafting import NgramProposer

    text = [5, 6, 7, 5, 6, 8, 5, 6]
    grown, fresh = NgramProposer(2, 4, vocab=20), NgramProposer(2, 4, vocab=20)
    grown.begin([text[:4]])
    grown.commit([text[4:]])
    grown.rollback([5])
    fresh.begin([text[:5]])
    assert grown.texts == fresh.texts and grown._index == fresh._index
    assert grown.continuations(0, 6) == fresh.continuations(0, 6) == [[7, 5, 6]]


def _draft_chain(model, context, length):
    """The draft model's greedy chain after `context` with a full cache: the reference."""
    tokens = list(context)
    for _ in range(length - 1):
        tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1]).item()))
    return tokens[len(context) - 1:]


def test_model_proposer_drafts_the_small_models_chain_and_follows_commit_and_rollback():
    from mlx_specdec.drafting import ModelProposer

    draft = make_tiny_lm(seed=5, layers=1).model
    proposer = ModelProposer(draft, length=4, vocab=97, sink=4, window=512)
    prompt = [(i * 7) % 50 + 3 for i in range(30)]
    proposer.begin([prompt])
    chain = proposer.propose(mx.array([9])).beams[0, 0].tolist()
    assert chain == _draft_chain(draft, prompt + [9], 4)
    proposer.commit([[9] + chain[1:3]])  # the verifier took two drafts: the cache keeps them
    assert proposer.cached[: len(prompt) + 3] == prompt + [9] + chain[1:3]
    after = proposer.propose(mx.array([11])).beams[0, 0].tolist()
    assert after == _draft_chain(draft, prompt + [9] + chain[1:3] + [11], 4)
    proposer.rollback([len(prompt) + 1])  # a level above kept only the 9
    again = proposer.propose(mx.array([13])).beams[0, 0].tolist()
    assert again == _draft_chain(draft, prompt + [9, 13], 4)


def test_model_proposer_over_a_streaming_window_attends_to_the_sink_and_the_recent_tokens():
    """Once evicted, the draft model sees the sink and the window only: its chain equals the
    model's chain over exactly those positions (keys keep their true RoPE positions)."""
    from mlx_specdec.cache import StreamingKVCache
    from mlx_specdec.drafting import ModelProposer
    from mlx_specdec.model.forward import forward

    draft = make_tiny_lm(seed=5, layers=1).model
    prompt = [(i * 11) % 60 + 3 for i in range(100)]
    proposer = ModelProposer(draft, length=3, vocab=97, sink=4, window=16, chunk=8)
    proposer.begin([prompt])
    chain = proposer.propose(mx.array([9])).beams[0, 0].tolist()
    assert proposer.cache.stored <= 4 + 16 + 8 + 3
    # the reference: a fresh streaming cache fed the same chunks, by hand
    cache = StreamingKVCache.for_model(draft, sink=4, window=16)
    text = prompt + [9]
    for start in range(0, len(text), 8):
        cache.evict()
        out = forward(draft, mx.array([text[start:start + 8]]), cache, logits_for="last")
    first = int(mx.argmax(out.logits[0, -1]).item())
    assert chain[1] == first and cache.stored == proposer.cache.stored - 1


def test_model_proposer_sampled_drafts_carry_the_small_models_distribution():
    from mlx_specdec.acceptance import target_probs
    from mlx_specdec.drafting import ModelProposer

    draft = make_tiny_lm(seed=5, layers=1).model
    prompt = [3, 9, 27, 81 % 97, 50]
    proposer = ModelProposer(draft, length=2, vocab=97, window=64, temperature=0.7, top_p=0.9)
    proposer.begin([prompt])
    proposal = proposer.propose(mx.array([7]))
    want = target_probs(draft(mx.array([prompt + [7]]))[0, -1], 0.7, 0.9)
    assert proposal.draft_probs.shape == (1, 1, 1, 97)
    assert mx.allclose(proposal.draft_probs[0, 0, 0], want, atol=1e-6).item()
    assert float(want[proposal.beams[0, 0, 1]].item()) > 0


def test_middle_level_proposer_drafts_the_targets_chain_over_its_cache_and_follows_the_top_level():
    """TriForce's middle level as a proposer: with no bottom it writes the target's greedy chain
    over the small cache; `propose` hands the same chain up in the interface's shapes; `commit`
    leaves the small cache holding the full cache's text (the kept tokens' keys copied from it),
    `rollback` forgets the round."""
    from mlx_specdec.cache import ContiguousKVCache, QueryRecorder, RetrievalKVCache
    from mlx_specdec.decoding.base import GenerationParams
    from mlx_specdec.drafting.base import NoDrafts
    from mlx_specdec.drafting.middle import Bottom, MiddleLevelProposer
    from mlx_specdec.model.forward import forward

    model = make_tiny_lm(seed=3, eos_id=96).model
    prompt = [(i * 7) % 50 + 3 for i in range(60)]
    full = ContiguousKVCache.for_model(model)
    forward(model, mx.array([prompt[:-1]]), full, logits_for="none")
    recorder = QueryRecorder(full)
    forward(model, mx.array([prompt[-1:]]), recorder, logits_for="none")
    small = RetrievalKVCache.build(full, recorder.queries(), 24)
    middle = MiddleLevelProposer(model, full, small, Bottom(NoDrafts(), V, False), gamma=4, params=GenerationParams())

    def chain_over(cache, token, length):  # the reference: greedy one token at a time, then undone
        out, x = [], token
        for _ in range(length):
            x = int(mx.argmax(forward(model, mx.array([[x]]), cache, logits_for="last").logits[0, -1]).item())
            out.append(x)
        cache.trim(length)
        return out

    want = chain_over(small, 9, 4)
    drafts, probs = middle.collect(9, None)
    assert drafts == want and probs is None and middle.forwards == 4
    middle.rollback()
    assert small.offset == full.offset == len(prompt)
    proposal = middle.propose(mx.array([9]), None)
    assert beams_of(proposal) == [[[9] + want]] and proposal.draft_probs is None
    # the top level kept 9 and two drafts: the full cache holds them, so must the small one
    forward(model, mx.array([[9] + want[:2]]), full, logits_for="none")
    middle.commit([[9] + want[:2]])
    assert small.offset == full.offset == len(prompt) + 3
    for mid, layer in zip(small.layers, full.layers):
        own = mid.keys[..., mid.retrieved:mid.retrieved + 3, :]
        assert mx.array_equal(own, layer.keys[..., len(prompt):len(prompt) + 3, :])
    following = chain_over(small, want[2], 4)  # continues from the committed text
    assert middle.collect(want[2], None)[0] == following


PROTOCOL = ("width", "length", "needs_hidden", "host_side", "begin", "propose", "draft_after", "commit", "rollback",
            "select_rows", "judged")


def every_source():
    """One of each drafting source: name -> proposer."""
    from test_redrafter import random_head

    from mlx_specdec.cache import ContiguousKVCache, QueryRecorder, RetrievalKVCache
    from mlx_specdec.decoding.base import GenerationParams
    from mlx_specdec.distributed.drafters import ScriptedSource
    from mlx_specdec.drafting import ModelProposer, PromptLookup
    from mlx_specdec.drafting.base import NoDrafts
    from mlx_specdec.drafting.middle import Bottom, MiddleLevelProposer
    from mlx_specdec.model.forward import forward

    lm = make_tiny_lm()
    prompt = [(i * 7) % 50 + 3 for i in range(40)]
    full = ContiguousKVCache.for_model(lm.model)
    forward(lm.model, mx.array([prompt[:-1]]), full, logits_for="none")
    recorder = QueryRecorder(full)
    forward(lm.model, mx.array([prompt[-1:]]), recorder, logits_for="none")
    small = RetrievalKVCache.build(full, recorder.queries(), 16)
    return {"head": HeadProposer(random_head(lm), lm.model.model.embed_tokens, 1, 3, vocab=V),
            "ngram": NgramProposer(1, 3, vocab=V), "lookup": PromptLookup(2, V),
            "draft model": ModelProposer(make_tiny_lm(seed=5, layers=1).model, 3, V, window=64),
            "middle level": MiddleLevelProposer(lm.model, full, small, Bottom(NoDrafts(), V, False), gamma=2,
                                                params=GenerationParams()),
            "none": NoDrafts(), "scripted": ScriptedSource([5, 6, 7], vocab=V)}


def test_every_drafting_source_follows_the_one_protocol():
    """Each source has every member of `base.Proposer`, drafts through it with a confidence for
    each drafted token, and a device-side source offers nothing on the host."""
    for name, source in every_source().items():
        missing = [m for m in PROTOCOL if not hasattr(source, m)]
        assert not missing, (name, missing)
        if name == "middle level":
            continue  # it needs the caches its triforce run keeps (tests above and tests/test_triforce.py)
        source.begin([[1, 2, 3, 1, 2]])
        hidden = mx.zeros((1, 64)) if source.needs_hidden else None
        proposal = source.propose(mx.array([3]), hidden)
        assert proposal.beams.shape[:2] == (1, source.width) and proposal.confidence is not None, name
        assert proposal.confidence.shape == proposal.beams.shape[:2] + (proposal.beams.shape[2] - 1,), name
        chains = source.draft_after([3])
        assert len(chains) == 1 and (source.host_side or chains[0] is None), name
        source.commit([[3, 1]])
        source.judged([1], [1])
        source.rollback([5])
        source.select_rows([0])


def test_no_caller_dispatches_on_the_kind_of_source():
    """TriForce's bottom, redrafter's lookup-first composition and PipeInfer's drafters talk to
    sources only through the protocol: no isinstance or hasattr on them."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "mlx_specdec"
    for path in ("decoding/triforce_bottom.py", "decoding/triforce.py", "drafting/middle.py",
                 "drafting/first_offer.py", "distributed/drafters.py", "decoding/redrafter.py"):
        text = (root / path).read_text()
        assert "isinstance(" not in text and "hasattr(" not in text, path


def test_the_pipeline_drafters_draft_through_their_sources():
    """PipeInfer's first rank asks `draft(seq, committed, k)`: a host-side source drafts after the
    tip of seq (its text following seq as it grows and is cut back), a head from the hidden state
    it observed, while the tail in flight is its chain's prefix."""
    from mlx_specdec.distributed.drafters import HeadDrafter, NgramDrafter, ScriptedDrafter
    from mlx_specdec.redrafter_head.beam import beam_search
    from test_redrafter import random_head

    ngram = NgramDrafter(vocab=V, length=4)
    ngram.begin([5, 6, 7, 8, 9, 5, 6])
    assert ngram.draft([5, 6, 7, 8, 9, 5, 6], 7, 2) == ([7, 8], [0.5, 0.5])
    ngram.outcome(False)  # its confidence: the running acceptance rate
    tokens, confidence = ngram.draft([5, 6, 7, 8, 9, 5, 6, 7, 8], 7, 3)  # a speculative tail: 7 8
    assert tokens == [9, 5, 6] and confidence == [pytest.approx(0.4)] * 3
    assert ngram.draft([5, 6, 7, 8, 9, 5, 6, 1], 8, 3) == ([], [])  # cut back, "6 1" never seen

    scripted = ScriptedDrafter([10, 11, 12, 13], wrong_at=[2], vocab=V)
    scripted.begin([1, 2, 3])
    assert scripted.draft([1, 2, 3], 3, 3) == ([10, 11, 13 % V], [1.0] * 3)  # answer index 2 drafted wrong
    assert scripted.draft([1, 2, 3, 10, 11], 4, 5) == ([13, 13], [1.0, 1.0])

    lm = make_tiny_lm()
    head = random_head(lm)
    embed = lm.model.model.embed_tokens
    drafter = HeadDrafter(head, embed, V, 3)
    hidden = mx.random.normal((64,))
    drafter.observe(hidden, 7, 4)
    want = beam_search(head, embed, hidden[None], mx.array([7]), 1, 4)
    assert drafter.chain == np.array(want.beams)[0, 0, 1:].tolist()
    np.testing.assert_allclose(drafter.confidence, np.array(want.confidence)[0, 0], rtol=1e-5)
    assert drafter.draft([0] * 5, 5, 2) == (drafter.chain[:2], drafter.confidence[:2])
    assert drafter.draft([0] * 5 + [drafter.chain[0]], 5, 5)[0] == drafter.chain[1:]
    assert drafter.draft([0] * 6, 6, 2) == ([], [])  # newer committed text than the chain
