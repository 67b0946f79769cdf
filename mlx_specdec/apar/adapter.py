"""The APAR adapter: mlx-lm LoRA layers plus two new token rows ([Fork], [Child]) for a base model.

A directory holds `adapter_config.json` (base model, tokenizer hash, LoRA settings, the control
tokens) and `adapters.safetensors` (the LoRA matrices and the new rows, a few MB). The base
model's own weights never change:

- for training, `prepare_for_training` freezes the model, wraps its linears with mlx-lm's
  `LoRALinear` and its token embedding with `ExtendedEmbedding` (the frozen base table plus two
  trainable rows appended after the vocabulary; with tied embeddings the same rows are the new
  output rows, otherwise an `ExtendedHead` adds output rows to the LM head);
- for decoding, `load_apar_model` builds a second model that shares every base array with the
  loaded one (no copy), with LoRA fused into new weights for the wrapped linears (so a decoding
  step costs what the base model's does) and the embedding extended. The tokenizer is a copy of
  the base tokenizer with the two tokens added; the base model and tokenizer are untouched, so
  `ar` keeps running the original model in the same process.

Two modes (`AdapterConfig.mode`):

- `full` (the paper's): LoRA on every token; the tuned model writes the whole answer.
- `skeleton`: the LoRA update is gated per token (`GatedLoRALinear`, gate 0 or 1). It is on only
  for the tokens of a thread that has forked ([Fork] and everything the thread writes after it:
  the "skeleton" of next-sibling heads); everything else, the prompt, the text before the first
  fork, every child's detail and every answer that never forks, is the base model's own forward.
  The [Fork] decision is the new output row read off the base hidden state. With gate 0 on every
  token the model IS the base model (its logits plus two control logits), so an answer that never
  forks is the base model's greedy answer, token for token. LoRA stays unfused (a fused weight
  cannot be switched per token); decoding skips the LoRA matmuls on steps where no token needs them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserError
from ..model.loader import LoadedModel
from .config import (CONFIG_FILE, WEIGHTS_FILE, AdapterConfig, LoraSettings, check_adapter, checked_mode,
                     read_adapter_config)
from .probe import load_fork_probe
from .tokens import CONVENTIONS, ControlTokens

# -- modules -----------------------------------------------------------------------------------

class LoraGate:
    """Which tokens of the next forward get the LoRA update: `value` is None (no token: the layers
    run the base linears only) or an array broadcastable to the activations' (B, L, 1), 1.0 or 0.0
    per token. One object is shared by every gated layer of a model; whoever builds a forward sets
    it first (MLX reads it when the graph is built, so changing it later does not touch that graph)."""

    def __init__(self) -> None:
        self.value: Optional[mx.array] = None


def gate_lora_layers(model: nn.Module) -> LoraGate:
    """Turn every mlx-lm `LoRALinear` of `model` into a `GatedLoRALinear` (same parameters, same
    names) that reads one shared `LoraGate`, stored as `model.lora_gate`."""
    from mlx_lm.tuner.lora import LoRALinear

    gate = LoraGate()
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            module.__class__ = GatedLoRALinear  # same fields; only __call__ differs
            module.gate = gate
    model.lora_gate = gate
    return gate


def _gated_lora_class():
    from mlx_lm.tuner.lora import LoRALinear

    class GatedLoRALinear(LoRALinear):
        """mlx-lm's LoRALinear whose update is multiplied by a per-token gate (see `LoraGate`)."""

        def __call__(self, x):
            y = self.linear(x)
            gate = self.gate.value
            if gate is None:
                return y  # no token needs the update: exactly the base linear
            z = (self.dropout(x) @ self.lora_a) @ self.lora_b
            return y + (self.scale * z * gate).astype(x.dtype)

    return GatedLoRALinear


GatedLoRALinear = _gated_lora_class()


class ExtendedEmbedding(nn.Module):
    """A frozen base embedding (plain or quantized) plus `extra` rows appended after its vocabulary."""

    def __init__(self, base: nn.Module, extra: mx.array):
        super().__init__()
        self.base = base
        self.extra = extra  # (k, D)
        self.base_vocab = int(base.weight.shape[0])

    def __call__(self, ids: mx.array) -> mx.array:
        ids = ids.astype(mx.int32)  # unsigned ids (argmax's uint32) would wrap below base_vocab
        inside = ids < self.base_vocab
        rows = self.base(mx.where(inside, ids, 0))
        added = self.extra[mx.maximum(ids - self.base_vocab, 0)].astype(rows.dtype)
        return mx.where(inside[..., None], rows, added)

    def as_linear(self, x: mx.array) -> mx.array:
        """Tied output: base logits then one logit per extra row."""
        return mx.concatenate([self.base.as_linear(x), x @ self.extra.T.astype(x.dtype)], axis=-1)


class ExtendedHead(nn.Module):
    """An untied LM head plus `extra` output rows."""

    def __init__(self, base: nn.Module, extra: mx.array):
        super().__init__()
        self.base = base
        self.extra = extra  # (k, D)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([self.base(x), x @ self.extra.T.astype(x.dtype)], axis=-1)


def _share_copy(value):
    """A new module tree whose arrays are the same objects as the original's (nothing copied)."""
    if isinstance(value, nn.Module):
        new = copy.copy(value)
        new.__dict__.update({k: copy.copy(v) for k, v in value.__dict__.items()
                             if isinstance(v, (set, dict, list))})  # e.g. the frozen-names set
        for key, item in value.items():
            new[key] = _share_copy(item)
        return new
    if isinstance(value, list):
        return [_share_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _share_copy(v) for k, v in value.items()}
    return value


def _is_tied(model: nn.Module) -> bool:
    return bool(getattr(model.args, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")


def _mean_rows(table: mx.array, count: int, seed: int) -> mx.array:
    """`count` rows at the mean of `table` (V, D) plus a little noise (so Fork and Child differ)."""
    table = table.astype(mx.float32)
    noise = mx.random.normal((count, table.shape[1]), key=mx.random.key(seed)) * table.std() * 0.1
    return table.mean(axis=0)[None] + noise


def _new_rows(model: nn.Module, count: int = 2, seed: int = 0):
    """Initial (input rows, output rows or None when tied) for the control tokens."""
    embed = model.model.embed_tokens
    vocab = int(embed.weight.shape[0])
    table = embed(mx.arange(vocab))  # (V, D), dequantized if needed
    rows_in = _mean_rows(table, count, seed)
    if _is_tied(model):
        return rows_in, None
    head_rows = model.lm_head(mx.eye(table.shape[1])).T  # (V, D): the head's rows, dequantized
    rows_out = _mean_rows(head_rows, count, seed + 1)
    return rows_in, rows_out


def add_control_tokens_to_tokenizer(tokenizer, convention: str = "project"):
    """A copy of an mlx-lm TokenizerWrapper with the two control tokens added after its vocabulary."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    inner = copy.deepcopy(tokenizer._tokenizer)
    base = len(inner)
    names = list(CONVENTIONS[convention])
    inner.add_tokens(names, special_tokens=True)
    vocab = inner.get_vocab()
    if [vocab[n] for n in names] != [base, base + 1]:
        raise UserError(f"cannot add {names} after a vocabulary of {base}: got ids {[vocab[n] for n in names]}")
    return TokenizerWrapper(inner, detokenizer_class=type(tokenizer._detokenizer),
                            eos_token_ids=sorted(tokenizer.eos_token_ids),
                            chat_template=getattr(tokenizer, "_chat_template", None))


def _control_for(base_vocab: int, convention: str) -> ControlTokens:
    return ControlTokens(base_vocab, base_vocab + 1, convention)


def _check_vocab(lm: LoadedModel) -> int:
    rows = int(lm.model.model.embed_tokens.weight.shape[0])
    size = len(lm.tokenizer._tokenizer)
    if size != rows:
        raise UserError(f"{lm.name}: tokenizer has {size} tokens but the embedding {rows} rows; "
                        "an APAR adapter needs them equal")
    return rows


# -- training --------------------------------------------------------------------------------

def prepare_for_training(lm: LoadedModel, lora: LoraSettings, convention: str = "project",
                         seed: int = 0, mode: str = "full"):
    """Turn `lm` (in place) into the trainable APAR model. Returns (adapted LoadedModel, config).

    Only the LoRA matrices and the new token rows are trainable."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from ..redrafter_head.model import tokenizer_hash

    base_vocab = _check_vocab(lm)
    model = lm.model
    tied = _is_tied(model)
    config = AdapterConfig(base_model=lm.name, tokenizer_hash=tokenizer_hash(lm.tokenizer),
                           base_vocab_size=base_vocab, tied=tied, lora=lora, convention=convention,
                           mode=checked_mode(mode))
    rows_in, rows_out = _new_rows(model, seed=seed)
    model.freeze()
    layers = len(model.model.layers) if lora.num_layers < 0 else lora.num_layers
    mx.random.seed(seed)
    linear_to_lora_layers(model, layers, lora.mlx_lm_parameters())
    if mode == "skeleton":
        gate_lora_layers(model)
    model.model.embed_tokens = ExtendedEmbedding(model.model.embed_tokens, rows_in)
    model.model.embed_tokens.base.freeze()
    if not tied:
        model.lm_head = ExtendedHead(model.lm_head, rows_out)
        model.lm_head.base.freeze()
    mx.eval(model.parameters())
    return _adapted_lm(lm, model, config), config


def trainable_weights(model: nn.Module) -> Dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))


def save_adapter(model: nn.Module, config: AdapterConfig, directory: Path, dtype=mx.float16) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in trainable_weights(model).items()}
    tmp = directory / (WEIGHTS_FILE + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), weights)
    tmp.rename(directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=1) + "\n")


# -- decoding --------------------------------------------------------------------------------

def load_apar_model(directory: Path, lm: LoadedModel, fuse: bool = True) -> LoadedModel:
    """The base model with the adapter applied, sharing every base array with `lm`."""
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.tuner.utils import linear_to_lora_layers

    directory = Path(directory)
    config = read_adapter_config(directory)
    check_adapter(config, lm, where=f"APAR adapter {directory}")
    try:
        weights = mx.load(str(directory / WEIGHTS_FILE))
    except Exception as exc:
        raise UserError(f"corrupt APAR adapter weights in {directory}: {type(exc).__name__}") from None
    model = _share_copy(lm.model)
    layers = len(model.model.layers) if config.lora.num_layers < 0 else config.lora.num_layers
    linear_to_lora_layers(model, layers, config.lora.mlx_lm_parameters())
    extra = weights.pop("model.embed_tokens.extra", None)
    head_extra = weights.pop("lm_head.extra", None)
    if extra is None or (not config.tied and head_extra is None):
        raise UserError(f"corrupt APAR adapter weights in {directory}: no control-token rows")
    dtype = _compute_dtype(lm)
    try:
        model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=False)
    except ValueError as exc:
        raise UserError(f"corrupt APAR adapter weights in {directory}: {str(exc).splitlines()[0]}") from None
    if config.mode == "skeleton":
        gate_lora_layers(model)  # per-token LoRA: cannot be fused
    elif fuse:
        fused = [(name, m.fuse()) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
        model.update_modules(tree_unflatten(fused))
    model.model.embed_tokens = ExtendedEmbedding(model.model.embed_tokens, extra.astype(dtype))
    if not config.tied:
        model.lm_head = ExtendedHead(model.lm_head, head_extra.astype(dtype))
    mx.eval(model.parameters())
    if config.mode == "full":  # the original model decides the first fork, if a probe is shipped
        probe = load_fork_probe(directory, lm.model)  # [Fork], [Child] = V, V + 1 (`_control_for`)
        if probe is not None:
            model.fork_probe = probe  # a plain attribute: not a parameter of the adapted model
    return _adapted_lm(lm, model, config)


def _compute_dtype(lm: LoadedModel):
    return getattr(mx, lm.dtype) if lm.dtype in ("float32", "float16", "bfloat16") else mx.float32


def _adapted_lm(lm: LoadedModel, model: nn.Module, config: AdapterConfig) -> LoadedModel:
    tokenizer = add_control_tokens_to_tokenizer(lm.tokenizer, config.convention)
    cfg = dict(lm.config)
    cfg["vocab_size"] = config.base_vocab_size + 2
    cfg["apar"] = {"convention": config.convention, "fork_token": config.fork_token,
                   "child_token": config.child_token, "mode": config.mode}
    return LoadedModel(model, tokenizer, lm.path, f"{lm.name}+apar", cfg, lm.dtype, lm.bits, layout=lm.layout)


def find_shipped_adapter(lm: LoadedModel, models_dir: Path) -> Optional[Path]:
    """The first adapter in models_dir/apar-* made for this model, if any."""
    for directory in sorted(Path(models_dir).glob("apar-*")):
        if not (directory / CONFIG_FILE).exists() or not (directory / WEIGHTS_FILE).exists():
            continue
        try:
            check_adapter(read_adapter_config(directory), lm)
        except UserError:
            continue
        return directory
    return None
