"""The drafting-source registry (drafting/sources.py) and redrafter's `sources` option: every
registered source builds and follows the protocol, and redrafter's greedy output with any list of
sources is plain decoding's."""

import mlx.core as mx
import pytest

from mlx_specdec.drafting.sources import FALLBACK, SOURCES, SourceSettings, source_names
from mlx_specdec.errors import UserError

from conftest import make_tiny_lm
from test_drafting import PROTOCOL
from test_redrafter import PROMPTS, engine_with, random_head, run
from test_redrafter_lookup import REPEATING


def test_every_registered_source_builds_follows_the_protocol_and_says_what_it_is():
    lm = make_tiny_lm()
    built = SourceSettings(vocab=97, drafts=3, head=random_head(lm), embed=lm.model.model.embed_tokens, length=4)
    assert list(SOURCES)[-1] == FALLBACK
    for name, entry in SOURCES.items():
        assert entry.help and "\n" not in entry.help, name
        source = entry.build(built)
        assert all(hasattr(source, member) for member in PROTOCOL), name
        assert source.host_side != (name == FALLBACK), name  # the head drafts on the device, the rest before it
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
