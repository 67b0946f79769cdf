"""The method registry is the one place a setting is declared: every setting is reachable from the
CLI, the server and the chat, each parses it the same way (same value, same refusal), the batch key
sees it, and docs/server.md lists it. A setting added to the registry and missed anywhere fails here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mlx_specdec.cli import build_parser
from mlx_specdec.decoding.base import GenerationParams
from mlx_specdec.errors import UserError
from mlx_specdec.settings import METHODS, SAMPLING, SettingError, all_settings, batch_key, method_settings, resolve

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [(m.name, s) for m, s in method_settings()]


def subparser(name):
    return build_parser()._subparsers._group_actions[0].choices[name]


def good_and_bad(s):
    """(a good value as text, the value it parses to, a bad value as text) for a setting."""
    if s.kind == "bool":
        return ("off" if s.default else "on"), (not s.default), "maybe"
    if s.kind == "list":
        return "lookup,recent,head", "lookup,recent,head", "lookup,nope,head"
    if s.kind == "choice":
        text = next(c for c in s.choices if s.parse(c) != s.parse(s.default or s.choices[0])) \
            if len(s.choices) > 1 else s.choices[0]
        return text, s.parse(text), "nonsense"
    if s.kind == "int":
        value = int(s.high) if s.high is not None else int(s.low) + 1
        return str(value), value, str(int(s.high) + 1 if s.high is not None else int(s.low) - 1)
    value = float(s.high)
    return str(value), value, "1.5" if s.high == 1.0 else "nan"


def cli_options(command, *argv):
    """What `command` passes to the engine for these flags (GenerationParams.options / bench grids)."""
    from mlx_specdec.cli.args import _method_options, method_grids

    args = subparser(command).parse_args(list(argv) + (["-p", "x"] if command == "generate" else []))
    return method_grids(args) if command == "bench" else _method_options(args)


def server_options(method, body):
    from mlx_specdec.serve.requests import parse

    class LM:
        context_length = 4096

        def encode_chat(self, messages, thinking=None):
            return [1, 2, 3]

    request = parse({"messages": [{"role": "user", "content": "hi"}], "method": method, **body}, LM(), "m",
                    list(METHODS), "ar", chat=True)
    return request.params.options


@pytest.mark.parametrize("method,setting", PAIRS, ids=[f"{m}.{s.name}" for m, s in PAIRS])
def test_every_setting_parses_the_same_from_the_cli_the_server_and_the_chat(method, setting):
    from mlx_specdec.serve.requests import ApiError

    text, value, bad = good_and_bad(setting)
    flag = setting.cli_flags[0]
    # CLI: generate and chat take one value, bench a comma list
    assert cli_options("generate", flag, text)[setting.name] == value
    assert cli_options("chat", flag, text)[setting.name] == value
    assert cli_options("bench", flag, text)[method][setting.name] == [value]
    with pytest.raises(UserError, match=flag):
        cli_options("generate", flag, bad)
    # server: the JSON value (numbers as JSON numbers), and a 400 naming the field for a bad one
    json_value = text if setting.kind in ("bool", "choice", "list") else value
    assert server_options(method, {setting.name: json_value})[setting.name] == value
    with pytest.raises(ApiError) as error:
        server_options(method, {setting.name: bad if setting.kind in ("bool", "choice", "list") else 10**12})
    assert error.value.status == 400 and error.value.param == setting.name
    # chat: the settings screen's text parses to the same value, and a bad one is refused
    pytest.importorskip("textual")
    from tui.screens import parse_settings
    from tui.workers import make_params

    settings = parse_settings({setting.name: text, "max_tokens": "9", "temperature": "0", "top_p": "1"}, method)
    assert make_params(settings, method).options[setting.name] == value
    with pytest.raises(ValueError, match=setting.label):
        parse_settings({setting.name: bad, "max_tokens": "9", "temperature": "0", "top_p": "1"}, method)


@pytest.mark.parametrize("method,setting", PAIRS, ids=[f"{m}.{s.name}" for m, s in PAIRS])
def test_every_setting_is_in_the_batch_key_and_the_server_docs(method, setting):
    text, value, _ = good_and_bad(setting)
    plain = GenerationParams(options={})
    changed = GenerationParams(options={setting.name: value})
    assert batch_key(method, plain) != batch_key(method, changed)
    assert batch_key(method, plain) == batch_key(method, GenerationParams(options=resolve(method, {})))
    assert f"`{setting.name}`" in (ROOT / "docs" / "server.md").read_text()


def test_the_server_docs_carry_the_registry_s_table_as_it_is():
    from mlx_specdec.settings import markdown

    assert markdown() in (ROOT / "docs" / "server.md").read_text(), \
        "regenerate docs/server.md's table: python -m mlx_specdec.settings --markdown"


def test_a_new_sampling_field_is_in_the_batch_key_without_being_named():
    """Every GenerationParams field but the per-row ones must match for requests to share a batch."""
    import dataclasses

    from mlx_specdec.settings import PER_ROW

    base = GenerationParams(temperature=0.7)
    for f in dataclasses.fields(GenerationParams):
        if f.name in PER_ROW:
            continue
        other = {"temperature": 0.9, "top_p": 0.5, "seed": 3, "prefill_chunk": 7, "frequency_penalty": 0.5,
                 "presence_penalty": -0.5, "repetition_penalty": 1.2, "repetition_context_size": 7}.get(f.name)
        assert other is not None, f"give the test a second value for the new field {f.name}"
        assert batch_key("redrafter", base) != batch_key("redrafter", dataclasses.replace(base, **{f.name: other}))
    # rows keep their own length, stop strings and thinking switch (it shapes the prompt only)
    assert set(PER_ROW) == {"max_tokens", "stop", "options", "thinking"}
    assert batch_key("redrafter", base) == batch_key("redrafter", dataclasses.replace(base, max_tokens=3, stop=("x",),
                                                                                     thinking=False))


def test_sampling_fields_share_one_parser():
    from mlx_specdec.serve.requests import ApiError

    for s in SAMPLING:
        assert s.name in all_settings() or s.name in ("max_tokens", "temperature", "top_p", "seed", "frequency_penalty",
                                                      "presence_penalty", "repetition_penalty",
                                                      "repetition_context_size", "thinking")
    with pytest.raises(UserError, match="--temp takes a number from 0 to 2"):
        from mlx_specdec.cli.args import _params

        _params(subparser("generate").parse_args(["-p", "x", "--temp", "3"]))
    with pytest.raises(ApiError, match="'temperature' takes a number from 0 to 2"):
        server_options("ar", {"temperature": 3})
    with pytest.raises(UserError, match="--repetition-penalty takes a number from 0 \\(exclusive\\) to 10"):
        _params(subparser("generate").parse_args(["-p", "x", "--repetition-penalty", "0"]))
    with pytest.raises(ApiError, match="'frequency_penalty' takes a number from -2 to 2") as error:
        server_options("ar", {"frequency_penalty": 2.5})
    assert error.value.param == "frequency_penalty"
    args = subparser("chat").parse_args(["--presence-penalty", "0.5", "--repetition-context-size", "9"])
    params = _params(args)
    assert (params.presence_penalty, params.repetition_context_size) == (0.5, 9)


def test_values_are_typed_strictly():
    width = METHODS["redrafter"].setting("beam_width")
    for bad in ("abc", 1.5, True, float("nan"), None, [1], {"a": 1}):
        with pytest.raises(SettingError):
            width.parse(bad)
    with pytest.raises(SettingError):
        width.parse("3", json=True)  # the server takes JSON numbers for numbers
    assert width.parse(3.0) == 3 and width.parse(" 4 ") == 4
    verify = METHODS["redrafter"].setting("verify_cost")
    assert [verify.parse(v) for v in ("on", "off", "margin", "OFF")] == [True, False, "margin", False]
    assert METHODS["apar"].setting("fork_probe").parse("off") is False


def test_resolve_fills_defaults_and_keeps_to_the_method():
    got = resolve("redrafter", {"beam_width": 2, "budget": 64})  # budget is triforce's: checked, then dropped
    assert got["beam_width"] == 2 and "budget" not in got
    assert set(got) == {s.name for s in METHODS["redrafter"].settings if s.default is not None}
    with pytest.raises(SettingError):
        resolve("redrafter", {"budget": 1})  # another method's setting is still held to its bounds


def test_the_chat_settings_screen_shows_every_setting_of_the_chosen_method(tmp_path):
    pytest.importorskip("textual")
    from tui.screens import SettingsScreen
    from textual.app import App

    class Host(App):
        def on_mount(self):
            self.push_screen(SettingsScreen(list(METHODS), "triforce", {}))

    async def run():
        app = Host()
        async with app.run_test(size=(90, 60)) as pilot:
            await pilot.pause(0.05)
            screen = app.screen
            for method, setting in method_settings():
                assert screen.query_one(f"#field-{setting.name}") is not None
                group = screen.query_one(f"#fields-{method.name}")
                assert group.display == (method.name == "triforce")
            screen.query_one("#method").value = "redrafter"
            await pilot.pause(0.05)
            assert screen.query_one("#fields-redrafter").display and not screen.query_one("#fields-triforce").display

    asyncio.run(run())
