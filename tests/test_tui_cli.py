"""`mlx-specdec chat` (the app, or `--plain`) and `bench --plot`, on a tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import save_tiny_model_dir


def cli(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "mlx_specdec.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=180, env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", context=512)


def test_chat_app_outside_a_terminal_is_one_clear_line():
    result = cli("chat", stdin="")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("error: the chat app needs a terminal; "
                                     "use `mlx-specdec chat --plain` for a pipe")


def test_plain_chat_still_works_in_a_pipe(tiny_dir):
    result = cli("chat", "--plain", "-m", str(tiny_dir), "--max-tokens", "3", "--temp", "0", stdin="w5 w6\n/quit\n")
    assert result.returncode == 0, result.stderr
    assert ">>>" in result.stdout and len(result.stdout.split()) >= 3


def test_bench_plot_writes_a_png(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"w{i + 5} w7"]})
                                 for i, c in enumerate(["math", "math", "writing"])))
    png = tmp_path / "plot.png"
    result = cli("bench", "-m", str(tiny_dir), "--methods", "ar,mlx-lm", "--prompts", str(prompts),
                 "--max-tokens", "4", "--output", str(tmp_path / "r.md"), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in result.stderr


def test_bench_plot_refuses_an_unknown_image_type(tiny_dir, tmp_path):
    result = cli("bench", "-m", str(tiny_dir), "--plot", str(tmp_path / "plot.gif"))
    assert result.returncode == 1 and "--plot writes .png, .svg or .pdf" in result.stderr


def test_per_category_pools_tokens_and_times():
    from mlx_specdec.bench import per_category

    def row(method, pid, category, tokens, seconds):
        return {"method": method, "config": "-", "prompt_id": pid, "category": category, "repeat": 0,
                "new_tokens": tokens, "decode_s": seconds}

    result = {"summary": [{"method": "ar", "config": "-"}, {"method": "redrafter", "config": "-"}],
              "rows": [row("ar", "1", "math", 11, 1.0), row("redrafter", "1", "math", 11, 0.5),
                       row("ar", "2", "writing", 21, 2.0), row("redrafter", "2", "writing", 21, 4.0)]}
    table = {(t["method"], t["category"]): t for t in per_category(result)}
    assert table[("redrafter", "math")]["speedup_vs_ar"] == pytest.approx(2.0)
    assert table[("redrafter", "writing")]["speedup_vs_ar"] == pytest.approx(0.5)
    assert table[("redrafter", "all")]["speedup_vs_ar"] == pytest.approx(3.0 / 4.5)
    assert table[("ar", "all")]["decode_tps"] == pytest.approx(30 / 3.0)


def test_bench_prompts_filter_by_shape_or_category():
    from mlx_specdec.bench import DEFAULT_PROMPTS, load_prompts

    lists = load_prompts(DEFAULT_PROMPTS, shapes=["list"])
    assert lists and all(p.shape == "list" for p in lists)
    mixed = load_prompts(DEFAULT_PROMPTS, shapes=["list"], categories=["coding", "math"])
    assert {p.shape for p in mixed} == {"list", "code", "math"}
    assert len(mixed) == len(lists) + len(load_prompts(DEFAULT_PROMPTS, categories=["coding", "math"]))


def test_speedup_compares_tokens_per_second_when_answers_differ():
    from mlx_specdec.bench import per_category

    def row(method, tokens, seconds):
        return {"method": method, "config": "-", "prompt_id": "1", "category": "generic", "repeat": 0,
                "new_tokens": tokens, "decode_s": seconds}

    # apar writes its own (longer) answer: 41 tokens in 2 s against ar's 21 in 2 s is 2x the speed
    result = {"summary": [{"method": "ar", "config": "-"}, {"method": "apar", "config": "-"}],
              "rows": [row("ar", 21, 2.0), row("apar", 41, 2.0)]}
    table = {t["method"]: t for t in per_category(result)}
    assert table["apar"]["speedup_vs_ar"] == pytest.approx(2.0)
