"""The chat app in a real terminal (tmux) with a thinking answer: a tiny Qwen3 scripted to think
"Hm." and answer "Ok!" (qwen_helpers.write_thinking_qwen3), through the real engine. The screen
shows the thought folded apart from the answer, and what was saved is the model's text as
written; with `--thinking off` the template closes the thought and the answer comes alone.
Skipped cleanly where tmux is absent; every wait has a timeout."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest

from qwen_helpers import ANSWER, THOUGHT, write_thinking_qwen3

if shutil.which("tmux") is None:
    pytest.skip("tmux is not installed", allow_module_level=True)

SOCKET = f"mlxspecdec-thinking-{os.getpid()}"
SESSION = "thinking"


def tmux(*args: str, check: bool = True) -> str:
    done = subprocess.run(["tmux", "-L", SOCKET, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise AssertionError(f"tmux {' '.join(args[:3])}: status {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def wait_screen(pattern: str, timeout: float) -> str:
    deadline, screen = time.time() + timeout, ""
    while time.time() < deadline:
        screen = tmux("capture-pane", "-p", "-t", SESSION, check=False)
        if re.search(pattern, screen):
            return screen
        time.sleep(0.25)
    raise AssertionError(f"{pattern!r} not on screen after {timeout:.0f}s:\n{screen}")


def ask(model, data, *flags) -> str:
    env = {"MLX_SPECDEC_DATA": str(data), "TERM": "xterm-256color", "COLORTERM": "truecolor"}
    command = (f"env {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} {shlex.quote(sys.executable)} "
               f"-m mlx_specdec.cli chat -m {shlex.quote(str(model))} --method ar --temp 0 --max-tokens 20 "
               + " ".join(flags))
    data.mkdir(parents=True, exist_ok=True)
    for attempt in range(5):  # a tmux server that is still exiting refuses a new session: try again
        try:
            tmux("new-session", "-d", "-s", SESSION, "-x", "80", "-y", "24", command)
            break
        except AssertionError:
            if attempt == 4:
                raise
            time.sleep(1.0)
    wait_screen(r"ready: ", timeout=120)
    tmux("send-keys", "-t", SESSION, "-l", "Why is the sky blue?")
    tmux("send-keys", "-t", SESSION, "Enter")
    screen = wait_screen(r"plain done", timeout=60)
    tmux("send-keys", "-t", SESSION, "C-q")
    time.sleep(0.5)
    tmux("kill-session", "-t", SESSION, check=False)
    return screen


def saved_answer(db) -> str:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT content FROM messages WHERE role = 'assistant' ORDER BY id DESC").fetchone()[0]
    finally:
        con.close()


@pytest.fixture
def thinker(tmp_path):
    yield write_thinking_qwen3(tmp_path / "qwen3-thinker")
    tmux("kill-server", check=False)


def test_a_thinking_answer_in_a_real_terminal_shows_the_thought_apart(tmp_path, thinker):
    screen = ask(thinker, tmp_path / "on")
    print("\n--- screen, thinking on ---\n" + screen)
    assert "▸ thought · 1 word (click to show)" in screen
    assert re.search(rf"▸ thought .*\n\s*(│\s*)?{re.escape(ANSWER)}", screen)  # the answer, under the fold
    assert THOUGHT not in screen and "think>" not in screen
    assert saved_answer(tmp_path / "on" / "chats.sqlite3") == f"<think>{THOUGHT}</think>{ANSWER}"

    screen = ask(thinker, tmp_path / "off", "--thinking", "off")
    print("\n--- screen, --thinking off ---\n" + screen)
    assert ANSWER in screen and "▸ thought" not in screen
    assert saved_answer(tmp_path / "off" / "chats.sqlite3") == ANSWER
