"""Ordered messages between pipeline ranks over MLX's own `mx.distributed` send/recv.

Every message is a fixed header of `HEADER` int32 fields, then (if the header says so) one
payload array whose dtype and shape the header carries. `mx.distributed` has no tags and no
probe, and a pair's messages arrive in the order sent (as MPI's non-overtaking rule for one tag),
so PipeInfer's ordered transactions are simply messages on one link in order.

Each link end runs a thread:
- `Outbox`: the sender. A send never blocks the computing thread (the paper's buffered
  `MPI_Bsend`). With an emulated link (`--link-latency-ms`, `--link-gbps`) each message leaves
  when a real link would have delivered it: after the latency, and after the bytes of every
  earlier message on that link.
- `Inbox`: the receiver. It drains the link as messages arrive and queues them, so a stage sees
  a cancellation that arrived behind a run it has not computed yet (what the paper's
  `MPI_Iprobe` for CANCEL_RUN gives). `on_arrival` lets a stage act at once (record and forward
  a cancellation). `get(timeout)` raises `RankFailure` when the peer is gone or silent: no
  receive in this package waits forever.
Both threads use MLX streams of their own (MLX streams are per thread).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

HEADER = 12
RUN, RESULT, CANCEL, TRIM, STOP, SKIPPED, HELLO, ERROR = range(1, 9)
KIND_NAMES = {RUN: "run", RESULT: "result", CANCEL: "cancel", TRIM: "trim", STOP: "stop", SKIPPED: "skipped",
              HELLO: "hello", ERROR: "error"}
_DTYPES = {1: mx.float32, 2: mx.int32}
_CODES = {mx.float32: 1, mx.int32: 2}


class RankFailure(RuntimeError):
    """A rank died, hung or could not be reached: the run ends with this one line."""


@dataclass
class Message:
    kind: int
    run: int = 0  # the run (batch) id
    count: int = 0  # tokens in the run
    start: int = 0  # position of the run's first token
    a: int = 0  # kind-specific: RUN/RESULT the first token whose prediction the head wants; CANCEL first id
    b: int = 0  # kind-specific: RUN/RESULT 1 when the head wants hidden states; CANCEL last id; TRIM length
    payload: Optional[mx.array] = None

    def header(self) -> mx.array:
        fields = [self.kind, self.run, self.count, self.start, self.a, self.b, 0, 0, 0, 0, 0, 0]
        if self.payload is not None:
            shape = self.payload.shape
            if len(shape) > 3:
                raise ValueError("payloads have at most 3 dimensions")
            fields[6] = _CODES[self.payload.dtype]
            fields[7] = len(shape)
            fields[8:8 + len(shape)] = shape
        return mx.array(fields, dtype=mx.int32)


def text_payload(text: str) -> mx.array:
    return mx.array(np.frombuffer(text.encode("utf-8")[:4000], dtype=np.uint8).astype(np.int32))


def payload_text(payload: Optional[mx.array]) -> str:
    if payload is None:
        return ""
    return bytes(np.array(payload).astype(np.uint8).tolist()).decode("utf-8", "replace")


class Outbox:
    def __init__(self, group, peer: int, latency_ms: float = 0.0, gbps: float = 0.0):
        self.group, self.peer = group, peer
        self.latency, self.gbps = latency_ms / 1000.0, gbps
        self._queue: "queue.Queue" = queue.Queue()
        self._free_at = 0.0  # when the emulated wire has carried every earlier message
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name=f"outbox->{peer}", daemon=True)
        self._thread.start()

    def send(self, message: Message) -> None:
        if self.error is not None:
            # the same words as the Inbox's: which side notices a dead peer first is a race
            raise RankFailure(f"rank {self.peer} is gone: lost the link ({self.error})")
        if message.payload is not None:
            mx.eval(message.payload)  # computed on the caller's stream, before the hand-over
        due = 0.0
        if self.latency or self.gbps:
            size = 4 * HEADER + (message.payload.nbytes if message.payload is not None else 0)
            wire = size * 8 / (self.gbps * 1e9) if self.gbps else 0.0
            now = time.perf_counter()
            self._free_at = max(self._free_at, now) + wire
            due = self._free_at + self.latency
        self._queue.put((message, due))

    def _loop(self) -> None:
        stream = mx.new_stream(mx.cpu)
        try:
            while True:
                message, due = self._queue.get()
                if message is None:
                    return
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)  # the emulated link's delay
                with mx.stream(stream):
                    # one eval per send: two sends in one graph may go out in either order
                    mx.eval(mx.distributed.send(message.header(), self.peer, group=self.group))
                    if message.payload is not None:
                        mx.eval(mx.distributed.send(message.payload, self.peer, group=self.group))
        except Exception as error:  # noqa: BLE001  (reported by the next send)
            self.error = error

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put((None, 0.0))
        self._thread.join(timeout)


class Inbox:
    def __init__(self, group, peer: int, on_arrival: Optional[Callable[[Message], bool]] = None):
        """on_arrival(message) runs in the receiver thread as each message arrives; returning
        True consumes it (it is not queued)."""
        self.group, self.peer, self.on_arrival = group, peer, on_arrival
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"inbox<-{peer}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        stream = mx.new_stream(mx.cpu)
        try:
            while True:
                with mx.stream(stream):
                    header = mx.distributed.recv((HEADER,), mx.int32, self.peer, group=self.group)
                    mx.eval(header)
                    f = [int(v) for v in header.tolist()]
                    payload = None
                    if f[6]:
                        payload = mx.distributed.recv(tuple(f[8:8 + f[7]]), _DTYPES[f[6]], self.peer, group=self.group)
                        mx.eval(payload)
                message = Message(f[0], f[1], f[2], f[3], f[4], f[5], payload)
                if self.on_arrival is not None and self.on_arrival(message):
                    continue
                self._queue.put(message)
                if message.kind == STOP:
                    return
        except Exception as error:  # noqa: BLE001  (the peer is gone: the reader is told)
            self._queue.put(RankFailure(f"rank {self.peer} is gone: {error}"))

    def get(self, timeout: float) -> Message:
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise RankFailure(f"rank {self.peer} sent nothing for {timeout:g} s (hung or too slow; see --rank-timeout)")
        if isinstance(item, BaseException):
            raise item
        if item.kind == ERROR:
            raise RankFailure(payload_text(item.payload) or f"rank {self.peer} failed")
        return item

    def pending(self) -> bool:
        return not self._queue.empty()
