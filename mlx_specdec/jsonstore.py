"""Small JSON files the engine keeps in the user cache (what `auto` and the plain rate measured):
read whole, written whole and atomically, so a crash or a second process never leaves half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional


MEASURED_DIR_ENV = "MLX_SPECDEC_MEASURED_DIR"  # another directory for them (the test suite's own)


def measured_path(lm, suffix: str) -> Path:
    """Where what the engine measured for this model on this machine is kept: beside its
    verify-cost table (drafting/cost_probe.py), or in $MLX_SPECDEC_MEASURED_DIR."""
    from .drafting.cost_probe import table_path

    table = table_path(lm)
    directory = Path(os.environ[MEASURED_DIR_ENV]) if os.environ.get(MEASURED_DIR_ENV) else table.parent
    return directory / f"{table.stem}-{suffix}.json"


def read_json(path: Optional[Path]) -> dict:
    """The file's object; {} where there is no file (or no path). Raises ValueError on a broken one."""
    if path is None or not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def write_json(path: Optional[Path], data: dict) -> None:
    """Replace the file; a read-only cache is not an error (the process still remembers)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, path)
    except OSError:
        pass
