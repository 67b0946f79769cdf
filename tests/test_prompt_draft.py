"""`redrafter --prompt-draft on`: the head drafts the answer's first tokens from the hidden state
before the prompt's last token, so the first forward verifies drafts; output stays the target's."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.decoding.base import DecodeContext, new_contiguous_cache, prefill_rows
from mlx_specdec.model.forward import forward

from conftest import make_tiny_lm
from test_redrafter import (PROMPTS, check_second_token_distribution, engine_with, oracle_head, run,
                            run_batch)

ON = {"prompt_draft": True, "lookup": 0}


@pytest.mark.parametrize("width,length,cutoff", [(1, 5, 0.0), (1, 5, 0.3), (2, 4, 0.0)])
def test_greedy_output_is_the_target_s_and_the_first_forward_accepts_drafts(width, length, cutoff):
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS))
    first_steps = []
    for prompt in PROMPTS:
        want, plain = run(engine, prompt, "ar", max_tokens=40)
        params = GenerationParams(max_tokens=40, options={**ON, "beam_width": width, "beam_length": length,
                                                          "draft_cutoff": cutoff})
        events = list(engine.generate_ids(prompt, "redrafter", params))
        assert [t for e in events if e.kind == "token" for t in e.tokens] == want
        first_steps.append(len(next(e for e in events if e.kind == "token").tokens))
        off, _ = run(engine, prompt, "redrafter", max_tokens=40,
                             options={**ON, "prompt_draft": False, "beam_width": width, "beam_length": length,
                                      "draft_cutoff": cutoff})
        assert off == want
    assert max(first_steps) > 1  # the first forward's drafts were accepted somewhere


@pytest.mark.parametrize("prompts", [PROMPTS + [[30, 31, 32, 33, 34, 35, 36, 37, 38]],
                                     PROMPTS + [[7]]])  # a one-token prompt: the first token alone
def test_batched_ragged_rows_each_equal_their_own_plain_decoding(prompts):
    lm = make_tiny_lm(seed=4, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.4))
    want = [run(engine, p, "ar", max_tokens=30)[0] for p in prompts]
    got, _ = run_batch(engine, prompts, max_tokens=30, options={**ON, "beam_width": 1, "beam_length": 4})
    assert got == want


def test_sampling_with_drafts_from_the_prompt_samples_the_models_distribution():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.5))
    check_second_token_distribution(lm, engine, PROMPTS[0], 1.0, 1.0,
                                    {**ON, "beam_width": 2, "beam_length": 3, "draft_cutoff": 0.3})


def test_prefill_gives_each_ragged_row_s_hidden_state_at_its_last_token():
    lm = make_tiny_lm(seed=1)
    rows = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]
    ctx = DecodeContext(lm=lm, prompt=rows[0], params=GenerationParams(prefill_chunk=2), sampler=None,
                        stats=None, prompts=rows)
    valid, last = prefill_rows(ctx, new_contiguous_cache(ctx), rows, last_hidden=True)
    assert valid.sum(axis=1).tolist() == [5, 2, 3]
    for b, row in enumerate(rows):
        alone = forward(lm.model, mx.array([row]), None).hidden[0, -1]
        np.testing.assert_allclose(np.array(last[b]), np.array(alone), rtol=1e-4, atol=1e-4)
