"""Qwen2 and Qwen3 GGUF files (llama.cpp's names and metadata: `qwen2.*` / `qwen3.*` keys, q/k/v
biases, `attn_q_norm` / `attn_k_norm`, NeoX RoPE rows, a `qwen2` byte-level BPE tokenizer with
<think> as a user-defined token), written here from tiny random mlx-lm models with `mx.save_gguf`,
convert to directories whose logits equal mlx-lm's own model on the same weights and whose
tokenizer encodes as the fixture's own."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_specdec.model.gguf import convert_gguf
from mlx_specdec.model.loader import load_model

from qwen_helpers import TOKENIZER_DIR, make_tiny_qwen
from test_qwen import PREFIX, prompt_and_steps_error, tree_error

BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{BLOCK[rest]}.{suffix}"
    return f"{TOP[base]}.{suffix}"


def write_gguf(path, model, config):
    tok = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1]) + \
        [(a["content"], a["id"]) for a in tok["added_tokens"]]
    tokens = [t for t, _ in sorted(vocab, key=lambda kv: kv[1])]
    tokens += [f"[PAD{i}]" for i in range(config["vocab_size"] - len(tokens))]
    types = [3 if t.startswith("<|") else 4 if t in ("<think>", "</think>") else 1 for t in tokens]
    arch = config["model_type"]
    meta = {"general.architecture": arch, f"{arch}.block_count": mx.array(config["num_hidden_layers"], mx.uint32),
            f"{arch}.embedding_length": mx.array(config["hidden_size"], mx.uint32),
            f"{arch}.feed_forward_length": mx.array(config["intermediate_size"], mx.uint32),
            f"{arch}.attention.head_count": mx.array(config["num_attention_heads"], mx.uint32),
            f"{arch}.attention.head_count_kv": mx.array(config["num_key_value_heads"], mx.uint32),
            f"{arch}.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], mx.float32),
            f"{arch}.rope.freq_base": mx.array(config["rope_theta"], mx.float32),
            f"{arch}.context_length": mx.array(config["max_position_embeddings"], mx.uint32),
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": mx.array(types, mx.int32), "tokenizer.ggml.merges": tok["model"]["merges"],
            "tokenizer.ggml.eos_token_id": mx.array(266, mx.uint32), "tokenizer.ggml.bos_token_id": mx.array(264, mx.uint32),
            "tokenizer.ggml.padding_token_id": mx.array(264, mx.uint32),
            "tokenizer.chat_template": json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())["chat_template"]}
    if arch == "qwen3":
        meta[f"{arch}.attention.key_length"] = mx.array(config["head_dim"], mx.uint32)
    weights = {gguf_name(k): v for k, v in tree_flatten(model.parameters())}
    mx.save_gguf(str(path), weights, meta)
    return path


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_a_qwen_gguf_converts_to_the_same_model_and_tokenizer(tmp_path, model_type):
    from transformers import AutoTokenizer

    model, config = make_tiny_qwen(model_type, seed=9, tie_word_embeddings=False)
    out = convert_gguf(write_gguf(tmp_path / f"{model_type}.gguf", model, config), tmp_path / "converted")
    converted = json.loads((out / "config.json").read_text())
    assert converted["model_type"] == model_type and converted["rope_traditional"] is False
    lm = load_model(str(out))
    tokens = mx.array([PREFIX])
    got = np.array(lm.model(tokens))
    assert np.abs(got - np.array(model(tokens))).max() <= 1e-5  # the same weights, read back
    prompt, tree = prompt_and_steps_error(lm.model), tree_error(lm.model)
    print(f"{model_type} from GGUF: max |logit error| prompt+steps {prompt:.2e}, tree {tree:.2e}")
    assert prompt <= 1e-5 and tree <= 1e-5
    own = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    text = "<think>\nLet's see: 12 apples?\n</think>\n\nTwelve, naïvely."
    assert lm.tokenizer.encode(text) == own.encode(text)
    messages = [{"role": "user", "content": "Hi there"}]
    for thinking in (True, False):
        want = own.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
        assert lm.encode_chat(messages, thinking=thinking) == list(want["input_ids"])
