"""A client cannot break the server: over a thousand generated hostile bodies (wrong types at every
level, huge, negative and non-finite numbers, deep nesting, huge bodies, bad JSON, unknown methods,
every method setting out of bounds) each get a 4xx in OpenAI's error shape, never a 5xx, and a
normal request still works afterwards. Bounded: one connection, a timeout on every request."""

from __future__ import annotations

import http.client
import json
import random

import pytest

pytest.importorskip("openai")

from test_serve import KEY, PROMPT, client, server  # noqa: E402,F401  (the real server on a tiny model)

from mlx_specdec.settings import METHODS, method_settings  # noqa: E402

NORMAL = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
WRONG_TYPES = ["x", 1.5, -7, True, None, [], [1, "a"], {}, {"a": {"b": []}}]


def hostile_values(field: str):
    """Values `field` refuses, whatever the rest of the body."""
    numbers = {
        "max_tokens": [0, -1, -10**30, 10**30, 2.5, float("nan"), float("inf"), "12", True, [3], {"n": 3}],
        "max_completion_tokens": [0, -5, 10**30, 1.25, float("-inf"), "7", False, [], {}],
        "temperature": [-0.1, 2.01, 1e308 * 10, float("nan"), "0.7", True, [0.7], {"t": 1}],
        "top_p": [0, -1, 1.0001, float("nan"), "1", False, [1], {}],
        "seed": [-1, 1.5, float("nan"), "3", True, [3], {}],
        "n": [0, 2, -1, 1.0, "1", True, [1], {}],
        "stop": [5, 1.5, True, [1], ["a"] * 5, "x" * 300, [None], {"a": "b"}, [["a"]]],
        "stream": ["yes", 1, 0.0, [], {}, "true"],
        "stream_options": ["x", 5, [], True, {"include_usage": "yes"}, {"include_usage": 1}],
        "method": ["nope", "", 5, [], {}, True, "AR", "redrafter "],
        "model": ["gpt-9", 5, [], {}, True, "tiny2"],
        "messages": ["hi", 5, None, [], [5], ["hi"], [None], [{"role": "robot", "content": "hi"}],
                     [{"content": "hi"}], [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
                     [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [5]}], [{"role": "user", "content": {"text": "hi"}}],
                     [{"role": ["user"], "content": "hi"}], [{"role": "user", "content": "w1 " * 5000}]],
    }
    if field in numbers:
        return numbers[field]
    setting = next(s for _, s in method_settings() if s.name == field)
    bad = ["nonsense", [], {}, "maybe"] if setting.kind in ("bool", "choice") else \
        [10**12, -10**12, float("nan"), float("inf"), "3", [1], {"v": 1}, True]
    if setting.kind in ("int", "float") and setting.high is not None:
        bad.append(setting.high + 1)
    if setting.kind in ("int", "float") and setting.low is not None:
        bad.append(setting.low - 1)
    if setting.kind == "int":
        bad.append(1.5)
    return bad


def hostile_bodies(count: int, seed: int = 0):
    """`count` bodies, each with 1-3 fields set to a value that field refuses (raw bytes)."""
    rng = random.Random(seed)
    fields = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "stop", "stream",
              "stream_options", "method", "model", "messages"] + [s.name for _, s in method_settings()]
    whole = [b"", b"{", b"[1, 2", b"null", b"5", b'"hi"', b"[]", b"\xff\xfe\x00", b"{'a': 1}",
             b"[" * 100_000 + b"]" * 100_000, json.dumps({"messages": [[[[[[]]]]]] * 10}).encode(),
             b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", b" " * (5 << 20)]
    bodies = list(whole)
    while len(bodies) < count:
        body = json.loads(json.dumps(NORMAL))
        for field in rng.sample(fields, rng.randint(1, 3)):
            body[field] = rng.choice(hostile_values(field))
            if field in {s.name for _, s in method_settings()} and rng.random() < 0.5:
                body["method"] = rng.choice([m for m in METHODS if any(s.name == field for s in METHODS[m].settings)])
        bodies.append(json.dumps(body).encode())  # NaN and Infinity as JSON's common extension
    return bodies


def test_a_thousand_hostile_bodies_each_get_a_4xx_and_the_server_goes_on(server):  # noqa: F811
    host, port = server["base"].rsplit("//", 1)[1].split(":")
    statuses, fivexx = {}, []
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    bodies = hostile_bodies(1100)
    for i, raw in enumerate(bodies):
        path = "/v1/chat/completions" if i % 5 else "/v1/completions"
        try:
            connection.request("POST", path, body=raw, headers={"Authorization": f"Bearer {KEY}",
                                                                "Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
        except (http.client.HTTPException, OSError):  # the server may close a connection after a 413
            connection.close()
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            continue
        statuses[response.status] = statuses.get(response.status, 0) + 1
        if not 400 <= response.status < 500:
            fivexx.append((response.status, raw[:200], payload[:200]))
        else:
            error = json.loads(payload)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
    connection.close()
    assert sum(statuses.values()) >= 1000 and not fivexx, (statuses, fivexx[:5])
    reply = client(server).chat.completions.create(model="tiny", messages=NORMAL["messages"], max_tokens=3,
                                                   temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"
