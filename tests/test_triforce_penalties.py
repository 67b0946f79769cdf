"""Penalties in TriForce (penalties.ChainPenalties): at both levels each position is penalized by
its own text (the prompt, the answer so far, the chain before it). Greedy: `ar`'s answer with the
same penalties, token for token, with every bottom; sampling: the second token follows plain
sampling's penalized marginal (chi-square)."""

from __future__ import annotations

import pytest

from mlx_specdec.decoding import GenerationParams
from test_penalties import PENALTIES, tokens_of
from test_triforce import PROMPT, chi_square_below_critical, draft_engine, sampled_second_tokens


@pytest.mark.parametrize("fields", PENALTIES)
def test_greedy_triforce_with_penalties_equals_ar_token_for_token(fields):
    engine = draft_engine()
    want = tokens_of(engine.generate_ids(PROMPT, "ar", GenerationParams(max_tokens=40, **fields)))
    assert want != tokens_of(engine.generate_ids(PROMPT, "ar", GenerationParams(max_tokens=40)))  # they matter
    accepted = 0
    for options in (dict(bottom="ngram", budget=24, gamma=4), dict(bottom="model", budget=16, gamma=5, draft_length=2),
                    dict(bottom="none", budget=1024, gamma=3)):
        events = list(engine.generate_ids(PROMPT, "triforce", GenerationParams(max_tokens=40, options=options,
                                                                               **fields)))
        assert tokens_of(events) == want, options
        accepted += events[-1].stats.accepted
    assert accepted > 0  # drafts were verified and kept: the chain positions were penalized


def test_sampled_triforce_with_a_presence_penalty_draws_the_penalized_distribution():
    """T = 1, presence 1.5, the middle level over 16 of 140 prompt keys: the second token follows
    P(t2) = sum_t1 p(t1) p(t2 | t1) with t1's logit lowered by 1.5 after it was written."""
    ok, (chi2, df) = chi_square_below_critical(*sampled_second_tokens(draft_engine(), presence=1.5))
    assert ok and df >= 5, (chi2, df)
