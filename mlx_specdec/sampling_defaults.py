"""The sampling a model answers with where a request does not say: the model's own
recommendation, read from its generation_config.json, else the measured default.

`chat`, `generate` and `serve` fill every sampling field a request leaves out from here; an
explicit flag or JSON field always wins; `bench` and the Python API stay greedy unless asked.
generation_config.json is read as Hugging Face reads it: `do_sample: false` is greedy; a
temperature, top_p or repetition_penalty it gives is taken (held to the registry's bounds), a
field it leaves out is Hugging Face's default (temperature 1, top_p 1, no penalty). `top_k` is
not supported here and is left out. A penalty default is left out for a method that cannot
apply one (penalties.SUPPORTED): there, only an explicit penalty is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

from .penalties import OFF, SUPPORTED

#: the default where the model recommends nothing: the chat loop-rate probe's choice
#: (benchmarks/loop_rate.py; figures and why in docs/decisions.md)
MEASURED: Dict[str, object] = {"temperature": 0.7, "top_p": 0.9}
MEASURED_SOURCE = "the measured default"
#: generation_config.json's fields read here (the sampling fields of the same names)
FIELDS = ("temperature", "top_p", "repetition_penalty")


def from_generation_config(directory: Optional[Path]) -> Optional[Dict[str, object]]:
    """The model's recommended sampling, or None where its directory has none."""
    from .settings import SAMPLING, SettingError

    file = Path(directory) / "generation_config.json" if directory else None
    try:
        config = json.loads(file.read_text()) if file is not None and file.is_file() else {}
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not any(k in config for k in FIELDS + ("do_sample",)):
        return None
    sampling = config.get("do_sample") is True or (config.get("do_sample") is None and "temperature" in config)
    hf = {"temperature": 1.0 if sampling else 0.0, "top_p": 1.0, "repetition_penalty": 1.0}  # Hugging Face's defaults
    settings = {s.name: s for s in SAMPLING}
    out: Dict[str, object] = {}
    for name, default in hf.items():
        try:
            out[name] = settings[name].parse(config.get(name, default), json=True)
        except SettingError:  # a value the engine does not take: Hugging Face's default
            out[name] = default
    if not sampling:
        out["temperature"] = 0.0
    return out


def model_defaults(directory: Optional[Path]) -> Tuple[Dict[str, object], str]:
    """(the default sampling fields, where they come from) for a model directory."""
    found = from_generation_config(directory)
    if found is not None:
        return found, f"{Path(directory).name}/generation_config.json"
    return dict(MEASURED), MEASURED_SOURCE


def spec_directory(spec: Optional[str]) -> Optional[Path]:
    """A model spec's directory where it is already here, without downloading or converting
    anything (the chat app shows the defaults before it loads the model): None otherwise."""
    from .model.default import default_model_dir, home

    if spec in (None, "", "default", "default-f16", "default-4bit"):
        return default_model_dir("4bit" if spec == "default-4bit" else "f16")
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        return home() / "models" / f"gguf-{path.stem}"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec, "generation_config.json")
    except Exception:  # noqa: BLE001  (not a repo id, or no cache: no recommendation known)
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def fill(given: Mapping[str, object], defaults: Mapping[str, object], method: str) -> Dict[str, object]:
    """The sampling fields a request runs with: the given ones, the rest from `defaults`."""
    out = {k: v for k, v in defaults.items() if method in SUPPORTED or k not in OFF}
    out.update({k: v for k, v in given.items() if v is not None})
    return out


def in_force(params) -> Dict[str, object]:
    """The sampling a generation runs with, as the server reports it and the CLI prints it."""
    out: Dict[str, object] = {"temperature": params.temperature}
    if not params.greedy:
        out.update(top_p=params.top_p, seed=params.seed)
    for name, off in OFF.items():
        if getattr(params, name) != off:
            out[name] = getattr(params, name)
    if params.repetition_penalty != 1.0:
        out["repetition_context_size"] = params.repetition_context_size
    return out


def describe(params, source: str = "") -> str:
    """One line: `sampling: temperature 0.7, top_p 0.9 (the measured default)`."""
    fields = ", ".join(f"{k} {v}" for k, v in in_force(params).items() if v is not None)
    return f"sampling: {fields}" + (f" (defaults: {source})" if source else "")
