"""Qwen3's thinking mode: the `thinking` setting (CLI `--thinking on|off`, the server's `thinking`
and vLLM/SGLang's `chat_template_kwargs.enable_thinking`, the chat's settings) reaches the chat
template; the thought and the answer come apart (`reasoning.ThoughtSplitter`), and the server
returns the thought as `reasoning_content` beside the answer alone where the client asks
(`separate_reasoning`). The model: a tiny Qwen3 whose greedy answer is scripted
(qwen_helpers.write_thinking_qwen3): "<think>Hm.</think>Ok!", or "Ok!" with thinking off."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from mlx_specdec.errors import UserError
from mlx_specdec.reasoning import ThoughtSplitter, opens_thought, split_thought

from qwen_helpers import ANSWER, THOUGHT, write_thinking_qwen3

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
RAW = f"<think>{THOUGHT}</think>{ANSWER}"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return write_thinking_qwen3(tmp_path_factory.mktemp("thinker") / "qwen3-thinker")


# -- the splitter -------------------------------------------------------------------------------

def test_the_thought_and_the_answer_come_apart_however_the_text_is_cut():
    text = "<think>\nLet me see.\nTwo and two.\n</think>\n\nFour, in the end."
    for size in range(1, len(text) + 1):
        splitter = ThoughtSplitter()
        shown = []
        for i in range(0, len(text), size):
            shown.append(splitter.feed(text[i:i + size]))
        shown.append(splitter.flush())
        assert splitter.thought_text == "Let me see.\nTwo and two." and splitter.answer_text == "Four, in the end."
        assert all("<" not in t and "<" not in a for t, a in shown), size  # no tag is ever shown as text
    assert split_thought("Four.") == (None, "Four.")
    assert split_thought("  Four <think> is text here") == (None, "  Four <think> is text here")
    assert split_thought("<think>\n\n</think>\n\nFour.") == ("", "Four.")
    assert split_thought("<think>\nstill thinking") == ("still thinking", "")  # cut off by max_tokens
    assert split_thought("Let me see.</think>Four.", inside=True) == ("Let me see.", "Four.")
    assert opens_thought("<|im_start|>assistant\n<think>\n") and not opens_thought("<think>\n\n</think>\n\n")


# -- the setting, from each front end -----------------------------------------------------------

def test_the_cli_the_chat_and_the_bench_take_thinking_on_and_off():
    from mlx_specdec.cli import build_parser
    from mlx_specdec.cli.args import _params
    from mlx_specdec.cli.bench import _params as bench_params

    parser = build_parser()
    command = lambda *argv: parser.parse_args(list(argv))  # noqa: E731
    assert _params(command("generate", "-p", "x", "--thinking", "off")).thinking is False
    assert _params(command("chat", "--thinking", "on")).thinking is True
    assert _params(command("generate", "-p", "x")).thinking is None  # the template's own default
    assert bench_params(command("bench", "--thinking", "off")).thinking is False
    with pytest.raises(UserError, match="--thinking is on or off, not 'maybe'"):
        _params(command("generate", "-p", "x", "--thinking", "maybe"))
    pytest.importorskip("textual")
    from tui.screens import parse_settings
    from tui.workers import make_params

    settings = parse_settings({"thinking": "off", "max_tokens": "9", "temperature": "0", "top_p": "1"}, "ar")
    assert make_params(settings, "ar").thinking is False
    with pytest.raises(ValueError, match="thinking is on or off"):
        parse_settings({"thinking": "sometimes"}, "ar")


def parsed(body, thinking_seen):
    from mlx_specdec.serve.requests import parse

    class LM:
        context_length = 4096
        tokenizer = None

        def encode_chat(self, messages, thinking=None):
            thinking_seen.append(thinking)
            return [1, 2, 3]

    return parse({"messages": QUESTION, **body}, LM(), "m", ["ar"], "ar", chat=True)


@pytest.mark.parametrize("body,want", [({}, None), ({"thinking": "off"}, False), ({"thinking": True}, True),
                                       ({"chat_template_kwargs": {"enable_thinking": False}}, False),
                                       ({"chat_template_kwargs": {"enable_thinking": True}, "thinking": "on"}, True),
                                       ({"chat_template_kwargs": {}}, None)])
def test_the_server_takes_its_own_field_and_vllm_s_chat_template_kwargs(body, want):
    seen = []
    request = parsed(body, seen)
    assert seen == [want] and request.params.thinking is want


@pytest.mark.parametrize("body,param", [
    ({"thinking": "maybe"}, "thinking"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": False}, "thinking": "on"}, "thinking"),
    ({"separate_reasoning": "yes"}, "separate_reasoning")])
def test_a_bad_thinking_field_is_a_400_naming_it(body, param):
    from mlx_specdec.serve.requests import ApiError

    with pytest.raises(ApiError) as error:
        parsed(body, [])
    assert error.value.status == 400 and error.value.param == param


# -- the engine, the CLI and the server on a thinking model -------------------------------------

def test_the_engine_thinks_or_not_as_the_template_is_told(thinker):
    from mlx_specdec.decoding import GenerationParams
    from mlx_specdec.engine import Engine

    engine = Engine.load(str(thinker), drafter=None, apar_adapter=None)
    for thinking, want in ((None, RAW), (True, RAW), (False, ANSWER)):
        for method in ("ar", "redrafter", "mlx-lm"):
            events = engine.chat(QUESTION, method, GenerationParams(max_tokens=20, thinking=thinking))
            assert "".join(e.text for e in events if e.kind == "token") == want, (thinking, method)
    out = subprocess.run([sys.executable, "-m", "mlx_specdec.cli", "generate", "-m", str(thinker), "-p",
                          QUESTION[0]["content"], "--max-tokens", "20", "--thinking", "off"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == ANSWER, out.stderr


def post(port, body, stream=False):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                                     data=json.dumps({"messages": QUESTION, "max_tokens": 20, **body,
                                                      "stream": stream}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read().decode()
    if not stream:
        return json.loads(raw)
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def test_the_server_returns_the_answer_alone_with_the_thought_beside_it(thinker):
    from test_serve import free_port, start_server

    port = free_port()
    process = start_server(str(thinker), port)
    try:
        message = post(port, {})["choices"][0]["message"]
        assert message["content"] == RAW and "reasoning_content" not in message  # as the model wrote it
        message = post(port, {"separate_reasoning": True})["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
        message = post(port, {"separate_reasoning": True, "chat_template_kwargs": {"enable_thinking": False}})
        message = message["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (None, ANSWER)
        assert post(port, {"thinking": "off"})["choices"][0]["message"]["content"] == ANSWER

        chunks = post(port, {"separate_reasoning": True}, stream=True)
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        thought = "".join(d.get("reasoning_content", "") for d in deltas)
        answer = "".join(d.get("content", "") for d in deltas)
        assert (thought, answer) == (THOUGHT, ANSWER)
        first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert all("content" not in d or not d["content"] for d in deltas[:first_answer])  # the thought first
        plain = post(port, {}, stream=True)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in plain if c.get("choices")) == RAW

        with pytest.raises(urllib.error.HTTPError) as error:
            post(port, {"chat_template_kwargs": {"enable_thinking": "no"}})
        body = json.loads(error.value.read())
        assert error.value.code == 400 and body["error"]["param"] == "chat_template_kwargs.enable_thinking"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
