"""Start the ranks with `mlx.launch` (ring backend) and read the head's events.

    run_pipeline(job, ranks=2)            N local ranks over the loopback ring
    run_pipeline(job, hostfile="h.json")  one rank per host in an `mlx.launch` hostfile (Macs over
                                          Ethernet or Thunderbolt; see docs/pipeinfer.md)

Every rank runs in one new process group: on a timeout, a failed rank, Ctrl-C or the end, the
whole group is killed, so no rank outlives the call. A failure is one `UserError` line: the
head's own error line, or the last thing a rank printed.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

from ..errors import UserError
from .rank import MARK

RANK_SCRIPT = Path(__file__).with_name("rank.py")


def _free_port(count: int) -> int:
    """A base port with `count` free ports after it (the ring listens on base + rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            for offset in range(1, count):
                with socket.socket() as other:
                    other.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise UserError("no free local ports for the ranks")


def _launcher() -> str:
    local = Path(sys.executable).with_name("mlx.launch")
    found = str(local) if local.exists() else shutil.which("mlx.launch")
    if not found:
        raise UserError("mlx.launch not found: install mlx (it ships the launcher)")
    return found


def check_hostfile(path: str) -> int:
    """The number of ranks an `mlx.launch` hostfile names; one line on a bad file."""
    try:
        hosts = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise UserError(f"--hostfile {path}: no such file")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"--hostfile {path}: not JSON ({error})")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, dict) and h.get("ssh") for h in hosts):
        raise UserError(f"--hostfile {path}: a JSON list of hosts, each {{\"ssh\": NAME, \"ips\": [...]}}")
    return len(hosts)


def run_pipeline(job: dict, ranks: int = 2, hostfile: Optional[str] = None, timeout: float = 600.0,
                 on_event: Optional[Callable[[dict], None]] = None, connect_timeout: float = 60.0) -> List[dict]:
    """Run `job` (see rank.py) on the ranks; returns the head's events in order. The ranks must
    connect (`mx.distributed.init` returns on the head) within connect_timeout seconds, and the
    whole run end within timeout."""
    if hostfile:
        ranks = check_hostfile(hostfile)
    if ranks < 2:
        raise UserError(f"--ranks needs at least 2, not {ranks}")
    # one core per rank helps only ranks that share this machine; a hostfile gives each its own
    job = dict(job, pin=bool(job.get("pin", True)) and not hostfile)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
        job_path = f.name
    command = [sys.executable, "-m", "mlx_specdec.distributed.mlx_launch", "--backend", "ring",
               "--python", sys.executable]
    command += ["--hostfile", hostfile] if hostfile else ["-n", str(ranks), "--starting-port", str(_free_port(ranks))]
    command += [str(RANK_SCRIPT), job_path]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    _launcher()  # MLX ships it: a clear line where it is missing
    # stdin: a pipe that stays open and empty (mlx_launch.py: at end of file the launcher spins)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                               text=True, start_new_session=True, env=env)
    lines: "queue.Queue" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout] + [lines.put(None)],
                     daemon=True).start()
    events: List[dict] = []
    other: List[str] = []
    started = time.monotonic()
    deadline = started + timeout
    connected = False
    error: Optional[str] = None
    try:
        while True:
            until = deadline if connected else min(deadline, started + connect_timeout)
            try:
                line = lines.get(timeout=max(0.1, until - time.monotonic()))
            except queue.Empty:
                if connected:
                    error = f"the ranks ran past {timeout:g} s and were stopped"
                else:
                    error = (f"the ranks did not connect within {connect_timeout:g} s: is every host of the "
                             "hostfile reachable at its 'ips', and no firewall in the way of the ports?")
                    error = _rank_line(other) or error
                break
            if line is None:
                break
            if not line.startswith(MARK):
                if line.strip() and "closed by the peer" not in line:
                    other.append(line.strip())
                continue
            event, rest = _event(line[len(MARK):])
            if rest:  # another process's text written onto the same line (mlx.launch's warnings)
                other.append(rest)
            if event is None:  # a torn event line: not an event
                continue
            if "connected" in event:
                connected = True
                continue
            if "error" in event:
                error = event["error"]
                break
            events.append(event)
            if on_event is not None:
                on_event(event)
            if event.get("done"):
                break
    finally:
        _stop(process)
        os.unlink(job_path)
    if error is None and not any(e.get("done") for e in events):
        error = _rank_line(other) or (other[-1] if other else f"the ranks ended early (exit {process.returncode})")
    if error is not None:
        raise UserError(f"pipeline: {error}")
    return events


def _event(payload: str):
    """One event line's JSON and whatever else shares the line: (event or None, the rest stripped).

    The ranks and `mlx.launch` write to one pipe; a launcher warning can land on the end of an
    event's line ('{"tokens": [19], "job": 0}\x1b[33m[WARN] Node with rank 0 exited ...')."""
    try:
        event, end = json.JSONDecoder().raw_decode(payload)
    except json.JSONDecodeError:
        return None, payload.strip()
    return (event if isinstance(event, dict) else None), payload[end:].strip()


def _rank_line(lines: List[str]) -> Optional[str]:
    """The last line a rank wrote about itself ("rank N: ..."), else the first rank that
    `mlx.launch` saw exit (the others are stopped after it), if any."""
    import re

    mine = [line for line in lines if re.match(r"rank \d+:", line)]
    if mine:
        return mine[-1]
    for line in lines:
        exited = re.search(r"Node with rank (\d+) exited with code (-?\d+)", line)
        if exited:
            rank, code = exited.groups()
            why = " (ssh could not reach its host)" if code == "255" else ""
            return f"rank {rank} exited with code {code}{why} before it said why"
    return None


def _stop(process: subprocess.Popen) -> None:
    """End every rank (one process group), politely first."""
    if process.stdin is not None:
        process.stdin.close()
    if process.poll() is None:
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=3)
        except subprocess.TimeoutExpired:
            continue
