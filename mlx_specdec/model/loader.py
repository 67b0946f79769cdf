"""Find, validate and load a model of the architectures the forward runs (architectures.py).

A model spec is one of:
- `default` / `default-4bit` / `default-f16`: the embedded SmolLM2-135M-Instruct (see `default`);
- a local directory in Hugging Face / mlx-lm layout (config.json + *.safetensors + tokenizer), or
  with PyTorch `pytorch_model*.bin` weights instead (converted once into the cache: torch_convert);
- a local `.gguf` file (converted once into the cache);
- a Hugging Face repo id (`owner/name`), downloaded with huggingface-hub: its config, tokenizer
  files and weights, safetensors where the repo has them, else its `pytorch_model*.bin` shards
  (converted as a local directory's are: Vicuna's official repos ship only those).

Loading, quantized layers and tokenizers are mlx-lm's; a tokenizer that only a sentencepiece
`tokenizer.model` describes (Vicuna's, Llama 1/2's) is made to encode as sentencepiece itself does
(`sentencepiece_tokenizer`). Pickled `.bin` weights are read only by torch_checkpoint's restricted
unpickler: tensors, nothing imported or run.
Every failure a user can cause raises a `UserError` with one clear line.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import CorruptModel, ModelNotFound, UnsupportedModel
from .architectures import architecture, check_modules
from .cpu_layout import apply_cpu_layout
from .default import ensure_default_model, home
from .device import on_cpu

# FastChat's Vicuna v1.1 conversation template, for Llama checkpoints whose tokenizer has none.
VICUNA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{{ 'A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user\\'s questions. ' }}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# What a repo download fetches: the config, tokenizer and card files, and one kind of weights.
REPO_FILES = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "README.md"]
SAFETENSORS_WEIGHTS = ["*.safetensors"]
TORCH_WEIGHTS = ["pytorch_model*.bin"]  # and their pytorch_model.bin.index.json (*.json); never other pickles
_TORCH_WEIGHT = re.compile(r"pytorch_model(-\d+-of-\d+)?\.bin")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    name: str
    config: dict
    dtype: str  # compute dtype of the non-quantized weights
    bits: Optional[int]  # quantization bits, None for unquantized
    dequantized: bool = False  # quantized weights expanded to `dtype` once at load (the CPU's fast path)
    layout: str = "mlx-lm's"  # how the float32 weights are laid out on the CPU, and why (cpu_layout.py)

    @property
    def context_length(self) -> int:
        """The model's window; for a model with sliding-window layers at most that window: the
        forward (forward.py) attends every cached key, which equals sliding-window attention only
        while the whole sequence fits in the window."""
        length = int(self.config.get("max_position_embeddings") or 4096)
        window = sliding_window(self.config)
        return min(length, window) if window else length

    @property
    def eos_token_ids(self) -> set:
        return set(self.tokenizer.eos_token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def encode_chat(self, messages: List[dict], thinking: Optional[bool] = None) -> List[int]:
        """thinking: the chat template's `enable_thinking` (Qwen3's switch; a template without
        one ignores it); None leaves it to the template's own default."""
        extra = {} if thinking is None else {"enable_thinking": bool(thinking)}
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def encode_prompt(self, prompt: str, chat: bool = True, thinking: Optional[bool] = None) -> List[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}], thinking=thinking)
        return list(self.tokenizer.encode(prompt))

    def describe(self) -> str:
        bits = f"{self.bits}-bit" if self.bits else "unquantized"
        if self.bits and self.dequantized:
            bits += ", dequantized at load"
        return f"{self.name} ({self.dtype}, {bits})"


def sliding_window(config: dict) -> Optional[int]:
    """The window of the layers mlx-lm builds with sliding-window attention (`layer_types` names
    them), or None. A `sliding_window` without such layers is not applied by mlx-lm: None."""
    if "sliding_attention" in (config.get("layer_types") or ()) and config.get("sliding_window"):
        return int(config["sliding_window"])
    return None


def resolve_model_path(spec: Optional[str]) -> Path:
    if spec in (None, "", "default", "default-f16"):
        return ensure_default_model("f16")
    if spec == "default-4bit":
        return ensure_default_model("4bit")
    path = Path(spec).expanduser()
    if path.is_dir():
        from .torch_convert import converted_torch_dir

        return converted_torch_dir(path)  # itself, unless it has only PyTorch .bin weights
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from .gguf import convert_gguf

            out = home() / "models" / f"gguf-{path.stem}"
            if not (out / "config.json").exists():
                convert_gguf(path, out)
            return out
        raise UnsupportedModel(f"{spec} is a file; give a model directory or a .gguf file")
    if _REPO_ID.match(spec) and not spec.startswith((".", "/", "~")):
        from .torch_convert import converted_torch_dir

        return converted_torch_dir(download_repo(spec), name=spec.replace("/", "--"))
    raise ModelNotFound(f"no model at {spec!r} (not a directory, .gguf file or repo id)")


def weight_patterns(files: List[str]) -> Optional[List[str]]:
    """The weights to fetch from a repo holding `files`: its safetensors where it has any, else its
    PyTorch `pytorch_model*.bin` checkpoint; None when it has neither."""
    if any(f.endswith(".safetensors") for f in files):
        return SAFETENSORS_WEIGHTS
    if any(_TORCH_WEIGHT.fullmatch(f) for f in files):
        return TORCH_WEIGHTS
    return None


def _has_weights(path: Path, patterns: List[str]) -> bool:
    return any(any(path.glob(pattern)) for pattern in patterns)


def download_repo(repo_id: str) -> Path:
    """Download a repo's config, tokenizer files and weights (`weight_patterns`, decided from the
    repo's file list, as the Hub's model_info gives it). Offline, a snapshot already in the local
    cache serves: safetensors first, else a PyTorch checkpoint. Pickles are fetched only as
    `pytorch_model*.bin` weights, and read only by torch_checkpoint (nothing in them runs)."""
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")
    try:
        import huggingface_hub
        from huggingface_hub.utils import RepositoryNotFoundError, RevisionNotFoundError  # also 0.2x
    except ImportError as exc:  # a broken install: still one line
        raise ModelNotFound(f"cannot get {repo_id!r}: huggingface_hub does not import ({exc})") from None

    try:
        # model_info: one request (list_repo_files retries for half a minute, noisily, offline)
        info = huggingface_hub.model_info(repo_id, timeout=float(os.environ["HF_HUB_ETAG_TIMEOUT"]))
        files = [sibling.rfilename for sibling in info.siblings or ()]
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:  # GatedRepoError is one too
        kind = type(exc).__name__
        raise ModelNotFound(f"no model {repo_id!r} on the Hugging Face Hub ({kind}): no such repo, or it is "
                            "private or gated (log in with `hf auth login`); pass a local model directory "
                            "instead") from None
    except Exception:  # offline, or the Hub unreachable: the local cache decides below
        files = None

    if files is not None:
        weights = weight_patterns(files)
        if weights is None:
            raise UnsupportedModel(f"{repo_id} has neither safetensors nor pytorch_model*.bin weights")
        try:
            return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=REPO_FILES + weights))
        except Exception as exc:
            raise ModelNotFound(f"cannot download {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: "
                                f"{_first_line(exc)}); pass a local model directory instead") from None

    for weights in (SAFETENSORS_WEIGHTS, TORCH_WEIGHTS):
        try:
            path = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=REPO_FILES + weights,
                                                          local_files_only=True))
        except Exception:
            continue
        if _has_weights(path, weights):
            return path
    raise ModelNotFound(f"cannot get {repo_id!r} from the Hugging Face Hub: offline (or the Hub unreachable) and "
                        "it is not in the local cache; pass a local model directory instead")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelNotFound(f"{path} has no config.json: not a model directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModel(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CorruptModel(f"{config_file} is not a JSON object")
    architecture(config.get("model_type"))  # UnsupportedModel naming the supported ones
    return config


def check_weights(path: Path) -> None:
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise UnsupportedModel(f"{path} has pickled weights but no pytorch_model.bin or "
                                   "pytorch_model.bin.index.json; convert them to safetensors first")
        raise ModelNotFound(f"{path} has no .safetensors weights")
    for shard in shards:
        _check_safetensors_header(shard)


def _check_safetensors_header(shard: Path) -> None:
    """Read the header and check every tensor lies inside the file: catches truncation cheaply."""
    size = shard.stat().st_size
    try:
        with open(shard, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("bad header length")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + header_len + end > size:
            raise ValueError(f"truncated: needs {8 + header_len + end} bytes, has {size}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptModel(f"corrupt safetensors file {shard}: {exc}") from None


def default_dtype(config: dict) -> str:
    """float32 on the CPU (MLX's float16 and 4-bit matmuls are slower there: see docs/cpu-backend.md);
    the checkpoint's own dtype on a GPU."""
    if on_cpu():
        return "float32"
    return config.get("torch_dtype") or "float16"


#: "auto" dequantizes a quantized model on the CPU when its float32 weights fit in this share of RAM
DEQUANTIZE_RAM_SHARE = 0.4


def float32_bytes(model: nn.Module) -> int:
    """What the model's weights take once every quantized layer is float32."""
    total = 0
    for _, module in model.named_modules():
        arrays = {k: v for k, v in module.items() if isinstance(v, mx.array)}  # this module's own
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            rows, packed = module.weight.shape
            total += rows * packed * (32 // module.bits) * 4 + (arrays["bias"].size * 4 if "bias" in arrays else 0)
        else:
            total += sum(v.size * 4 for v in arrays.values())
    return total


def should_dequantize(model: nn.Module, bits: Optional[int], choice: str) -> bool:
    """On the CPU, MLX's quantized matmul of more than one row is slow (a 4-bit verify or
    prefill); dequantized once at load, a quantized model runs at float32's speed with the same
    weight values, for 32/bits x the weight memory. `choice`: auto (when the float32 weights fit
    in DEQUANTIZE_RAM_SHARE of RAM, on the CPU), on, off."""
    if choice not in ("auto", "on", "off"):
        raise UnsupportedModel(f"--dequantize is auto, on or off, not {choice!r}")
    if not bits or choice == "off":
        return False
    if choice == "on":
        return True
    if not on_cpu():
        return False
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float32_bytes(model) <= DEQUANTIZE_RAM_SHARE * ram


def load_model(spec: Optional[str] = "default", dtype: str = "auto", dequantize: str = "auto") -> LoadedModel:
    path = resolve_model_path(spec)
    config = read_config(path)
    check_weights(path)
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, tokenizer = mlx_lm_load(str(path))
    except Exception as exc:
        raise CorruptModel(f"cannot load the model in {path}: {str(exc).splitlines()[0]}") from None
    check_modules(model, config)

    quant = config.get("quantization") or {}
    bits = quant.get("bits")
    compute = default_dtype(config) if dtype == "auto" else dtype
    if compute not in ("float32", "float16", "bfloat16"):
        raise UnsupportedModel(f"unknown dtype {dtype!r} (choose auto, float32, float16, bfloat16)")
    if bits and dtype == "auto" and compute != "float32":
        compute = "float16"  # on Metal, quantized layers keep their float16 scales
    # On the CPU a quantized model computes in float32 too (its scales/biases are cast; the packed
    # weights stay 4-bit): MLX's CPU float16 activations are far slower than float32 there.
    dequantized = should_dequantize(model, bits, dequantize)
    if dequantized:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
    model.set_dtype(getattr(mx, compute))
    mx.eval(model.parameters())  # materialise once: lazy weights would be loaded inside the first step
    name = path.name if spec in (None, "", "default") or Path(str(spec)).exists() else str(spec)
    layout = "mlx-lm's"
    if compute == "float32" and on_cpu():  # row- or column-major, as measured fastest here (cpu_layout.py)
        layout = apply_cpu_layout(model, name, compute).describe()

    finish_tokenizer(tokenizer, path)
    return LoadedModel(model, tokenizer, path, name, config, compute, bits, dequantized, layout)


def load_tokenizer_only(spec: Optional[str] = "default") -> LoadedModel:
    """The tokenizer and config of a model, without its weights (`model` is None): for a process
    that only encodes and decodes, while ranks elsewhere hold the weights."""
    from mlx_lm.utils import load_tokenizer

    path = resolve_model_path(spec)
    config = read_config(path)
    tokenizer = load_tokenizer(path)
    finish_tokenizer(tokenizer, path)
    return LoadedModel(None, tokenizer, path, path.name, config, "float32", None)


def finish_tokenizer(tokenizer, path: Path) -> None:
    """What mlx-lm's tokenizer lacks for a Llama checkpoint: sentencepiece's own encoding where only
    a `tokenizer.model` describes it, and Vicuna's conversation format where it has no chat template."""
    sentencepiece_tokenizer(tokenizer, path)
    if getattr(tokenizer, "chat_template", None) is None:
        tokenizer._tokenizer.chat_template = VICUNA_TEMPLATE


def sentencepiece_tokenizer(tokenizer, path: Path) -> bool:
    """Make a tokenizer that only a sentencepiece `tokenizer.model` describes (no tokenizer.json:
    Vicuna's and Llama 1/2's official repos) encode as sentencepiece does. transformers converts the
    .model, and its conversion may part from sentencepiece: transformers 5's LlamaTokenizer drops the
    dummy prefix ("▁") of a text that starts with a space, and of the text after a special token
    (the chat template's BOS: Vicuna's prompt would begin "A" where FastChat's begins "▁A"), and
    without a tokenizer_config.json it adds no BOS. So the model, normalizer, pre-tokenizer and
    decoder are rebuilt from the .model's own settings (transformers' `build_tokenizer_from_spm_proto`,
    in its legacy mode: each text between special tokens encodes exactly as
    `SentencePieceProcessor.encode` encodes it, as transformers 4 and FastChat encoded Vicuna's
    prompts; a tokenizer_config.json's `legacy: false` is not followed), and BOS goes first, as
    Llama's tokenizer puts it, unless tokenizer_config.json says `add_bos_token: false`. The ids are
    the .model's and added tokens stay as they are, so nothing else changes. True when rebuilt;
    False (the tokenizer as loaded) for a directory with a tokenizer.json, a `tokenizer.model` that
    is no BPE or unigram sentencepiece model (a tiktoken file), or a transformers without the builder."""
    model_file = path / "tokenizer.model"
    if (path / "tokenizer.json").exists() or not model_file.is_file():
        return False
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

        proto = SentencePieceExtractor(str(model_file)).proto
        kind = proto.trainer_spec.model_type  # 1 unigram, 2 BPE (3 word, 4 char: left as loaded)
        if kind not in (1, 2) or not proto.pieces:
            return False
        if kind == 1:
            vocab = [(piece.piece, piece.score) for piece in proto.pieces]
        else:
            vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
        built = SpmConverter.build_tokenizer_from_spm_proto(proto=proto, vocab=vocab, legacy=True)
    except Exception:
        return False
    if built is None:
        return False
    backend.model = built.model
    backend.normalizer = built.normalizer
    backend.pre_tokenizer = built.pre_tokenizer
    backend.decoder = built.decoder
    settings = {}
    try:
        settings = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        pass
    add_bos = settings.get("add_bos_token", True) if isinstance(settings, dict) else True
    if add_bos and proto.trainer_spec.bos_id >= 0 and not getattr(inner, "add_bos_token", True):
        inner.add_bos_token = True  # rebuilds the post-processor around the tokenizer's bos_token
    return True
