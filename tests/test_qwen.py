"""Qwen2 and Qwen3 through the engine's one forward: logits equal to mlx-lm's own model classes on
the same weights (float32, within 1e-5) over a prompt, decoding steps and a tree verify with
per-token positions and a mask; the loader takes their directories (float32 and mlx-lm's 4-bit
layers) and holds them to the declared switches; and Qwen3's chat template, thinking on and off,
encodes token for token as the tokenizer's own `apply_chat_template`."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_specdec import masks
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.errors import UnsupportedModel
from mlx_specdec.model.architectures import ARCHITECTURES, check_modules
from mlx_specdec.model.forward import forward
from mlx_specdec.model.loader import load_model

from conftest import tree_path
from qwen_helpers import TOKENIZER_DIR, make_tiny_qwen, write_qwen_dir

TOLERANCE = 1e-5
PREFIX = [5, 17, 42, 3, 88, 11, 60, 200, 7]
STEPS = [7, 19, 2, 55, 31]
# the tree of tests/test_forward.py: three branches off one root, and a second root
TREE_TOKENS = [30, 31, 32, 33, 34, 35, 36, 37]
TREE_PARENTS = [-1, 0, 1, 2, 1, 0, 5, -1]
KINDS = [("qwen2", True), ("qwen2", False), ("qwen3", True), ("qwen3", False)]


def _err(got: mx.array, want: mx.array) -> float:
    return float(np.abs(np.array(got, dtype=np.float32) - np.array(want, dtype=np.float32)).max())


def prompt_and_steps_error(model) -> float:
    """The largest |our logit - mlx-lm's| over a prefill of PREFIX and STEPS one at a time, each on
    its own cache (ours: ContiguousKVCache; theirs: mlx-lm's prompt cache)."""
    ours, theirs = ContiguousKVCache.for_model(model), make_prompt_cache(model)
    worst = _err(forward(model, mx.array([PREFIX]), ours).logits, model(mx.array([PREFIX]), cache=theirs))
    for token in STEPS:
        worst = max(worst, _err(forward(model, mx.array([[token]]), ours).logits,
                                model(mx.array([[token]]), cache=theirs)))
    return worst


def tree_error(model) -> float:
    """The largest |our logit - mlx-lm's| over a tree verify: each tree row (positions by depth, a
    mask of its ancestors) against mlx-lm's model run on PREFIX + that row's root-to-node path."""
    cache = ContiguousKVCache.for_model(model)
    forward(model, mx.array([PREFIX]), cache, logits_for="none")
    positions = masks.tree_positions(TREE_PARENTS, len(PREFIX))
    mask = masks.prefix_tree_mask(TREE_PARENTS, len(PREFIX))[None, None]
    tree = forward(model, mx.array([TREE_TOKENS]), cache, positions=positions, mask=mask).logits
    worst = 0.0
    for i in range(len(TREE_TOKENS)):
        path = PREFIX + [TREE_TOKENS[j] for j in tree_path(TREE_PARENTS, i)]
        worst = max(worst, _err(tree[0, i], model(mx.array([path]))[0, -1]))
    return worst


@pytest.mark.parametrize("model_type,tie", KINDS, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in KINDS])
def test_forward_equals_mlx_lm_s_own_model_over_a_prompt_and_a_tree(model_type, tie):
    model, _ = make_tiny_qwen(model_type, seed=3, tie_word_embeddings=tie)
    assert model.args.model_type == model_type and hasattr(model, "lm_head") != tie
    prompt, tree = prompt_and_steps_error(model), tree_error(model)
    print(f"{model_type} tie={tie}: max |logit error| prompt+steps {prompt:.2e}, tree verify {tree:.2e}")
    assert prompt <= TOLERANCE and tree <= TOLERANCE


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_4bit_forward_equals_mlx_lm_s_own_model(model_type):
    model, _ = make_tiny_qwen(model_type, seed=4)
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    prompt, tree = prompt_and_steps_error(model), tree_error(model)
    print(f"{model_type} 4-bit: max |logit error| prompt+steps {prompt:.2e}, tree verify {tree:.2e}")
    assert prompt <= TOLERANCE and tree <= TOLERANCE


def test_the_switches_are_what_each_architecture_needs(monkeypatch):
    """Leaving a declared switch out is a different model: the check is not vacuous."""
    import importlib

    forward_module = importlib.import_module("mlx_specdec.model.forward")
    for model_type in ("qwen2", "qwen3"):
        model, _ = make_tiny_qwen(model_type, seed=5)
        tokens = mx.array([PREFIX])
        want = model(tokens)
        assert _err(forward(model, tokens).logits, want) <= TOLERANCE
        if model_type == "qwen3":  # without the per-head norms the logits part
            monkeypatch.setattr(forward_module, "of_layer", lambda layer: ARCHITECTURES["llama"])
            assert _err(forward(model, tokens).logits, want) > 1e-2
            monkeypatch.undo()
        else:  # without the biases
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias = mx.zeros_like(proj.bias)
            assert _err(forward(model, tokens).logits, want) > 1e-2


@pytest.mark.parametrize("model_type,bits", [("qwen2", None), ("qwen3", None), ("qwen2", 4), ("qwen3", 4)])
def test_a_model_directory_loads_and_decodes_as_mlx_lm(tmp_path, model_type, bits):
    from mlx_lm.generate import generate_step

    path = write_qwen_dir(tmp_path / model_type, model_type, seed=6, bits=bits)
    lm = load_model(str(path), dequantize="off")
    assert lm.config["model_type"] == model_type and lm.bits == bits and lm.eos_token_ids == {266, 264}
    quantized = isinstance(lm.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert quantized == bool(bits)
    prompt, tree = prompt_and_steps_error(lm.model), tree_error(lm.model)
    print(f"{model_type} bits={bits} loaded: max |logit error| prompt+steps {prompt:.2e}, tree {tree:.2e}")
    assert prompt <= TOLERANCE and tree <= TOLERANCE
    from mlx_specdec.decoding import GenerationParams
    from mlx_specdec.engine import Engine

    events = list(Engine(lm, drafter=None, apar_adapter=None).generate_ids(PREFIX, "ar",
                                                                          GenerationParams(max_tokens=12)))
    ours = [t for e in events if e.kind == "token" for t in e.tokens]
    theirs = [int(t) for t, _ in generate_step(mx.array(PREFIX), lm.model, max_tokens=12,
                                               sampler=lambda lp: mx.argmax(lp, -1))]
    assert ours == theirs and len(ours) == 12


def test_a_block_that_is_not_its_architecture_s_is_refused_in_one_line():
    model, config = make_tiny_qwen("qwen2", seed=0)
    check_modules(model, config)
    with pytest.raises(UnsupportedModel, match=r"does not have the block .* mlx-specdec runs llama"):
        check_modules(model, dict(config, model_type="qwen3"))
    with pytest.raises(UnsupportedModel, match="q/k/v biases"):
        check_modules(model, dict(config, model_type="llama"))


def test_other_architectures_are_refused_naming_the_supported_ones(tmp_path):
    from mlx_specdec.model.loader import read_config

    (tmp_path / "config.json").write_text('{"model_type": "gemma3"}')
    with pytest.raises(UnsupportedModel) as error:
        read_config(tmp_path)
    assert str(error.value) == ("model_type 'gemma3' is not supported; mlx-specdec runs llama (Llama), "
                                "mistral (Mistral), qwen2 (Qwen2 / Qwen2.5), qwen3 (Qwen3)")


# -- Qwen3's chat template --------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "Two plus two?"},
     {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nFour."},
     {"role": "user", "content": "And three plus three?"}],
]


@pytest.mark.parametrize("thinking", [True, False, None], ids=["on", "off", "template-default"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_qwen3_template_with_thinking_on_and_off_is_the_tokenizer_s_own(tmp_path, thinking, conversation):
    from transformers import AutoTokenizer

    from mlx_specdec.model.loader import load_tokenizer_only

    messages = CONVERSATIONS[conversation]
    own = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    want = own.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
    text = own.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if thinking is False
                         else "<|im_start|>assistant\n")
    if conversation == 2:  # an earlier answer's thought is left out of the history, as Qwen3 asks
        assert "Easy." not in text and "<|im_start|>assistant\nFour.<|im_end|>" in text
    lm = load_tokenizer_only(str(write_qwen_dir(tmp_path / "qwen3", "qwen3")))
    got = lm.encode_chat(messages, thinking=thinking)
    assert got == want
    assert (267 in got) == (thinking is False)  # <think>, in the prompt only when thinking is off


def test_bench_ar_and_mlx_lm_on_a_tiny_qwen3_write_the_same_answers(tmp_path):
    """`mlx-specdec bench --methods ar,mlx-lm` on a tiny Qwen3: every one of 8 prompts' answers
    identical (speed is the bench's to report, not a test's to assert)."""
    import json

    from mlx_specdec.cli import build_parser

    path = write_qwen_dir(tmp_path / "qwen3", "qwen3", seed=11)
    out = tmp_path / "bench.json"
    args = build_parser().parse_args(["bench", "-m", str(path), "--methods", "ar,mlx-lm", "--limit", "8",
                                      "--max-tokens", "32", "--format", "json", "--output", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    rows = [r for r in report["rows"] if r["method"] == "mlx-lm"]
    summary = {s["method"]: s for s in report["summary"]}
    print(f"mlx-lm identical to ar: {sum(r['identical_to_ar'] for r in rows)}/{len(rows)}, "
          f"speed-up vs ar {summary['mlx-lm']['speedup_vs_ar']}")
    assert len(rows) == 8 and all(r["identical_to_ar"] and r["new_tokens"] == 32 for r in rows)
    assert summary["mlx-lm"]["identical_fraction"] == 1.0
