"""The server's prompt cache (cache/prefix.py through `mlx-specdec serve`): a conversation's next
turn resumes from its last prompt, `usage.prompt_tokens_details.cached_tokens` says how many
prompt tokens were not prefilled again (streamed usage chunk too), a method that cannot resume
reports 0, and the answers are the ones written without the cache."""

import argparse
import json
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from conftest import save_tiny_model_dir  # noqa: E402
from test_serve import free_port, start_server  # noqa: E402

from mlx_specdec.cli.serve import _size  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = save_tiny_model_dir(tmp_path_factory.mktemp("prompt-cache") / "tiny", seed=5)
    port = free_port()
    process = start_server(str(model), port, "--method", "ar", "--prompt-cache-entries", "3")
    assert process.poll() is None, process.stdout.read()
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=10)


def ask(base, messages, method="ar", stream=False):
    """(answer, usage) of one greedy chat request."""
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)
    kwargs = dict(model="tiny", temperature=0, messages=messages, max_tokens=8, extra_body={"method": method})
    if not stream:
        reply = c.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.usage
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks[-1].usage


def test_each_conversation_resumes_from_its_last_prompt_and_answers_as_without_the_cache(served):
    conversations = {name: [{"role": "user", "content": opening}]
                     for name, opening in (("a", "w3 w5 w7 w9 w3 w5 w7 w11"), ("b", "w4 w6 w8 w10 w12"))}
    last_prompt = {}
    for turn in range(3):
        for name, messages in conversations.items():
            without, plain = ask(served, messages, method="mlx-lm")  # mlx-lm's own loop: no prompt cache
            assert plain.prompt_tokens_details.cached_tokens == 0
            answer, usage = ask(served, messages, stream=turn == 2)
            assert answer == without
            assert usage.prompt_tokens == plain.prompt_tokens
            cached = usage.prompt_tokens_details.cached_tokens
            if name in last_prompt:  # its own last prompt but that prompt's last token (fed again to decode)
                assert cached == last_prompt[name] - 1, (name, turn)
            elif last_prompt:  # a new conversation: the chat template's opening it shares with "a"
                assert 0 < cached < last_prompt["a"] - 1
            else:  # the server's first request
                assert cached == 0
            last_prompt[name] = usage.prompt_tokens
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"w{20 + turn} w30"}]
    with urllib.request.urlopen(served + "/health", timeout=10) as response:
        cache = json.loads(response.read())["prompt_cache"]
    assert cache["entries"] == 2 and 0 < cache["bytes"] <= cache["max_bytes"]


def test_the_prompt_cache_size_takes_bytes_or_units():
    assert _size("1048576") == 1 << 20 and _size("512M") == 512 << 20 and _size("2G") == _size("2GiB") == 2 << 30
    assert _size("1.5k") == 1536 and _size("0") == 0
    for bad in ("", "G", "-1", "lots", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            _size(bad)
