"""What the app shows of one generation, computed from the engine's events alone.

`StreamState.feed(event)` keeps, per thread, its text and which parts of it came from accepted
drafts; the live figures of the status bar (tok/s, tokens per forward, acceptance, speed-up
against the plain speed of this machine); and the answer. An unforked stream's answer is thread
0's text; once threads fork (APAR), the answer is restored from the paragraph tree by a pluggable
`restore(events) -> str` (the engine's `mlx_specdec.apar.restore_answer` when it exists, else
`fork_restore` below). No Textual here, so all of it is testable on plain event lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

Restore = Callable[[Sequence[object]], str]
Decode = Callable[[List[int]], str]


def fork_restore(events: Sequence[object]) -> str:
    """The answer of a forked stream: each child's text is spliced into its parent's text at the
    point where the parent had written when the child started (a depth-first walk of the tree)."""
    texts: Dict[int, str] = {}
    parent_of: Dict[int, Optional[int]] = {}
    children: Dict[int, List[Tuple[int, int]]] = {}  # parent -> [(offset in parent text, child)]
    for ev in events:
        kind, tid = ev.kind, ev.thread_id
        if kind == "thread_start":
            texts.setdefault(tid, "")
            if ev.parent_id is not None and ev.parent_id != tid and tid not in parent_of:
                parent_of[tid] = ev.parent_id
                children.setdefault(ev.parent_id, []).append((len(texts.get(ev.parent_id, "")), tid))
        elif kind == "token":
            texts[tid] = texts.get(tid, "") + (ev.text or "")

    def build(tid: int, path: frozenset) -> str:
        text, out, pos = texts.get(tid, ""), [], 0
        for offset, child in children.get(tid, []):
            if child in path:  # a malformed cycle: never loop
                continue
            out.append(text[pos:offset])
            out.append(build(child, path | {child}))
            pos = offset
        out.append(text[pos:])
        return "".join(out)

    roots = [t for t in sorted(texts) if t not in parent_of] or [0]
    return "".join(build(r, frozenset([r])) for r in roots)


def default_restore(engine=None, method: str = "apar") -> Restore:
    """The engine's APAR restore (`mlx_specdec.apar.restore_answer(events, tokenizer)`: decodes the
    restored token ids in one go, exact where joining text deltas is not) when it is there and the
    engine has a tokenizer; else `fork_restore`. Kept pluggable: `ChatApp(restore=...)`."""
    try:
        from mlx_specdec.apar import restore_answer  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - no APAR module, or one that fails to import
        return fork_restore
    if engine is None:
        return fork_restore

    def restore(events: Sequence[object]) -> str:
        lm_for = getattr(engine, "lm_for", None)  # APAR may decode with an adapted tokenizer
        lm = lm_for(method) if callable(lm_for) else getattr(engine, "lm", None)
        tokenizer = getattr(lm, "tokenizer", None)
        if tokenizer is None:
            return fork_restore(events)
        return restore_answer(events, tokenizer)

    return restore


@dataclass
class ThreadView:
    thread_id: int
    parent_id: Optional[int]
    depth: int
    text: str = ""
    tokens: int = 0
    done: bool = False
    segments: List[List] = field(default_factory=list)  # [[text, from_accepted_draft], ...]

    def add(self, text: str, accepted: bool) -> None:
        if not text:
            return
        self.text += text
        if self.segments and self.segments[-1][1] == accepted:
            self.segments[-1][0] += text
        else:
            self.segments.append([text, accepted])


@dataclass
class Change:
    """What one event (or, merged with `absorb`, several) changed, for the widgets."""

    opened: List[int] = field(default_factory=list)
    closed: List[int] = field(default_factory=list)
    updated: List[int] = field(default_factory=list)
    done: bool = False

    def absorb(self, other: "Change") -> None:
        """Add what `other`, a later change, did: each thread once, in first-seen order."""
        for mine, theirs in ((self.opened, other.opened), (self.closed, other.closed),
                             (self.updated, other.updated)):
            mine.extend(t for t in theirs if t not in mine)
        self.done = self.done or other.done


def split_accepted(text: str, tokens: List[int], accepted: int, decode: Optional[Decode]) -> Tuple[str, str]:
    """Split a token event's text delta into (from accepted drafts, the model's own tokens).

    ReDrafter events carry the accepted drafts first: `accepted=k` means tokens[:k] were drafts.
    The split point is where the decoded draft tokens end in the delta; without a tokenizer, or
    when detokenisation does not line up (a character split across tokens), it falls back to a
    split proportional to the token counts.
    """
    if accepted <= 0 or not text:
        return "", text
    if not tokens or accepted >= len(tokens):
        return text, ""
    if decode is not None:
        try:
            drafted = decode(list(tokens[:accepted]))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode a fragment
            drafted = None
        if drafted:
            for candidate in (drafted, drafted.lstrip()):
                if candidate and text.startswith(candidate):
                    return text[: len(candidate)], text[len(candidate):]
    cut = round(len(text) * accepted / len(tokens))
    return text[:cut], text[cut:]


class StreamState:
    def __init__(self, method: str = "", decode: Optional[Decode] = None,
                 restore: Optional[Restore] = None, baseline_tps: Optional[float] = None):
        """baseline_tps: a fixed plain speed to compare with, for an engine that states none (tests,
        demos); the real engine states plain decoding's rate at the answer's own context and sampling
        (`Event.plain_tps`, then `plain_tps` in the stats), or nothing where it has not measured one."""
        self.method = method
        self.decode = decode
        self.restore = restore or fork_restore
        self.baseline_tps = baseline_tps
        self._plain: Optional[float] = None  # what the engine stated, once it has
        self._plain_stated = False
        self.events: List[object] = []
        self.threads: Dict[int, ThreadView] = {0: ThreadView(0, None, 0)}
        self.forked = False
        self.tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.token_events = 0
        self.forwards = 0  # live estimate (see `_count_forward`); exact from the final stats
        self._group: set = set()
        self.first_t: Optional[float] = None
        self.first_tokens = 0
        self.last_t: Optional[float] = None
        self.stats = None  # GenerationStats from the "done" event
        self.chosen: Optional[dict] = None  # an `auto` answer: the method chosen and why
        self._answer_cache: Optional[str] = None

    # -- feeding ----------------------------------------------------------------------------
    def feed(self, event) -> Change:
        self.events.append(event)
        change = Change()
        if getattr(event, "chosen", None):
            self.chosen = event.chosen
        if getattr(event, "plain_tps", None):
            self._plain, self._plain_stated = float(event.plain_tps), True
        kind, tid = event.kind, event.thread_id
        if kind == "thread_start":
            if tid not in self.threads:  # thread 0 (the root) always exists
                parent = event.parent_id
                depth = self.threads[parent].depth + 1 if parent in self.threads else 1
                self.threads[tid] = ThreadView(tid, parent, depth)
                self.forked = True
                change.opened.append(tid)
        elif kind == "thread_end":
            view = self.threads.get(tid)
            if view is not None and not view.done:
                view.done = True
                if tid != 0:
                    change.closed.append(tid)
        elif kind == "token":
            view = self.threads.get(tid)
            if view is None:  # a thread the strategy never announced
                parent = event.parent_id if event.parent_id in self.threads else 0
                view = self.threads[tid] = ThreadView(tid, parent, self.threads[parent].depth + 1)
                self.forked = True
                change.opened.append(tid)
            n = len(event.tokens)
            if n or event.text:
                if n:
                    self._count_forward(tid)
                    self.token_events += 1
                    self.tokens += n
                    view.tokens += n
                    if self.first_t is None:
                        self.first_t, self.first_tokens = event.elapsed_s, n
                    self.last_t = event.elapsed_s
                self.drafted += event.drafted
                self.accepted += event.accepted
                drafted_text, own = split_accepted(event.text, event.tokens, event.accepted, self.decode)
                view.add(drafted_text, True)
                view.add(own, False)
                change.updated.append(tid)
        elif kind == "done":
            self.stats = event.stats
            extra = getattr(event.stats, "extra", None) or {}
            if self._plain_stated or extra.get("plain_tps"):  # at the context the answer did average
                self._plain, self._plain_stated = extra.get("plain_tps"), True
            change.done = True
            for view in self.threads.values():
                if view.thread_id != 0 and not view.done:
                    view.done = True
                    change.closed.append(view.thread_id)
        self._answer_cache = None
        return change

    def _count_forward(self, tid: int) -> None:
        """Live forward count: strategies that decode several threads per forward (APAR) yield one
        step per thread per forward, so a thread seen again starts a new forward."""
        if tid in self._group or not self._group:
            self.forwards += 1
            self._group = {tid}
        else:
            self._group.add(tid)

    # -- what is shown ----------------------------------------------------------------------
    def answer(self) -> str:
        if not self.forked:
            return self.threads[0].text
        if self._answer_cache is None:
            try:
                self._answer_cache = self.restore(self.events)
            except Exception:  # noqa: BLE001 - a restore that cannot handle a partial tree
                self._answer_cache = fork_restore(self.events)
        return self._answer_cache

    def answer_segments(self) -> List[List]:
        """[[text, from_accepted_draft], ...] whose texts join to `answer()`."""
        if self.forked:
            return [[self.answer(), False]]
        return [list(s) for s in self.threads[0].segments]

    def marks(self) -> List[List[int]]:
        """Character ranges of the answer that came from accepted drafts."""
        out, pos = [], 0
        for text, accepted in self.answer_segments():
            if accepted:
                out.append([pos, pos + len(text)])
            pos += len(text)
        return out

    def live_threads(self) -> List[ThreadView]:
        return [v for v in self.threads.values() if v.thread_id != 0 and not v.done]

    def thread_record(self) -> Dict[str, dict]:
        if not self.forked:
            return {}
        return {str(t): {"parent": v.parent_id, "text": v.text, "done": v.done}
                for t, v in self.threads.items()}

    # -- figures ----------------------------------------------------------------------------
    @property
    def decode_tps(self) -> float:
        if self.stats is not None:
            return float(self.stats.decode_tps)
        if self.first_t is None or self.last_t is None or self.last_t <= self.first_t:
            return 0.0
        return (self.tokens - self.first_tokens) / (self.last_t - self.first_t)

    @property
    def tokens_per_forward(self) -> float:
        if self.stats is not None and getattr(self.stats, "forward_passes", 0):
            return float(self.stats.tokens_per_forward)
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def acceptance(self) -> Optional[float]:
        return self.accepted / self.drafted if self.drafted else None

    def triforce_levels(self) -> Optional[Tuple[float, float, float]]:
        """TriForce's figures from the answer's stats (`stats.extra`): (bottom level acceptance,
        middle level acceptance, tokens per full-cache forward); None before them or for another
        method."""
        extra = getattr(self.stats, "extra", None) or {}
        if "middle_acceptance" not in extra:
            return None
        return (float(extra.get("bottom_acceptance", 0.0)), float(extra["middle_acceptance"]),
                float(extra.get("tokens_per_full_forward", self.tokens_per_forward)))

    @property
    def plain_tps(self) -> Optional[float]:
        """Plain decoding's tok/s to compare this answer with; None where there is no fair figure."""
        return self._plain if self._plain_stated else self.baseline_tps

    @property
    def speedup(self) -> Optional[float]:
        tps, plain = self.decode_tps, self.plain_tps
        if not plain or tps <= 0:
            return None
        return tps / plain

    def figures(self) -> Dict[str, object]:
        out = {"tokens": self.tokens, "decode_tps": round(self.decode_tps, 2),
               "tokens_per_forward": round(self.tokens_per_forward, 2),
               "drafted": self.drafted, "accepted": self.accepted,
               "speedup": round(self.speedup, 2) if self.speedup else None,
               "threads": len(self.threads) - 1 if self.forked else 0}
        extra = getattr(self.stats, "extra", None) or {}
        if "prefix_reused" in extra:  # prompt tokens the engine did not prefill again (the last turn's)
            out["prefix_reused"] = extra["prefix_reused"]
        if self.triforce_levels() is not None:
            out.update({k: extra[k] for k in ("bottom_acceptance", "middle_acceptance", "tokens_per_full_forward",
                                              "budget", "gamma", "bottom") if k in extra})
        return out

    def summary_line(self) -> str:
        levels = self.triforce_levels()
        per_forward = (f"{self.tokens_per_forward:.2f} tok/fwd" if levels is None
                       else f"{levels[2]:.2f} tok/full fwd")  # TriForce counts full-cache verifies
        parts = [f"{self.tokens} tok", f"{self.decode_tps:.1f} tok/s", per_forward]
        if self.chosen:
            parts.insert(0, f"auto chose {self.chosen['chose']}: {self.chosen['why']}")
        if levels is not None:
            parts.append(f"acc bottom {levels[0]:.0%} · middle {levels[1]:.0%}")
            if "budget" in self.stats.extra:
                parts.append(f"budget {self.stats.extra['budget']}")
        elif self.drafted:
            parts.append(f"accepted {self.accepted}/{self.drafted}")
        if self.forked:
            parts.append(f"{len(self.threads) - 1} forked threads")
        if self.speedup:
            parts.append(f"x{self.speedup:.2f} vs plain")
        return " · ".join(parts)
