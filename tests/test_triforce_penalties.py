"""Penalties in TriForce (penalties.ChainPenalties): at both levels each position is penalized by
its own text (the prompt, the answer so far, the chain before it). Greedy: `ar`'s answer with the
same penalties, token for token, with every bottom; sampling: the second token follows plain
sampling's penalized marginal (chi-square)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.decoding import GenerationParams
from test_penalties import PENALTIES, tokens_of
from test_triforce import PROMPT, chi_square_below_critical, draft_engine


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
    from test_acceptance import nucleus_reference

    presence = 1.5
    engine = draft_engine()
    lm = engine.lm
    lm.model.model.embed_tokens.weight = lm.model.model.embed_tokens.weight / 4  # a flatter p: more cells
    seconds = []
    for seed in range(700):
        params = GenerationParams(max_tokens=2, temperature=1.0, seed=seed, presence_penalty=presence,
                                  options=dict(bottom="ngram", budget=16, gamma=3, draft_length=2))
        tokens = tokens_of(engine.generate_ids(PROMPT, "triforce", params))
        if tokens:
            seconds.append(tokens[1] if len(tokens) > 1 else 96)
    model = lm.model
    p_first = nucleus_reference(np.array(model(mx.array(PROMPT)[None])[0, -1]), 1.0, 1.0)
    p_first[96] = 0.0
    p_first /= p_first.sum()
    second_logits = np.array(model(mx.array([PROMPT + [t] for t in range(97)]))[:, -1])
    second_logits[np.arange(97), np.arange(97)] -= presence  # t1 was written: its presence
    p_second = np.stack([nucleus_reference(row, 1.0, 1.0) for row in second_logits])
    ok, (chi2, df) = chi_square_below_critical(seconds, (p_first[:, None] * p_second).sum(0))
    assert ok and df >= 5, (chi2, df)
