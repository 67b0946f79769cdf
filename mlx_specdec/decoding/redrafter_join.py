"""ReDrafter as a continuous batch: requests join a running batch at its next step and leave
when they end, as plain decoding's do (continuous.py), speculation and all.

    decoder = ContinuousRedrafter(lm, resources, params)   # the batch's shared settings
    row = decoder.join(prompt_ids, row_params)              # prefilled alone, laid into the batch
    for event in decoder.step():                            # one verify forward for every row
        event.thread_id                                     # its row; "done" ends that row

A joining row is prefilled alone (resuming from the engine's prefix store where it can), laid
into the batch's ragged cache (ragged.py) and enters the loop (redrafter_step.py) the way a
step leaves every row: the cache holds its text but its own latest token, here the prompt's
last. It has no drafts yet (confidence 0: never verified past its own token), so its first
step is a plain one inside the batch's verify and writes its first token; from then on the
head drafts it from the hidden state that step produced, like every other row. Each source
learns its trust in the new row from nothing, as at the start of an answer.

Rows share what the loop shares: the method's settings, the sampling settings and penalties
(the worker joins only requests with equal `batch_key`s); each row keeps its own max_tokens and
stop strings. Greedy rows write what they write alone (every accepted token is the target's
own, and a row attends only its own keys); sampled rows share the process's random stream.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..drafting import Proposal
from ..drafting.sources import FALLBACKS, source_names
from .base import DecodeContext, Event, GenerationParams, GenerationStats, make_sampler
from .continuous import RowBatch
from .ragged import cut_unused, merge_row
from .redrafter import DEFAULT_SOURCES, build_loop
from .redrafter_step import RedrafterLoop


def joinable(params: GenerationParams, resources: Dict[str, object]) -> bool:
    """Whether requests with these settings can share a continuous batch: not with a draft
    model drafting (it keeps one sequence's cache) nor with sampled chains (`sampled_drafts`:
    their draft distributions are per step, not per row)."""
    try:
        names = source_names(params.options.get("sources", DEFAULT_SOURCES))
    except ValueError:
        return True  # the decoder's join reports the bad option to its request
    model = names[-1] == "model" or (resources.get("drafter") is None and resources.get("draft_model") is not None
                                     and names[-1] in FALLBACKS and names[-1] != "none")
    return not model and not (params.options.get("sampled_drafts") and not params.greedy)


class JoinableLoop(RedrafterLoop):
    """The ReDrafter loop started empty, taking rows in between steps."""

    def begin_empty(self) -> None:
        self.rows, self.keep = [], None
        self.cache = None  # the first row's cache becomes the batch's
        self.valid = np.zeros((0, 0), dtype=bool)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.emitted = np.zeros(0, dtype=np.int64)
        self.committed = 0
        self.learners(0)
        self.head.begin([])
        if self.first_offer is not None:
            self.first_offer.begin([])
        self.beams = np.zeros((0, 1, 2), dtype=np.int32)
        self.owner = np.zeros((0, 1, 2), dtype=np.int32)
        self.confidence = np.zeros((0, 1, 1), dtype=np.float32)
        self.drafts = Proposal(mx.array(self.beams), mx.array(self.owner), None, mx.array(self.confidence))

    def add_row(self, ident: int, prompt: Sequence[int], alone) -> None:
        """`prompt`'s row, its cache `alone` holding all but its last token, into the batch."""
        self.select_rows()  # rows that ended at the last step leave first
        self.keep = None
        text = list(prompt[:-1])
        self.cache, self.valid = merge_row(self.cache, self.valid, alone, len(text))
        self.valid = cut_unused(self.cache, self.valid)
        self.committed = self.cache.offset
        self.rows.append(ident)
        self.lengths = np.append(self.lengths, len(text))
        self.emitted = np.append(self.emitted, 0)
        # its own token (the prompt's last) and no drafts: every draft slot repeats it at confidence 0
        W, L = self.beams.shape[1], self.beams.shape[2]
        self.beams = np.concatenate([self.beams, np.full((1, W, L), prompt[-1], dtype=self.beams.dtype)])
        self.owner = np.concatenate([self.owner, np.zeros((1, W, L), dtype=self.owner.dtype)])
        self.confidence = np.concatenate([self.confidence, np.zeros((1, W, L - 1), dtype=self.confidence.dtype)])
        self.source = np.append(self.source, self.fallback)
        self.drafts = Proposal(mx.array(self.beams), mx.array(self.owner), None, mx.array(self.confidence))
        for trust in self.trusts:
            trust.add_rows(1)
        self.penalties.add_row(prompt)
        self.head.add_rows([text])
        if self.first_offer is not None:
            self.first_offer.add_rows([text])


class ContinuousRedrafter(RowBatch):
    def __init__(self, lm, resources: Optional[Dict[str, object]], params: GenerationParams):
        """params: the settings every row shares (method options, sampling, penalties)."""
        super().__init__(lm, resources, "redrafter")
        shared = dataclasses.replace(params, max_tokens=lm.context_length)  # each row ends by its own limit
        self.ctx = DecodeContext(lm, [], shared, make_sampler(shared), GenerationStats(method="redrafter"),
                                 resources=self.resources, prompts=[])
        self.loop = build_loop(self.ctx, cls=JoinableLoop)
        self.loop.begin_empty()

    def _kv(self):
        return self.loop.cache, self.loop.valid

    def join(self, prompt: Sequence[int], params: GenerationParams) -> int:
        """Prefill `prompt` alone and add it as a row; its first token comes at the next step."""
        row, ctx, alone = self._open(prompt, params)
        self.loop.add_row(row.ident, ctx.prompt, alone)
        self.rows.append(row)
        return row.ident

    def step(self) -> List[Event]:
        """One verify forward for every row: each row's accepted tokens (and text), and a `done`
        for each row that ended (EOS, a stop string, its max_tokens)."""
        if not self.rows:
            return []
        by_ident = {row.ident: row for row in self.rows}
        events, ended = [], []
        for step in self.loop.step():
            row = by_ident[step.thread_id]
            row_events, reason = self._emit(row, step.tokens, time.perf_counter(), step.drafted, step.accepted)
            events.extend(row_events)
            if reason is not None:  # before the loop resumes: it drops the row at the end of this step
                self.ctx.stopped_rows.add(row.ident)
                ended.append(row.ident)
        self._leave(ended)
        return events

    def _drop(self, ended: Sequence[int]) -> None:  # by position in self.rows (`cancel`)
        self._leave([self.rows[b].ident for b in ended])

    def _leave(self, idents: Sequence[int]) -> None:
        """Rows whose request ended leave the loop before its next step (`stopped_rows`)."""
        self.ctx.stopped_rows.update(idents)
        gone = set(idents)
        self.rows = [row for row in self.rows if row.ident not in gone]
        # Rows the loop still holds (a cancel between steps) leave at its next step or join:
        # `keep` indexes the cache's rows, of which loop.rows are the ones kept so far.
        loop = self.loop
        live = [j for j, ident in enumerate(loop.rows) if ident not in gone]
        if len(live) < len(loop.rows):
            loop.keep = np.array(live if loop.keep is None else [loop.keep[j] for j in live], dtype=np.int64)
            loop.rows = [loop.rows[j] for j in live]

    def _row_extra(self) -> dict:
        return dict(self.ctx.stats.extra)

