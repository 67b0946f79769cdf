"""The server's one generation thread: requests decode one at a time, first come first served.

The HTTP side (an asyncio loop) submits a `Job` and reads its events from an asyncio queue that
this thread fills through `loop.call_soon_threadsafe`. One long-lived thread owns every MLX call
(MLX streams are per thread), and one model's KV cache (the engine's prefix store) is touched by
one request at a time. A job whose client went away is cancelled: the thread stops at the next
event and closes the generator, whose `finally` rolls the cache back, so the next request starts
from a clean cache.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ..decoding import GenerationParams

DONE = object()  # the end of a job's events


@dataclass
class Job:
    prompt_ids: List[int]
    method: str
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    events: "asyncio.Queue" = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class GenerationWorker:
    def __init__(self, load: Callable[[], object]):
        """load() -> the engine, called on the generation thread itself: MLX keeps streams per
        thread, and arrays made on one thread's stream (a lazily loaded draft head, a compiled
        draft) then fail on another ("There is no Stream(cpu, 0) in current thread")."""
        self.engine = None
        self.error: Optional[BaseException] = None
        self.ready = threading.Event()
        self._load = load
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self._thread.start()

    def wait_ready(self):
        """The engine, once loaded (raises what the load raised)."""
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self.engine

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> Job:
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        try:
            self.engine = self._load()
        except BaseException as error:  # noqa: BLE001  (raised again by wait_ready, on the caller's thread)
            self.error = error
            return
        finally:
            self.ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():  # the client left while it waited
                job.put(DONE)
                continue
            events = None
            try:
                events = self.engine.generate_ids(job.prompt_ids, job.method, job.params)
                for event in events:
                    if job.cancelled.is_set():
                        break
                    job.put(event)
            except Exception as error:  # noqa: BLE001  (reported to that request; the server goes on)
                job.put(error)
            finally:
                if events is not None and hasattr(events, "close"):
                    events.close()  # a stopped generation's `finally` rolls its cache back
                job.put(DONE)
