"""A fake engine for tests and demos: the real engine's event stream, scripted, on a fake clock.

`FakeEngine.chat` yields the same `Event`s the engine does: plain streams (`ar`), ReDrafter-like
steps whose tokens start with accepted drafts (`accepted`/`drafted` counts), and APAR-like forks
(`thread_start` with a parent, per-thread tokens, `thread_end`), one forward per round of live
threads, and TriForce-like steps (γ drafts per full-cache verify, the two levels' acceptance in
`stats.extra` as the engine reports them). Its tokenizer splits text into words (`words`); its
chat encoding wraps each message in two marker tokens, and a prompt that does not fit
`lm.context_length` is refused as the engine refuses it. `elapsed_s` runs on a fake clock
(`step_s` per forward), so the figures are exact and snapshots stable. `hold_after=N` blocks the stream after N forwards until `release()` or until the
consumer closes it (what Esc does), so a test can look at a half-written answer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

from mlx_specdec.decoding.base import Event, GenerationStats
from mlx_specdec.decoding.redrafter import DEFAULT_BEAM_LENGTH
from mlx_specdec.decoding.triforce import BOTTOMS, DEFAULT_BUDGET, DEFAULT_GAMMA
from mlx_specdec.errors import ContextOverflow, UserError

PLAIN_ANSWER = ("The sky looks blue because air scatters blue sunlight much more than red light, "
                "so blue reaches your eyes from every direction.")

#: thread id -> items: text pieces (one token each) or ("fork", child id)
APAR_SCRIPT: Dict[int, list] = {
    0: ["Here", " are", " three", " tips:", "\n1.", ("fork", 1), "\n2.", ("fork", 2), "\n3.", ("fork", 3)],
    1: [" Keep", " a", " fixed", " bedtime.", ("fork", 4), " Set", " an", " alarm."],
    2: [" Avoid", " screens", " late", " at", " night."],
    3: [" Keep", " the", " room", " cool", " and", " dark."],
    4: [" Even", " on", " weekends."],
}
PARENTS = {1: 0, 2: 0, 3: 0, 4: 1}
#: what the fake's `auto` chooses (a FakeEngine lists "auto" among its methods only when asked to)
AUTO_CHOICE = {"chose": "redrafter", "why": "measured here: redrafter 1.40x ar (greedy, 3+3 answers)"}
#: sizes of successive ReDrafter steps (accepted drafts = size - 1)
REDRAFTER_STEPS = [1, 3, 1, 2, 4, 1, 3, 2, 1, 4]
#: TriForce: drafts of the middle level the full-cache verify accepts, round after round (of γ)
TRIFORCE_ACCEPTED = [6, 4, 6, 1, 6, 5]
#: TriForce's bottom level (n-gram lookup, 3 drafts a middle forward): how many the middle accepts
TRIFORCE_BOTTOM = [3, 0, 2, 3, 1]


def words(text: str) -> List[str]:
    """Split text into word tokens, each with its leading space."""
    out, current = [], ""
    for ch in text:
        if ch == " " and current:
            out.append(current)
            current = ""
        current += ch
    if current:
        out.append(current)
    return out


@dataclass
class FakeLM:
    name: str = "fake-llm"
    dtype: str = "float32"
    context_length: int = 8192  # tokens, as the real `LoadedModel.context_length`

    tokenizer: object = None  # the fake engine itself (it has `encode` and `decode`)

    def describe(self) -> str:
        return f"{self.name} ({self.dtype}, fake)"

    def encode_chat(self, messages: List[dict], thinking: Optional[bool] = None) -> List[int]:
        """A chat template: each message between a role marker and an end marker, then the
        assistant's marker (the generation prompt)."""
        tok = self.tokenizer
        ids: List[int] = []
        for m in messages:
            ids += [tok.token(f"<|{m['role']}|>")] + tok.encode(m["content"]) + [tok.token("<|end|>")]
        return ids + [tok.token("<|assistant|>")]


class FakeEngine:
    def __init__(self, methods=("ar", "mlx-lm", "redrafter", "apar", "triforce"), step_s: float = 0.1,
                 delay: float = 0.0, hold_after=None, answer: str = PLAIN_ANSWER,
                 fail: Optional[Exception] = None, hold_timeout: float = 10.0):
        self.lm = FakeLM(tokenizer=self)
        self.methods = list(methods)
        self.step_s = step_s
        self.delay = delay  # real seconds per forward (0: as fast as possible)
        #: forward counts after which the stream blocks until `release()` (an int or a list)
        self.hold_after = [hold_after] if isinstance(hold_after, int) else list(hold_after or [])
        self.hold_timeout = hold_timeout  # a held stream goes on by itself after this (no hung tests)
        self.answer = answer
        self.fail = fail
        self.vocab: List[str] = []
        self.ids: Dict[str, int] = {}
        self.calls: List[dict] = []
        self.closed = 0  # streams closed before their end (Esc)
        self.finished = 0
        self.holding = threading.Event()  # set while a stream is held
        self.holds = 0  # holds entered so far
        self.yielded = 0  # events handed to the caller so far
        self._release = threading.Event()
        self._cancelled = threading.Event()
        self._vocab_lock = threading.Lock()  # the UI thread counts tokens while a stream runs

    # -- tokenizer ----------------------------------------------------------------------------
    def token(self, piece: str) -> int:
        with self._vocab_lock:
            if piece not in self.ids:
                self.ids[piece] = len(self.vocab)
                self.vocab.append(piece)
            return self.ids[piece]

    def encode(self, text: str) -> List[int]:
        return [self.token(p) for p in words(text)]

    def decode(self, tokens: List[int]) -> str:
        return "".join(self.vocab[t] for t in tokens)

    def release(self) -> None:
        self.holding.clear()
        self._release.set()

    def cancel(self) -> None:
        """The app's optional stop hook (engines may offer one): a held stream lets go at once."""
        self._cancelled.set()
        self._release.set()

    # -- the engine's API ---------------------------------------------------------------------
    def chat(self, messages: List[dict], method: str = "ar", params=None) -> Iterator[Event]:
        if method not in self.methods:
            raise UserError(f"unknown method {method!r} (choose from {', '.join(self.methods)})")
        self.calls.append({"messages": [dict(m) for m in messages], "method": method, "params": params})
        self._cancelled.clear()
        if method == "auto":  # as the engine's: one method, said on the answer's first event
            return self._told(self._stream(messages, AUTO_CHOICE["chose"], params), dict(AUTO_CHOICE))
        return self._stream(messages, method, params)

    @staticmethod
    def _told(events: Iterator[Event], chosen: dict) -> Iterator[Event]:
        try:
            for i, event in enumerate(events):
                if i == 0:
                    event.chosen = chosen
                yield event
        finally:
            events.close()

    def _stream(self, messages, method, params) -> Iterator[Event]:
        if self.fail is not None:
            raise self.fail
        prompt = len(self.lm.encode_chat(messages))
        if prompt >= self.lm.context_length:  # as the engine's check_context
            raise ContextOverflow(f"prompt has {prompt} tokens but the context window of {self.lm.name} "
                                  f"is {self.lm.context_length}")
        max_tokens = min(getattr(params, "max_tokens", 256), self.lm.context_length - prompt)
        options = dict(getattr(params, "options", {}) or {})
        stats = GenerationStats(method=method, prompt_tokens=prompt)
        clock = {"t": 0.05, "forwards": 0}
        finished = False
        try:
            if method == "apar":
                steps = self._apar_steps()
            elif method == "redrafter":
                steps = self._redrafter_steps(int(options.get("beam_length", DEFAULT_BEAM_LENGTH)) - 1)
            elif method == "triforce":
                steps = self._triforce_steps(options, stats)
            else:
                steps = self._plain_steps()
            first = last = None
            for forward in steps:  # one list of events per forward
                clock["forwards"] += 1
                if clock["forwards"] - 1 in self.hold_after:
                    self._hold()
                if self.delay:
                    time.sleep(self.delay)
                clock["t"] += self.step_s
                for ev in forward:
                    ev.elapsed_s = round(clock["t"], 6)
                    if ev.kind == "token":
                        room = max_tokens - stats.generated_tokens
                        if room <= 0:
                            break
                        if len(ev.tokens) > room:
                            ev.tokens = ev.tokens[:room]
                            ev.accepted = min(ev.accepted, room)
                            ev.text = self.decode(ev.tokens)
                        stats.generated_tokens += len(ev.tokens)
                        stats.drafted += ev.drafted
                        stats.accepted += ev.accepted
                        first = first if first is not None else clock["t"]
                        last = clock["t"]
                    self.yielded += 1
                    yield ev
                stats.forward_passes = clock["forwards"]
                if stats.generated_tokens >= max_tokens:
                    stats.finish_reason = "length"
                    break
            else:
                stats.finish_reason = "stop"
            stats.prefill_s = stats.ttft_s = 0.05 + self.step_s
            stats.decode_s = (last - first) if first is not None else 0.0
            finished = True
            self.finished += 1
            yield Event("done", elapsed_s=clock["t"], stats=stats)
        finally:
            if not finished:
                self.closed += 1
            self.holding.clear()

    def _hold(self) -> None:
        if self._cancelled.is_set():
            return
        self.holds += 1
        self.holding.set()
        self._release.wait(self.hold_timeout)
        self._release.clear()
        self.holding.clear()

    def _plain_steps(self):
        for piece in words(self.answer):
            yield [Event("token", 0, None, [self.token(piece)], piece)]

    def _redrafter_steps(self, drafted: int):
        pieces = words(self.answer)
        i = k = 0
        while i < len(pieces):
            size = min(REDRAFTER_STEPS[k % len(REDRAFTER_STEPS)], drafted + 1, len(pieces) - i)
            chunk = pieces[i: i + size]
            yield [Event("token", 0, None, [self.token(p) for p in chunk], "".join(chunk),
                         drafted=drafted, accepted=size - 1)]
            i += size
            k += 1

    def _apar_steps(self):
        queues = {t: list(items) for t, items in APAR_SCRIPT.items()}
        live = [0]
        while live:
            forward, started, ended = [], [], []
            for tid in live:
                item = queues[tid].pop(0)
                if isinstance(item, tuple):
                    child = item[1]
                    forward.append(Event("thread_start", child, tid))
                    started.append(child)
                else:
                    forward.append(Event("token", tid, PARENTS.get(tid), [self.token(item)], item))
                if not queues[tid]:
                    forward.append(Event("thread_end", tid, PARENTS.get(tid)))
                    ended.append(tid)
            live = [t for t in live if t not in ended] + started
            yield forward

    def _triforce_steps(self, options: dict, stats: GenerationStats):
        """As the engine's strategy: the first token from the prefill, then one full-cache verify a
        round accepting some of the middle level's γ drafts, its own token after them (the same
        steps at any temperature: the script decides what is accepted)."""
        budget = int(options.get("budget", DEFAULT_BUDGET))
        gamma = int(options.get("gamma", DEFAULT_GAMMA))
        bottom = str(options.get("bottom", "ngram"))
        if bottom not in BOTTOMS:
            raise UserError(f"--bottom is {', '.join(BOTTOMS)}, not {bottom!r}")
        if budget < 16 or gamma < 1:
            raise UserError("triforce needs --budget >= 16, --gamma >= 1 and --draft-length >= 1")
        pieces = words(self.answer)
        counts = dict(bottom_drafted=0, bottom_accepted=0, top_drafted=0, top_accepted=0, top_forwards=0,
                      middle_forwards=0)
        yield [Event("token", 0, None, [self.token(pieces[0])], pieces[0])]
        i, k = 1, 0
        while i < len(pieces):
            written = 0
            while written < gamma:  # the middle level's forwards, each verifying the bottom's drafts
                drafted = 3 if bottom == "ngram" else 0
                accepted = min(TRIFORCE_BOTTOM[counts["middle_forwards"] % len(TRIFORCE_BOTTOM)], drafted)
                counts["middle_forwards"] += 1
                counts["bottom_drafted"] += drafted
                counts["bottom_accepted"] += accepted
                written += accepted + 1
            n = min(TRIFORCE_ACCEPTED[k % len(TRIFORCE_ACCEPTED)], gamma, len(pieces) - i - 1)
            n = max(n, 0)
            counts["top_forwards"] += 1
            counts["top_drafted"] += gamma
            counts["top_accepted"] += n
            stats.extra.update(
                budget=min(budget, stats.prompt_tokens), bottom=bottom, gamma=gamma,
                bottom_acceptance=round(counts["bottom_accepted"] / max(counts["bottom_drafted"], 1), 3),
                middle_acceptance=round(counts["top_accepted"] / max(counts["top_drafted"], 1), 3),
                tokens_per_full_forward=round((counts["top_accepted"] + counts["top_forwards"])
                                              / counts["top_forwards"], 3),
                middle_forwards=counts["middle_forwards"], retrieval_rebuilds=0)
            chunk = pieces[i: i + n + 1]
            yield [Event("token", 0, None, [self.token(p) for p in chunk], "".join(chunk),
                         drafted=gamma, accepted=n)]
            i += n + 1
            k += 1
