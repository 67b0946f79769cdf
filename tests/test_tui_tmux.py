"""The chat app in a real terminal (tmux) on the real default model.

1. Start `mlx-specdec chat`, type a question with send-keys, read the streamed answer back with
   capture-pane; it matches the saved row; Ctrl+Q exits with status 0.
2. Ask for a long answer, `kill -9` the app mid-answer, start it again: the partial answer that
   was on screen is shown again (marked interrupted).
3. APAR with the shipped adapter: a list question forks; the saved (restored) answer is exactly
   the engine's own restored answer for the same question, and it is what the screen shows.
4. TriForce with a document: `/attach` shows the chip with the real tokenizer's count, a missing
   file is one line, the answer to the next message (which carries the document) is on screen
   with both levels' acceptance in the status bar; a follow-up resumes from the last turn's cache.

Marked slow (the real model); skipped cleanly where tmux is absent. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

pytestmark = pytest.mark.slow

if shutil.which("tmux") is None:
    pytest.skip("tmux is not installed", allow_module_level=True)

WIDTH, HEIGHT = 80, 24  # the smallest size the app promises to be usable at
# A private tmux server per test (never the user's, never the previous test's: a server that was just
# killed can still be exiting when the next test connects, and tmux then fails with status 1).
SOCKET = f"mlxspecdec-test-{os.getpid()}"


def tmux(*args: str, check: bool = True) -> str:
    done = subprocess.run(["tmux", "-L", SOCKET, *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise AssertionError(f"tmux {' '.join(args[:3])} ...: status {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def capture(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session, check=False)


def wait_screen(session: str, pattern: str, timeout: float) -> str:
    deadline = time.time() + timeout
    screen = ""
    while time.time() < deadline:
        screen = capture(session)
        if re.search(pattern, screen):
            return screen
        time.sleep(0.25)
    raise AssertionError(f"{pattern!r} not on screen after {timeout:.0f}s:\n{screen}")


def start_app(session: str, data: Path, max_tokens: int, method: str = "ar", model: str = "default",
              env: Optional[dict] = None) -> Path:
    """Start the app in a detached tmux session (with `env` added to its environment); returns the
    file its exit status goes to."""
    env = {"MLX_SPECDEC_DATA": str(data), "TERM": "xterm-256color", "COLORTERM": "truecolor", **(env or {})}
    if os.environ.get("MLX_SPECDEC_HOME"):
        env.setdefault("MLX_SPECDEC_HOME", os.environ["MLX_SPECDEC_HOME"])
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    status = data / f"exit-{time.time_ns()}"
    command = (f"env {assignments} {shlex.quote(sys.executable)} -m mlx_specdec.cli chat -m {shlex.quote(model)} "
               f"--max-tokens {max_tokens} --method {method} --temp 0; echo $? > {shlex.quote(str(status))}")
    data.mkdir(parents=True, exist_ok=True)
    # After kill-session the server of the last session exits; a client that connects while it is
    # exiting gets status 1 ("server exited unexpectedly"), so a failed start is tried again.
    for attempt in range(5):
        try:
            tmux("new-session", "-d", "-s", session, "-x", str(WIDTH), "-y", str(HEIGHT), command)
            return status
        except AssertionError:
            if attempt == 4:
                raise
            time.sleep(1.0)
    return status


def processes() -> dict:
    """Every process's parent and command line, {pid: (ppid, command)}, from `ps` (Linux and macOS
    alike; macOS has no /proc)."""
    listing = subprocess.run(["ps", "-A", "-ww", "-o", "pid=,ppid=,command="], capture_output=True, text=True,
                             check=True).stdout
    table = {}
    for line in listing.splitlines():
        fields = line.split(None, 2)
        if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
            table[int(fields[0])] = (int(fields[1]), fields[2] if len(fields) == 3 else "")
    return table


def app_pid(session: str) -> int:
    """The app's Python process: a child (or grandchild) of the pane's shell."""
    shell = int(tmux("display-message", "-p", "-t", session, "#{pane_pid}").strip())
    table = processes()
    for pid, (parent, command) in sorted(table.items()):
        if "mlx_specdec.cli" in command and shell in (parent, table.get(parent, (None,))[0]):
            return pid
    raise AssertionError("the app's process was not found")


def answer_on_screen(screen: str) -> str:
    """The last assistant message's text as drawn (sidebar hidden), without wrapping."""
    lines = screen.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().startswith("Assistant ·")]
    assert starts, screen
    out = []
    for line in lines[starts[-1] + 1:]:
        text = line.strip()
        if not text or text.startswith("[") or text.startswith("▔") or text.startswith("▁"):
            break
        out.append(text.replace("▍", ""))
    return " ".join(out)


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def rows(db: Path):
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM messages ORDER BY id")]
    finally:
        con.close()


@pytest.fixture
def session(request):
    global SOCKET
    SOCKET = f"mlxspecdec-test-{os.getpid()}-{request.node.name[:40]}"
    name = "mlxspecdec-test"
    yield name
    tmux("kill-server", check=False)


def test_chat_app_in_tmux_streams_and_survives_kill_9(tmp_path, session):
    data = tmp_path / "data"
    db = data / "chats.sqlite3"

    # 1. a question typed into the real terminal, the streamed answer read back
    status = start_app(session, data, max_tokens=40)
    wait_screen(session, r"ready: ", timeout=300)  # load + measuring the plain speed once
    tmux("send-keys", "-t", session, "C-b")  # hide the conversation list: whole lines of answer
    tmux("send-keys", "-t", session, "-l", "What is the capital of France?")
    tmux("send-keys", "-t", session, "Enter")
    screen = wait_screen(session, r"plain done", timeout=120)
    shown = answer_on_screen(screen)
    saved = rows(db)
    assert [(r["role"], r["status"]) for r in saved] == [("user", "done"), ("assistant", "done")]
    assert saved[0]["content"] == "What is the capital of France?"
    assert shown and squash(shown) == squash(saved[1]["content"])
    assert "Paris" in saved[1]["content"]
    assert re.search(r"plain done │ \d+\.\d tok/s │ \d\.\d\d tok/fwd", screen)  # the status bar
    print("\n--- screen after the answer ---\n" + screen)
    tmux("send-keys", "-t", session, "C-q")
    deadline = time.time() + 30
    while not (status.exists() and status.read_text().strip()):
        assert time.time() < deadline, "the app did not exit on Ctrl+Q"
        time.sleep(0.2)
    assert status.read_text().strip() == "0"
    tmux("kill-session", "-t", session, check=False)

    # 2. kill -9 in the middle of a long answer; the partial answer comes back on restart
    start_app(session, data, max_tokens=400)
    wait_screen(session, r"ready: ", timeout=120)
    tmux("send-keys", "-t", session, "C-b")
    tmux("send-keys", "-t", session, "C-n")
    tmux("send-keys", "-t", session, "-l", "Write a long story about a dragon who learns to bake bread.")
    tmux("send-keys", "-t", session, "Enter")
    deadline = time.time() + 120
    while True:
        assert time.time() < deadline, capture(session)
        last = rows(db)[-1]
        if last["role"] == "assistant" and len(last["content"]) >= 80:
            break
        time.sleep(0.2)
    screen_before = capture(session)
    shown_before = answer_on_screen(screen_before)
    os.kill(app_pid(session), signal.SIGKILL)
    time.sleep(0.5)
    saved = rows(db)[-1]
    assert saved["status"] == "streaming"  # nobody closed it: the process died mid-answer
    assert squash(shown_before) in squash(saved["content"])  # nothing shown was lost
    print("\n--- screen just before kill -9 ---\n" + screen_before)
    tmux("kill-session", "-t", session, check=False)

    start_app(session, data, max_tokens=40)
    screen_after = wait_screen(session, r"interrupted", timeout=120)
    tmux("send-keys", "-t", session, "C-b")
    time.sleep(0.5)
    screen_after = capture(session)
    print("\n--- screen after restarting ---\n" + screen_after)
    restored = answer_on_screen(screen_after)
    assert squash(restored) == squash(saved["content"])
    assert rows(db)[-1]["status"] == "interrupted"
    assert "Write a long story about a dragon" in screen_after


def test_apar_answer_in_tmux_is_the_engines_restored_answer(tmp_path, session):
    from mlx_specdec.apar import restore_answer
    from mlx_specdec.decoding import GenerationParams
    from mlx_specdec.engine import Engine

    question, max_tokens = "What are 5 tips for getting a better night's sleep?", 120  # forks (phrase: heads)
    data = tmp_path / "data"
    start_app(session, data, max_tokens=max_tokens, method="apar")
    wait_screen(session, r"ready: ", timeout=300)
    tmux("send-keys", "-t", session, "C-b")
    tmux("send-keys", "-t", session, "-l", question)
    tmux("send-keys", "-t", session, "Enter")
    screen = wait_screen(session, r"APAR done", timeout=180)
    print("\n--- screen after the APAR answer ---\n" + screen)
    saved = rows(data / "chats.sqlite3")[-1]
    assert saved["role"] == "assistant" and saved["status"] == "done"

    engine = Engine.load("default")
    events = list(engine.generate(question, "apar", GenerationParams(max_tokens=max_tokens)))
    assert any(e.kind == "thread_start" for e in events)  # it forked
    want = restore_answer(events, engine.apar_lm.tokenizer)
    assert saved["content"].strip() == want.strip()
    drawn = [re.sub(r"[│┃▍▌▐▔▁]", "", line).strip() for line in screen.splitlines()]
    drawn = [line for line in drawn if len(line) > 20]
    assert sum(squash(line) in squash(want) for line in drawn) >= 2, screen  # the answer is on screen


def test_attached_document_with_triforce_in_tmux(tmp_path, session):
    from mlx_specdec.engine import Engine

    text = ("The lighthouse keeper on Marrow Island is named Edwin Calloway. He has kept the light for "
            "31 years. His dog is called Biscuit.\n") * 3
    doc = tmp_path / "notes.txt"
    doc.write_text(text)
    tokens = len(Engine.load("default").lm.tokenizer.encode(text))
    data = tmp_path / "data"
    start_app(session, data, max_tokens=30, method="triforce")
    wait_screen(session, r"ready: ", timeout=300)
    tmux("send-keys", "-t", session, "C-b")
    tmux("send-keys", "-t", session, "-l", f"/attach {tmp_path / 'missing.txt'}")
    tmux("send-keys", "-t", session, "Enter")
    wait_screen(session, r"missing\.txt:\s+no\s+such\s+file", timeout=30)  # one line (wrapped where the temp path's length puts it)
    tmux("send-keys", "-t", session, "-l", f"/attach {doc}")
    tmux("send-keys", "-t", session, "Enter")
    wait_screen(session, rf"notes\.txt · {tokens} tokens", timeout=30)  # the chip
    tmux("send-keys", "-t", session, "-l", "What is the name of the lighthouse keeper?")
    tmux("send-keys", "-t", session, "Enter")
    screen = wait_screen(session, r"TriForce done", timeout=180)
    print("\n--- screen after the TriForce answer ---\n" + screen)
    assert re.search(r"acc (bottom|bot) \d+% · (middle|mid) \d+%", screen)  # the status bar
    user, answer = rows(data / "chats.sqlite3")
    assert user["content"] == ("Document: notes.txt\n\n" + text.strip()
                               + "\n\nQuestion: What is the name of the lighthouse keeper?")
    assert answer["status"] == "done" and "Calloway" in answer["content"]
    assert squash(answer_on_screen(screen)) == squash(answer["content"])
    # a follow-up: the document stays in the conversation, unchanged, so the engine resumes from
    # the last turn's KV cache instead of prefilling the document again
    tmux("send-keys", "-t", session, "-l", "What is his dog called?")
    tmux("send-keys", "-t", session, "Enter")
    deadline = time.time() + 180
    while len(rows(data / "chats.sqlite3")) < 4 or rows(data / "chats.sqlite3")[-1]["status"] != "done":
        assert time.time() < deadline, capture(session)
        time.sleep(0.25)
    saved = rows(data / "chats.sqlite3")
    assert saved[0]["content"] == user["content"]
    assert json.loads(saved[-1]["stats"]).get("prefix_reused", 0) > tokens
