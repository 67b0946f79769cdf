"""The head rank (rank 0): the first stage's layers, and every decision.

Three methods over the same stages and the same drafts:

    pp-ar      one token through all stages per step; the next step starts when it returns
    pp-spec    the paper's baseline: draft, send [token + drafts] as one run, wait, accept
    pipeinfer  asynchronous speculation: the known token starts through the pipeline at once
               (a non-speculative run) and drafts follow it as speculative micro-batches of
               1-4 tokens, each continuing the one before, whenever the head would otherwise
               wait (continuous speculation), while the confidence cutoff allows:
                   cutoff = p_accept + iter * p_recovery - n_reject * p_decay
               (iter: runs launched since the last result; n_reject: draft attempts that found
               nothing, reset when a run is accepted whole). A draft token below the cutoff
               ends the micro-batch.

Verification (every method): the results of a run are the target's own token after each of its
tokens (argmax, or a sample when sampling: so every committed token is the target's own choice,
exact for any sampler, as the paper). Walking a run's results in order, position p's token y:
    a speculative token already sits at p:  equal -> accepted, go on
                                            else  -> y is committed, and everything in flight
                                                     after p is wrong: early cancellation
    nothing sits at p:                      y is committed (the run's bonus token)
Early cancellation: CANCEL(run ids) goes out at once (each stage acts on it at arrival, before
the runs queued behind it: see stage.py), then TRIM(p), ordered behind every run sent, cuts the
stages' caches back to the canonical text. A cancelled run still answers (a SKIPPED stub, or
results the head drops), so the head's FIFO of runs stays in step with the pipeline.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Iterator, List, Optional

import mlx.core as mx
import numpy as np

from ..acceptance import sample_token
from ..penalties import ChainPenalties, Penalties
from .link import CANCEL, HELLO, RESULT, RUN, SKIPPED, STOP, TRIM, Inbox, Message, Outbox, RankFailure
from .stage import StageModel

METHODS = ("pp-ar", "pp-spec", "pipeinfer")


@dataclass
class PipelineSettings:
    method: str = "pipeinfer"
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    frequency_penalty: float = 0.0  # the penalties (penalties.py) on the target's logits: off by default
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    draft_length: int = 4  # pp-spec: drafts per verify
    micro_batch: int = 2  # pipeinfer: tokens per speculative run (the paper: 1-4)
    max_runs: int = 4  # pipeinfer: speculative runs in flight at once
    p_accept: float = 0.0  # confidence cutoff (the paper's -pa; the CLI's default is 0.4)
    p_recovery: float = 0.0  # (-pr)
    p_decay: float = 0.0  # (-pd)
    prefill_chunk: int = 256  # prompt tokens per run: prefill chunks are pipelined too
    timeout: float = 60.0  # seconds any receive waits before the run ends with one line
    eos: List[int] = field(default_factory=list)
    check_cache: bool = False  # report every stage's cache checksum at the end (tests)
    trace: bool = False  # report the head's timeline (launches, results) in the stats


@dataclass
class Run:
    id: int
    start: int
    count: int
    speculative: bool
    want_from: int
    cancelled: bool = False


class Head:
    def __init__(self, stage: StageModel, group, ranks: int, outbox: Outbox, drafter=None):
        self.stage, self.group, self.ranks = stage, group, ranks
        self.outbox, self.drafter = outbox, drafter
        self.inbox = Inbox(group, ranks - 1)  # the last stage answers the head: its ring neighbour
        self.next_id = 0

    # ---- pipeline operations -------------------------------------------------------------
    def handshake(self, timeout: float) -> List[List[int]]:
        """Every rank's model fingerprint and parameter KiB, rank 1 first (the head checks they match)."""
        self.outbox.send(Message(HELLO, payload=mx.array([0], dtype=mx.int32)))
        reply = self.inbox.get(timeout)
        if reply.kind != HELLO:
            raise RankFailure(f"unexpected {reply.kind} in the handshake")
        values = [int(v) for v in reply.payload.tolist()][1:]
        return [values[i:i + 5] for i in range(0, len(values), 5)]

    def stop(self) -> None:
        self.outbox.send(Message(STOP))
        self.outbox.close()

    def cache_checksums(self, length: int, timeout: float) -> List[int]:
        """Every stage's `cache_checksum` of its first `length` entries (rank 0 first)."""
        from .stage import cache_checksum

        self.outbox.send(Message(HELLO, a=2, b=length, payload=mx.array([0], dtype=mx.int32)))
        reply = self.inbox.get(timeout)
        return [cache_checksum(self.stage.cache, length)] + [int(v) for v in reply.payload.tolist()[1:]]

    def stage_busy(self, timeout: float) -> List[float]:
        """Seconds each worker rank computed since the last call (rank 1 first)."""
        self.outbox.send(Message(HELLO, a=1, payload=mx.array([0], dtype=mx.int32)))
        reply = self.inbox.get(timeout)
        return [v / 1e6 for v in reply.payload.tolist()[1:]]

    # ---- one generation ------------------------------------------------------------------
    def generate(self, prompt: List[int], s: PipelineSettings) -> Iterator[dict]:
        """Yields {"tokens": [...]} as tokens are committed, then {"stats": {...}}."""
        self.settings, self.runs = s, deque()  # type: ignore[var-annotated]
        self.runs: Deque[Run]
        self.text, self.seq = list(prompt), list(prompt)
        self.prompt_length = len(prompt)
        self.sent = 0  # positions [0, sent) are in every stage's cache (or on their way)
        self.busy = 0.0
        self.pending_observe = None
        self.t0 = time.perf_counter()
        self.trace: List[list] = []
        c = self.counts = dict(runs=0, speculative_runs=0, cancelled=0, skipped=0, drafted=0, accepted=0,
                               decode_runs=0, rejected_drafts=0, abandoned=0)
        self.stage.truncate(0)
        self.outbox.send(Message(TRIM, b=0))  # every stage starts empty
        self.penalty = Penalties.of(s)  # None: every penalty off
        self.penalties = None  # made at the first row (it needs the vocabulary)
        want_logits = s.temperature > 0 or self.penalty is not None  # penalties need the logits even when greedy
        self.flags = (2 if want_logits else 0) | (1 if getattr(self.drafter, "needs_hidden", False) else 0)
        if s.temperature > 0:
            mx.random.seed(s.seed)
        if self.drafter is not None:
            self.drafter.begin(prompt)
        t0 = self.t0
        for start in range(0, len(prompt), s.prefill_chunk):
            chunk = prompt[start:start + s.prefill_chunk]
            last = start + len(chunk) == len(prompt)
            self._launch(chunk, speculative=False, want_from=len(chunk) - 1 if last else len(chunk), prefill=True)
        generated: List[int] = []
        first_token_s = None
        iteration = n_reject = 0
        while len(generated) < s.max_tokens and not (generated and generated[-1] in s.eos):
            if all(run.cancelled for run in self.runs):  # nothing live in flight (cancelled runs
                # still drain through the stages, ahead of this one: no wait for them, unlike the
                # reference code's FIXME at speculative.cpp line 364)
                self._launch_base()
                iteration = 0
                continue
            if s.method == "pipeinfer" and not self.inbox.pending():
                cutoff = s.p_accept + iteration * s.p_recovery - n_reject * s.p_decay
                launched = self._speculate(cutoff)
                if launched is True:
                    iteration += 1
                    continue
                if launched is False:
                    n_reject += 1
            message = self.inbox.get(s.timeout)
            new = self._settle(message)
            iteration = 0
            if new is None:
                continue
            tokens, whole = new
            if whole:
                n_reject = 0
            room = s.max_tokens - len(generated)
            tokens = tokens[:room]
            for i, token in enumerate(tokens):
                if token in s.eos:
                    tokens = tokens[: i + 1]
                    break
            if tokens:
                if first_token_s is None:
                    first_token_s = time.perf_counter() - t0
                generated += tokens
                yield {"tokens": tokens}
        self._drain()
        wall = time.perf_counter() - t0
        busy = [self.busy] + self.stage_busy(s.timeout)
        if s.trace:
            c["trace"] = self.trace
        if s.check_cache:  # the canonical text's entries, on every stage (the text but its last token)
            c["cache_checksums"] = self.cache_checksums(len(self.text) - 1, s.timeout)
            c["committed"] = self.text[len(prompt):]
        decode = max(wall - (first_token_s or 0.0), 1e-9)
        yield {"stats": dict(c, new_tokens=len(generated), ttft_s=first_token_s or wall, decode_s=decode,
                             wall_s=wall, stage_busy_s=[round(b, 3) for b in busy],
                             stage_idle=[round(max(0.0, 1 - b / wall), 3) for b in busy],
                             tokens_per_pass=round(max(len(generated) - 1, 0) / max(c["decode_runs"], 1), 3))}

    # ---- scheduling ----------------------------------------------------------------------
    def _launch(self, tokens: List[int], speculative: bool, want_from: int, prefill: bool = False) -> bool:
        """Run the first stage on `tokens` and send them on. A speculative run is abandoned
        (False) when a result arrives meanwhile: the head verifies first."""
        begin = time.perf_counter()
        start = self.sent
        h = self.stage.run(mx.array([tokens], dtype=mx.int32), self.inbox.pending if speculative else None)
        if h is None:
            self.stage.truncate(start)
            self.busy += time.perf_counter() - begin
            self.counts["abandoned"] += 1
            return False
        run = Run(self.next_id, start, len(tokens), speculative, want_from)
        self.next_id += 1
        self.outbox.send(Message(RUN, run.id, run.count, run.start, want_from, self.flags, h.astype(mx.float32)))
        self.busy += time.perf_counter() - begin
        if self.settings.trace:
            self.trace.append(["launch", run.id, run.start, run.count, int(speculative),
                               round((begin - self.t0) * 1000, 1), round((time.perf_counter() - self.t0) * 1000, 1)])
        self.sent += len(tokens)
        self.runs.append(run)
        self.counts["runs"] += 1
        if not prefill:
            self.counts["decode_runs"] += 1
        self.counts["speculative_runs"] += int(speculative)
        return True

    def _launch_base(self) -> None:
        """Nothing in flight: the last committed token goes in (with drafts for pp-spec)."""
        s = self.settings
        drafts: List[int] = []
        if s.method == "pp-spec" and self.drafter is not None:
            self._draft_ready()
            drafts, _ = self.drafter.draft(self.seq, len(self.text), s.draft_length)
        self.seq.extend(drafts)
        self.counts["drafted"] += len(drafts)
        self._launch([self.text[-1]] + drafts, speculative=bool(drafts), want_from=0)
        self._draft_ready()  # pipeinfer: the known token is on its way before the drafter runs

    def _speculate(self, cutoff: float) -> Optional[bool]:
        """One speculative micro-batch continuing the tip. True: launched; False: the drafter
        had nothing; None: not allowed now (run limit, cutoff, or nothing to continue)."""
        s = self.settings
        if self.drafter is None or cutoff >= 1.0 or len(self.seq) > self.sent:
            return None
        self._draft_ready()
        if sum(run.speculative and not run.cancelled for run in self.runs) >= s.max_runs:
            return None
        tokens, confidence = self.drafter.draft(self.seq, len(self.text), s.micro_batch)
        keep = 0
        while keep < len(tokens) and confidence[keep] >= cutoff:
            keep += 1
        if keep == 0:
            return False
        self.seq.extend(tokens[:keep])
        if not self._launch(tokens[:keep], speculative=True, want_from=0):
            del self.seq[len(self.seq) - keep:]
            return None
        self.counts["drafted"] += keep
        return True

    def _settle(self, message: Message):
        """One run's answer: the committed tokens and whether the run was accepted whole."""
        run = self.runs.popleft()
        if self.settings.trace:
            self.trace.append(["answer", run.id, message.kind, int(run.cancelled),
                               round((time.perf_counter() - self.t0) * 1000, 1)])
        if message.run != run.id or message.kind not in (RESULT, SKIPPED):
            raise RankFailure(f"the pipeline answered {message.kind}/{message.run}, expected run {run.id}")
        if message.kind == SKIPPED:
            self.counts["skipped"] += 1
            return None
        if run.cancelled:
            return None
        rows = message.payload  # (K, 1|V [+ D])
        hidden_width = self.stage.hidden_size if self.flags & 1 else 0
        return self._walk(run, rows, hidden_width)

    def _penalized(self, logits: mx.array, p: int) -> mx.array:
        """logits (V,) of the token at position p, penalized by its own text: the prompt and the
        tokens before p (every one of them committed or a draft still standing, as the row saw)."""
        if self.penalty is None:
            return logits
        if self.penalties is None:
            self.penalties = ChainPenalties(self.penalty, self.prompt_length, logits.shape[-1])
        return self.penalties.first(logits[None], self.seq[:p])[0]

    def _walk(self, run: Run, rows: mx.array, hidden_width: int):
        committed: List[int] = []
        last = None
        # greedy: the run's tokens in one host sync, not one per row
        greedy_ids = None if self.flags & 2 or rows is None else np.array(rows[:, 0]).astype(np.int64)
        for j in range(run.want_from, run.count):
            p = run.start + j + 1  # the position this row's token goes to
            row = rows[j - run.want_from]
            if self.flags & 2:
                logits = self._penalized(row[: row.shape[0] - hidden_width], p)
                if self.settings.temperature > 0:
                    y = int(sample_token(logits - mx.logsumexp(logits), self.settings.temperature,
                                         self.settings.top_p).item())  # host sync: the target's own token
                else:  # greedy with penalties: the row came as logits so that they could apply
                    y = int(mx.argmax(logits).item())
            else:
                y = int(greedy_ids[j - run.want_from])
            if hidden_width:  # the drafter continues from the newest committed token
                last = (row[row.shape[0] - hidden_width:], y, p)
            drafted_here = p < len(self.seq)
            if drafted_here and self.drafter is not None:
                self.drafter.outcome(self.seq[p] == y)
            if drafted_here and self.seq[p] == y:  # a draft, accepted
                self.text.append(y)
                committed.append(y)
                self.counts["accepted"] += 1
                continue
            self.text.append(y)
            committed.append(y)
            if p < len(self.seq):  # a draft, rejected: everything in flight after p is wrong
                self.counts["rejected_drafts"] += 1
                self._cancel_after(p)
                self._hold_for_drafter(last)
                return committed, False
            self.seq.append(y)  # nothing was drafted there: the run's bonus token
            self._hold_for_drafter(last)
            return committed, True
        self._hold_for_drafter(last)
        return committed, True

    def _hold_for_drafter(self, last) -> None:
        """Kept for `_draft_ready`: pipeinfer launches the known token before the drafter runs."""
        if last is not None:
            self.pending_observe = last

    def _draft_ready(self) -> None:
        """Hand the drafter the newest committed token's hidden state (it drafts from it)."""
        if self.pending_observe is not None and self.drafter is not None:
            self.drafter.observe(*self.pending_observe)
        self.pending_observe = None

    def _cancel_after(self, p: int) -> None:
        victims = [run for run in self.runs if not run.cancelled]
        for run in victims:
            run.cancelled = True
        if victims:
            self.counts["cancelled"] += len(victims)
            self.outbox.send(Message(CANCEL, a=victims[0].id, b=victims[-1].id))
        self.seq = list(self.text)
        begin = time.perf_counter()
        self.stage.truncate(p)
        self.busy += time.perf_counter() - begin
        self.sent = p
        self.outbox.send(Message(TRIM, b=p))

    def _drain(self) -> None:
        """Collect the answers of runs still in flight (the stages finish or skip them)."""
        if self.runs:
            first, last = self.runs[0].id, self.runs[-1].id
            self.outbox.send(Message(CANCEL, a=first, b=last))
        while self.runs:
            message = self.inbox.get(self.settings.timeout)
            run = self.runs.popleft()
            if message.run != run.id:
                raise RankFailure(f"the pipeline answered run {message.run}, expected {run.id}")
