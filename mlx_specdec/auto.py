"""`--method auto`: per request, the method predicted fastest for this model on this machine, at
this prompt length and sampling, from what this engine has measured.

The candidates are `ar`, always, and `redrafter` where the model has a draft head. Per band (the
method, greedy or sampled, the prompt's length band) the chooser keeps the decode rates (tok/s)
of the latest answers each method wrote, and per request it takes, in order:

  measured  both measured in this band: `redrafter` where its median rate beats `ar`'s by more
            than MARGIN (a tie is `ar`'s: never slower than plain decoding beyond the noise);
  explore   one of them not yet measured in this band: the one the prediction below favours
            first, then the other, once, so that by its second answer a band has tried both
            (a measured loss is not tried again: it stays measured; nor is redrafter where its
            planner would verify no drafts, each more token costing about a forward: `cannot_pay`);
  busy      other requests waiting beside this one (the server): `ar`, whose continuous batch
            serves many at once better than speculation's rows do. A request arriving while a
            continuous batch runs joins it instead (serve/worker.py): an `ar` batch always, a
            `redrafter` batch while it holds fewer than `join_spec_rows()` rows.

Rates come from answers that decoded alone (a batch's rows share their steps and say nothing
about either method alone).

What is measured is kept across processes, beside the verify-cost table (`store`): a new chat
or server starts from what this machine measured for this model, not from the prior.

The prediction, before a band is measured, is what ReDrafter's planner would get: the best over
step lengths T of (1 + the drafts expected to be accepted) / (the verify-cost table's cost of T
tokens × a step's overhead), the acceptance by depth and the overhead taken from this machine's
measurements (the acceptance of its last redrafter answers; the overhead that makes a measured
band's prediction match its measured ratio) where there are any, else the shipped head's
(PRIOR_ACCEPTANCE; the step's fixed cost measured on this device, drafting/step_cost.py, else
DRAFT_OVERHEAD). Without a table (a machine no one calibrated) it is unknown
and `ar` goes first.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from pathlib import Path
from typing import Deque, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .drafting.verify_cost import CostTable, cost_of, costs_at
from .jsonstore import measured_path, read_json, write_json

CANDIDATES = ("ar", "redrafter")
MARGIN = 1.03  # redrafter's median rate must beat ar's by this factor to be chosen
LOSES = 0.9  # a ratio measured below this elsewhere, and predicted here: redrafter is not tried
KEEP = 7  # latest answers per band whose rates are kept (the median of these decides)
# The shipped head's acceptance by depth (the fraction of steps accepting at least k drafts) on
# held-out chats, greedy and sampled (docs/decisions.md): the prior until this
# machine has measured its own.
PRIOR_ACCEPTANCE = {True: (0.63, 0.26, 0.09, 0.03, 0.01), False: (0.55, 0.2, 0.06, 0.02, 0.005)}
DRAFT_OVERHEAD = 1.25  # a step's drafting and host work on top of its verify, until measured
BANDS = (1024, 4096)  # prompt-length bands: below 1k tokens, below 4k, longer
BAND_CONTEXT = (300, 2000, 6000)  # a context typical of each band, for its prediction
# A running redrafter batch takes `auto` requests while it has fewer rows than this: past it plain
# decoding's batch serves more (each row's verify multiplies the batch's work; the CPU runs out of
# compute sooner than a GPU runs out of bandwidth). docs/decisions.md has the figures.
JOIN_SPEC_ROWS = {"cpu": 2, "gpu": 4}


def join_spec_rows() -> int:
    from .model.device import on_cpu

    return JOIN_SPEC_ROWS["cpu" if on_cpu() else "gpu"]


def store_path(lm, head: Optional[str]) -> Path:
    """Where `auto`'s measurements for this model, head and machine are kept: beside the
    verify-cost table (drafting/cost_probe.py)."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(head or "none")).name)
    return measured_path(lm, f"auto-{name}")


class Choice(NamedTuple):
    method: str
    why: str  # one line, for the status bar and the API's speculation object

    def as_dict(self) -> dict:
        return {"chose": self.method, "why": self.why}


def band_of(prompt_tokens: int) -> int:
    return int(np.searchsorted(BANDS, prompt_tokens, side="right"))


class MethodChooser:
    """Thread-safe: the server's request threads choose while its generation thread records.
    store: a JSON file the measurements are read from and written to (None: this process only)."""

    def __init__(self, table: Optional[CostTable], has_head: bool, store: Optional[Path] = None,
                 step_overhead: Optional[float] = None):
        """step_overhead: a draft step's fixed cost here, in one-token forwards (drafting/step_cost.py)."""
        self.table, self.has_head, self.store, self.step_overhead = table, has_head, store, step_overhead
        self.rates: Dict[Tuple[str, bool, int], Deque[float]] = defaultdict(lambda: deque(maxlen=KEEP))
        self.acceptance: Dict[bool, List[float]] = {}  # by greedy: the last redrafter answer's, by depth
        self._lock = threading.Lock()
        self._load()

    # -- the prediction ----------------------------------------------------------------------------

    def _per_cost(self, context: int, acceptance) -> np.ndarray:
        """(T,) expected tokens per unit of verify cost for a step of 1..T tokens."""
        per_t, fixed = costs_at(context, self.table), self.step_overhead or 0.0
        reach = np.concatenate([[1.0], np.asarray(acceptance, dtype=np.float64)])
        return np.array([float(np.sum(reach[:t])) / (cost_of(per_t, t) + fixed) for t in range(1, len(reach) + 1)])

    def _planned(self, context: int, acceptance) -> float:
        """Expected tokens per unit of verify cost at the best step length (the planner's choice)."""
        return float(self._per_cost(context, acceptance).max())

    def cannot_pay(self, prompt_tokens: int, greedy: bool) -> bool:
        """Whether the planner would verify no drafts here (a step of one token is its best: each
        more query token costs about a forward of its own); redrafter is then plain decoding plus
        the head's work, and is not tried."""
        return self.table is not None and int(np.argmax(self._per_cost(prompt_tokens, self._acceptance(greedy)))) == 0

    def _acceptance(self, greedy: bool):
        return self.acceptance.get(greedy) or PRIOR_ACCEPTANCE[greedy]

    def _measured_overhead(self, greedy: bool) -> Optional[float]:
        """The overhead that makes the prediction of each band measured in this mode match its
        measured ratio (their median); None where no band is."""
        overheads = []
        for band, context in enumerate(BAND_CONTEXT):
            ar, spec = (self.rates.get((m, greedy, band)) for m in CANDIDATES)
            if ar and spec:
                ratio = float(np.median(spec) / np.median(ar))
                overheads.append(self._planned(context, self._acceptance(greedy)) / ratio)
        return float(np.median(overheads)) if overheads else None

    def predicted_speedup(self, prompt_tokens: int, greedy: bool) -> Optional[float]:
        """redrafter over ar as its planner would get it here; None without a table."""
        if self.table is None:
            return None
        overhead = self._measured_overhead(greedy) or (1.0 if self.step_overhead else DRAFT_OVERHEAD)
        return self._planned(prompt_tokens, self._acceptance(greedy)) / overhead

    # -- the choice --------------------------------------------------------------------------------

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
            predicted = self.predicted_speedup(prompt_tokens, greedy)
            measured_elsewhere = self._measured_overhead(greedy) is not None
        mode = "greedy" if greedy else "sampled"
        if ar and spec:
            ratio = float(np.median(spec) / np.median(ar))
            method = "redrafter" if ratio > MARGIN else "ar"
            return Choice(method, f"measured here: redrafter {ratio:.2f}x ar ({mode}, {len(spec)}+{len(ar)} answers)")
        if self.cannot_pay(prompt_tokens, greedy):
            return Choice("ar", f"a draft costs about a forward here ({self.table.source}): speculation cannot pay")
        if predicted is None:
            first, why = "ar", "no verify-cost table for this machine (`mlx-specdec calibrate`)"
        else:
            first = "redrafter" if predicted > MARGIN else "ar"
            source = "this machine's other measurements" if measured_elsewhere else "the verify-cost table"
            why = f"predicted redrafter {predicted:.2f}x ar from {source}"
        if not ar and not spec:
            return Choice(first, f"{why}; measuring")
        if ar and measured_elsewhere and predicted is not None and predicted < LOSES:
            return Choice("ar", why)  # a loss measured in another band, predicted here too
        other = "redrafter" if ar else "ar"
        return Choice(other, f"{why}; measuring {other} against it ({mode})")

    def record(self, method: str, prompt_tokens: int, greedy: bool, decode_tps: float, tokens: int,
               acceptance: Optional[List[float]] = None) -> None:
        """An answer's decode rate (answers of fewer than 8 tokens say too little to keep) and, for
        redrafter, its acceptance by depth."""
        if method not in CANDIDATES or tokens < 8 or decode_tps <= 0:
            return
        with self._lock:
            self.rates[(method, greedy, band_of(prompt_tokens))].append(decode_tps)
            if acceptance:
                self.acceptance[greedy] = [float(a) for a in acceptance]
            self._save()

    # -- across processes --------------------------------------------------------------------------

    def _load(self) -> None:
        try:
            data = read_json(self.store)
            for key, values in data.get("rates", {}).items():
                method, greedy, band = key.split("|")
                self.rates[(method, greedy == "greedy", int(band))].extend(float(v) for v in values[-KEEP:])
            self.acceptance = {mode == "greedy": [float(a) for a in values]
                               for mode, values in data.get("acceptance", {}).items()}
        except (OSError, ValueError, TypeError, AttributeError):  # unreadable: start afresh, rewrite it
            self.rates.clear()
            self.acceptance = {}

    def _save(self) -> None:
        write_json(self.store, {
            "rates": {f"{m}|{'greedy' if g else 'sampled'}|{b}": [round(v, 3) for v in values]
                      for (m, g, b), values in self.rates.items() if values},
            "acceptance": {"greedy" if g else "sampled": values for g, values in self.acceptance.items()}})
