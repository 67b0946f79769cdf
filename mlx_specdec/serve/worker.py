"""The server's one generation thread: requests decode first come first served; `ar` and
`redrafter` requests join a running batch at its next step.

The HTTP side (an asyncio loop) submits a `Job` and reads its events from an asyncio queue that
this thread fills through `loop.call_soon_threadsafe`. One long-lived thread owns every MLX call
(MLX streams are per thread), and one model's KV cache (the engine's prefix store) is touched by
one request at a time. A job whose client went away is cancelled: the thread stops at the next
event and closes the generator, whose `finally` rolls the cache back, so the next request starts
from a clean cache; in a batch, its row leaves the batch at the next step and the others go on.

Continuous batching (decoding/continuous.py, decoding/redrafter_join.py): a running batch takes
in, before every step, the requests waiting at the front of the queue that can join it (up to
`max_batch` rows; sampled requests only without a seed, since a batch has one random stream),
and a row leaves as soon as it ends. An `ar` row has its own sampling settings; `redrafter` rows
share the first row's (the same method options, sampling settings and penalties: equal
`batch_key`s). Every row has its own max_tokens and stop strings, usage and speculation figures.
A request that cannot join waits for the batch to drain, so nothing is overtaken.

Settings that cannot join (a draft model drafting, sampled chains) batch the old way: the job at
the head of the queue takes with it up to `max_batch - 1` waiting jobs that share its rows
(decoding/batch.py), or decodes alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional

from ..decoding import Event, GenerationParams
from ..auto import join_spec_rows
from ..engine import AUTO, BATCH_METHODS, JOIN_METHODS
from ..settings import batch_key

DONE = object()  # the end of a job's events
STALL_S = 60.0  # a running request with no event for this long is reported


@dataclass
class Job:
    prompt_ids: List[int]
    method: str
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    events: "asyncio.Queue" = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    progress_at: float = 0.0  # monotonic time of its last event (or of its start)
    stalled: bool = False  # the watchdog found it making no progress
    finished: bool = False  # its last event (DONE) was sent
    auto: Optional[dict] = None  # `auto`: what it chose and why (the done event's stats carry it)

    def put(self, item) -> None:
        self.progress_at = time.monotonic()
        self.finished = self.finished or item is DONE
        if self.auto is not None and isinstance(item, Event) and item.stats is not None:
            item.stats.extra["auto"] = self.auto
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    def batch_key(self):
        """Jobs with equal keys can be rows of one batch (None: this one decodes alone)."""
        p = self.params
        if self.method not in BATCH_METHODS or (not p.greedy and p.seed is not None):
            return None
        return batch_key(self.method, p)


class GenerationWorker:
    def __init__(self, load: Callable[[], object], max_batch: int = 8, stall_s: float = STALL_S,
                 max_batch_bytes: Optional[int] = None):
        """load() -> the engine, called on the generation thread itself: MLX keeps streams per
        thread, and arrays made on one thread's stream (a lazily loaded draft head, a compiled
        draft) then fail on another ("There is no Stream(cpu, 0) in current thread").
        max_batch_bytes: the KV cache bytes a continuous batch may hold (None: no bound but
        max_batch rows); a request whose row would take it past waits for rows to leave."""
        self.max_batch_bytes = max_batch_bytes
        self.engine = None
        self.support: dict = {}  # method -> None (runs) or why not, found on the generation thread
        self.error: Optional[BaseException] = None
        self.ready = threading.Event()
        self._load = load
        self.max_batch = max(1, max_batch)
        self._jobs: Deque[Optional[Job]] = deque()  # None: stop
        self._arrived = threading.Condition()
        self._running: List[Job] = []
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self._thread.start()
        self.stall_s = stall_s
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._watchdog.start()

    def wait_ready(self):
        """The engine, once loaded (raises what the load raised)."""
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self.engine

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    @property
    def running(self) -> int:
        return sum(not job.finished for job in list(self._running))

    @property
    def stalled(self) -> int:
        return sum(job.stalled for job in list(self._running))

    def _watch(self) -> None:
        """Report (once, on stderr and in /health) a running request with no event for stall_s:
        a generation step that does not come back is visible, not silent."""
        while True:
            time.sleep(max(0.05, self.stall_s / 4))
            now = time.monotonic()
            for job in list(self._running):
                if not (job.stalled or job.finished or job.cancelled.is_set()) and now - job.progress_at > self.stall_s:
                    job.stalled = True
                    print(f"warning: a {job.method} request ({len(job.prompt_ids)} prompt tokens) has made no "
                          f"progress for {now - job.progress_at:.0f} s", file=sys.stderr, flush=True)

    def submit(self, job: Job) -> Job:
        with self._arrived:
            self._jobs.append(job)
            self._arrived.notify()
        return job

    def stop(self) -> None:
        with self._arrived:
            self._jobs.append(None)
            self._arrived.notify()

    def cancel_all(self) -> None:
        """Shutting down: every queued and running request stops at its next event."""
        with self._arrived:
            for job in list(self._jobs) + self._running:
                if job is not None:
                    job.cancelled.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _next(self) -> Optional[List[Job]]:
        """The job at the head of the queue and the waiting jobs that can share its batch."""
        with self._arrived:
            while not self._jobs:
                self._arrived.wait()
            head = self._jobs.popleft()
            if head is None:
                return None
            self._resolve(head, busy=bool(self._jobs))
            batch, key = [head], head.batch_key()
            if key is not None and not self._joins(head):  # a continuous batch takes the others as it runs
                for job in list(self._jobs):
                    if len(batch) == self.max_batch:
                        break
                    if job is not None:
                        self._resolve(job, busy=True)
                    if job is not None and not job.cancelled.is_set() and job.batch_key() == key:
                        self._jobs.remove(job)
                        batch.append(job)
            for job in batch:
                job.progress_at = time.monotonic()
            self._running = batch
            return batch

    def _run(self) -> None:
        try:
            self.engine = self._load()
            support = getattr(self.engine, "method_support", None)
            self.support = support() if support is not None else {}
        except BaseException as error:  # noqa: BLE001  (raised again by wait_ready, on the caller's thread)
            self.error = error
            return
        finally:
            self.ready.set()
        while True:
            jobs = self._next()
            if jobs is None:
                return
            live = [job for job in jobs if not job.cancelled.is_set()]
            for job in jobs:
                if job.cancelled.is_set():  # the client left while it waited
                    job.put(DONE)
            if len(live) == 1 and self._joins(live[0]):
                self._run_continuous(live[0])
            elif len(live) == 1:
                self._run_one(live[0])
            elif live:
                self._run_batch(live)
            with self._arrived:
                self._running = []

    def _resolve(self, job: Job, busy: bool, running: Optional[Job] = None) -> None:
        """`auto`: the method for this request, chosen on the generation thread (the chooser may
        load the draft head); busy: other requests wait or run beside it; running: the first row
        of the continuous batch running now, whose method it takes where it can join it (rather
        than wait for the batch to drain)."""
        if job.method != AUTO:
            return
        if running is not None:
            job.method = running.method
            if self._fits(running, job):
                job.auto = {"chose": running.method, "why": f"joins the running {running.method} batch"}
                return
            job.method = AUTO
        choose = getattr(self.engine, "choose_method", None)
        if choose is None:
            job.method = "ar"
            return
        choice = choose(job.prompt_ids, job.params, busy=busy or bool(self._running))
        job.method, job.auto = choice.method, choice.as_dict()

    def _joins(self, job: Job) -> bool:
        """Can run as a row of a continuous batch: a method that joins with these settings, and
        not a seeded sampled request (a batch has one random stream)."""
        if job.method not in JOIN_METHODS or not (job.params.greedy or job.params.seed is None):
            return False
        joins = getattr(self.engine, "joins", None)
        return joins is None or joins(job.method, job.params)

    def _fits(self, first: Job, job: Job) -> bool:
        """Can join `first`'s running batch: `ar` rows any `ar` request, other methods' rows
        those that share every setting but max_tokens and stop strings."""
        if not self._joins(job) or job.method != first.method:
            return False
        return first.method == "ar" or job.batch_key() == first.batch_key()

    def _joiner(self, first: Job, decoder) -> Optional[Job]:
        """The job at the front of the queue, taken if it can join the running batch now (first
        come, first served: one that cannot waits, and the batch drains for it; one that would
        take the batch's cache past max_batch_bytes waits for rows to leave)."""
        with self._arrived:
            while self._jobs and self._jobs[0] is not None:
                job = self._jobs[0]
                joinable = first.method == "ar" or decoder.live < join_spec_rows()  # for `auto`
                self._resolve(job, busy=True, running=first if joinable else None)
                if not self._fits(first, job):
                    return None
                if self.max_batch_bytes and decoder.bytes_with(len(job.prompt_ids)) > self.max_batch_bytes:
                    return None
                self._jobs.popleft()
                job.progress_at = time.monotonic()
                if job.cancelled.is_set():  # the client left while it waited
                    job.put(DONE)
                    continue
                self._running.append(job)
                return job
        return None

    def _run_continuous(self, first: Job) -> None:
        """Plain decoding as a continuous batch: waiting requests join at every step, each row
        leaves when it ends; its events go to its job as thread 0's."""
        rows = {}
        try:
            decoder = self.engine.continuous_decoder(first.method, first.params)
        except Exception as error:  # noqa: BLE001  (reported to that request; the server goes on)
            first.put(error)
            first.put(DONE)
            return

        def admit(job: Job) -> None:
            try:
                rows[decoder.join(job.prompt_ids, job.params)] = job
            except Exception as error:  # noqa: BLE001  (that request's error; the batch goes on)
                job.put(error)
                job.put(DONE)

        def deliver(events) -> None:
            for event in events:
                job = rows.get(event.thread_id)
                if job is None:
                    continue
                if event.kind == "done" and event.stats is not None and event.stats.extra.get("batch_rows") == 1:
                    # decoded alone: `auto` learns its rate; its speed-up over plain goes in its stats
                    record = getattr(self.engine, "record_alone", None)
                    if record is not None:
                        record(job.method, len(job.prompt_ids), job.params, event.stats)
                job.put(dataclasses.replace(event, thread_id=0))
                if event.kind == "done":
                    job.put(DONE)
                    del rows[event.thread_id]
                    with self._arrived:  # a batch that never drains must not keep its finished jobs
                        self._running = [j for j in self._running if j is not job]

        admit(first)
        try:
            while rows:
                while len(rows) < self.max_batch:
                    job = self._joiner(first, decoder)
                    if job is None:
                        break
                    admit(job)
                for ident, job in list(rows.items()):
                    if job.cancelled.is_set():
                        deliver(decoder.cancel(ident))
                deliver(decoder.step())
        except Exception as error:  # noqa: BLE001  (reported to every request of the batch)
            for job in rows.values():
                job.put(error)
        finally:
            for job in rows.values():
                job.put(DONE)

    def _run_one(self, job: Job) -> None:
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

    def _run_batch(self, jobs: List[Job]) -> None:
        """Rows of one batch: each row's events go to its job as thread 0's, and its `thread_end`
        (the row's own stats) becomes the job's `done`."""
        ended, events = set(), None
        try:
            events = self.engine.generate_ids_batch(
                [job.prompt_ids for job in jobs], jobs[0].method, jobs[0].params,
                rows=[job.params for job in jobs], cancelled=lambda row: jobs[row].cancelled.is_set())
            for event in events:
                if event.kind == "token":
                    jobs[event.thread_id].put(dataclasses.replace(event, thread_id=0))
                elif event.kind == "thread_end":
                    job = jobs[event.thread_id]
                    job.put(Event("done", elapsed_s=event.elapsed_s, stats=event.stats))
                    job.put(DONE)
                    ended.add(event.thread_id)
        except Exception as error:  # noqa: BLE001  (reported to every request of the batch)
            for row, job in enumerate(jobs):
                if row not in ended:
                    job.put(error)
        finally:
            if events is not None:
                events.close()  # rows still decoding (the server stopping): the cache drops its tree
            for row, job in enumerate(jobs):
                if row not in ended:
                    job.put(DONE)
