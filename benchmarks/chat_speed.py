"""The chat app's tok/s against `mlx-specdec generate` for the same prompt and settings.

Each repeat runs, one after the other:

1. `mlx-specdec generate --method M --max-tokens N --temp 0 -p PROMPT` and reads the decode tok/s
   of its stats line (stderr);
2. `mlx-specdec chat --method M --max-tokens N --temp 0` in a detached tmux session of a real
   terminal's size (120x40 by default), types the same prompt, waits for the status bar to say
   the answer is done and reads the tok/s the status bar shows (capture-pane).

It prints every repeat, the medians and their ratio (chat / generate), and with --output writes
them as Markdown. Both sides decode the same tokens: the chat encodes its one-message conversation
with the same chat template as `generate -p`, and greedy decoding gives the same answer; the
token counts are checked (the chat's from its saved stats).

    flock /tmp/bench.lock .venv/bin/python benchmarks/chat_speed.py --method ar --repeats 3

Every chat run starts from a fresh data directory (its conversation store), which gets the first
run's `baseline.json` so that the app measures the model's plain speed only once. On Linux it also
reports the CPU time of the app's UI thread (its main thread) per token of the answer: what
drawing the answer costs, besides the engine. `--app-dir DIR` runs the chat from DIR, whose `tui/`
is then imported instead of this checkout's (an A/B against an older copy of the app).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a long story about a dragon who learns to bake bread."
LABELS = {"ar": "plain", "mlx-lm": "mlx-lm", "redrafter": "ReDrafter", "apar": "APAR", "triforce": "TriForce"}
SOCKET = f"chat-speed-{os.getpid()}"


def run_generate(method: str, max_tokens: int, prompt: str, model: str) -> dict:
    cmd = [sys.executable, "-m", "mlx_specdec.cli", "generate", "-m", model, "--method", method,
           "--max-tokens", str(max_tokens), "--temp", "0", "-p", prompt]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = re.search(r"(\d+) tok, decode ([\d.]+) tok/s", done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"generate failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return {"tokens": int(found.group(1)), "tps": float(found.group(2)), "text": done.stdout}


def tmux(*args: str, check: bool = True) -> str:
    done = subprocess.run(["tmux", "-L", SOCKET, *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"tmux {' '.join(args[:3])}: status {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def wait_screen(session: str, pattern: str, timeout: float) -> str:
    deadline, screen = time.time() + timeout, ""
    while time.time() < deadline:
        screen = tmux("capture-pane", "-p", "-t", session, check=False)
        if re.search(pattern, screen):
            return screen
        time.sleep(0.25)
    raise RuntimeError(f"{pattern!r} not on screen after {timeout:.0f}s:\n{screen}")


def ui_cpu_s(session: str) -> float | None:
    """CPU seconds the app's main (UI) thread used so far; None where /proc is not there."""
    try:
        shell = int(tmux("display-message", "-p", "-t", session, "#{pane_pid}").strip())
        pids = [shell] + [int(p) for p in Path(f"/proc/{shell}/task/{shell}/children").read_text().split()]
        for pid in reversed(pids):
            if "mlx_specdec.cli" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, ValueError, RuntimeError):
        pass
    return None


def run_chat(method: str, max_tokens: int, prompt: str, model: str, data: Path, size: tuple,
             app_dir: str) -> dict:
    env = {"MLX_SPECDEC_DATA": str(data), "TERM": "xterm-256color", "COLORTERM": "truecolor"}
    if os.environ.get("MLX_SPECDEC_HOME"):
        env["MLX_SPECDEC_HOME"] = os.environ["MLX_SPECDEC_HOME"]
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    command = (f"env {assignments} {shlex.quote(sys.executable)} -m mlx_specdec.cli chat -m {shlex.quote(model)} "
               f"--method {method} --max-tokens {max_tokens} --temp 0")
    session = "chat"
    tmux("new-session", "-d", "-s", session, "-x", str(size[0]), "-y", str(size[1]), "-c", app_dir, command)
    try:
        wait_screen(session, r"ready: ", timeout=600)  # load (and the plain speed, measured once)
        time.sleep(1.0)
        cpu_before = ui_cpu_s(session)
        tmux("send-keys", "-t", session, "-l", prompt)
        tmux("send-keys", "-t", session, "Enter")
        label = LABELS.get(method, method)
        screen = wait_screen(session, rf"{re.escape(label)} (done|stopped|error)", timeout=900)
        cpu_after = ui_cpu_s(session)
        tmux("send-keys", "-t", session, "C-q")
    finally:
        time.sleep(1.0)
        tmux("kill-server", check=False)
    bar = next((line for line in reversed(screen.splitlines()) if f"{label} done" in line), "")
    found = re.search(r"([\d.]+) tok/s", bar)
    if not found:
        raise RuntimeError(f"no tok/s in the status bar:\n{screen}")
    con = sqlite3.connect(data / "chats.sqlite3")
    try:
        row = con.execute("SELECT content, stats FROM messages WHERE role='assistant' ORDER BY id DESC").fetchone()
    finally:
        con.close()
    stats = json.loads(row[1] or "{}")
    tokens = int(stats.get("tokens", 0))
    ui_ms = (1000 * (cpu_after - cpu_before) / tokens if tokens and cpu_before is not None and cpu_after is not None
             else float("nan"))
    return {"tps": float(found.group(1)), "tokens": tokens, "text": row[0], "bar": bar.strip(), "ui_ms": ui_ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ar")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--model", default="default")
    ap.add_argument("--size", default="120x40", help="the terminal's columns x rows")
    ap.add_argument("--output", help="also write the figures as Markdown here")
    ap.add_argument("--app-dir", default=str(Path(__file__).resolve().parent.parent),
                    help="the directory the chat runs in (its tui/ is imported first; default: this checkout)")
    args = ap.parse_args()
    if shutil.which("tmux") is None:
        print("tmux is not installed", file=sys.stderr)
        return 2
    size = tuple(int(x) for x in args.size.split("x"))
    gen_tps, chat_tps, ui_ms, lines = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="chat-speed-") as tmp:
        baseline = None
        for i in range(args.repeats):
            gen = run_generate(args.method, args.max_tokens, args.prompt, args.model)
            data = Path(tmp) / f"data{i}"
            data.mkdir()
            if baseline is not None:
                shutil.copy(baseline, data / "baseline.json")
            chat = run_chat(args.method, args.max_tokens, args.prompt, args.model, data, size, args.app_dir)
            if baseline is None and (data / "baseline.json").exists():
                baseline = data / "baseline.json"
            same = chat["text"].strip() == gen["text"].strip()
            gen_tps.append(gen["tps"])
            chat_tps.append(chat["tps"])
            ui_ms.append(chat["ui_ms"])
            line = (f"| {i + 1} | {gen['tps']:.1f} | {gen['tokens']} | {chat['tps']:.1f} | {chat['tokens']} | "
                    f"{chat['tps'] / gen['tps']:.2f} | {chat['ui_ms']:.1f} | {same} |")
            lines.append(line)
            print(line, "   status bar:", chat["bar"], flush=True)
    ratio = statistics.median(chat_tps) / statistics.median(gen_tps)
    table = ["| repeat | generate tok/s | tokens | chat tok/s | tokens | chat / generate | UI thread ms/token | same text |",
             "|---:|---:|---:|---:|---:|---:|---:|---|", *lines,
             f"| median | {statistics.median(gen_tps):.1f} | | {statistics.median(chat_tps):.1f} | | {ratio:.2f} | "
             f"{statistics.median(ui_ms):.1f} | |"]
    report = (f"method {args.method}, max tokens {args.max_tokens}, greedy, terminal {args.size}, "
              f"prompt {args.prompt!r}, app from {args.app_dir}\n\n" + "\n".join(table))
    print("\n" + report)
    if args.output:
        Path(args.output).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
