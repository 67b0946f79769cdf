"""What the engine measures about itself as it answers, and the warm-up at load.

- `auto`'s chooser (auto.py): the decode rates of the `ar` and `redrafter` answers that decoded
  alone, per band, and the method it picks for a request from them;
- plain decoding's rate by context and sampling mode (plain_rate.py), which every other method's
  answer is stated against: the first event of an answer carries `plain_tps` (at the context the
  answer is expected to average), its stats `plain_tps` and `speedup_vs_plain` (at the context it
  did average), or neither where nothing comparable was measured;
- `warm_up`: what a first answer would otherwise pay inside it (loading the head, the verify-cost
  table and step cost measured on a GPU's first use, compiling the step's shapes), and a plain
  point in the chat's sampling mode where none is stored, done before the user's first token.

`Engine` takes these as a mixin; it sets `remember_auto` (Engine.load: the measurements are kept
across processes, beside the verify-cost table).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Optional

from .decoding import STRATEGIES, Event, GenerationParams, stream_events
from .errors import UserError
from .penalties import check_method as check_penalties
from .plain_rate import PlainRates, mean_context, mode_of

CANDIDATES = ("ar", "redrafter")  # the methods `auto` chooses between
# The warm-up's plain run: a prompt about as long as a chat's first turn and enough tokens that the
# point's mean context sits where a first answer's does (plain_rate.WINDOW covers 80-320 tokens).
WARM_PROMPT = (
    "I am planning a small vegetable garden behind my house. The plot gets about six hours of sun "
    "in the morning and shade in the afternoon, the soil is heavy clay that stays wet after rain, "
    "and I can spend a few hours each weekend on it. I would like tomatoes, beans, lettuce and some "
    "herbs, and I want to avoid buying expensive equipment. My neighbour says raised beds are the "
    "only way to deal with clay, but a friend says I should just dig in compost. Which would you "
    "suggest, what should I plant first, and what mistakes do beginners usually make?")
WARM_PLAIN_TOKENS = 48
# The plain points the warm-up measures once per sampling mode: a first turn's context, and a later
# turn's (the prompt repeated, as a conversation's history grows): plain_rate.WINDOW around the two
# covers contexts from about 80 to 1,300 tokens.
WARM_PLAIN_REPEATS = (1, 5)
WARM_METHOD_TOKENS = 16  # enough steps for the step's common shapes


class MeasuredMixin:
    remember_auto = False

    # -- auto -----------------------------------------------------------------------------------------
    @property
    def chooser(self):
        """`--method auto`'s chooser: what this engine measured, per band (auto.py)."""
        if "chooser" not in self._resources:
            from . import auto

            store = auto.store_path(self.lm, self.drafter_spec) if self.remember_auto else None
            self._resources["chooser"] = auto.MethodChooser(self.verify_costs, self.drafter is not None, store,
                                                            self.step_overhead(self.drafter))
        return self._resources["chooser"]

    def choose_method(self, prompt_ids, params: Optional[GenerationParams] = None, busy: bool = False):
        """`auto` for this request -> auto.Choice (the method and why)."""
        params = params or GenerationParams()
        try:
            check_penalties("redrafter", params)
            unsupported = None
        except UserError as error:
            unsupported = str(error)
        return self.chooser.choose(len(prompt_ids), params.greedy, busy=busy, unsupported=unsupported)

    # -- plain decoding's rate ------------------------------------------------------------------------
    @property
    def plain_rates(self) -> PlainRates:
        if "plain_rates" not in self._resources:
            from . import plain_rate

            self._resources["plain_rates"] = PlainRates(plain_rate.store_path(self.lm) if self.remember_auto else None)
        return self._resources["plain_rates"]

    def plain_tps(self, context: float, params: GenerationParams) -> Optional[float]:
        """Plain decoding's tok/s here at this context with these sampling settings, where measured."""
        return self.plain_rates.tps_at(mode_of(params), context)

    def record_alone(self, method: str, prompt_tokens: int, params: GenerationParams, stats) -> None:
        """An answer that decoded alone: its rate for `auto` and the plain rate (`ar`), or its
        speed-up over plain decoding (every other method), in its stats."""
        if method in CANDIDATES:
            self.chooser.record(method, prompt_tokens, params.greedy, stats.decode_tps, stats.generated_tokens,
                                stats.extra.get("acceptance_per_position"))
        if method == "ar":
            self.plain_rates.record(mode_of(params), prompt_tokens, stats.generated_tokens, stats.decode_tps)
            return
        plain = self.plain_tps(mean_context(prompt_tokens, stats.generated_tokens), params)
        if plain and stats.decode_tps > 0:
            stats.extra["plain_tps"] = round(plain, 2)
            stats.extra["speedup_vs_plain"] = round(stats.decode_tps / plain, 3)

    def _measured(self, events: Iterator[Event], method: str, prompt_tokens: int, params: GenerationParams,
                  choice=None) -> Iterator[Event]:
        """Pass the events on. The first says what `auto` chose and plain decoding's rate to
        compare with; the finished answer is recorded (`record_alone`)."""
        first = True
        try:
            for event in events:
                if first:
                    first = False
                    if choice is not None:
                        event.chosen = choice.as_dict()  # shown from the start
                    if method != "ar":
                        expected = mean_context(prompt_tokens, min(params.max_tokens, 256))
                        event.plain_tps = self.plain_tps(expected, params)
                if event.stats is not None and event.kind == "done":
                    if choice is not None:
                        event.stats.extra["auto"] = choice.as_dict()
                    self.record_alone(method, prompt_tokens, params, event.stats)
                yield event
        finally:
            events.close()  # stopped early: the strategy's `finally` runs now (its cache rolls back)

    # -- warm-up --------------------------------------------------------------------------------------
    def warm_up(self, method: str, params: Optional[GenerationParams] = None,
                progress: Optional[Callable[[str], None]] = None) -> float:
        """Ready `method` (`auto`: both candidates) for a first answer with these sampling settings,
        and measure plain decoding's rate in this sampling mode if none is stored. Nothing it
        decodes is recorded for `auto` or kept in the prefix store. Returns the seconds it took."""
        start, params = time.perf_counter(), params or GenerationParams()
        tell = progress or (lambda stage: None)
        prompt = self._warm_prompt(1)
        methods = list(CANDIDATES) if method == "auto" else [method]
        if "redrafter" in methods and self.drafter is None:
            methods.remove("redrafter")
        for name in methods:
            if name not in STRATEGIES:
                continue
            try:
                check_penalties(name, params)
            except UserError:  # this method will not take these settings: nothing to ready
                continue
            tell(f"warming up {name}")
            self._decode_quietly(prompt, name, params, WARM_METHOD_TOKENS)
        mode = mode_of(params)
        for repeats in WARM_PLAIN_REPEATS:
            prompt = self._warm_prompt(repeats)
            if self.plain_rates.has_near(mode, mean_context(len(prompt), WARM_PLAIN_TOKENS)):
                continue
            tell(f"measuring plain decoding's speed at {len(prompt)} tokens of context ({mode}, once)")
            stats = self._decode_quietly(prompt, "ar", params, WARM_PLAIN_TOKENS)
            if stats is not None:
                self.plain_rates.record(mode, len(prompt), stats.generated_tokens, stats.decode_tps)
        return time.perf_counter() - start

    def _warm_prompt(self, repeats: int):
        """The warm-up question, its text `repeats` times; in a small window, what fits."""
        prompt = self.lm.encode_chat([{"role": "user", "content": "\n\n".join([WARM_PROMPT] * repeats)}])
        return prompt[-max(self.lm.context_length // 4, 8):]

    def _decode_quietly(self, prompt, method: str, params: GenerationParams, tokens: int):
        """One answer of `tokens` tokens (no stop at EOS's text; the prefix store left alone) -> its stats."""
        resources = self._resources_for(method, params)
        resources.pop("prefix_store", None)
        run = dataclasses.replace(params, max_tokens=tokens, stop=())
        stats = None
        for event in stream_events(self.lm_for(method), list(prompt), STRATEGIES[method], run, method,
                                   resources=resources):
            if event.kind == "done":
                stats = event.stats
        return stats
