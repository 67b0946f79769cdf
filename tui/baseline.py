"""The model's plain (autoregressive) decode speed on this machine: measured once, cached.

The status bar's speed-up is a method's tok/s over this figure. It is measured by a short plain
run at load time the first time a model is used on a machine, and kept in `baseline.json` in the
user data directory, keyed by model, dtype and machine, so later starts cost nothing.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Callable, Optional

BASELINE_FILE = "baseline.json"
PROMPT = "Write a short paragraph about the sea."
MEASURE_TOKENS = 32


def machine_key(engine) -> str:
    lm = getattr(engine, "lm", None)
    name = getattr(lm, "name", type(engine).__name__)
    dtype = getattr(lm, "dtype", "")
    return f"{name}|{dtype}|{platform.system()} {platform.machine()}|{os.cpu_count()} cores|{platform.node()}"


def cached_plain_speed(engine, directory: Path) -> Optional[float]:
    try:
        table = json.loads((directory / BASELINE_FILE).read_text())
        value = float(table[machine_key(engine)]["decode_tps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if value > 0 else None


def measure_plain_speed(engine, params_factory: Callable[..., object], tokens: int = MEASURE_TOKENS) -> float:
    """decode tok/s of one short greedy `ar` run (after a 2-token warm-up)."""
    messages = [{"role": "user", "content": PROMPT}]
    for _ in engine.chat(messages, method="ar", params=params_factory(max_tokens=2)):
        pass
    stats = None
    for event in engine.chat(messages, method="ar", params=params_factory(max_tokens=tokens)):
        if event.kind == "done":
            stats = event.stats
    return float(stats.decode_tps) if stats is not None else 0.0


def plain_speed(engine, directory: Path, params_factory: Callable[..., object]) -> float:
    """The cached figure, or measure now and cache it."""
    cached = cached_plain_speed(engine, directory)
    if cached:
        return cached
    value = measure_plain_speed(engine, params_factory)
    if value > 0:
        path = directory / BASELINE_FILE
        try:
            table = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            table = {}
        table[machine_key(engine)] = {"decode_tps": round(value, 3), "tokens": MEASURE_TOKENS}
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=2))
    return value
