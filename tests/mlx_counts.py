"""Host traffic counted through MLX and numpy themselves, not through the project's wrappers.

While a `Counter` is on, every way a Python program makes the host wait for the device or feeds
it host data is counted, whoever calls it:
    reads   `mx.eval` of work not yet evaluated, and every conversion of a pending array to the host:
            `item`, `tolist`, `bool`, `int`, `float`, `__index__`, `np.array` / `np.asarray`
    queued  `mx.async_eval`
    built   `mx.array(...)`: an array made from host data
An array becomes known evaluated when it is made from host data, read, or evaluated; reading
it again, or evaluating it again, costs nothing and is not counted. `mx.async_eval` does not make
an array evaluated: the read that waits for it is the blocking one.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import mlx.core as mx
import numpy as np

REAL = mx.array
CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class Counter:
    def __init__(self):
        self.on = False
        self.reads = self.queued = self.built = 0
        self.known = {}  # id -> array, evaluated (kept alive so an id is not reused)

    def _leaves(self, args):
        for a in args:
            if isinstance(a, REAL):
                yield a
            elif isinstance(a, (list, tuple)):
                yield from self._leaves(a)
            elif isinstance(a, dict):
                yield from self._leaves(list(a.values()))

    def evaluated(self, arrays) -> None:
        for a in arrays:
            self.known[id(a)] = a

    def read(self, arrays) -> None:
        arrays = list(arrays)
        if self.on and any(id(a) not in self.known for a in arrays):
            self.reads += 1
        self.evaluated(arrays)


@contextlib.contextmanager
def counting(patch) -> Iterator[Counter]:
    """Install the counting hooks for the test (`patch`: pytest's monkeypatch); counts are taken
    only while `counter.on` is True."""
    counter = Counter()
    real_eval, real_async, real_np_array, real_np_asarray = mx.eval, mx.async_eval, np.array, np.asarray

    def eval_(*args):
        counter.read(counter._leaves(args))
        return real_eval(*args)

    def async_eval(*args):
        if counter.on:
            counter.queued += 1
        return real_async(*args)

    def to_numpy(real):
        def convert(obj, *args, **kwargs):
            if isinstance(obj, REAL):
                counter.read([obj])
            return real(obj, *args, **kwargs)
        return convert

    for name in CONVERSIONS:
        method = getattr(REAL, name)

        def hooked(self, *args, _method=method, **kwargs):
            counter.read([self])
            return _method(self, *args, **kwargs)

        patch.setattr(REAL, name, hooked)

    class _Built(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, REAL)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, REAL)

        def __call__(cls, *args, **kwargs):
            made = REAL(*args, **kwargs)
            if counter.on:
                counter.built += 1
            counter.evaluated([made])
            return made

        def __getattr__(cls, name):
            return getattr(REAL, name)

    class array(metaclass=_Built):  # noqa: N801 - stands in for mx.array
        pass

    patch.setattr(mx, "eval", eval_)
    patch.setattr(mx, "async_eval", async_eval)
    patch.setattr(mx, "array", array)
    patch.setattr(np, "array", to_numpy(real_np_array))
    patch.setattr(np, "asarray", to_numpy(real_np_asarray))
    yield counter


def count_steps(patch, cls, counter: Counter) -> dict:
    """Count only while `cls.step` (a decoding loop's step generator) runs -> {"steps": n}."""
    real = cls.step
    seen = {"steps": 0}

    def step(self):
        seen["steps"] += 1
        inner = real(self)
        while True:
            counter.on = True
            try:
                item = next(inner)
            except StopIteration:
                return
            finally:
                counter.on = False
            yield item

    patch.setattr(cls, "step", step)
    return seen
