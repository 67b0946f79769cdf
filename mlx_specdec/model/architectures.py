"""The architectures the engine's forward runs, and the few switches in which they differ.

Llama, Mistral, Qwen2 (Qwen2.5) and Qwen3 are one block: RMSNorm, attention with grouped KV heads
and RoPE, a SwiGLU MLP. Where they differ is declared here, once:

- `qkv_bias`: the q/k/v projections carry a bias (Qwen2); for Llama and Mistral the config's
  `attention_bias` says (it biases o_proj too). mlx-lm's linear layers apply it: the forward
  calls them as they are.
- `qk_norm`: each head's query and key pass an RMSNorm over the head dimension before RoPE
  (Qwen3's `q_norm`, `k_norm`). The forward (forward.py `head_projections`) applies it.

Tied embeddings and the RoPE base (Qwen's is 1e6) are each checkpoint's config, read by mlx-lm's
own model classes; the forward reuses their modules. `check_modules` holds a loaded model to its
declared switches, so a model class that grew another difference is refused in one line rather
than computed wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import mlx.nn as nn

from ..errors import UnsupportedModel


@dataclass(frozen=True)
class Architecture:
    model_type: str  # config.json's
    family: str  # in words, for messages and docs
    qkv_bias: Optional[bool]  # q/k/v projections biased; None: as the config's attention_bias says
    qk_norm: bool  # per-head RMSNorm of queries and keys before RoPE
    gguf: bool  # the GGUF converter (gguf.py) reads this architecture's files


ARCHITECTURES: Dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "Llama", qkv_bias=None, qk_norm=False, gguf=True),
    Architecture("mistral", "Mistral", qkv_bias=None, qk_norm=False, gguf=False),
    Architecture("qwen2", "Qwen2 / Qwen2.5", qkv_bias=True, qk_norm=False, gguf=True),
    Architecture("qwen3", "Qwen3", qkv_bias=False, qk_norm=True, gguf=True),
)}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
LLAMA = ARCHITECTURES["llama"]


def supported_list() -> str:
    return ", ".join(f"{a.model_type} ({a.family})" for a in ARCHITECTURES.values())


def architecture(model_type: object) -> Architecture:
    """The declared switches of a config's model_type; UnsupportedModel naming what is supported."""
    found = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; mlx-specdec runs {supported_list()}")
    return found


def of_layer(layer: nn.Module) -> Architecture:
    """A block's architecture, from the args mlx-lm's block keeps (Llama's for a block without)."""
    return ARCHITECTURES.get(getattr(getattr(layer, "args", None), "model_type", None), LLAMA)


def check_modules(model: nn.Module, config: dict) -> None:
    """Every block of the loaded model has what its architecture's switches say, and nothing the
    forward would skip: q/k norms exactly where `qk_norm`, q/k/v biases exactly where `qkv_bias`."""
    arch = architecture(config.get("model_type"))
    bias = arch.qkv_bias if arch.qkv_bias is not None else bool(config.get("attention_bias", False))
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        norms = all(hasattr(attn, name) for name in ("q_norm", "k_norm"))
        biased = [name for name in ("q_proj", "k_proj", "v_proj") if "bias" in getattr(attn, name)]
        if norms != arch.qk_norm or (biased != ["q_proj", "k_proj", "v_proj"] if bias else biased):
            raise UnsupportedModel(
                f"layer {i} of this {arch.family} model does not have the block mlx-specdec's forward runs "
                f"(q/k norms: {norms}, q/k/v biases: {biased or 'none'}); mlx-specdec runs {supported_list()}")
