"""The bench on tiny random models: the sd of a single repeat, the method order per prompt, and
the point every method's decoding time starts from (ReDrafter's first draft is decoding)."""

import csv
import io
import json
import time

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.bench import MethodConfig, Prompt, run_bench, run_one, summarize
from mlx_specdec.bench_report import render
from mlx_specdec.decoding import GenerationParams

from conftest import make_tiny_lm
from test_redrafter import PROMPTS, engine_with, random_head, run


CONFIGS = [MethodConfig("ar"), MethodConfig("redrafter", {"beam_width": 1}),
           MethodConfig("redrafter", {"beam_width": 2}), MethodConfig("mlx-lm")]
BENCH_PROMPTS = [Prompt("1", "generic", "w5 w17 w42 w3"), Prompt("2", "coding", "w60 w61 w9 w9 w33"),
                 Prompt("3", "math", "w88 w12")]
MAX_TOKENS = 12  # the bench's warm-up runs write 8: this tells the timed runs apart


def tiny_engine():
    lm = make_tiny_lm()
    lm.tokenizer._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return engine_with(lm, random_head(lm))


def record_calls(engine, monkeypatch):
    """Wraps `engine.generate`: every call's (prompt text, method, options, max_tokens), in order."""
    calls = []
    original = engine.generate

    def recording(prompt, method="ar", params=None, **kwargs):
        calls.append((prompt, method, dict(params.options), params.max_tokens))
        return original(prompt, method, params, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    return calls


def summary_table(markdown: str):
    """The '## Summary' table of a Markdown report: a list of {column: cell}."""
    lines = markdown.split("## Summary", 1)[1].strip().split("\n\n", 1)[0].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


# -- 1: one repeat has no sd ----------------------------------------------------------------------

def test_one_repeat_reports_no_sd_in_md_and_json():
    engine = tiny_engine()
    result = run_bench(engine, BENCH_PROMPTS[:2], CONFIGS[:2], GenerationParams(max_tokens=MAX_TOKENS),
                       repeats=1, progress=False)
    for s in result["summary"]:
        assert s["decode_tps"] > 0
        assert s["decode_tps_sd"] is None and s["speedup_sd"] is None  # undefined, not 0.0
    for s in summary_table(render(result, "md")):
        assert s["decode_tps_sd"] == "n/a" and s["speedup_sd"] == "n/a"
        assert float(s["decode_tps"]) > 0
    for s in json.loads(render(result, "json"))["summary"]:
        assert s["decode_tps_sd"] is None and s["speedup_sd"] is None  # null
    rows = list(csv.DictReader(io.StringIO(render(result, "csv"))))
    assert len(rows) == 2 * 2 and all(float(r["decode_tps"]) > 0 for r in rows)


def test_two_repeats_report_a_number_for_the_sd():
    rows = []
    for repeat, (ar_s, method_s) in enumerate([(1.0, 0.5), (1.0, 0.25)]):
        for method, config, seconds in (("ar", "-", ar_s), ("redrafter", "-", method_s)):
            rows.append({"method": method, "config": config, "prompt_id": "1", "repeat": repeat,
                         "category": "generic", "new_tokens": 11, "decode_s": seconds, "forward_passes": 11, "ttft_ms": 1.0,
                         "peak_memory_mb": 1.0, "identical_to_ar": True})
    summary = {s["method"]: s for s in summarize(rows, [MethodConfig("ar"), MethodConfig("redrafter")], 2)}
    assert summary["ar"]["decode_tps_sd"] == 0.0 and summary["ar"]["speedup_sd"] == 0.0  # defined: 0
    assert summary["redrafter"]["decode_tps"] == 30.0 and summary["redrafter"]["speedup_vs_ar"] == 3.0
    assert summary["redrafter"]["decode_tps_sd"] == pytest.approx(14.14, abs=0.01)
    assert summary["redrafter"]["speedup_sd"] == pytest.approx(1.414, abs=0.001)
    table = {s["method"]: s for s in summary_table(render(
        {"environment": {}, "params": {}, "rows": rows, "summary": list(summary.values())}, "md"))}
    assert table["redrafter"]["decode_tps_sd"] == "14.14" and table["ar"]["speedup_sd"] == "0.0"


# -- 2: the method order rotates per prompt ---------------------------------------------------------

def test_method_order_rotates_per_prompt_and_the_identity_flags_do_not_change(monkeypatch):
    engine = tiny_engine()
    calls = record_calls(engine, monkeypatch)
    params = GenerationParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=0)  # redrafter != ar
    repeats = 2
    result = run_bench(engine, BENCH_PROMPTS, CONFIGS, params, repeats=repeats, progress=False)

    timed = [c for c in calls if c[3] == MAX_TOKENS]
    n = len(CONFIGS)
    assert len(timed) == repeats * len(BENCH_PROMPTS) * n
    labels = {(c.method, c.label) for c in CONFIGS}
    orders = []
    for start in range(0, len(timed), n):
        group = timed[start : start + n]  # one prompt of one repeat
        assert len({prompt for prompt, *_ in group}) == 1
        order = [(method, MethodConfig(method, options).label) for _, method, options, _ in group]
        assert sorted(order) == sorted(labels)  # every config exactly once
        orders.append(tuple(order))
    for repeat in range(repeats):
        mine = orders[repeat * len(BENCH_PROMPTS) : (repeat + 1) * len(BENCH_PROMPTS)]
        assert len(set(mine)) == len(BENCH_PROMPTS)  # a different order for every prompt
        assert len({order[0] for order in mine}) == len(BENCH_PROMPTS)  # a different method first

    # The report is what running each config on its own says: same rows, same identity flags.
    assert len(result["rows"]) == repeats * len(BENCH_PROMPTS) * n
    flags = {(r["prompt_id"], r["method"], r["config"], r["repeat"]): r["identical_to_ar"]
             for r in result["rows"]}
    want = {}
    for prompt in BENCH_PROMPTS:
        answers = {(c.method, c.label): run_one(engine, prompt, c, params)[0] for c in CONFIGS}
        for (method, label), tokens in answers.items():
            for repeat in range(repeats):
                want[(prompt.id, method, label, repeat)] = tokens == answers[("ar", "-")]
    assert flags == want
    assert any(want.values()) and not all(want.values())  # the check is not vacuous


# -- 3: ReDrafter's first draft is decoding, not TTFT -----------------------------------------------

DELAY = 0.3


def slow_first_draft(monkeypatch):
    """ReDrafter's proposer (greedy beam search or sampled chains), the first draft of a
    generation delayed by DELAY seconds. Returns the perf_counter times drafts were asked for."""
    from mlx_specdec.drafting.head import HeadProposer

    started = []
    propose = HeadProposer.propose

    def patched(self, *args, **kwargs):
        started.append(time.perf_counter())
        if len(started) == 1:
            time.sleep(DELAY)
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(HeadProposer, "propose", patched)
    return started


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_redrafter_first_draft_is_timed_as_decoding(monkeypatch, temperature):
    lm = make_tiny_lm()
    engine = engine_with(lm, random_head(lm))
    params = dict(max_tokens=16, temperature=temperature, seed=0)
    want, _ = run(engine, PROMPTS[0], "redrafter", **params)  # warm-up: compiles the draft
    started = slow_first_draft(monkeypatch)
    first_token_at, tokens = None, []
    for event in engine.generate_ids(PROMPTS[0], "redrafter", GenerationParams(**params)):
        if event.kind == "token" and first_token_at is None:
            first_token_at = time.perf_counter()
        if event.kind == "token":
            tokens += event.tokens
        stats = event.stats
    assert tokens == want and len(tokens) > 2  # the delay changes nothing but the times
    assert started and started[0] > first_token_at  # the first token was out before any drafting
    assert DELAY <= stats.decode_s  # the delayed draft ran inside decoding (a lower bound, not a speed)
    assert stats.prefill_s <= stats.ttft_s


def test_ar_and_redrafter_time_decoding_from_their_first_token():
    """TTFT is prefill + the first token's forward for both; the rest is decoding."""
    lm = make_tiny_lm()
    engine = engine_with(lm, random_head(lm))
    for method in ("ar", "redrafter"):
        run(engine, PROMPTS[1], method, max_tokens=16)  # warm-up
        tokens, stats = run(engine, PROMPTS[1], method, max_tokens=16)
        assert stats.prefill_s <= stats.ttft_s and stats.decode_s > 0
        assert stats.generated_tokens == len(tokens) > 1


def test_bench_compares_several_heads_each_config_decoding_with_its_own(tmp_path, monkeypatch):
    """`bench --drafter A,B` runs redrafter once per head in the same run (a fair comparison of two
    heads on a noisy machine); each config's decoding gets the head it names, loaded once."""
    from mlx_specdec.drafter.head import save_drafter

    engine = tiny_engine()
    first, second = tmp_path / "a", tmp_path / "b"
    save_drafter(random_head(engine.lm, seed=1), first, dtype=mx.float32)
    save_drafter(random_head(engine.lm, seed=2), second, dtype=mx.float32)
    engine.drafter_spec = str(first)
    head_a, head_b = engine.drafter_for(str(first)), engine.drafter_for(str(second))
    assert head_a is engine.drafter and head_b is engine.drafter_for(str(second)) and head_a is not head_b
    assert not np.allclose(np.array(head_a.U.weight), np.array(head_b.U.weight))
    used = []
    original = engine._resources_for
    monkeypatch.setattr(engine, "_resources_for",
                        lambda method, params=None: used.append(original(method, params).get("drafter")) or original(method, params))
    configs = [MethodConfig("ar")] + [MethodConfig("redrafter", {"drafter": str(d)}) for d in (first, second)]
    result = run_bench(engine, BENCH_PROMPTS[:1], configs, GenerationParams(max_tokens=MAX_TOKENS))
    assert {id(h) for h in used if h is not None} == {id(head_a), id(head_b)}
    labels = {row["config"] for row in summary_table(render(result, "md"))}
    assert {f"drafter={first}", f"drafter={second}"} <= labels
