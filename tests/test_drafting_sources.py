"""The drafting-source registry (drafting/sources.py) and redrafter's `sources` option: every
registered source builds and follows the protocol, and redrafter's greedy output with any list of
sources is plain decoding's."""

import mlx.core as mx
import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.drafting.sources import FALLBACKS, SOURCES, SourceSettings, source_names
from mlx_specdec.errors import UserError

from conftest import make_tiny_lm
from test_drafting import PROTOCOL
from test_redrafter import PROMPTS, engine_with, random_head, run
from test_redrafter_lookup import REPEATING


def test_every_registered_source_builds_follows_the_protocol_and_says_what_it_is():
    lm = make_tiny_lm()
    built = SourceSettings(vocab=97, drafts=3, head=random_head(lm), embed=lm.model.model.embed_tokens, length=4,
                           draft_model=make_tiny_lm(seed=2))
    assert set(FALLBACKS) <= set(SOURCES)
    for name, entry in SOURCES.items():
        assert entry.help and "\n" not in entry.help, name
        source = entry.build(built)
        assert all(hasattr(source, member) for member in PROTOCOL), name
        assert source.host_side != (name in FALLBACKS), name  # the head (or a draft model) on the device, last
        source.begin([[5, 6, 7, 5, 6]])
        proposal = source.propose(mx.array([7]), mx.zeros((1, 64)) if source.needs_hidden else None)
        assert proposal.confidence is not None, name


@pytest.mark.parametrize("bad", ["head,lookup", "lookup", "lookup,lookup,head", "nope,head", "", "head,head"])
def test_source_lists_are_known_names_each_once_ending_with_the_head(bad):
    with pytest.raises(ValueError):
        source_names(bad)
    lm = make_tiny_lm(seed=1, eos_id=96)
    with pytest.raises(UserError, match="redrafter: "):
        run(engine_with(lm, random_head(lm)), PROMPTS[0], "redrafter", max_tokens=4, options={"sources": bad})


def test_the_default_sources_are_lookup_then_the_head_and_lookup_0_leaves_the_head_alone():
    import importlib

    redrafter = importlib.import_module("mlx_specdec.decoding.redrafter")
    assert source_names(redrafter.DEFAULT_SOURCES) == ["lookup", "head"]
    lm = make_tiny_lm(seed=2, eos_id=96)
    engine = engine_with(lm, random_head(lm))
    steps = {}
    for options in ({}, {"sources": ["lookup", "head"]}, {"sources": "head"}, {"lookup": 0}):
        tokens, stats = run(engine, REPEATING, "redrafter", max_tokens=40, options=options)
        steps[str(options)] = (tokens, stats.forward_passes, stats.extra["source_steps"])
    default, listed, head_only, no_lookup = steps.values()
    assert default == listed and head_only == no_lookup
    assert default[0] == head_only[0]  # the same answer: plain decoding's
    assert default[2]["lookup"] > 0 and head_only[2] == {"head": head_only[2]["head"]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_redrafter_with_the_recent_source_equals_plain_decoding(seed):
    """`recent` (a 1-gram lookup) behind `lookup`: it drafts rows the 2-4-gram lookup leaves, and
    the answer is still plain decoding's, one prompt at a time and as a batch."""
    lm = make_tiny_lm(seed=seed, eos_id=96)
    engine = engine_with(lm, random_head(lm, seed=seed))
    prompts = PROMPTS + [REPEATING]
    options = {"sources": "lookup,recent,head", "draft_cutoff": 0.1}
    drafted = 0
    for prompt in prompts:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        got, stats = run(engine, prompt, "redrafter", max_tokens=40, options=options)
        assert got == want
        drafted += stats.extra["source_steps"]["recent"]
    assert drafted > 0  # it really drafted
    batch = {}
    for e in engine.generate_ids_batch(prompts, "redrafter", GenerationParams(max_tokens=24, options=options)):
        if e.kind == "token":
            batch.setdefault(e.thread_id, []).extend(e.tokens)
    assert [batch.get(b, []) for b in range(len(prompts))] == [run(engine, p, "ar", max_tokens=24)[0] for p in prompts]


def test_the_recent_source_drafts_what_followed_the_own_token_last_time():
    from mlx_specdec.drafting.recent import RecentToken

    source = RecentToken(drafts=3, vocab=97)
    source.begin([[4, 9, 1, 2, 9, 7, 8, 5]])
    chain, = source.draft_after([9])  # 9 was last followed by 7 8 5
    assert chain.tokens == [7, 8, 5] and chain.confidence.tolist() == [0.5] * 3
    assert source.draft_after([3]) == [None]  # never seen
    source.judged([3], [0])  # its first draft was rejected: trusted less
    assert source.draft_after([9])[0].confidence[0] < 0.5
