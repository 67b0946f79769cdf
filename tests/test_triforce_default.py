"""TriForce on the real default model at long context (slow): greedy output identical to `ar`
with every bottom, and on a pass-key prompt the retrieval cache finds what a StreamingLLM cache
of the same size cannot (the middle level accepts more)."""

import json
from pathlib import Path

import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine

pytestmark = pytest.mark.slow

LONG_PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "long_prompts.jsonl"


def record(question_id):
    for line in LONG_PROMPTS.read_text().splitlines():
        item = json.loads(line)
        if item["question_id"] == question_id:
            return item
    raise KeyError(question_id)


@pytest.fixture(scope="module")
def engine():
    # prefix reuse: the 1.8K-token prompt is prefilled once, every later run resumes from it
    return Engine.load("default", reuse_prefix=True)


@pytest.fixture(scope="module", params=["2k-needle-10", "2k-needle-50"])
def needle(engine, request):
    item = record(request.param)
    ids = engine.lm.encode_chat([{"role": "user", "content": item["turns"][0]}])
    return ids, item["expected"]


def run(engine, ids, method, **options):
    events = list(engine.generate_ids(ids, method, GenerationParams(max_tokens=20, options=options)))
    return [t for e in events if e.kind == "token" for t in e.tokens], events[-1].stats


@pytest.fixture(scope="module")
def plain(engine, needle):
    return run(engine, needle[0], "ar")[0]


@pytest.mark.parametrize("options", [dict(bottom="ngram"), dict(bottom="none", budget=128),
                                     dict(bottom="redrafter", gamma=4), dict(bottom="ngram", rebuild_stride=6),
                                     dict(bottom="ngram", score_window=1)])
def test_greedy_triforce_equals_plain_decoding_at_long_context(engine, needle, plain, options):
    got, stats = run(engine, needle[0], "triforce", **options)
    assert got == plain
    window = options.get("score_window", 16)  # the last prompt tokens are fed with the query recorder
    assert stats.extra["prefix_reused"] == len(needle[0]) - window


def test_on_a_pass_key_the_retrieval_middle_level_accepts_more_than_a_streaming_one(engine, needle, plain):
    ids, key = needle
    assert key in engine.lm.tokenizer.decode(plain)  # the model finds the key with the whole document
    acceptance = {}
    for cache in ("retrieval", "streaming"):
        got, stats = run(engine, ids, "triforce", bottom="none", budget=128, gamma=4, middle_cache=cache)
        assert got == plain
        acceptance[cache] = stats.extra["middle_acceptance"]
    # the retrieval cache keeps the needle's keys and accepts nearly every draft (measured 1.0 vs
    # 0.286 at both depths); 0.3 leaves room for noise while still telling the two apart
    assert acceptance["retrieval"] > acceptance["streaming"] + 0.3, acceptance
