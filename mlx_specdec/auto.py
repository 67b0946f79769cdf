"""`--method auto`: per request, the method predicted fastest for this model on this machine, at
this prompt length and sampling, from what this engine has measured.

The candidates are `ar`, always, and `redrafter` where the model has a draft head. Per band (the
method, greedy or sampled, the prompt's length band) the chooser keeps the decode rates (tok/s)
of the latest answers each method wrote, and per request it takes, in order:

  measured  both measured in this band: `redrafter` where its median rate beats `ar`'s by more
            than MARGIN (a tie is `ar`'s: never slower than plain decoding beyond the noise);
  explore   one of them not yet measured in this band: `ar` first where the prediction below
            says `redrafter` would lose or cannot say, else `redrafter`; then the other, once, to
            compare, unless the prediction says `redrafter` loses clearly (below LOSES);
  busy      other requests waiting beside this one (the server): `ar`, whose continuous batch
            serves many at once better than speculation's rows do. A request arriving while a
            continuous batch runs joins it instead (serve/worker.py): an `ar` batch always, a
            `redrafter` batch while it holds fewer than `join_spec_rows()` rows.

Rates come from answers that decoded alone (a batch's rows share their steps and say nothing
about either method alone).

The prediction, before any answer, is speculation's expected tokens a step (PRIOR_TOKENS, by
greedy or sampled) over a step's cost in plain forwards at this context: the verify-cost table's
cost of the tokens a step verifies, times DRAFT_OVERHEAD for drafting. Without a table (a machine
no one calibrated) it is unknown and `ar` goes first.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from typing import Deque, Dict, NamedTuple, Optional, Tuple

import numpy as np

from .drafting.verify_cost import CostTable, verify_cost

CANDIDATES = ("ar", "redrafter")
MARGIN = 1.03  # redrafter's median rate must beat ar's by this factor to be chosen
LOSES = 0.9  # a predicted speed-up below this: redrafter is not even tried
KEEP = 7  # latest answers per band whose rates are kept (the median of these decides)
PRIOR_TOKENS = {True: 1.9, False: 1.6}  # tokens a speculative step is expected to emit: greedy, sampled
STEP_TOKENS = 5  # tokens a step is expected to verify (the own token and its drafts)
DRAFT_OVERHEAD = 1.15  # a step's drafting and host work, on top of its verify
BANDS = (1024, 4096)  # prompt-length bands: below 1k tokens, below 4k, longer
# A running redrafter batch takes `auto` requests while it has fewer rows than this: past it plain
# decoding's batch serves more (each row's verify multiplies the batch's work; the CPU runs out of
# compute sooner than a GPU runs out of bandwidth). docs/decisions.md has the figures.
JOIN_SPEC_ROWS = {"cpu": 2, "gpu": 4}


def join_spec_rows() -> int:
    from .model.device import on_cpu

    return JOIN_SPEC_ROWS["cpu" if on_cpu() else "gpu"]


class Choice(NamedTuple):
    method: str
    why: str  # one line, for the status bar and the API's speculation object

    def as_dict(self) -> dict:
        return {"chose": self.method, "why": self.why}


def band_of(prompt_tokens: int) -> int:
    return int(np.searchsorted(BANDS, prompt_tokens, side="right"))


class MethodChooser:
    """Thread-safe: the server's request threads choose while its generation thread records."""

    def __init__(self, table: Optional[CostTable], has_head: bool):
        self.table, self.has_head = table, has_head
        self.rates: Dict[Tuple[str, bool, int], Deque[float]] = defaultdict(lambda: deque(maxlen=KEEP))
        self._lock = threading.Lock()

    def predicted_speedup(self, prompt_tokens: int, greedy: bool) -> Optional[float]:
        """redrafter over ar from the verify-cost table alone; None without a table."""
        if self.table is None:
            return None
        cost = verify_cost(STEP_TOKENS, prompt_tokens, self.table) * DRAFT_OVERHEAD
        return PRIOR_TOKENS[greedy] / cost

    def choose(self, prompt_tokens: int, greedy: bool, busy: bool = False,
               unsupported: Optional[str] = None) -> Choice:
        """unsupported: why redrafter cannot take this request (None: it can)."""
        if not self.has_head:
            return Choice("ar", "no draft head for this model")
        if unsupported:
            return Choice("ar", unsupported)
        if busy:
            return Choice("ar", "other requests running: plain decoding batches them")
        band = band_of(prompt_tokens)
        with self._lock:
            ar, spec = (list(self.rates[(m, greedy, band)]) for m in CANDIDATES)
        mode = "greedy" if greedy else "sampled"
        if ar and spec:
            ratio = float(np.median(spec) / np.median(ar))
            method = "redrafter" if ratio > MARGIN else "ar"
            return Choice(method, f"measured here: redrafter {ratio:.2f}x ar ({mode}, {len(spec)}+{len(ar)} answers)")
        predicted = self.predicted_speedup(prompt_tokens, greedy)
        if predicted is None:
            first = "ar"
            why = "no verify-cost table for this machine (`mlx-specdec calibrate`)"
        else:
            first = "redrafter" if predicted > MARGIN else "ar"
            why = f"predicted redrafter {predicted:.2f}x ar from the verify-cost table"
        if predicted is not None and predicted < LOSES:
            return Choice("ar", why)
        if not ar and not spec:
            return Choice(first, f"{why}; measuring")
        other = "redrafter" if ar else "ar"
        return Choice(other, f"{why}; measuring {other} against it ({mode})")

    def record(self, method: str, prompt_tokens: int, greedy: bool, decode_tps: float, tokens: int) -> None:
        """An answer's decode rate (answers of fewer than 8 tokens say too little to keep)."""
        if method not in CANDIDATES or tokens < 8 or decode_tps <= 0:
            return
        with self._lock:
            self.rates[(method, greedy, band_of(prompt_tokens))].append(decode_tps)
