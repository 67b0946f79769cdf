"""An APAR adapter directory's config: what it was trained for, its LoRA settings, its tokens.

`adapter_config.json` beside `adapters.safetensors`; read by the adapter loader (`adapter.py`),
the fork-probe trainer (`probe.py`) and the adapter trainer (`train.py`). Nothing here builds a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import UserError
from ..model.loader import LoadedModel
from .tokens import CONVENTIONS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
FORMAT = "mlx-specdec-apar"


class AdapterMismatch(UserError):
    pass


@dataclass
class LoraSettings:
    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    num_layers: int = -1  # the last N blocks; -1 = all
    keys: Optional[List[str]] = None  # module paths inside a block; None = every linear

    def mlx_lm_parameters(self) -> Dict[str, object]:
        params: Dict[str, object] = {"rank": self.rank, "scale": self.scale, "dropout": self.dropout}
        if self.keys is not None:
            params["keys"] = list(self.keys)
        return params


@dataclass
class AdapterConfig:
    base_model: str
    tokenizer_hash: str
    base_vocab_size: int
    tied: bool
    lora: LoraSettings = field(default_factory=LoraSettings)
    convention: str = "project"
    mode: str = "full"  # "full" | "skeleton" (see the module docstring)
    format: str = FORMAT
    version: int = 1

    @property
    def fork_token(self) -> str:
        return CONVENTIONS[self.convention][0]

    @property
    def child_token(self) -> str:
        return CONVENTIONS[self.convention][1]

    def to_json(self) -> dict:
        lora = self.lora
        return {
            "format": self.format, "version": self.version, "base_model": self.base_model,
            "tokenizer_hash": self.tokenizer_hash, "base_vocab_size": self.base_vocab_size,
            "tied_embeddings": self.tied,
            "apar": {"convention": self.convention, "fork_token": self.fork_token,
                     "child_token": self.child_token, "mode": self.mode},
            # mlx-lm's adapter_config keys, so its tools can read the LoRA part
            "fine_tune_type": "lora", "num_layers": lora.num_layers,
            "lora_parameters": lora.mlx_lm_parameters(),
        }

    @classmethod
    def from_json(cls, data: dict) -> "AdapterConfig":
        params = data.get("lora_parameters", {})
        lora = LoraSettings(rank=int(params.get("rank", 8)), scale=float(params.get("scale", 20.0)),
                            dropout=float(params.get("dropout", 0.0)),
                            num_layers=int(data.get("num_layers", -1)), keys=params.get("keys"))
        return cls(base_model=data.get("base_model", ""), tokenizer_hash=data.get("tokenizer_hash", ""),
                   base_vocab_size=int(data["base_vocab_size"]), tied=bool(data.get("tied_embeddings", True)),
                   lora=lora, convention=data.get("apar", {}).get("convention", "project"),
                   mode=checked_mode(data.get("apar", {}).get("mode", "full")),
                   format=data.get("format", ""), version=int(data.get("version", 1)))


MODES = ("full", "skeleton")


def checked_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown APAR adapter mode {mode!r} (known: {', '.join(MODES)})")
    return mode


def read_adapter_config(directory: Path) -> AdapterConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise UserError(f"{directory} has no {CONFIG_FILE}: not an APAR adapter")
    try:
        data = json.loads(path.read_text())
        config = AdapterConfig.from_json(data)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"corrupt APAR adapter config {path}: {exc}") from None
    if config.format != FORMAT:
        raise UserError(f"{path} is not an mlx-specdec APAR adapter (format {config.format!r})")
    return config


def check_adapter(config: AdapterConfig, lm: LoadedModel, where: str = "APAR adapter") -> None:
    from ..redrafter_head.model import tokenizer_hash

    rows = int(lm.model.model.embed_tokens.weight.shape[0])
    if config.base_vocab_size != rows or config.tokenizer_hash != tokenizer_hash(lm.tokenizer):
        raise AdapterMismatch(f"{where} was trained for {config.base_model or 'another model'}, "
                              f"not {lm.name} (vocabulary or tokenizer differ)")
