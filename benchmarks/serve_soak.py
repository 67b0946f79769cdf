"""A bounded soak of `mlx-specdec serve`: mixed, misbehaving clients for a few minutes; nothing may
hang, nothing may get a 5xx, and the server must end idle.

    python benchmarks/serve_soak.py [--minutes 3] [--clients 8] [--max-batch 8] [--timeout 180]
                                    [--seed 0] [--json benchmarks/results/serve/soak.json]

Our server (`serve --max-batch`) on a free localhost port with the default model, its output in a
log file. Every client loops until the time is up; of each 10 of its requests (in a shuffled
order) 8 are good, 1 leaves and 1 is garbage:

  good     a chat (or, one in ten, a raw completion) with a method the server supports among
           ar, redrafter, triforce, apar and auto (GET /v1/models says which), streamed or not,
           greedy or sampled (temperature 0.7, half of them seeded), some with fields the API does
           not know (`user`, `metadata`: OpenAI clients send such fields, the server ignores them).
           It must answer 200 within --timeout, with finish_reason stop or length, no more tokens
           than asked, and a streamed one must end with [DONE] and no error chunk.
  leave    a good request whose client goes away: a streamed one after its first content
           chunk, a non-streamed one after 0.2-1.5 s (the server notices within half a second).
  garbage  a body the server must refuse with a 4xx (never a 5xx, never a hang): invalid
           JSON, wrong types, huge or non-finite numbers, unknown fields beside a bad value, deep
           nesting, a body past the size limit (ideas from tests/test_serve_hostile.py). Before the
           clients start, --preflight garbage bodies go one after another (counted apart, as
           "garbage first"), so every kind is sent at least once.

Greedy answers of the lossless methods (ar, redrafter, auto, triforce) to one prompt must agree
with each other (the shorter a prefix of the longer), whatever ran beside them. Recorded: the
server's resident memory (VmRSS) after the warm-up (a request per method), every 10 s and at
the end; requests by kind and outcome; latencies; /health at the end (nothing waiting, running
or stalled, polled for up to 30 s while left requests are cancelled). Exits non-zero on any 5xx,
timeout, error chunk, bad answer, garbage that was not refused, or a server not idle at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from serve_load import QUESTIONS, free_port, percentile, start

WANTED_METHODS = ["ar", "redrafter", "triforce", "apar", "auto"]
LOSSLESS = {"ar", "redrafter", "auto", "triforce"}  # greedy: the base model's own answer
MAX_TOKENS = [8, 16, 32, 48]  # few sizes, so greedy answers to one prompt can be compared
# outcomes that are as they should be; a body past the size limit may be answered (413) or the
# connection closed while it is still being sent
FINE = ("ok", "refused", "left", "closed while sending")


def rss_kib(pid: int) -> int:
    """The process's resident memory in KiB (/proc, else ps)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out) if out else -1


def get_json(port: int, path: str, timeout: float = 10.0) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path)
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


BAD_JSON = [b"", b"{", b'{"messages": [', b"[1, 2", b"null", b"5", b'"hi"', b"[]", b"\xff\xfe\x00",
            b"{'messages': 1}", b'{"messages": [{"role": "user", "content": "hi"}],}']
DEEP = b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
TOO_BIG = b'{"messages": "' + b"x" * (5 << 20) + b'"}'  # past the server's 4 MiB limit


def fixed_garbage():
    """(label, path, raw body): every fixed body once (the preflight's first)."""
    return [("invalid JSON", "/v1/chat/completions", raw) for raw in BAD_JSON] + \
        [("deep nesting", "/v1/chat/completions", DEEP), ("body past the limit", "/v1/chat/completions", TOO_BIG)]


def garbage_body(rng: random.Random, model: str):
    """(label, path, raw body) that the server must refuse with a 4xx."""
    normal = {"model": model, "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": 8}
    wrong = {
        "messages": ["hi", 5, None, [], [5], [{"role": "robot", "content": "hi"}], [{"content": "hi"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user", "content": {"text": "hi"}}]],
        "max_tokens": [0, -1, 10**30, -10**30, 2.5, "12", True, [3], float("nan"), float("inf")],
        "temperature": [-0.1, 2.01, 1e308 * 10, float("nan"), "0.7", [0.7]],
        "top_p": [0, 1.0001, -1, "1"],
        "seed": [-1, 1.5, "3", True],
        "n": [2, 0, "1"],
        "stop": [5, ["a"] * 5, "x" * 300, [None]],
        "stream": ["yes", 1, []],
        "stream_options": ["x", {"include_usage": "yes"}],
        "method": ["nope", "", 5, "AR", "redrafter "],
        "model": ["gpt-9", 5],
        "beam_width": [10**12, -10**12, 0, 17, "3", 1.5],
        "budget": [10**30, -1, "big"],
        "max_threads": [10**9, 0, "x"],
    }
    kind = rng.random()
    if kind < 0.2:
        return "invalid JSON", "/v1/chat/completions", rng.choice(BAD_JSON)
    if kind < 0.25:
        return "deep nesting", "/v1/chat/completions", DEEP
    if kind < 0.28:
        return "body past the limit", "/v1/chat/completions", TOO_BIG
    if kind < 0.38:
        return "completion prompt", "/v1/completions", json.dumps(
            {"model": model, "prompt": rng.choice([5, None, "", [1, 2], {"a": 1}]), "max_tokens": 8}).encode()
    body = dict(normal)
    fields = rng.sample(sorted(wrong), rng.randint(1, 2))
    for field in fields:
        body[field] = rng.choice(wrong[field])
    if rng.random() < 0.3:  # fields the API does not know, beside the bad value
        body.update({"frobnicate": rng.choice([1, "x", None, [1] * 10]), "logit_bias_x": {"1": 10**30}})
        fields.append("unknown fields")
    if rng.random() < 0.3:
        body["stream"] = True if "stream" not in fields else body["stream"]
    label = "huge number" if any(isinstance(body.get(f), (int, float)) and not isinstance(body.get(f), bool)
                                 and abs(body[f]) > 1e6 for f in fields if f in body) else "wrong value"
    if "unknown fields" in fields:
        label += " + unknown fields"
    return label, "/v1/chat/completions", json.dumps(body).encode()  # NaN/Infinity as JSON's common extension


class Soak:
    def __init__(self, args, port: int, model: str, methods):
        self.args, self.port, self.model, self.methods = args, port, model, methods
        self.lock = threading.Lock()
        self.counts = Counter()  # (kind, detail, outcome) -> n
        self.latency = {}  # good requests: method -> [seconds]
        self.failures = []  # what went wrong, with the body
        self.greedy = {}  # (endpoint, question) -> [(method, max_tokens, text)]

    def record(self, kind: str, detail: str, outcome: str, body: bytes = b"", why: str = "") -> None:
        with self.lock:
            self.counts[(kind, detail, outcome)] += 1
            if outcome not in FINE:
                self.failures.append(dict(kind=kind, detail=detail, outcome=outcome, why=why[:500],
                                          body=body[:300].decode("utf-8", "replace")))

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.args.timeout)

    def good_body(self, rng: random.Random):
        method = rng.choice(self.methods)
        question = rng.choice(QUESTIONS)
        chat = rng.random() >= 0.1
        body = {"model": self.model, "max_tokens": rng.choice(MAX_TOKENS), "method": method,
                "stream": rng.random() < 0.5}
        if chat:
            body["messages"] = [{"role": "user", "content": question}]
        else:
            body["prompt"] = question
        if rng.random() < 0.4:
            body["temperature"] = 0.7
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(1000)
        else:
            body["temperature"] = 0.0
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.15:
            body.update({"user": "soak", "metadata": {"run": "soak"}})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return body, path, question

    def good(self, rng: random.Random) -> None:
        body, path, question = self.good_body(rng)
        raw, method = json.dumps(body).encode(), body["method"]
        detail = f"{method} {'stream' if body['stream'] else 'whole'} {'greedy' if body['temperature'] == 0 else 'sampled'}"
        begin = time.monotonic()
        connection = self.connect()
        try:
            connection.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                payload = response.read()
                outcome = "5xx" if response.status >= 500 else f"http {response.status}"
                return self.record("good", detail, outcome, raw, payload[:300].decode("utf-8", "replace"))
            if body["stream"]:
                text, finish, tokens, problem = self.read_stream(response, begin, path)
            else:
                reply = json.loads(response.read())
                choice = reply["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                finish, tokens, problem = choice["finish_reason"], reply["usage"]["completion_tokens"], ""
        except (socket.timeout, TimeoutError):
            return self.record("good", detail, "timeout", raw, f"no answer in {self.args.timeout:g} s")
        except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
            return self.record("good", detail, "broken", raw, f"{type(error).__name__}: {error}")
        finally:
            connection.close()
        took = time.monotonic() - begin
        if not problem and took > self.args.timeout:
            problem = f"timeout: took {took:.0f} s"
        if not problem and finish not in ("stop", "length"):
            problem = f"finish_reason {finish!r}"
        if not problem and tokens is not None and not 0 <= tokens <= body["max_tokens"]:
            problem = f"{tokens} tokens for max_tokens {body['max_tokens']}"
        if not problem and finish == "length" and tokens == 0:
            problem = "finish_reason length with no tokens"
        if problem:
            return self.record("good", detail, "timeout" if problem.startswith("timeout") else "bad answer", raw, problem)
        with self.lock:
            self.latency.setdefault(method, []).append(took)
            if body["temperature"] == 0 and method in LOSSLESS:
                self.greedy.setdefault((path, question), []).append((method, body["max_tokens"], text))
        self.record("good", detail, "ok")

    def read_stream(self, response, begin: float, path: str):
        """(text, finish_reason, completion tokens or None, problem) of a server-sent-event stream."""
        text, finish, tokens, done = [], None, None, False
        while True:
            if time.monotonic() - begin > self.args.timeout:
                return "".join(text), finish, tokens, f"timeout: streaming past {self.args.timeout:g} s"
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return "".join(text), finish, tokens, f"error chunk: {data[:300].decode('utf-8', 'replace')}"
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                text.append(piece or "")
                finish = choice.get("finish_reason") or finish
        return "".join(text), finish, tokens, "" if done else "the stream ended without [DONE]"

    def leave(self, rng: random.Random) -> None:
        body, path, _ = self.good_body(rng)
        body["max_tokens"] = 48  # long enough to still be decoding when the client goes
        raw = json.dumps(body).encode()
        detail = f"{body['method']} {'after the first chunk' if body['stream'] else 'mid-answer (whole)'}"
        connection, sock, response = self.connect(), None, None
        try:
            connection.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            sock = connection.sock
            if body["stream"]:
                response = connection.getresponse()
                if response.status != 200:
                    response.read()
                    return self.record("leave", detail, "5xx" if response.status >= 500 else f"http {response.status}", raw)
                begin = time.monotonic()
                while time.monotonic() - begin < self.args.timeout:  # up to the first chunk with text
                    line = response.readline()
                    if line.startswith(b"data: ") and b'"error"' in line:
                        return self.record("leave", detail, "error chunk", raw, line[:300].decode("utf-8", "replace"))
                    if not line or (line.startswith(b"data: ") and (b'"content": "' in line and b'"content": ""' not in line
                                                                    or b'"text": "' in line and b'"text": ""' not in line)):
                        break
            else:
                time.sleep(rng.uniform(0.2, 1.5))
        except (socket.timeout, TimeoutError):
            return self.record("leave", detail, "timeout", raw, f"no first chunk in {self.args.timeout:g} s")
        except (OSError, http.client.HTTPException) as error:
            return self.record("leave", detail, "broken", raw, f"{type(error).__name__}: {error}")
        finally:
            if sock is not None:  # a hard close: the server sees the connection go
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if response is not None:
                response.close()
            connection.close()
        self.record("leave", detail, "left")

    def garbage(self, rng: random.Random, kind: str = "garbage", fixed=None) -> None:
        label, path, raw = fixed or garbage_body(rng, self.model)
        connection = self.connect()
        try:
            connection.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
        except (socket.timeout, TimeoutError):
            return self.record(kind, label, "timeout", raw, f"no answer in {self.args.timeout:g} s")
        except (OSError, http.client.HTTPException) as error:
            # a server may close the connection on a body past its limit before reading it all
            outcome = "closed while sending" if label == "body past the limit" else "broken"
            return self.record(kind, label, outcome, raw, f"{type(error).__name__}: {error}")
        finally:
            connection.close()
        if 400 <= response.status < 500:
            try:
                ok = set(json.loads(payload)["error"]) >= {"message", "type"}
            except (ValueError, KeyError, TypeError):
                ok = False
            return self.record(kind, label, "refused" if ok else "4xx not OpenAI-shaped", raw,
                               payload[:300].decode("utf-8", "replace"))
        outcome = "5xx" if response.status >= 500 else f"accepted ({response.status})"
        self.record(kind, label, outcome, raw, payload[:300].decode("utf-8", "replace"))

    def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        order = []  # in every 10 of a client's requests: one garbage, one that leaves, 8 good, shuffled
        while time.monotonic() < deadline:
            if not order:
                order = ["garbage", "leave"] + ["good"] * 8
                rng.shuffle(order)
            kind = order.pop()
            if kind == "garbage":
                self.garbage(rng)
            elif kind == "leave":
                self.leave(rng)
            else:
                self.good(rng)

    def greedy_disagreements(self):
        """Greedy answers to one prompt that are not prefixes of the longest one."""
        out = []
        for (path, question), answers in self.greedy.items():
            longest = max(answers, key=lambda a: (a[1], len(a[2])))
            for method, max_tokens, text in answers:
                if not longest[2].startswith(text):
                    out.append(dict(path=path, question=question, method=method, max_tokens=max_tokens, text=text,
                                    longest_method=longest[0], longest=longest[2]))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds any one request may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(WANTED_METHODS),
                        help="methods to mix (those the server does not support are left out)")
    parser.add_argument("--preflight", type=int, default=60,
                        help="random garbage bodies sent one after another before the soak, after one of each "
                             "fixed kind (invalid JSON, deep nesting, a body past the limit)")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args()
    from mlx_specdec.model.default import ensure_default_model

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="serve-soak-", suffix=".log", delete=False)
    process = start("ours", port, args.max_batch, Path(ensure_default_model()), log=log)
    rss, failures_at_end, health = [], [], None
    try:
        listing = get_json(port, "/v1/models")["data"][0]
        model = listing["id"]
        support = listing.get("methods", {})
        methods = [m for m in args.methods.split(",") if support.get(m, {}).get("supported")]
        left_out = {m: support.get(m, {}).get("why_not", "not listed") for m in args.methods.split(",")
                    if m not in methods}
        print(f"methods: {', '.join(methods)}" + "".join(f"; {m} left out: {why}" for m, why in left_out.items()),
              flush=True)
        soak = Soak(args, port, model, methods)
        for method in methods:  # each method's first use loads what it needs: not part of the soak's timing
            connection = soak.connect()
            connection.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                               body=json.dumps({"model": model, "method": method, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": QUESTIONS[0]}]}).encode())
            status = connection.getresponse().status
            connection.close()
            if status != 200:
                raise SystemExit(f"the warm-up request with {method} got {status}")
        # every kind of garbage at least once, whatever the clients' dice give (not timed, not in the mix)
        rng = random.Random(args.seed)
        for fixed in fixed_garbage():
            soak.garbage(rng, kind="garbage first", fixed=fixed)
        for _ in range(args.preflight):
            soak.garbage(rng, kind="garbage first")
        start_at = time.monotonic()
        rss.append((0.0, rss_kib(process.pid)))
        deadline = start_at + args.minutes * 60
        threads = [threading.Thread(target=soak.client, args=(i, deadline), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(1.0)
            if process.poll() is not None:
                raise SystemExit(f"the server exited with {process.returncode} (log: {log.name})")
            if time.monotonic() - start_at >= 10 * len(rss):
                rss.append((round(time.monotonic() - start_at, 1), rss_kib(process.pid)))
            if time.monotonic() > deadline + args.timeout + 30:
                failures_at_end.append("a client thread did not finish (a request hung past its timeout)")
                break
        soaked = time.monotonic() - start_at
        for _ in range(30):  # left requests are cancelled at their next event
            health = get_json(port, "/health")
            if health.get("running") == 0 and health.get("waiting") == 0:
                break
            time.sleep(1.0)
        rss.append((round(time.monotonic() - start_at, 1), rss_kib(process.pid)))
        if health.get("running") or health.get("waiting") or health.get("stalled"):
            failures_at_end.append(f"not idle at the end: {health}")
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            failures_at_end.append("the server did not stop within 30 s of SIGTERM")
        log.close()

    counts = soak.counts
    by_kind = Counter()
    for (kind, _, outcome), n in counts.items():
        by_kind[(kind, outcome)] += n
    latencies = [s for values in soak.latency.values() for s in values]
    disagreements = soak.greedy_disagreements()
    bad = list(soak.failures)
    fivexx = sum(n for (_, _, outcome), n in counts.items() if outcome == "5xx")
    timeouts = sum(n for (_, _, outcome), n in counts.items() if outcome == "timeout")
    server_log = Path(log.name).read_text(errors="replace")
    summary = dict(
        settings=vars(args), methods=methods, left_out=left_out, soaked_s=round(soaked, 1),
        requests=sum(counts.values()), by_kind={f"{k} {o}": n for (k, o), n in sorted(by_kind.items())},
        by_detail={f"{k} | {d} | {o}": n for (k, d, o), n in sorted(counts.items())},
        fivexx=fivexx, timeouts=timeouts, failures=bad, failures_at_end=failures_at_end,
        greedy_compared=sum(len(v) for v in soak.greedy.values()), greedy_disagreements=disagreements,
        latency_s={m: dict(n=len(v), p50=round(statistics.median(v), 2), p95=round(percentile(v, 0.95), 2),
                           max=round(max(v), 2)) for m, v in sorted(soak.latency.items())},
        latency_all_s=dict(p50=round(statistics.median(latencies), 2), p95=round(percentile(latencies, 0.95), 2),
                           max=round(max(latencies), 2)) if latencies else None,
        rss_kib=dict(start=rss[0][1], end=rss[-1][1], max=max(r for _, r in rss), series=rss),
        health_at_end=health,
        server_log_tail=server_log[-3000:])
    print(f"\n{summary['requests']} requests in {soaked:.0f} s from {args.clients} clients "
          f"(max batch {args.max_batch}, timeout {args.timeout:g} s):")
    for (kind, outcome), n in sorted(by_kind.items()):
        print(f"  {kind:13s} {outcome:24s} {n}")
    print("by method and kind:")
    for (kind, detail, outcome), n in sorted(counts.items()):
        print(f"  {kind:13s} {detail:44s} {outcome:20s} {n}")
    for method, lat in summary["latency_s"].items():
        print(f"  latency {method}: n {lat['n']}, p50 {lat['p50']} s, p95 {lat['p95']} s, max {lat['max']} s")
    print(f"5xx: {fivexx}, timeouts: {timeouts}, other failures: {len(bad) - fivexx - timeouts}")
    print(f"greedy answers compared: {summary['greedy_compared']}, disagreeing: {len(disagreements)}")
    print(f"RSS: {rss[0][1] / 1024:.0f} MiB after the warm-up, {rss[-1][1] / 1024:.0f} MiB at the end, "
          f"{summary['rss_kib']['max'] / 1024:.0f} MiB at most")
    print(f"/health at the end: {health}")
    for failure in bad[:10]:
        print(f"  FAILED: {failure}")
    for line in failures_at_end:
        print(f"  FAILED: {line}")
    for d in disagreements[:5]:
        print(f"  GREEDY DISAGREES: {d}")
    if "Traceback" in server_log or "warning:" in server_log:
        print(f"server log ({log.name}) has a traceback or warning; its tail:\n{server_log[-3000:]}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if bad or failures_at_end or disagreements:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
