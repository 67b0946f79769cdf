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
    from mlx_specdec.drafting.head_source import HeadProposer

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
    from mlx_specdec.redrafter_head.model import save_drafter

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


# -- 4: one schema in every format, from one process or over ranks ----------------------------------

PIPELINE_RUN = ["--methods", "ar,pp-ar,pp-spec,pipeinfer", "--ranks", "2"]
SINGLE_RUN = ["--methods", "ar,redrafter"]


def md_table(markdown: str, heading: str):
    """A Markdown report's table under `## heading`: (header, rows as lists of cells)."""
    lines = markdown.split(f"## {heading}", 1)[1].strip().split("\n\n", 1)[0].splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    assert all(len(row) == len(cells[0]) for row in cells[2:])  # every row as wide as the header
    return cells[0], cells[2:]


def fake_ranks(engine, wrong=("pp-spec",)):
    """Stands in for the ranks `mlx.launch` starts: each job decoded here by ar, its events shaped
    as the ranks write them (distributed/rank.py, head.py); a method in `wrong` changes its answer's
    last token. The pipeline itself is run for real in test_pipeline.py."""
    def run_jobs(args, model_path, jobs, on_event):
        on_event({"ranks": 2, "split": [[0, 1], [1, 2]], "parameter_mb": [0.1, 0.1]})
        for index, job in enumerate(jobs):
            s = job["settings"]
            events = engine.generate_ids(job["prompt"], "ar", GenerationParams(max_tokens=s["max_tokens"]))
            tokens = [t for e in events if e.kind == "token" for t in e.tokens]
            if s["method"] in wrong:
                tokens[-1] = (tokens[-1] + 1) % 97
            on_event({"tokens": tokens, "job": index})
            drafted = 0 if s["method"] == "pp-ar" else 6
            runs = len(tokens) - 1
            on_event({"job": index, "stats": dict(
                runs=runs + 1, speculative_runs=drafted // 3, cancelled=drafted // 6, skipped=0, drafted=drafted,
                accepted=drafted // 2, decode_runs=runs, rejected_drafts=0, abandoned=0, new_tokens=len(tokens),
                ttft_s=0.01, decode_s=0.02, wall_s=0.03, stage_busy_s=[0.02, 0.01], stage_idle=[0.3, 0.6],
                tokens_per_pass=round(runs / max(runs, 1), 3))})
        return []
    return run_jobs


@pytest.fixture
def bench_cli(monkeypatch, capsys, tmp_path):
    """`mlx-specdec bench ARGS` in this process on the tiny engine (ranks faked): (stdout, stderr)."""
    import mlx_specdec.bench_pipeline as bench_pipeline
    import mlx_specdec.cli.bench as cli_bench
    from mlx_specdec.cli import build_parser

    engine = tiny_engine()
    monkeypatch.setattr(cli_bench, "load_engine", lambda args: engine)
    monkeypatch.setattr(bench_pipeline, "run_jobs", fake_ranks(engine))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p.text for p in BENCH_PROMPTS[:2]) + "\n")

    def bench(*argv):
        args = build_parser().parse_args(["bench", "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS),
                                          *argv])
        assert args.func(args) == 0
        captured = capsys.readouterr()
        return captured.out, captured.err
    return bench


def test_json_is_one_schema_whether_the_bench_ran_in_one_process_or_over_ranks(bench_cli):
    from mlx_specdec.bench import EXTRA_FIELDS, ROW_COLUMNS, SUMMARY_COLUMNS

    single = json.loads(bench_cli(*SINGLE_RUN, "--format", "json")[0])
    piped = json.loads(bench_cli(*PIPELINE_RUN, "--format", "json")[0])  # JSON, not Markdown
    assert set(single) == set(piped) == {"environment", "params", "rows", "summary", "per_category"}
    assert set(single["params"]) == set(piped["params"])
    assert set(single["environment"]) < set(piped["environment"])
    assert piped["environment"]["ranks"] == 2
    # a row may carry a method's raw figures besides (EXTRA_FIELDS: its summary's inputs)
    for key, schema in (("rows", ROW_COLUMNS + EXTRA_FIELDS), ("summary", SUMMARY_COLUMNS)):
        ar_keys = {k for r in single[key] if r["method"] == "ar" for k in r}
        assert ar_keys <= {k for r in piped[key] if r["method"] == "ar" for k in r}
        for record in single[key] + piped[key]:
            assert ar_keys <= set(record) <= set(schema), (key, record["method"])
    assert {tuple(sorted(t)) for t in single["per_category"]} >= {tuple(sorted(t)) for t in piped["per_category"]}

    summary = {s["method"]: s for s in piped["summary"]}
    assert set(summary) == {"ar", "pp-ar", "pp-spec", "pipeinfer"}
    assert summary["pp-spec"]["config"] == "draft_length=4,drafter=auto"
    assert [summary[m]["identical_fraction"] for m in ("ar", "pp-ar", "pp-spec", "pipeinfer")] == [1, 1, 0, 1]
    assert summary["pp-ar"]["acceptance"] is None and summary["pipeinfer"]["acceptance"] == 0.5
    assert summary["pp-spec"]["speedup_vs_pp_spec"] == 1.0 and summary["pp-ar"]["ttft_vs_pp_ar"] == 1.0
    assert summary["pipeinfer"]["stage_idle"] == [0.3, 0.6] and summary["pipeinfer"]["runs"] > 0
    assert summary["pp-ar"]["peak_memory_mb"] is None and summary["ar"]["peak_memory_mb"] > 0  # the ranks': n/a
    assert "runs" not in summary["ar"] and all(s["decode_tps"] > 0 for s in summary.values())
    rows = piped["rows"]
    assert len(rows) == 4 * 2 and all(r["tokens_per_forward"] > 0 for r in rows)


def test_csv_has_every_column_of_the_schema_and_a_row_a_run_in_both_benches(bench_cli, tmp_path):
    from mlx_specdec.bench import ROW_COLUMNS

    out = tmp_path / "single.csv"
    stdout, stderr = bench_cli(*SINGLE_RUN, "--format", "csv", "--output", str(out))
    assert stdout == "" and f"wrote {out}" in stderr and "| method |" in stderr  # the summary on stderr
    single = csv.DictReader(io.StringIO(out.read_text()))
    single_rows = list(single)
    piped = csv.DictReader(io.StringIO(bench_cli(*PIPELINE_RUN, "--format", "csv")[0]))
    piped_rows = list(piped)
    assert single.fieldnames == piped.fieldnames == ROW_COLUMNS
    assert sorted(r["method"] for r in single_rows) == ["ar", "ar", "redrafter", "redrafter"]
    assert sorted(r["method"] for r in piped_rows) == sorted(["ar", "pp-ar", "pp-spec", "pipeinfer"] * 2)
    for row in piped_rows:
        assert float(row["decode_tps"]) > 0
        assert row["identical_to_ar"] == str(row["method"] != "pp-spec")
        assert (row["runs"] == "") == (row["method"] == "ar")  # the ranks' figures, where they ran
    assert all(r["acceptance_per_position"] for r in single_rows if r["method"] == "redrafter")


def test_markdown_tables_show_only_the_columns_a_method_run_fills_in_the_schema_order(bench_cli):
    from mlx_specdec.bench import CATEGORY_COLUMNS, ROW_COLUMNS, SUMMARY_COLUMNS

    single, piped = bench_cli(*SINGLE_RUN)[0], bench_cli(*PIPELINE_RUN, "--format", "md")[0]
    for report in (single, piped):
        for heading, schema in (("Summary", SUMMARY_COLUMNS), ("Per category", CATEGORY_COLUMNS),
                                ("Per prompt", ROW_COLUMNS)):
            header, rows = md_table(report, heading)
            assert header == [c for c in schema if c in header]  # the schema's order
            for i, column in enumerate(header):
                assert any(row[i] != "" for row in rows), (heading, column)  # no all-empty column
    header, rows = md_table(single, "Summary")
    assert len(header) < len(SUMMARY_COLUMNS) // 2
    assert {"decode_tps_sd", "acceptance_per_position", "compression"} <= set(header)  # n/a is a value
    assert not {"forked_fraction", "nll_vs_ar", "bottom_acceptance", "runs", "stage_idle"} & set(header)
    cells = {row[0]: dict(zip(header, row)) for row in rows}
    assert cells["ar"]["acceptance_per_position"] == "" and cells["redrafter"]["acceptance_per_position"]
    assert cells["ar"]["decode_tps_sd"] == "n/a"
    header, rows = md_table(piped, "Summary")
    assert {"speedup_vs_pp_spec", "tokens_per_pass", "cancelled", "stage_idle"} <= set(header)
    assert not {"acceptance_per_position", "compression", "forked_fraction"} & set(header)
    cells = {row[0]: dict(zip(header, row)) for row in rows}
    assert cells["ar"]["stage_idle"] == "" and cells["pipeinfer"]["stage_idle"] == "[0.3, 0.6]"
    assert cells["pp-ar"]["acceptance"] == cells["pp-ar"]["peak_memory_mb"] == "n/a"


def test_a_format_other_than_md_json_csv_is_refused_before_anything_runs(bench_cli):
    from mlx_specdec.errors import UserError

    for methods in (SINGLE_RUN, PIPELINE_RUN):
        with pytest.raises(UserError, match="unknown format 'yaml'"):
            bench_cli(*methods, "--format", "yaml")
