"""The embedded default model, for real: GGUF conversion, tokenizer, greedy parity with mlx-lm."""

import json
import re

import pytest

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine
from mlx_specdec.model.default import ensure_default_model, fetch_gguf
from mlx_specdec.model.device import on_cpu
from mlx_specdec.model.gguf import convert_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return Engine.load("default")


def test_gguf_converts_to_a_loadable_llama(tmp_path):
    out = tmp_path / "smol-4bit"
    convert_gguf(fetch_gguf(quiet=True), out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rope_traditional"] is True  # GGUF keeps Meta's interleaved q/k rows
    assert config["quantization"]["bits"] == 4
    engine = Engine.load(str(out))
    assert engine.lm.bits == 4
    answer = "".join(e.text for e in engine.generate("What is the capital of France?",
                                                     params=GenerationParams(max_tokens=16)))
    assert "Paris" in answer


def test_tokenizer_round_trips(engine):
    tok = engine.lm.tokenizer
    text = "Hello, world! Ünïcödé 🚀 and code: def f(x):\n    return x**2  # 12345\n\n\tTabs"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids[:3] == [19556, 28, 905]  # "Hello", ",", " world" in SmolLM2's vocabulary
    assert len(tok.encode("12345", add_special_tokens=False)) == 5  # digits split one by one
    # every whole-character, digit-free, non-special vocabulary entry encodes back to itself
    checked = 0
    for token_id in range(0, 49152, 7):
        piece = tok.decode([token_id])
        if "\ufffd" in piece or re.search(r"\d", piece) or piece.startswith("<"):
            continue
        assert tok.encode(piece, add_special_tokens=False) == [token_id], (token_id, piece)
        checked += 1
    assert checked > 6500


def test_chat_template_comes_from_the_gguf(engine):
    text = engine.lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                    add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert engine.lm.eos_token_ids == {2}  # <|im_end|>


@pytest.mark.parametrize("prompt", [
    "Give me three tips for staying healthy.",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
])
def test_greedy_ar_equals_mlx_lm_on_the_default_model(engine, prompt):
    params = GenerationParams(max_tokens=40)
    runs = {}
    for method in ("ar", "mlx-lm"):
        events = list(engine.generate(prompt, method=method, params=params))
        runs[method] = [t for e in events if e.kind == "token" for t in e.tokens]
    assert len(runs["ar"]) > 10
    assert runs["ar"] == runs["mlx-lm"]


def test_default_model_answers(engine):
    answer = "".join(e.text for e in engine.generate("What is the capital of France?",
                                                     params=GenerationParams(max_tokens=16)))
    assert "Paris" in answer
    assert engine.lm.dtype == ("float32" if on_cpu() else engine.lm.config["torch_dtype"])  # the CPU's, or the model's


def test_default_model_directories_are_cached():
    first = ensure_default_model("f16", quiet=True)
    assert ensure_default_model("f16", quiet=True) == first
    assert (first / "config.json").exists() and list(first.glob("*.safetensors"))


@pytest.mark.skipif(not __import__("mlx_specdec._blas", fromlist=["x"]).small_gemm, reason="needs the small-row GEMM")
@pytest.mark.parametrize("context", [40, 1100])  # below and above attention.GROUPED_MIN_KEYS (1,024)
def test_on_the_cpu_a_verify_gives_the_one_token_steps_logits_bit_for_bit(engine, context):
    """float32 on the CPU: the small-row GEMM sums each row alike whatever the row count, and
    `exact_attention` is MLX's attention whatever the query count, so a T-token verify (a chain at
    contiguous positions, or the same chain as a tree at per-token positions) gives each position
    the logits the one-token steps give it: speculation is then lossless bit for bit, not only up
    to near-ties."""
    import mlx.core as mx
    import numpy as np

    from mlx_specdec import masks
    from mlx_specdec.cache import ContiguousKVCache
    from mlx_specdec.model.forward import forward

    from mlx_specdec.model import attention

    if mx.default_device() != mx.cpu or not attention.EXACT_ATTENTION:
        pytest.skip("the x86-64 CPU's arithmetic")
    model = engine.lm.model
    prompt = [(i * 37 + 11) % 40000 + 100 for i in range(context)]
    cache = ContiguousKVCache.for_model(model)
    forward(model, mx.array([prompt]), cache, logits_for="none")
    start, token, tokens, steps = cache.offset, prompt[-1], [], []
    for _ in range(5):  # `ar`: one token a forward
        logits = forward(model, mx.array([[token]]), cache).logits[0, -1]
        token = int(mx.argmax(logits))
        tokens.append(token)
        steps.append(np.array(logits))
    chain = [prompt[-1]] + tokens[:-1]
    for tree in (False, True):
        cache.rollback_to(start)
        where = {}
        if tree:
            parents = [list(range(-1, len(chain) - 1))]
            where = dict(positions=masks.ragged_tree_positions(np.array([start]), parents, len(chain)),
                         mask=masks.tree_tail_mask(parents, len(chain)))
        verify = np.array(forward(model, mx.array([chain]), cache, **where).logits[0])
        for i, step in enumerate(steps):
            assert np.array_equal(verify[i].view(np.uint32), step.view(np.uint32)), (tree, i)
