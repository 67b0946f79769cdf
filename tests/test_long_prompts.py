"""The long-document prompt set (benchmarks/long_prompts.jsonl) and `bench --context-length`: the
file, its sizes and needles, picking a size, refusing a prompt past the window, the warm-up that
skips long prefills, and the needle check in the report. Only the `slow` test loads the real model."""

import csv
import importlib.util
import io
import json
import re

import pytest

from mlx_specdec.bench import (LONG_PROMPTS, WARMUP_MAX_TOKENS, WARMUP_PROMPT, MethodConfig, Prompt,
                               load_prompts, run_bench)
from mlx_specdec.bench_report import render
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.errors import UserError

from conftest import make_tiny_lm, save_tiny_model_dir
from test_cli_errors import assert_one_line_error, cli
from test_redrafter import engine_with, random_head

RANGES = {"2k": (1800, 2048), "4k": (3600, 4096), "6k": (6000, 7000)}
RECORDS = [json.loads(line) for line in LONG_PROMPTS.read_text().splitlines()]
NEEDLE = re.compile(r"The pass key is (\d+)\. Remember it\.")


def normalized(text):
    return " ".join(text.split())


# -- the file ---------------------------------------------------------------------------------------

def test_the_file_is_valid_and_every_size_has_every_kind():
    assert LONG_PROMPTS.stat().st_size < 1_000_000
    ids = [r["question_id"] for r in RECORDS]
    assert len(ids) == len(set(ids))
    for r in RECORDS:
        assert r["category"] == r["kind"] in ("question", "summary", "needle")
        assert r["context"] in RANGES and isinstance(r["tokens"], int) and len(r["turns"]) == 1
        assert ("expected" in r) == (r["kind"] == "needle")
    for size in RANGES:
        kinds = [r["kind"] for r in RECORDS if r["context"] == size]
        assert 8 <= len(kinds) <= 10
        assert kinds.count("question") >= 2 and kinds.count("summary") >= 2 and kinds.count("needle") == 3
    prompts = load_prompts(LONG_PROMPTS)  # the bench reads it like any FastChat file
    assert [p.id for p in prompts] == ids
    assert all(p.context in RANGES and p.tokens for p in prompts)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r["question_id"])
def test_tokens_are_in_the_stated_range(record):
    low, high = RANGES[record["context"]]
    assert low <= record["tokens"] <= high


@pytest.mark.parametrize("record", [r for r in RECORDS if r["kind"] == "needle"], ids=lambda r: r["question_id"])
def test_each_needle_appears_once_at_its_depth(record):
    text = record["turns"][0]
    assert re.fullmatch(r"\d{5}", record["expected"])
    assert text.count(record["expected"]) == 1  # the key nowhere else, not even inside a number
    needles = NEEDLE.findall(text)
    assert needles == [record["expected"]]
    assert "What is the pass key?" in text.rsplit("\n\n", 1)[1]  # the request comes last
    depth = NEEDLE.search(text).start() / len(text)
    assert abs(depth - record["depth"]) < 0.05, depth
    assert {r["depth"] for r in RECORDS if r["kind"] == "needle" and r["context"] == record["context"]} == {0.1, 0.5, 0.9}


@pytest.mark.parametrize("record", [r for r in RECORDS if r["kind"] != "needle"], ids=lambda r: r["question_id"])
def test_the_answer_is_in_the_document(record):
    text = record["turns"][0]
    assert "pass key" not in text
    for passage in record["evidence"]:
        assert normalized(passage) in normalized(text.rsplit("\n\n", 1)[0])


# -- picking a size ---------------------------------------------------------------------------------

def ids(prompts):
    return [p.id for p in prompts]


def test_context_length_picks_one_set_by_name_number_or_all():
    for size in RANGES:
        assert {p.context for p in load_prompts(None, context=size)} == {size}
    assert ids(load_prompts(None, context="4K")) == ids(load_prompts(None, context="4k"))
    assert {p.context for p in load_prompts(None, context="4096")} == {"4k"}  # the nearest set
    assert {p.context for p in load_prompts(None, context="2048")} == {"2k"}
    assert {p.context for p in load_prompts(None, context="8192")} == {"6k"}
    assert len(load_prompts(None, context="all")) == len(RECORDS)
    # composes with --categories and --limit (size first, then category, then limit)
    assert ids(load_prompts(None, context="6k", categories=["needle"], limit=2)) == ["6k-needle-10", "6k-needle-50"]
    assert ids(load_prompts(None, context="all", categories=["summary"], limit=1)) == ["2k-summary-1"]
    assert ids(load_prompts(None, limit=1)) == ["1"]  # without --context-length: the usual set


@pytest.mark.parametrize("size", ["8k", "0", "-4096", "big"])
def test_an_unknown_size_is_one_clear_error(size):
    with pytest.raises(UserError, match=f"unknown --context-length '{size}': long_prompts.jsonl has 2k, 4k, 6k"):
        load_prompts(None, context=size)


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    """A tiny model directory (16-token window) whose tokenizer has a chat template, as the bench encodes."""
    path = save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", context=16)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_cli_size_errors_and_refusal_past_the_window(tiny_chat_dir, tmp_path):
    assert_one_line_error(cli("bench", "-m", str(tiny_chat_dir), "--context-length", "8k"),
                          "unknown --context-length '8k'", "2k, 4k, 6k")
    assert_one_line_error(cli("bench", "-m", str(tiny_chat_dir), "--context-length", "2k",
                              "--prompts", "benchmarks/prompts.jsonl"), "has no size sets")
    assert_one_line_error(cli("bench", "-m", str(tiny_chat_dir), "--context-length", "2k", "--limit", "2"),
                          "prompt 2k-question-1 (and 1 more) has", "past the context window", "(16 tokens)")
    # a short prompt that fits alone, but not with its answer: refused too, with its counts
    (tmp_path / "p.jsonl").write_text(json.dumps({"question_id": "q7", "turns": ["w5 w6 w7 w8 w9"]}) + "\n")
    assert_one_line_error(cli("bench", "-m", str(tiny_chat_dir), "--prompts", str(tmp_path / "p.jsonl"),
                              "--max-tokens", "12"), "prompt q7 has 5 tokens + --max-tokens 12 = 17")
    result = cli("bench", "--help")
    assert "--context-length" in result.stdout and "6k" in result.stdout


# -- the bench on a tiny model: refusal, warm-up, needles -------------------------------------------

def tiny_engine(context=2048):
    lm = make_tiny_lm(context=context)
    lm.tokenizer._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return engine_with(lm, random_head(lm))


def words(n, start=3):
    """n tokens of the tiny word-level tokenizer (one-digit words: one token each through the chat template)."""
    return " ".join(f"w{start + i % (10 - start)}" for i in range(n))


def test_refused_past_the_window_and_accepted_at_its_edge():
    engine = tiny_engine(context=64)
    fits = Prompt("edge", "-", words(52))  # 52 + 12 = 64: exactly the window
    run_bench(engine, [fits], [MethodConfig("ar")], GenerationParams(max_tokens=12), progress=False)
    with pytest.raises(UserError, match=r"prompt long has 53 tokens \+ --max-tokens 12 = 65, past the "
                                        r"context window of tiny-llama \(64 tokens\)"):
        run_bench(engine, [fits, Prompt("long", "-", words(53))], [MethodConfig("ar")],
                  GenerationParams(max_tokens=12), progress=False)


def warm_up_prompts(engine, prompts, monkeypatch):
    """The prompt texts the bench warms up on (its 8-token runs)."""
    calls = []
    original = engine.generate

    def recording(prompt, method="ar", params=None, **kwargs):
        calls.append((prompt, params.max_tokens))
        return original(prompt, method, params, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    run_bench(engine, prompts, [MethodConfig("ar"), MethodConfig("redrafter")], GenerationParams(max_tokens=6),
              progress=False)
    return [text for text, max_tokens in calls if max_tokens == 8]


def test_warm_up_skips_long_prompts(monkeypatch):
    engine = tiny_engine()
    long, short, other = (Prompt("long", "-", words(WARMUP_MAX_TOKENS + 100)), Prompt("short", "-", words(20)),
                          Prompt("other", "-", words(30, start=5)))
    assert warm_up_prompts(engine, [short, long], monkeypatch) == [short.text] * 2  # as before: prompts[0]
    assert warm_up_prompts(engine, [other, short], monkeypatch) == [other.text] * 2
    assert warm_up_prompts(engine, [long, other, short], monkeypatch) == [short.text] * 2  # the shortest
    assert warm_up_prompts(engine, [long, long], monkeypatch) == [WARMUP_PROMPT] * 2  # a fixed short one


def test_needles_found_per_row_and_per_method_in_md_json_csv():
    engine = tiny_engine()
    params = GenerationParams(max_tokens=8)
    text = words(40)
    tokens = [t for e in engine.generate(text, "ar", params) if e.kind == "token" for t in e.tokens]
    answer = engine.lm.tokenizer.decode(tokens).split()
    prompts = [Prompt("found", "needle", text, expected=answer[-1]),
               Prompt("lost", "needle", text, expected="not-a-word"), Prompt("plain", "question", text)]
    result = run_bench(engine, prompts, [MethodConfig("ar"), MethodConfig("redrafter")], params, progress=False)
    rows = {(r["method"], r["prompt_id"]): r for r in result["rows"]}
    for method in ("ar", "redrafter"):  # greedy: the same answer
        assert rows[(method, "found")]["needle_found"] is True
        assert rows[(method, "lost")]["needle_found"] is False
        assert "needle_found" not in rows[(method, "plain")]
    assert {s["method"]: s["needles_found"] for s in result["summary"]} == {"ar": "1/2", "redrafter": "1/2"}
    summary = render(result, "md").split("## Summary", 1)[1].split("## Per category", 1)[0]
    header = [c.strip() for c in summary.strip().splitlines()[0].strip("|").split("|")]
    cells = [c.strip() for c in summary.strip().splitlines()[2].strip("|").split("|")]
    assert dict(zip(header, cells))["needles_found"] == "1/2"
    assert [s["needles_found"] for s in json.loads(render(result, "json"))["summary"]] == ["1/2", "1/2"]
    found = {(r["method"], r["prompt_id"]): r["needle_found"] for r in csv.DictReader(io.StringIO(render(result, "csv")))}
    assert found[("ar", "found")] == "True" and found[("ar", "lost")] == "False" and found[("ar", "plain")] == ""


# -- the real model: the counts are the engine's --------------------------------------------------

def _licence_texts_here() -> bool:
    """The builder's documents: the licence texts Debian ships (/usr/share/common-licenses); a Mac
    has none."""
    spec = importlib.util.spec_from_file_location("long_prompts", LONG_PROMPTS.with_suffix(".py"))
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    return all((builder.LICENSES / name).is_file() for entry in builder.SPECS for name in entry[2])


@pytest.mark.slow
@pytest.mark.skipif(not _licence_texts_here(), reason="no /usr/share/common-licenses (Debian's licence texts) here")
def test_the_builder_writes_this_file_with_the_default_models_token_counts():
    from mlx_specdec.engine import Engine

    spec = importlib.util.spec_from_file_location("long_prompts", LONG_PROMPTS.with_suffix(".py"))
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    lm = Engine.load("default").lm
    for record in (RECORDS[0], RECORDS[10], RECORDS[-1]):  # one of each size
        assert len(lm.encode_prompt(record["turns"][0], chat=True)) == record["tokens"]
    assert builder.build(lambda text: len(lm.encode_prompt(text, chat=True))) == RECORDS  # deterministic
