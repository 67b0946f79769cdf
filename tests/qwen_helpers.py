"""Tiny random Qwen2 and Qwen3 models, built with mlx-lm's own model classes, and written to disk
as Hugging Face / mlx-lm model directories with the Qwen3 tokenizer fixture
(tests/fixtures/qwen3_tokenizer: Qwen3's real chat template over a byte-level BPE)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2, qwen3

TOKENIZER_DIR = Path(__file__).resolve().parent / "fixtures" / "qwen3_tokenizer"
MODULES = {"qwen2": qwen2, "qwen3": qwen3}
CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
VOCAB = 272  # the fixture tokenizer's 269 ids, and room
EOS = 266  # <|im_end|>
THINK, END_THINK = 267, 268
BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=1000000.0,
            max_position_embeddings=512, tie_word_embeddings=True)
QUIET = (EOS, *range(0, 32), *range(127, 256))  # never the argmax (write_qwen_dir)
QWEN3_HEAD_DIM = 24  # not hidden / heads (16), as Qwen3's own head_dim is not


def qwen_config(model_type: str, **overrides) -> dict:
    config = dict(BASE, model_type=model_type, architectures=[CLASSES[model_type]], torch_dtype="float32",
                  bos_token_id=None, eos_token_id=EOS)
    if model_type == "qwen3":
        config.update(head_dim=QWEN3_HEAD_DIM, attention_bias=False)
    config.update(overrides)
    return config


def make_tiny_qwen(model_type: str, seed: int = 0, embed_scale: float = 1.0, quiet_rows=(), **overrides):
    """A random-init mlx-lm Qwen model in float32. Its q/k norm weights (Qwen3) and q/k/v biases
    (Qwen2) are random too, so a forward that skipped either would not match. embed_scale
    separates the greedy argmax (8: tokens far apart); quiet_rows: head rows set to zero (never
    the argmax: EOS, so every answer runs to max_tokens)."""
    config = qwen_config(model_type, **overrides)
    module = MODULES[model_type]
    known = module.ModelArgs.__dataclass_fields__
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**{k: v for k, v in config.items() if k in known}))
    rng = np.random.default_rng(seed)
    for layer in model.model.layers:
        attn = layer.self_attn
        if model_type == "qwen3":
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight = mx.array(1.0 + 0.5 * rng.standard_normal(norm.weight.shape), dtype=mx.float32)
        else:
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias = mx.array(0.5 * rng.standard_normal(proj.bias.shape), dtype=mx.float32)
    embed = np.array(model.model.embed_tokens.weight) * embed_scale
    head = embed if config["tie_word_embeddings"] else np.array(model.lm_head.weight)
    head[list(quiet_rows)] = 0.0
    model.model.embed_tokens.weight = mx.array(embed)
    if not config["tie_word_embeddings"]:
        model.lm_head.weight = mx.array(head)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, config


def write_qwen_dir(path: Path, model_type: str, seed: int = 0, bits=None, embed_scale: float = 8.0,
                   **overrides) -> Path:
    """A tiny Qwen model directory: config.json, model.safetensors (bits: mlx-lm's affine
    quantization, group 32) and the fixture's tokenizer files. The head rows of EOS, of control
    bytes and of non-ASCII bytes are zero: answers run to max_tokens and are
    printable text (a byte-level BPE's lone high bytes decode to nothing)."""
    model, config = make_tiny_qwen(model_type, seed, embed_scale=embed_scale, quiet_rows=QUIET, **overrides)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        config["quantization"] = {"group_size": 32, "bits": bits}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, path / name)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 264], "do_sample": False}))
    return path


# A Qwen3 that writes a thinking answer: every layer's attention and MLP outputs are zero (o_proj,
# down_proj), so each logit row depends on the last token alone, and the head makes SCRIPT's
# successor the argmax. After the generation prompt ("assistant\n") it thinks, then answers; after
# the thinking-off prompt ("</think>\n\n": the "\n\n" token) it answers at once.
SCRIPT = {10: THINK, THINK: ord("H"), ord("H"): ord("m"), ord("m"): ord("."), ord("."): END_THINK,
          END_THINK: ord("O"), 261: ord("O"), ord("O"): ord("k"), ord("k"): ord("!"), ord("!"): EOS}
THOUGHT, ANSWER = "Hm.", "Ok!"


def write_thinking_qwen3(path: Path, seed: int = 0) -> Path:
    path = write_qwen_dir(path, "qwen3", seed=seed, embed_scale=1.0, tie_word_embeddings=False)
    weights = mx.load(str(path / "model.safetensors"))
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    embed = np.array(weights["model.embed_tokens.weight"])
    norm = np.array(weights["model.norm.weight"])
    rms = lambda v: v / np.sqrt(np.mean(v * v) + 1e-6) * norm  # noqa: E731  (the final RMSNorm)
    head = 0.01 * np.random.default_rng(seed).standard_normal(embed.shape).astype(np.float32)
    for token, successor in SCRIPT.items():
        h = rms(embed[token])
        head[successor] += 4.0 * h / np.linalg.norm(h)
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path
