"""`mlx-specdec bench --synthetic`: a tiny stand-in shape runs every section end to end; bad names
and depths end in one line. (The real presets are measured by hand: docs/benchmarking.md.)"""

import json

import pytest

from mlx_specdec import bench_synthetic, synthetic_shapes
from mlx_specdec.synthetic_shapes import Shape
from test_cli_errors import assert_one_line_error, cli

TINY = dict(layers=4, hidden=64, ffn=128, heads=4, kv_heads=4, vocab=256, max_positions=128)
SECTIONS = ("## (a) Verify cost", "## (b) Fixed cost per step", "## (c) TriForce's middle level",
            "## (d) APAR: k threads", "## (e) Memory", "## PREDICTION")


@pytest.fixture
def synthetic_cli(monkeypatch, capsys):
    from mlx_specdec.cli import build_parser

    monkeypatch.setitem(synthetic_shapes.PRESETS, "_tiny", Shape(**TINY))
    monkeypatch.setitem(synthetic_shapes.PRESETS, "_tiny-4bit", Shape(**TINY, bits=4))
    monkeypatch.setattr(bench_synthetic, "RETRIEVAL_MIN_CONTEXT", 96)
    monkeypatch.setattr(bench_synthetic, "RETRIEVAL_BUDGETS", (16, 48))

    def run(*argv):
        args = build_parser().parse_args(["bench", "--rounds", "1", "--contexts", "32,96", *argv])
        assert args.func(args) == 0
        return capsys.readouterr().out
    return run


def test_every_section_is_reported_in_json(synthetic_cli):
    result = json.loads(synthetic_cli("--synthetic", "_tiny", "--layers", "2", "--format", "json"))
    assert result["model"]["layers_built"] == 2 and "x 4/2" in result["model"]["scaling"]
    assert result["environment"]["machine"]["device"] in ("cpu", "gpu")
    verify = result["verify_cost"]
    assert {(r["context"], r["tokens"]) for r in verify} == {(c, t) for c in (32, 96) for t in range(1, 17)}
    assert all(r["ms"] > 0 for r in verify) and all(r["ratio"] == 1.0 for r in verify if r["tokens"] == 1)
    whats = [r["what"] for r in result["overheads"] if r["context"] == 32]
    assert sum(w.startswith("redrafter head") for w in whats) == 2 and any(w.startswith("apar") for w in whats)
    assert [(r["context"], r["budget"]) for r in result["retrieval"]] == [(96, 16), (96, 48)]
    assert [r["threads"] for r in result["threads"] if r["context"] == 96] == [1, 2, 4, 8]
    assert result["memory"]["peak_mb_run"] > 0
    assert {row["method"] for row in result["prediction"]["rows"]} >= {"redrafter", "apar", "triforce"}


def test_markdown_of_a_kept_4bit_model(synthetic_cli):
    text = synthetic_cli("--synthetic", "_tiny-4bit", "--dequantize", "off")
    for section in SECTIONS:
        assert section in text
    assert "4-bit kept quantized" in text and "every layer built: nothing scaled" in text


def test_bad_names_and_depths_end_in_one_line():
    assert_one_line_error(cli("bench", "--synthetic", "vicuna-70b"), "unknown synthetic model 'vicuna-70b'",
                          "vicuna-7b-4bit")
    assert_one_line_error(cli("bench", "--synthetic", "vicuna-7b", "--layers", "0"), "--layers is 1 to 32")
