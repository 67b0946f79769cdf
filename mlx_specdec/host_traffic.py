"""What a decoding step costs the host, counted the same way on every device.

On a GPU a step is bound by what makes the device wait for the host, not by the arithmetic of
a small model: a blocking read (the host waits for every queued op), an array built from host
data (a copy the next op waits for) and a shape not seen before (a kernel or graph compiled
anew). These counts do not depend on the machine, so they can be measured on the test bench and
asserted in tests, where timings cannot.

Every deliberate read of a decoding loop goes through `read_host` (or `read_scalar`,
`read_list`), every `mx.async_eval` through `queue` and every host-built input of a step through
`to_device`; `Tally` takes one answer's share of the running counts and
the verify shapes it used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Set, Tuple

import mlx.core as mx
import numpy as np


@dataclass
class Counts:
    reads: int = 0  # blocking host reads (each waits for the queued work it reads)
    uploads: int = 0  # arrays built from host data
    shapes: Set[Tuple[int, ...]] = field(default_factory=set)  # verify input shapes seen
    idle_s: float = 0.0  # host time with no device work queued: from a read that left nothing
    idle_since: Optional[float] = None  # pending to the next queue or read
    queued: Set[int] = field(default_factory=set)  # ids of arrays queued with `queue`, not yet read


COUNTS = Counts()  # the process's running counts


def queue(*arrays) -> None:
    """`mx.async_eval`: the device's next work starts while the host goes on."""
    _busy()
    COUNTS.queued |= {id(a) for a in arrays}
    mx.async_eval(*arrays)


def _busy() -> None:
    if COUNTS.idle_since is not None:
        COUNTS.idle_s += time.perf_counter() - COUNTS.idle_since
        COUNTS.idle_since = None


def _read(arrays, take):
    """One counted blocking read; after it the device idles unless other queued work is pending."""
    COUNTS.reads += 1
    _busy()
    values = take()
    COUNTS.queued -= {id(a) for a in arrays}
    if not COUNTS.queued:
        COUNTS.idle_since = time.perf_counter()
    return values


def read_host(*arrays) -> list:
    """Evaluate together and bring to the host (a decoding loop's deliberate sync): numpy arrays."""
    def take():
        mx.eval(*arrays)
        return [np.array(a) for a in arrays]
    return _read(arrays, take)


def read_scalar(array: mx.array):
    """`array.item()`, counted as one blocking read."""
    return _read((array,), array.item)


def read_list(array: mx.array) -> list:
    """`array.tolist()`, counted as one blocking read."""
    return _read((array,), array.tolist)


def to_device(values, dtype=None) -> mx.array:
    """An array built from host data (numpy, lists): counted as one upload."""
    COUNTS.uploads += 1
    return mx.array(values, dtype=dtype) if dtype is not None else mx.array(values)


class Tally:
    """One answer's reads, uploads and verify shapes, from the moment it was made."""

    def __init__(self):
        if COUNTS.idle_since is not None:  # idle before this answer is not its own
            COUNTS.idle_since = time.perf_counter()
        COUNTS.queued.clear()  # work an earlier answer queued and never read (its last step) is not pending
        self.reads, self.uploads, self.idle_s = COUNTS.reads, COUNTS.uploads, COUNTS.idle_s
        self.shapes = set(COUNTS.shapes)
        self.seen: Set[Tuple[int, ...]] = set()
        self.steps = 0  # verifies (decoding steps) so far

    def verify(self, shape) -> None:
        """A verify of this answer, of this input shape."""
        shape = tuple(int(s) for s in shape)
        self.steps += 1
        self.seen.add(shape)
        COUNTS.shapes.add(shape)

    def figures(self) -> dict:
        """Per decoding step: blocking reads, host-built arrays, host milliseconds with no device
        work queued (the device idles); distinct verify shapes in the answer, and how many of them
        this process had not seen before (compiled anew)."""
        steps = max(1, self.steps)
        return {"syncs_per_step": round((COUNTS.reads - self.reads) / steps, 3),
                "host_arrays_per_step": round((COUNTS.uploads - self.uploads) / steps, 3),
                "host_idle_ms_per_step": round(1000 * (COUNTS.idle_s - self.idle_s) / steps, 3),
                "verify_shapes": len(self.seen), "new_verify_shapes": len(self.seen - self.shapes)}
