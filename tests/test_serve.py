"""`mlx-specdec serve`: the real server (uvicorn) on a free localhost port, talked to with the
official `openai` client and raw HTTP: answers equal `generate`'s, streaming and not, every
method, stop strings, OpenAI-shaped errors, the API key, a client that leaves mid-stream, and a
bounded concurrent load. Every request and the server itself have timeouts."""

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

from conftest import save_tiny_model_dir  # noqa: E402

KEY = "test-key"
PROMPT = "w3 w5 w7 w9 w3 w5 w7"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from mlx_specdec.redrafter_head.model import save_drafter
    from test_redrafter import random_head

    root = tmp_path_factory.mktemp("serve")
    model = save_tiny_model_dir(root / "tiny", seed=5)  # served as "tiny"
    drafter = save_drafter(random_head(None, draft_vocab=97), root / "head")  # a random ReDrafter head
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "mlx_specdec.cli", "serve", "-m", str(model), "--port", str(port),
                                "--api-key", KEY, "--drafter", str(drafter), "--max-batch", "4"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except OSError:
            assert process.poll() is None, process.stdout.read()
            time.sleep(0.2)
    else:
        process.kill()
        pytest.fail("the server did not start")
    yield dict(base=base, model=str(model), process=process, drafter=str(drafter))
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


def client(server, key=KEY):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=key, timeout=60, max_retries=0)


def generate(server, *extra):
    out = subprocess.run([sys.executable, "-m", "mlx_specdec.cli", "generate", "-m", server["model"], "-p", PROMPT,
                          "--max-tokens", "12", "--temp", "0", *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.rstrip("\n")


def test_chat_answers_equal_generate_streaming_and_not(server):
    want = generate(server)
    c = client(server)
    messages = [{"role": "user", "content": PROMPT}]
    reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == want
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 0
    assert reply.choices[0].finish_reason == "length"
    assert reply.model_extra["sampling"] == {"temperature": 0.0}  # the sampling in force
    sampled = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, presence_penalty=0.5)
    assert sampled.model_extra["sampling"]["presence_penalty"] == 0.5  # the rest: the model's defaults
    chunks = list(c.chat.completions.create(model="tiny", temperature=0, messages=messages, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == 12
    assert [m.id for m in c.models.list().data] == ["tiny"]
    methods = c.models.list().data[0].model_extra["methods"]
    assert methods["redrafter"] == {"supported": True} and methods["ar"] == {"supported": True}
    assert not methods["apar"]["supported"] and "control tokens" in methods["apar"]["why_not"]


@pytest.mark.parametrize("method,options", [("mlx-lm", {}), ("triforce", {"budget": 16, "gamma": 3})])
def test_other_methods_by_the_method_field_write_the_same_answer(server, method, options):
    want = generate(server)
    reply = client(server).chat.completions.create(
        model="tiny", temperature=0, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
        extra_body={"method": method, **options})
    assert reply.choices[0].message.content == want
    assert reply.model_extra["speculation"]["method"] == method


def test_the_default_method_auto_says_what_it_chose(server):
    """`--method auto` (the default): the answer is the chosen method's (greedy: `ar`'s), and
    `speculation` names the method that ran and why it was chosen."""
    for _ in range(3):  # the first answers measure; later ones choose from what was measured
        reply = client(server).chat.completions.create(model="tiny", temperature=0, max_tokens=12,
                                                       messages=[{"role": "user", "content": PROMPT}])
        assert reply.choices[0].message.content == generate(server)
        speculation = reply.model_extra["speculation"]
        assert speculation["auto"]["chose"] == speculation["method"] in ("ar", "redrafter")
        assert speculation["auto"]["why"]


def test_an_answer_states_its_speedup_over_plain_decoding_like_for_like(server):
    """The server warmed up at the model's default sampling (T 0.7, top-p 0.9 here), timing plain
    decoding there: a speculative answer in that mode near that context says its rate over plain
    decoding's; a plain answer says none (it is the plain rate)."""
    messages = [{"role": "user", "content": " ".join(f"w{3 + i % 90}" for i in range(100))}]
    sampled = dict(model="tiny", messages=messages, max_tokens=40, temperature=0.7, top_p=0.9, seed=1)
    spec = client(server).chat.completions.create(**sampled, extra_body={"method": "redrafter"})
    speculation = spec.model_extra["speculation"]
    assert speculation["plain_tps"] > 0 and speculation["speedup_vs_plain"] > 0
    plain = client(server).chat.completions.create(**sampled, extra_body={"method": "ar"})
    assert "speedup_vs_plain" not in plain.model_extra["speculation"]


def test_a_method_the_model_cannot_run_is_a_400_and_the_server_goes_on(server):
    with pytest.raises(openai.BadRequestError, match="apar needs a model with"):
        client(server).chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=4, extra_body={"method": "apar"})
    assert client(server).chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=12).choices[0].message.content == generate(server)


def test_completions_and_stop_strings(server):
    c = client(server)
    raw = c.completions.create(model="tiny", temperature=0, prompt=PROMPT, max_tokens=12)
    assert raw.choices[0].text and raw.usage.prompt_tokens == len(PROMPT.split())
    messages = [{"role": "user", "content": PROMPT}]
    text = c.chat.completions.create(model="tiny", temperature=0, messages=messages, max_tokens=12).choices[0].message.content
    words = text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut = c.chat.completions.create(model="tiny", temperature=0, messages=messages, max_tokens=12, stop=stop)
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    # a stop string across two tokens ("5 w7" ends one word and begins the next): nothing of it leaks,
    # streamed or not
    spanning = words[1][-1:] + " " + words[2][:2]
    want = text[: text.index(spanning)]
    cut = c.chat.completions.create(model="tiny", temperature=0, messages=messages, max_tokens=12, stop=[spanning])
    assert cut.choices[0].message.content == want
    chunks = c.chat.completions.create(model="tiny", temperature=0, messages=messages, max_tokens=12, stop=[spanning], stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want


def test_the_model_may_be_named_as_the_server_was_started(server):
    reply = client(server).chat.completions.create(model=server["model"], temperature=0, messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=3)
    assert reply.model == "tiny" and reply.choices[0].message.content


def post(server, body, key=KEY, raw=None):
    """(status, JSON body) of a raw POST to /v1/chat/completions."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(server["base"] + "/v1/chat/completions", method="POST", headers=headers,
                                     data=raw if raw is not None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("body,raw,key,status,words", [
    (None, b"{not json", KEY, 400, "not valid JSON"),
    ({"messages": []}, None, KEY, 400, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": 5}]}, None, KEY, 400, "content must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}], "method": "nope"}, None, KEY, 400, "unknown method 'nope'"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None, KEY, 400, "'max_tokens' takes a whole number from 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, None, KEY, 400, "'temperature' takes a number"),
    ({"messages": [{"role": "user", "content": "hi"}], "method": "triforce", "gamma": 10**9}, None, KEY, 400,
     "'gamma' takes a whole number from 1 to 64"),
    ({"messages": [{"role": "user", "content": "hi"}], "beam_width": "abc"}, None, KEY, 400, "'beam_width' takes"),
    ({"messages": [{"role": "user", "content": "hi"}], "verify_cost": "maybe"}, None, KEY, 400,
     "'verify_cost' is on or off or margin"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, None, KEY, 400, "'n' must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, None, KEY, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "w1 " * 600}]}, None, KEY, 413, "context window"),
    ({"messages": [{"role": "user", "content": "hi"}]}, None, None, 401, "API key"),
    ({"messages": [{"role": "user", "content": "hi"}]}, None, "wrong", 401, "API key"),
])
def test_bad_requests_get_openai_shaped_errors_and_the_server_keeps_serving(server, body, raw, key, status, words):
    code, reply = post(server, body, key=key, raw=raw)
    assert code == status
    error = reply["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert client(server).chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": "w4"}],
                                                  max_tokens=2).choices[0].message.content


def test_a_client_that_leaves_mid_stream_does_not_disturb_the_next_request(server):
    want = generate(server)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 400, "stream": True, "temperature": 0}
    host, port = server["base"].rsplit("//", 1)[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = connection.getresponse()
    seen = b""
    while b'"content": "w' not in seen:  # the first tokens arrived: leave
        seen += response.read1(256)
    connection.sock.close()  # gone mid-stream, without reading the rest
    reply = client(server).chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=12)
    assert reply.choices[0].message.content == want


def test_concurrent_clients_each_get_their_own_complete_answer(server):
    """16 clients x 4 requests (bounded, localhost): every answer complete and its own."""
    prompts = [f"w{3 + i % 40} w{7 + i % 30} w{11 + i % 20}" for i in range(16)]
    c = client(server)
    want = {p: c.chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": p}],
                                         max_tokens=6).choices[0].message.content for p in set(prompts)}

    def ask(prompt):
        out = []
        for _ in range(4):
            stream = c.chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=6, stream=True)
            out.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
        return prompt, out

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, prompts, timeout=240))
    for prompt, answers in results:
        assert answers == [want[prompt]] * 4


def test_concurrent_redrafter_requests_are_decoded_together_each_with_its_own_answer(server):
    """While one long request decodes, six redrafter requests with their own max_tokens and stop
    strings queue up; they join a continuous batch of at most --max-batch 4 rows, and every
    answer is the one `generate` writes for it alone."""
    prompts = [f"w{5 + 7 * i} w{9 + 3 * i} w{2 + i}" for i in range(6)]
    limits = [4, 9, 6, 12, 5, 10]
    drafter = ("--drafter", server["drafter"], "--method", "redrafter")
    want = [generate(server, *drafter, "--max-tokens", str(m), "-p", p) for p, m in zip(prompts, limits)]
    c = client(server)

    def ask(i):
        if i < 0:  # the long request that keeps the generation thread busy while the others queue
            return c.chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=400)
        time.sleep(0.3)
        return c.chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": prompts[i]}],
                                         max_tokens=limits[i], extra_body={"method": "redrafter"})

    with ThreadPoolExecutor(7) as pool:
        replies = list(pool.map(ask, [-1] + list(range(6)), timeout=240))[1:]
    assert [r.choices[0].message.content for r in replies] == want
    assert [r.usage.completion_tokens for r in replies] == [len(w.split()) for w in want]
    # the most rows its batch held while each was in it
    sizes = [r.model_extra["speculation"]["batch_rows"] for r in replies]
    assert max(sizes) > 1 and max(sizes) <= 4, sizes
    stop = " " + want[3].split()[4]  # a row's stop string ends that row only
    cut = c.chat.completions.create(model="tiny", temperature=0, messages=[{"role": "user", "content": prompts[3]}], max_tokens=12,
                                    stop=stop, extra_body={"method": "redrafter"})
    assert cut.choices[0].message.content == want[3][: want[3].index(stop)]


@pytest.mark.slow
def test_the_default_model_serves_redrafter_and_apar():
    """The real default model: redrafter's answer is generate's (lossless), apar answers with its
    threads in `speculation`."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "mlx_specdec.cli", "serve", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert process.poll() is None, process.stdout.read()
                time.sleep(0.5)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        question = "Give three tips for staying focused while studying."
        want = subprocess.run([sys.executable, "-m", "mlx_specdec.cli", "generate", "-p", question, "--max-tokens", "24", "--temp", "0"],
                              capture_output=True, text=True, timeout=120).stdout.rstrip("\n")
        messages = [{"role": "user", "content": question}]
        spec = c.chat.completions.create(model="SmolLM2-135M-Instruct-f16", messages=messages, max_tokens=24,
                                         temperature=0, extra_body={"method": "redrafter"})
        assert spec.choices[0].message.content == want
        assert spec.model_extra["speculation"]["tokens_per_forward"] > 1.0
        apar = c.chat.completions.create(model="SmolLM2-135M-Instruct-f16", messages=messages, max_tokens=24,
                                         extra_body={"method": "apar"})
        assert apar.choices[0].message.content and apar.model_extra["speculation"]["method"] == "apar"
    finally:
        process.terminate()
        process.wait(timeout=10)


def start_server(model, port, *extra, wait_s: float = 60):
    process = subprocess.Popen([sys.executable, "-m", "mlx_specdec.cli", "serve", "-m", model, "--port", str(port), *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process
        except OSError:
            if process.poll() is not None:
                return process
            time.sleep(0.2)
    process.kill()
    pytest.fail("the server did not start")


def test_ctrl_c_mid_answer_stops_the_server_at_once_and_cleanly(server):
    import signal

    port = free_port()
    process = start_server(server["model"], port)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 480, "stream": True}
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert b"data:" in response.read1(256)  # an answer is streaming
        started = time.time()
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=20)
        assert process.returncode == 0 and time.time() - started < 10, out
        assert out.rstrip().endswith("stopped") and "Traceback" not in out, out
    finally:
        if process.poll() is None:
            process.kill()


def test_a_port_in_use_is_one_clear_line(server):
    port = int(server["base"].rsplit(":", 1)[1])
    process = start_server(server["model"], port)
    out, _ = process.communicate(timeout=30)
    assert process.returncode != 0 and f"port {port}" in out and "Traceback" not in out, out


def test_the_watchdog_reports_a_request_that_makes_no_progress(capsys):
    """A generation step that never comes back is reported once, on stderr and in /health."""
    import asyncio
    import threading

    from mlx_specdec.decoding import GenerationParams
    from mlx_specdec.serve.worker import GenerationWorker, Job

    release = threading.Event()

    class Stuck:
        def generate_ids(self, prompt_ids, method, params):
            yield from ()
            release.wait(10)  # a step that does not come back (until the test lets it)

    async def run():
        worker = GenerationWorker(lambda: Stuck(), stall_s=0.2)
        worker.wait_ready()
        job = worker.submit(Job([1, 2, 3], "mlx-lm", GenerationParams(), asyncio.get_running_loop()))
        for _ in range(100):
            if job.stalled:
                break
            await asyncio.sleep(0.05)
        assert job.stalled and worker.stalled == 1
        release.set()
        worker.stop()
        worker.join(5)

    asyncio.run(run())
    assert "has made no progress" in capsys.readouterr().err
