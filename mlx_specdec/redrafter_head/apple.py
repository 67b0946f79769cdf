"""Apple's ReDrafter drafter checkpoints (`recurrent_drafting`, github apple/ml-recurrent-drafter)
converted into this project's head directory.

Apple's drafter (config `model_type: recurrent_drafting_drafter`: vocab_size, hidden_size,
exit_dim, num_draft_layers, rnn), for the LLM's final-norm hidden state h and embeddings e:

    s_0 = 0
    s_t = SiLU(rnn_w e_t + rnn_u s_{t-1} + rnn_u.bias)   rnn=true
    s_t = s_{t-1} + e_t                                  rnn=false
    x   = [h, s_t]                                       context first, state second
    x  <- input_proj(x)                                  only when exit_dim != 2 * hidden_size
    x  <- x + SiLU(lm_head.i.linear(x))                  i < num_draft_layers
    logits = lm_head.N(x)                                no bias, the full vocabulary
    logits: all but the 50 largest set 50000 below the largest (its `warp_logits`)

Ours concatenates [s_t, h] and has W's bias as b, so the import permutes the feature axis (and,
without an input projection, every block's rows and columns with it) and moves rnn_u's bias to W.
The head is a full-vocabulary `draft_vocab` head with a zero output bias.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from ..errors import UserError

MODEL_TYPE = "recurrent_drafting_drafter"
APPLE_TOP_K = 50  # Apple's drafter keeps its 50 best logits per step (warp_logits' default)
_SAFETENSORS = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN = "pytorch_model.bin"
_BIN_INDEX = "pytorch_model.bin.index.json"
_FIELDS = ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers")


def read_apple_config(src: Path) -> dict:
    """Apple's config.json, checked: the model type and the four sizes it needs."""
    if not src.is_dir():
        raise UserError(f"no drafter directory {src}")
    path = src / "config.json"
    if not path.exists():
        raise UserError(f"{src} has no config.json: not a ReDrafter checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"corrupt drafter config {path}: {type(exc).__name__}") from None
    if not isinstance(raw, dict) or raw.get("model_type") != MODEL_TYPE:
        found = raw.get("model_type") if isinstance(raw, dict) else None
        raise UserError(f"{path}: model_type is {found!r}, expected {MODEL_TYPE!r} "
                        "(an Apple ReDrafter drafter checkpoint)")
    for name in _FIELDS:
        value = raw.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "num_draft_layers" else 1):
            raise UserError(f"{path}: {name} is {value!r}, expected a positive integer")
    if not isinstance(raw.get("rnn", False), bool):
        raise UserError(f"{path}: rnn is {raw.get('rnn')!r}, expected true or false")
    return raw


def _load_safetensors(files) -> Dict[str, np.ndarray]:
    import mlx.core as mx

    out = {}
    for f in files:
        try:
            arrays = mx.load(str(f))
        except Exception as exc:
            raise UserError(f"corrupt drafter weights {f}: {type(exc).__name__}") from None
        out.update({k: np.array(v.astype(mx.float32)) for k, v in arrays.items()})
    return out


def _load_bin(files) -> Dict[str, np.ndarray]:
    """PyTorch checkpoints through the allow-listed reader (model/torch_checkpoint.py): tensors
    only, no torch needed, nothing in the pickle run."""
    import mlx.core as mx

    from ..model.torch_checkpoint import load_torch_checkpoint

    out = {}
    for f in files:
        state = load_torch_checkpoint(f)  # a refusal or a corrupt file: one line (a UserError)
        out.update({k: np.array(v.astype(mx.float32)) for k, v in state.items()})
    return out


def _shards(src: Path, index: str) -> list:
    try:
        weight_map = json.loads((src / index).read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"corrupt weight index {src / index}: {type(exc).__name__}") from None
    return [src / name for name in sorted(set(weight_map.values()))]


def read_apple_weights(src: Path) -> Dict[str, np.ndarray]:
    """All tensors as float32 numpy arrays, by Apple's names (a `drafter.` prefix dropped)."""
    if (src / _SAFETENSORS).exists():
        weights = _load_safetensors([src / _SAFETENSORS])
    elif (src / _SAFETENSORS_INDEX).exists():
        weights = _load_safetensors(_shards(src, _SAFETENSORS_INDEX))
    elif (src / _BIN).exists():
        weights = _load_bin([src / _BIN])
    elif (src / _BIN_INDEX).exists():
        weights = _load_bin(_shards(src, _BIN_INDEX))
    else:
        raise UserError(f"{src} has no {_SAFETENSORS} or {_BIN}")
    if weights and all(k.startswith("drafter.") for k in weights):  # saved from the LLM + drafter wrapper
        weights = {k[len("drafter."):]: v for k, v in weights.items()}
    return weights


def expected_shapes(cfg: dict) -> Dict[str, tuple]:
    H, X, N, V = (cfg[name] for name in ("hidden_size", "exit_dim", "num_draft_layers", "vocab_size"))
    shapes = {}
    if X != 2 * H:
        shapes.update({"input_proj.weight": (X, 2 * H), "input_proj.bias": (X,)})
    for i in range(N):
        shapes.update({f"lm_head.{i}.linear.weight": (X, X), f"lm_head.{i}.linear.bias": (X,)})
    shapes[f"lm_head.{N}.weight"] = (V, X)
    if cfg.get("rnn", False):
        shapes.update({"rnn_u.weight": (H, H), "rnn_u.bias": (H,), "rnn_w.weight": (H, H)})
    return shapes


def check_weights(src: Path, cfg: dict, weights: Dict[str, np.ndarray]) -> None:
    shapes = expected_shapes(cfg)
    missing = [k for k in shapes if k not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{src}: weights lack {missing[0]}{more}, which its config "
                        f"(exit_dim={cfg['exit_dim']}, num_draft_layers={cfg['num_draft_layers']}, "
                        f"rnn={str(cfg.get('rnn', False)).lower()}) needs")
    extra = sorted(k for k in weights if k not in shapes)
    if extra:
        raise UserError(f"{src}: unexpected tensor {extra[0]} for its config "
                        f"(not an Apple ReDrafter drafter, or a config that does not match its weights)")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise UserError(f"{src}: {name} has shape {tuple(weights[name].shape)}, expected {shape}")


def convert(cfg: dict, weights: Dict[str, np.ndarray], top_k: int = APPLE_TOP_K):
    """(our DrafterConfig fields, our weights by name) for Apple's checked config and weights."""
    H, X, N, V = (cfg[name] for name in ("hidden_size", "exit_dim", "num_draft_layers", "vocab_size"))
    rnn = bool(cfg.get("rnn", False))
    # ours[i] = apple[perm[i]]: our [s, h] from Apple's [h, s]
    perm = np.concatenate([np.arange(H, 2 * H), np.arange(0, H)])
    out = {}
    projected = X != 2 * H
    if projected:
        out["input_proj.weight"] = weights["input_proj.weight"][:, perm]
        out["input_proj.bias"] = weights["input_proj.bias"]
        feat = np.arange(X)  # the blocks act on the projection's own features: no permutation
    else:
        feat = perm
    for i in range(N):
        w, b = weights[f"lm_head.{i}.linear.weight"], weights[f"lm_head.{i}.linear.bias"]
        out[f"blocks.{i}.weight"] = w[feat][:, feat]
        out[f"blocks.{i}.bias"] = b[feat]
    out["proj.weight"] = weights[f"lm_head.{N}.weight"][:, feat]
    out["proj.bias"] = np.zeros((V,), dtype=np.float32)  # Apple's output layer has no bias
    if rnn:
        out["U.weight"] = weights["rnn_u.weight"]
        out["W.weight"] = weights["rnn_w.weight"]
        out["W.bias"] = weights["rnn_u.bias"]  # U s + W e + b: which of the two carries b is immaterial
    fields = dict(llm_hidden_size=H, embed_size=H, vocab_size=V, draft_vocab_size=V, num_blocks=N,
                  draft_length=4, output="draft_vocab",
                  recurrence="rnn" if rnn else "sum", initial_state="zero" if rnn else "embedding",
                  exit_dim=X if projected else 0, logits_top_k=max(0, int(top_k)))
    return fields, out


def source_dtype(cfg: dict) -> Optional[str]:
    """The float dtype the checkpoint states it was saved in, where it is one MLX has."""
    dtype = cfg.get("torch_dtype")
    return dtype if dtype in ("float32", "float16", "bfloat16") else None
