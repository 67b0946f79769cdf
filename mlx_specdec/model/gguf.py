"""Convert a Llama, Qwen2 or Qwen3 GGUF file into an MLX model directory that mlx-lm loads.

`mx.load(path, return_metadata=True)` already returns Q4_0/Q4_1/Q8_0 tensors as MLX affine
quantized triples (uint32 weight + scales + biases, group 32), so conversion is renaming,
a config from the metadata, and a tokenizer rebuilt from the metadata's vocabulary and merges.

GGUF stores a Llama's q/k projections in Meta's interleaved-rotary row order, hence
`"rope_traditional": true` (mathematically the same model; no row permutation needed); llama.cpp
leaves Qwen's rows as Hugging Face has them (NeoX RoPE). Qwen2's q/k/v biases and Qwen3's
`attn_q_norm` / `attn_k_norm` map to mlx-lm's names; a `qwen2` pre-tokenizer gets Qwen2's split regex.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx
import numpy as np

from ..errors import CorruptModel, UnsupportedModel

GGUF_GROUP_SIZE = 32  # every GGUF type MLX reads as quantized (Q4_0, Q4_1, Q8_0) uses blocks of 32

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# GGUF metadata value types -> fixed byte sizes (8 = string, 9 = array are variable).
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _HeaderReader:
    """Bounds-checked reader for the GGUF header (`mx.load` can crash on a corrupt one)."""

    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError(f"header runs past the end of the file at byte {self.pos}")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def string(self) -> bytes:
        return bytes(self.take(self.uint(8)))

    def value(self, kind: int, depth: int = 0) -> None:
        if kind in _GGUF_SCALAR_SIZES:
            self.take(_GGUF_SCALAR_SIZES[kind])
        elif kind == 8:
            self.string()
        elif kind == 9 and depth == 0:
            item_kind, count = self.uint(4), self.uint(8)
            if item_kind in _GGUF_SCALAR_SIZES:
                self.take(_GGUF_SCALAR_SIZES[item_kind] * count)
            else:
                for _ in range(count):
                    self.value(item_kind, depth + 1)
        else:
            raise ValueError(f"unknown metadata value type {kind}")


def check_gguf_header(path: Path) -> None:
    """Walk the GGUF header (magic, version, metadata, tensor table) inside the file's bounds."""
    import mmap

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            reader = _HeaderReader(memoryview(mapped))
            try:
                if bytes(reader.take(4)) != b"GGUF":
                    raise ValueError("not a GGUF file (bad magic)")
                version = reader.uint(4)
                if version not in (2, 3):
                    raise ValueError(f"unsupported GGUF version {version}")
                tensors, entries = reader.uint(8), reader.uint(8)
                if tensors > 1_000_000 or entries > 1_000_000:
                    raise ValueError("implausible tensor or metadata count")
                for _ in range(entries):
                    reader.string()
                    reader.value(reader.uint(4))
                for _ in range(tensors):
                    reader.string()
                    dims = reader.uint(4)
                    if not 1 <= dims <= 4:
                        raise ValueError(f"tensor with {dims} dimensions")
                    reader.take(8 * dims + 4 + 8)  # shape, type, data offset
            finally:
                reader.data.release()
    except (ValueError, OSError) as exc:
        raise CorruptModel(f"cannot read GGUF file {path}: {exc}") from None


def read_gguf(path: Path) -> Tuple[Dict[str, mx.array], dict]:
    check_gguf_header(path)
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises ValueError/RuntimeError with a terse message
        raise CorruptModel(f"cannot read GGUF file {path}: {exc}") from None


def _scalar(value):
    if isinstance(value, mx.array):
        return value.item() if value.size == 1 else value.tolist()
    return value


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | scales | biases
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise UnsupportedModel(f"unknown GGUF tensor {gguf_name!r}: not a Llama-family model")


GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Qwen2's pre-tokenizer split (its tokenizer.json's), before byte-level BPE
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def config_from_metadata(meta: dict) -> dict:
    arch = _scalar(meta.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported (the converter reads "
                               f"{', '.join(GGUF_ARCHITECTURES)})")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}")
        return default if value is None else _scalar(value)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = {
        "model_type": arch,
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", get("rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_traditional": arch == "llama",
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "bos_token_id": int(_scalar(meta.get("tokenizer.ggml.bos_token_id", 1))),
        "eos_token_id": int(_scalar(meta.get("tokenizer.ggml.eos_token_id", 2))),
    }
    if arch == "qwen3":
        config["attention_bias"] = False
    return config


def build_tokenizer(meta: dict):
    """Byte-level BPE from `tokenizer.ggml.tokens`/`merges`; token_type 3 marks specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model_kind = _scalar(meta.get("tokenizer.ggml.model", ""))
    if model_kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer {model_kind!r} is not supported (byte-level BPE only)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # SmolLM2 ("smollm" pre-tokenizer) splits digits one by one, then GPT-2 byte-level regex;
    # Qwen2/Qwen3 ("qwen2") split by their own regex, NFC-normalized.
    pre = _scalar(meta.get("tokenizer.ggml.pre", ""))
    split_digits = pre in ("smollm", "starcoder")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "qwen2")
    if pre == "qwen2":
        from tokenizers import Regex, normalizers

        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), byte_level])
    else:
        tokenizer.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if split_digits
            else byte_level
        )
    tokenizer.decoder = decoders.ByteLevel()
    types = np.array(meta["tokenizer.ggml.token_type"]) if "tokenizer.ggml.token_type" in meta else []
    specials = [tokens[i] for i, t in enumerate(types) if int(t) == 3]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    # user-defined tokens (type 4: Qwen3's <think>, </think>) stay whole but decode as text
    defined = [tokens[i] for i, t in enumerate(types) if int(t) == 4]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in defined])
    return tokenizer, tokens


def write_tokenizer(meta: dict, out_dir: Path, config: dict) -> None:
    tokenizer, tokens = build_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    unk = int(_scalar(meta.get("tokenizer.ggml.unknown_token_id", 0)))
    pad = int(_scalar(meta.get("tokenizer.ggml.padding_token_id", eos)))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": tokens[unk],
        "pad_token": tokens[pad],
        "add_bos_token": bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = _scalar(meta.get("tokenizer.chat_template"))
    if template:
        tokenizer_config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


def _linear_bits(weights: Dict[str, mx.array], prefix: str) -> int | None:
    scales = weights.get(f"{prefix}.scales")
    if scales is None:
        return None
    packed = weights[f"{prefix}.weight"].shape[-1]  # in_features * bits / 32
    return (packed * 32) // (scales.shape[-1] * GGUF_GROUP_SIZE)


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "as-is") -> Path:
    """Write an mlx-lm model directory. dtype: "as-is" keeps GGUF's quantization;
    "float16"/"bfloat16"/"float32" dequantizes every tensor to that type."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    weights, meta = read_gguf(gguf_path)
    config = config_from_metadata(meta)
    renamed = {hf_name(k): v for k, v in weights.items()}
    config["tie_word_embeddings"] = "lm_head.weight" not in renamed

    prefixes = sorted({k.rsplit(".", 1)[0] for k in renamed if k.endswith(".scales")})
    if dtype == "as-is":
        if prefixes:
            bits = {p: _linear_bits(renamed, p) for p in prefixes}
            common = max(set(bits.values()), key=list(bits.values()).count)
            quant = {"group_size": GGUF_GROUP_SIZE, "bits": common, "mode": "affine"}
            for p, b in bits.items():
                if b != common:  # e.g. the 8-bit token embedding next to 4-bit linears
                    quant[p] = {"group_size": GGUF_GROUP_SIZE, "bits": b}
            config["quantization"] = quant
            config["quantization_config"] = quant
        out = renamed
    else:
        target = getattr(mx, dtype)
        out = {}
        for name, value in renamed.items():
            base, _, suffix = name.rpartition(".")
            if suffix in ("scales", "biases") and base in prefixes:
                continue
            if base in prefixes and suffix == "weight":
                value = mx.dequantize(
                    value,
                    renamed[f"{base}.scales"],
                    renamed[f"{base}.biases"],
                    group_size=GGUF_GROUP_SIZE,
                    bits=_linear_bits(renamed, base),
                )
            out[name] = value.astype(target)
        config["torch_dtype"] = dtype

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), out, metadata={"format": "mlx"})
    write_tokenizer(meta, out_dir, config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir
