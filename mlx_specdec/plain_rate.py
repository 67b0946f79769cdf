"""Plain decoding's rate on this machine for this model, at a given context and sampling mode: the
figure a speculative answer's speed-up is stated against (the chat's status bar, the API's
`speculation.speedup_vs_plain`).

A speed-up is only true against plain decoding doing the same work: the same sampling (a top-p
nucleus sorts the vocabulary every token, a greedy argmax does not, so on a small model plain
sampling runs well below plain greedy) at about the same context (attention grows with it). So
the engine keeps, per sampling mode (`mode_of`), the points (mean context, ms per token) of the
plain answers it decoded alone (`ar`, at least 8 tokens), and the warm-up at load adds one where a
mode has none (engine_measured.py). What it says for an answer at context C uses only the points
within a factor of 2 of C:

    none         no figure (the status bar then shows none rather than a wrong one)
    1 or 2       their median
    3 or more    spread over contexts (the widest at least 1.5x the narrowest): the least-squares
                 line ms = a + b * context (b >= 0; else their median), evaluated at C

Kept across processes beside the verify-cost table, like `auto`'s measurements (auto.py).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from pathlib import Path
from typing import Deque, Dict, Optional, Tuple

import numpy as np

from .jsonstore import measured_path, read_json, write_json

KEEP = 32  # latest points per mode
WINDOW = 2.0  # points within this factor of the asked context count
MIN_TOKENS = 8  # an answer of fewer decoded tokens says too little


def mode_of(params) -> str:
    """Plain decoding's cost depends on the sampling path: an argmax, a full-vocabulary draw, a
    top-p nucleus (a sort), each with or without the repetition penalties."""
    if params.greedy:
        mode = "greedy"
    else:
        mode = "top-p" if params.top_p < 1.0 else "sampled"
    penalized = (params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0)
    return mode + ("+penalties" if penalized else "")


def mean_context(prompt_tokens: int, generated_tokens: int) -> float:
    """The context an answer's average decode step attends over."""
    return prompt_tokens + generated_tokens / 2.0


def store_path(lm) -> Path:
    return measured_path(lm, "plain")


class PlainRates:
    """Thread-safe (the server's request threads read while its generation thread records).
    store: the JSON file read at start and written after each point (None: this process only)."""

    def __init__(self, store: Optional[Path] = None):
        self.store = store
        self.points: Dict[str, Deque[Tuple[float, float]]] = defaultdict(lambda: deque(maxlen=KEEP))
        self._lock = threading.Lock()
        self._load()

    def record(self, mode: str, prompt_tokens: int, generated_tokens: int, decode_tps: float) -> None:
        """A plain answer decoded alone."""
        if generated_tokens - 1 < MIN_TOKENS or decode_tps <= 0:
            return
        with self._lock:
            self.points[mode].append((mean_context(prompt_tokens, generated_tokens), 1000.0 / decode_tps))
            self._save()

    def has_near(self, mode: str, context: float) -> bool:
        with self._lock:
            return bool(self._near(mode, context))

    def tps_at(self, mode: str, context: float) -> Optional[float]:
        """Plain decoding's tok/s at this context in this mode, from the points near it; None without."""
        with self._lock:
            near = self._near(mode, context)
        if not near:
            return None
        contexts, ms = (np.array(v, dtype=np.float64) for v in zip(*near))
        estimate = float(np.median(ms))
        if len(near) >= 3 and contexts.max() >= 1.5 * contexts.min():
            slope, intercept = np.polyfit(contexts, ms, 1)
            if slope >= 0:
                estimate = float(intercept + slope * context)
        return 1000.0 / estimate if estimate > 0 else None

    def _near(self, mode: str, context: float):
        return [(c, ms) for c, ms in self.points.get(mode, ()) if context / WINDOW <= c <= context * WINDOW]

    # -- across processes --------------------------------------------------------------------------

    def _load(self) -> None:
        try:
            for mode, points in read_json(self.store).get("points", {}).items():
                self.points[mode].extend((float(c), float(ms)) for c, ms in points[-KEEP:] if c > 0 and ms > 0)
        except (OSError, ValueError, TypeError, AttributeError):  # unreadable: start afresh, rewrite it
            self.points.clear()

    def _save(self) -> None:
        write_json(self.store, {"points": {mode: [[round(c, 1), round(ms, 3)] for c, ms in points]
                                           for mode, points in self.points.items() if points}})
