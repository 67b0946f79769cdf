"""Progress with a rate and an ETA for long training work (distillation, training): tqdm's
updating line on a terminal, a plain line every `every` seconds otherwise (a log file must not
fill with carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional


def _clock_text(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """done / total, rate and ETA. On a terminal: tqdm's single updating line; otherwise one line
    every `every` seconds (and one at the end) through `log`. `enabled=False`: silent."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, every: float = 30.0,
                 log: Optional[Callable[[str], None]] = None, enabled: bool = True,
                 tty: Optional[bool] = None, clock: Callable[[], float] = time.perf_counter):
        self.total, self.desc, self.unit, self.n, self.every = total, desc, unit, initial, every
        self.start_n, self.postfix, self.clock = initial, {}, clock
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.enabled = enabled
        tty = sys.stderr.isatty() if tty is None else tty
        self.bar = None
        if enabled and tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, mininterval=2)
        self.t0 = self.last = clock()
        self.logged = initial  # n at the last line written (the closing line is not written twice)

    def line(self) -> str:
        spent = self.clock() - self.t0
        rate = (self.n - self.start_n) / spent if spent > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else float("nan")
        post = "".join(f", {k}={v}" for k, v in self.postfix.items())
        return (f"{self.desc}: {self.n}/{self.total} {self.unit}s, {rate:.2f} {self.unit}/s, "
                f"{_clock_text(spent)} spent, ETA {_clock_text(eta) if eta == eta else '?'}{post}")

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and self.clock() - self.last >= self.every:
            self.last, self.logged = self.clock(), self.n
            self.log(self.line())

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}
        if self.bar is not None:
            self.bar.set_postfix(**values, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.n > self.logged:
            self.log(self.line())
