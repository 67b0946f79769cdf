"""A request's life on the real server with the real default model: a non-streaming client that
leaves stops its generation (the next request is answered at once, not after the abandoned one's
2,000 tokens), a request that arrives mid-answer joins the running batch (answered while the long
one goes on), and SIGTERM, as systemd, Docker and launchd send it, ends answers in flight at
their next token (`finish_reason: "cancelled"`) and the server exits within seconds with status 0.
Bounded: every request and the server have timeouts."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.request

import pytest

from test_serve import free_port, start_server

pytestmark = pytest.mark.slow
LONG = {"messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}],
        "max_tokens": 2000, "temperature": 0}


def post(port: int, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
        return json.loads(response.read())


def raw_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_leaving_joining_and_sigterm_on_the_real_server():
    port = free_port()
    process = start_server("default", port, wait_s=180)
    assert process.poll() is None, process.stdout.read()
    try:
        # the model as the server was started ("default") is accepted, and is fast enough here
        short = post(port, {**LONG, "max_tokens": 8, "model": "default"}, timeout=60)
        assert short["choices"][0]["finish_reason"] == "length"
        # a non-streaming client leaves one second into a 2,000-token answer
        sock = raw_request(port, LONG)
        time.sleep(1.0)
        assert health(port)["running"] == 1
        sock.close()
        time.sleep(1.5)  # noticed within half a second, then it ends at its next token
        assert health(port)["running"] == 0, "the abandoned answer is still being generated"
        # SIGTERM while a streamed answer is in flight
        sock = raw_request(port, {**LONG, "stream": True})
        seen = b""
        while seen.count(b"data: ") < 5:
            seen += sock.recv(4096)
        # a request that arrives mid-answer joins the running batch at its next step
        began = time.time()
        joined = post(port, {**LONG, "max_tokens": 8}, timeout=60)
        assert joined["choices"][0]["finish_reason"] == "length" and time.time() - began < 10
        assert b"[DONE]" not in seen  # the long answer is still being written beside it
        process.send_signal(signal.SIGTERM)
        began = time.time()
        sock.settimeout(15)
        while True:
            part = sock.recv(65536)
            if not part:
                break
            seen += part
        code = process.wait(timeout=20)
        assert code == 0 and time.time() - began < 10
        finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in seen.decode().split("\n")
                    if line.startswith("data: {") and json.loads(line[6:]).get("choices")]
        assert finishes[-1] == "cancelled"
    finally:
        if process.poll() is None:
            process.kill()
