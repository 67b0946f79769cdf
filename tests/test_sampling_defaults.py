"""The sampling a request runs with where it does not say (sampling_defaults.py): the model's
generation_config.json as Hugging Face reads it, else the measured default; an explicit flag or
JSON field always wins; the default in force is shown (the CLI's stderr, the server's response)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import save_tiny_model_dir
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.sampling_defaults import MEASURED, describe, fill, from_generation_config, in_force, model_defaults


@pytest.mark.parametrize("config,want", [
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, dict(temperature=0.6, top_p=0.9, repetition_penalty=1.0)),
    ({"temperature": 0.9, "top_p": 0.6}, dict(temperature=0.9, top_p=0.6, repetition_penalty=1.0)),
    ({"do_sample": False, "temperature": 0.6}, dict(temperature=0.0, top_p=1.0, repetition_penalty=1.0)),
    ({"do_sample": True, "repetition_penalty": 1.05}, dict(temperature=1.0, top_p=1.0, repetition_penalty=1.05)),
    ({"do_sample": True, "temperature": 5, "top_p": 0}, dict(temperature=1.0, top_p=1.0, repetition_penalty=1.0)),
    ({"bos_token_id": 1, "eos_token_id": 2}, None),
])
def test_generation_config_is_read_as_hugging_face_reads_it(tmp_path, config, want):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert from_generation_config(tmp_path) == want
    assert model_defaults(tmp_path)[0] == (want or MEASURED)


def test_an_explicit_field_wins_and_a_default_penalty_stays_off_where_it_cannot_apply():
    defaults = dict(temperature=0.6, top_p=0.9, repetition_penalty=1.1)
    assert fill({"temperature": 0.0}, defaults, "ar") == dict(temperature=0.0, top_p=0.9, repetition_penalty=1.1)
    assert fill({}, defaults, "apar") == dict(temperature=0.6, top_p=0.9)
    assert fill({}, defaults, "triforce") == defaults  # triforce applies penalties too


def generate(model, *extra):
    return subprocess.run([sys.executable, "-m", "mlx_specdec.cli", "generate", "-m", str(model), "-p", "w5 w6",
                           "--raw", "--max-tokens", "3", *extra], capture_output=True, text=True, timeout=120)


def test_generate_takes_the_model_s_defaults_and_says_so(tmp_path):
    model = save_tiny_model_dir(tmp_path / "tiny")
    result = generate(model)
    assert result.returncode == 0, result.stderr
    assert describe(GenerationParams(**MEASURED), "the measured default") in result.stderr
    (model / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.3, "top_p": 0.8,
                                                              "repetition_penalty": 1.2}))
    result = generate(model, "--top-p", "0.5")
    assert result.returncode == 0, result.stderr
    assert ("sampling: temperature 0.3, top_p 0.5, repetition_penalty 1.2, repetition_context_size 20 "
            "(defaults: tiny/generation_config.json)") in result.stderr


def test_the_chat_app_gets_the_model_s_defaults_as_new_conversations_settings(tmp_path, monkeypatch):
    pytest.importorskip("textual")
    import tui.cli

    from mlx_specdec.cli import build_parser

    model = save_tiny_model_dir(tmp_path / "tiny")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.4, "top_p": 0.7}))
    seen = {}
    monkeypatch.setattr(tui.cli, "run_chat", lambda args, params: seen.setdefault("params", params) and 0)
    args = build_parser().parse_args(["chat", "-m", str(model), "--presence-penalty", "0.2"])
    args.func(args)
    params = seen["params"]
    assert (params.temperature, params.top_p, params.presence_penalty) == (0.4, 0.7, 0.2)


def test_the_server_reports_the_sampling_in_force():
    from mlx_specdec.serve.requests import parse

    class LM:
        context_length = 4096

        def encode_chat(self, messages, thinking=None):
            return [1, 2, 3]

    body = {"messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}
    request = parse(body, LM(), "m", ["ar"], "ar", chat=True, defaults=dict(MEASURED, repetition_penalty=1.1))
    assert in_force(request.params) == dict(temperature=MEASURED["temperature"], top_p=0.5, seed=None,
                                            repetition_penalty=1.1, repetition_context_size=20)
    greedy = parse({**body, "temperature": 0}, LM(), "m", ["ar"], "ar", chat=True, defaults=MEASURED)
    assert in_force(greedy.params) == {"temperature": 0.0}
