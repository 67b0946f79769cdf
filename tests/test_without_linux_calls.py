"""The engine where Linux's own calls do not exist, as on macOS: every process of a run (the CLI,
`mlx.launch`, each pipeline rank, the chat app) starts with a `sitecustomize` that removes the
`os.sched_*` affinity and scheduler calls and hides /proc from Python, and then must answer with
the same output as it does with them.

The pipeline's ranks once pinned themselves with `os.sched_setaffinity` unconditionally, so on a
Mac every `--ranks` run ended "rank 0 exited with code 1 before it said why"."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import save_tiny_model_dir

# Linux's scheduler calls that macOS's `os` does not have
LINUX_ONLY_OS = ("sched_getaffinity", "sched_setaffinity", "sched_setscheduler", "sched_getscheduler",
                 "sched_setparam", "sched_getparam", "sched_rr_get_interval", "SCHED_IDLE", "SCHED_BATCH",
                 "SCHED_RESET_ON_FORK")

SITECUSTOMIZE = f'''
import builtins, io, os, sys

for name in {LINUX_ONLY_OS!r}:
    if hasattr(os, name):
        delattr(os, name)


def _in_proc(path):
    try:
        path = os.fsdecode(path)
    except TypeError:  # a file descriptor
        return False
    return path == "/proc" or path.startswith("/proc/")


def _hide(call):
    def hidden(path=".", *args, **kwargs):
        if _in_proc(path):
            raise FileNotFoundError(2, "No such file or directory", os.fsdecode(path))
        return call(path, *args, **kwargs)
    return hidden


for module, name in ((os, "listdir"), (os, "scandir"), (os, "stat"), (os, "lstat"), (os, "open"),
                     (builtins, "open"), (io, "open")):
    setattr(module, name, _hide(getattr(module, name)))

with builtins.open(os.environ["WITHOUT_LINUX_CALLS_LOG"], "a") as log:  # which processes ran this
    log.write(str(os.getpid()) + " " + " ".join(getattr(sys, "orig_argv", sys.argv)) + "\\n")
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def without_linux(tmp_path):
    """The environment a child process gets to run without Linux's calls, and the log of the
    processes that started so."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "started.log"
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, WITHOUT_LINUX_CALLS_LOG=str(log)), log


def cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mlx_specdec.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_the_simulation_removes_the_calls_and_hides_proc(without_linux):
    env, log = without_linux
    probe = ("import os, pathlib; print(hasattr(os, 'sched_getaffinity'), hasattr(os, 'sched_setaffinity'), "
             "os.path.isdir('/proc/self'), pathlib.Path('/proc/cpuinfo').is_file(), os.path.isdir('/'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False", "False", "True"]
    assert len(log.read_text().splitlines()) == 1


def test_the_cli_and_a_pipeline_over_two_ranks_answer_as_they_do_with_linux_s_calls(tiny, without_linux):
    env, log = without_linux
    base = ["generate", "-m", str(tiny), "-p", "w3 w5 w7 w9 w3 w5 w7", "--raw", "--max-tokens", "12", "--temp", "0"]
    want = cli(*base)
    assert want.returncode == 0, want.stderr
    assert len(want.stdout.split()) == 12

    plain = cli(*base, env=env)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == want.stdout

    piped = cli(*base, "--method", "pp-ar", "--ranks", "2", env=env)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == want.stdout
    assert "[pp-ar over 2 ranks]" in piped.stderr
    started = [line.split() for line in log.read_text().splitlines()]
    ranks = [argv for argv in started if argv[2].endswith("distributed/rank.py")]  # pid, python, script
    assert len(ranks) == 2, started  # both ranks ran without the calls


def test_the_chat_app_in_tmux_answers_as_the_cli_does(tiny, without_linux, tmp_path):
    import test_tui_tmux as app  # skips where tmux is absent

    env, log = without_linux
    question = "w3 w5 w7 w9"
    want = cli("generate", "-m", str(tiny), "-p", question, "--max-tokens", "12", "--temp", "0")
    assert want.returncode == 0, want.stderr

    app.SOCKET = f"mlxspecdec-test-{os.getpid()}-without-linux"
    session, data = "mlxspecdec-test", tmp_path / "data"
    try:
        status = app.start_app(session, data, max_tokens=12, model=str(tiny),
                               env={k: env[k] for k in ("PYTHONPATH", "WITHOUT_LINUX_CALLS_LOG")})
        app.wait_screen(session, r"ready: ", timeout=180)
        assert app.app_pid(session) > 0  # the helper finds the app without /proc as well
        app.tmux("send-keys", "-t", session, "C-b")
        app.tmux("send-keys", "-t", session, "-l", question)
        app.tmux("send-keys", "-t", session, "Enter")
        screen = app.wait_screen(session, r"plain done", timeout=120)
        saved = app.rows(data / "chats.sqlite3")
        assert [(r["role"], r["status"]) for r in saved] == [("user", "done"), ("assistant", "done")]
        assert saved[1]["content"].strip() == want.stdout.strip()
        assert app.squash(app.answer_on_screen(screen)) == app.squash(saved[1]["content"])
        app.tmux("send-keys", "-t", session, "C-q")
        deadline = time.time() + 30
        while not (status.exists() and status.read_text().strip()):
            assert time.time() < deadline, "the app did not exit on Ctrl+Q"
            time.sleep(0.2)
        assert status.read_text().strip() == "0"
    finally:
        app.tmux("kill-server", check=False)
    assert "mlx_specdec.cli chat" in log.read_text()  # the app ran without the calls


def test_the_cli_help_runs_without_linux_s_calls(without_linux):
    env, _ = without_linux
    done = cli("--help", env=env, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr
    assert "mlx_specdec.cli --help" in Path(env["WITHOUT_LINUX_CALLS_LOG"]).read_text()


def test_only_local_ranks_are_pinned_and_only_where_the_system_can(tmp_path, monkeypatch):
    """`--ranks N` shares this machine: one core per rank, where `sched_setaffinity` exists; a
    hostfile's ranks each have a machine of their own and are never pinned."""
    import json

    from mlx_specdec.distributed import launch, rank

    written = []

    class Started(Exception):
        pass

    def popen(command, **kwargs):  # the job file the ranks would read; no rank starts
        written.append(json.loads(Path(command[-1]).read_text()))
        os.unlink(command[-1])
        raise Started

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    for where in (dict(ranks=2), dict(hostfile=str(hostfile))):
        with pytest.raises(Started):
            launch.run_pipeline({"model": "m", "jobs": []}, **where)
    assert [job["pin"] for job in written] == [True, False]

    for name in ("sched_getaffinity", "sched_setaffinity"):
        monkeypatch.delattr(os, name, raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert not rank.can_pin()
    rank._pin(1)  # nothing to pin with: the rank keeps its threads
    assert "OPENBLAS_NUM_THREADS" not in os.environ
