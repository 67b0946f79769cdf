"""The app's two thread workers and the UI-thread handlers of what they post, as mixins of `ChatApp`.

The model loads in a thread worker (`LoadingMixin._load`) that reports its stages as
`LoadProgress` messages; each answer is generated in a thread worker (`GenerationMixin._generate`)
that appends the engine's events to the answer's inbox, which the UI empties once a frame, and
posts a `GenFinished` at the end. The workers never touch widgets or the store: the UI thread
(the `on_*` handlers and the frame timer below) alone does, so what is saved is exactly what is
shown. Both workers hold the app's engine lock while they use the engine.
Esc stops an answer at once: the UI marks it stopped and ignores the worker's later messages; the
worker closes the engine's stream at its next event (the engine rolls its cache back).

The mixins keep no state of their own: they use the attributes `ChatApp.__init__` sets and its
`status`, `chat` and `panes` widgets. Textual finds their `on_*` handlers through the app's MRO.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

from textual.css.query import NoMatches
from textual.widgets import ProgressBar, Static

from .documents import compose
from .hints import error_line, hint_for
from .messages import EngineReady, GenFinished, Generation, LoadFailed, LoadProgress
from .stream import Change, StreamState, default_restore
from .widgets import METHOD_LABELS, MessageView

Loader = Callable[[Callable[[str, int, int], None]], object]


def make_params(settings: dict, method: str):
    from mlx_specdec.decoding.base import GenerationParams
    from mlx_specdec.settings import METHODS, SAMPLING, resolve

    from .screens import DEFAULT_SETTINGS

    names = {s.name for s in METHODS[method].settings} if method in METHODS else set()
    options = resolve(method, {k: v for k, v in settings.items() if k in names and v is not None})
    sampling = {s.name: settings.get(s.name, DEFAULT_SETTINGS[s.name]) for s in SAMPLING}
    sampling.update({s.name: s.parse(sampling[s.name]) for s in SAMPLING if s.values and sampling[s.name] is not None})
    return GenerationParams(**{k: v for k, v in sampling.items() if v is not None}, options=options)


def engine_decoder(engine) -> Optional[Callable[[List[int]], str]]:
    decode = getattr(engine, "decode", None)
    if callable(decode):
        return decode
    tokenizer = getattr(getattr(engine, "lm", None), "tokenizer", None)
    return getattr(tokenizer, "decode", None)


def real_loader(model: str = "default", dtype: str = "auto", drafter: Optional[str] = "auto",
                apar_adapter: Optional[str] = "auto", draft_model: Optional[str] = None) -> Loader:
    """Load the engine in stages (fetch/convert the default model once, then load weights). The
    engine keeps the last prompt's KV cache (`reuse_prefix`): a chat's next turn, which starts with
    every earlier message unchanged (an attached document included), prefills only what is new."""

    def load(progress: Callable[[str, int, int], None]):
        from mlx_specdec.engine import Engine

        if model in (None, "", "default", "default-f16", "default-4bit"):
            from mlx_specdec.model.default import default_model_dir, ensure_default_model

            variant = "4bit" if model == "default-4bit" else "f16"
            if not (default_model_dir(variant) / "config.json").exists():
                progress("downloading and converting the default model (once, 93 MB)", 0, 4)
            ensure_default_model(variant, quiet=True)
        progress(f"loading {model} weights", 1, 4)
        return Engine.load(model, dtype=dtype, drafter=drafter, apar_adapter=apar_adapter,
                           draft_model=draft_model, reuse_prefix=True)

    return load


class LoadingMixin:
    """Loads the engine and warms up its default method off the UI thread."""

    # -- loading (thread worker) ------------------------------------------------------------
    def _load(self) -> None:
        def progress(stage: str, step: int, total: int) -> None:
            self.post_message(LoadProgress(stage, step, total))

        try:
            engine = self._engine_given if self._engine_given is not None else self._loader(progress)
            support = getattr(engine, "method_support", None)
            support = support() if callable(support) else {}  # loads a method's artifacts: here, not in the UI
            warm_s = self._warm_up(engine, support, progress)
            progress("ready", 4, 4)
            self.post_message(EngineReady(engine, support, warm_s))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a notification
            self.post_message(LoadFailed(error_line(exc), hint_for(exc)))

    def _warm_up(self, engine, support: dict, progress: Callable[[str, int, int], None]) -> float:
        """The default method readied for the first answer (engine_measured.py), so the first answer
        runs as fast as the third. An engine without `warm_up`, or a failure, costs nothing but that."""
        warm_up = getattr(engine, "warm_up", None)
        method = self.default_method
        if not callable(warm_up) or support.get(method):
            return 0.0
        try:
            with self._engine_lock:
                return warm_up(method, make_params(self.default_settings, method), lambda stage: progress(stage, 3, 4))
        except Exception:  # noqa: BLE001 - a first answer that pays its own warm-up, but a working chat
            return 0.0

    def on_load_progress(self, message: LoadProgress) -> None:
        self.load_stage = message.stage
        try:
            self.query_one("#load-stage", Static).update(f"{message.stage}…")
            self.query_one("#load-bar", ProgressBar).update(total=message.total, progress=message.step)
            self.status.show_text(f"{self.model_label}: {message.stage}…")
        except NoMatches:  # the app closed while the model was loading
            pass

    def on_engine_ready(self, message: EngineReady) -> None:
        self.engine = message.engine
        self.unavailable = {m: why for m, why in message.support.items() if why}
        if self._restore_given is None:
            self.restore = default_restore(self.engine)
        self.query_one("#load-box").remove_class("-loading")
        lm = getattr(self.engine, "lm", None)
        self.model_label = lm.describe() if hasattr(lm, "describe") else self.model_label
        self.update_header()
        warmed = f" · warmed up in {message.warm_s:.1f} s" if message.warm_s >= 1.0 else ""
        self.status.show_text(f"ready: {self.model_label}{warmed}")
        if self._pending is not None:
            text, self._pending = self._pending, None
            self.ask(text)

    def on_load_failed(self, message: LoadFailed) -> None:
        self.query_one("#load-box").remove_class("-loading")
        self.load_stage = "failed"
        self.status.show_text(f"model not loaded: {message.error}")
        self.notify(f"{message.error}\n{message.hint}", title="Cannot load the model",
                    severity="error", timeout=30)


class GenerationMixin:
    """Writes one answer at a time: starts the worker, shows and saves its events, finishes or stops it.

    The worker only appends the engine's events to the answer's inbox: it never waits for the UI
    and never wakes it. While the answer is written the UI looks at the inbox once a frame
    (`FRAME_S`) and, when something came, takes it all and draws one frame (saved, then shown: the
    message appends to what is on screen, `MessageView.set_stream`). So the UI's cost follows the
    frame rate, not the engine's token rate, and an idle engine costs the UI nothing but the look."""

    FRAME_S = 1 / 30  # the shortest time between two frames
    UI_SHARE = 0.05  # frames are spaced so that drawing takes at most this share of the UI thread
    MAX_FRAME_S = 0.25  # ... but never further apart than this
    STATUS_S = 1 / 4  # the status bar's figures change this often while an answer is written

    # -- asking -----------------------------------------------------------------------------
    def history(self, conversation_id: int) -> List[dict]:
        """The conversation as the engine gets it: its messages in order, as stored (a document a
        message carried stays in it)."""
        return [{"role": m.role, "content": m.content} for m in self.store.messages(conversation_id)
                if m.content and m.role in ("user", "assistant")]

    def _method_for(self, conv) -> str:
        """The conversation's method, or `ar` where this model cannot run it (said once a method)."""
        why = self.unavailable.get(conv.method)
        if why is None:
            return conv.method
        if conv.method not in self._told_unavailable:
            self._told_unavailable.add(conv.method)
            self.notify(f"{why}.\nAnswering with plain decoding (Ctrl+O picks another method).",
                        title=f"{METHOD_LABELS.get(conv.method, conv.method)} is not available for this model",
                        severity="warning", timeout=15)
        return "ar"

    def ask(self, text: str, document=None) -> None:
        """Send `text`; with a `tui.documents.Document`, the message is the document + the question."""
        conv = self.store.conversation(self.conversation.id)
        method = self._method_for(conv)  # this answer's (the conversation keeps its own)
        history = self.history(conv.id)
        if not history:
            title = text.splitlines()[0][:48]
            self.store.update_conversation(conv.id, title=title)
            conv.title = title
            self.conversation = conv
        content = compose(document, text)
        shown = {"name": document.name, "tokens": document.tokens, "question": text} if document else None
        self.store.add_message(conv.id, "user", content, stats={"document": shown} if shown else None)
        self.chat.add(MessageView("user", content, document=shown))
        history.append({"role": "user", "content": content})
        message_id = self.store.add_message(conv.id, "assistant", "", status="streaming", method=method)
        view = self.chat.add(MessageView("assistant", message_id=message_id, method=method,
                                         status="streaming", segments=[]))
        self._gen_ids += 1
        state = StreamState(method, decode=engine_decoder(self.engine), restore=self.restore,
                            baseline_tps=self.baseline)
        gen = Generation(self._gen_ids, conv.id, message_id, method, dict(conv.settings), state, view=view)
        self.current = gen
        self.panes.reset()
        self.update_header()
        self.refresh_list()
        self.status.show_state(state, method, "prefill")
        try:
            params = make_params({**self.default_settings, **conv.settings}, method)
        except (TypeError, ValueError) as exc:
            self.post_message(GenFinished(gen.id, f"bad settings: {exc}", "Fix them with Ctrl+O."))
            return
        gen.timer = self.set_interval(self.FRAME_S, lambda: self._take_events(gen), name=f"answer {gen.id} frames")
        self.run_worker(lambda: self._generate(gen, history, params), thread=True, group="generate",
                        name=f"answer {gen.id}")

    def _generate(self, gen: Generation, history: List[dict], params) -> None:
        """Thread worker: runs one engine stream and appends its events to `gen.inbox`, which the
        UI empties once a frame. Holds the engine lock, so a new answer waits for a stopped one to
        close its stream."""
        with self._engine_lock:
            if gen.cancel.is_set():
                self.post_message(GenFinished(gen.id))
                return
            stream = None
            try:
                stream = self.engine.chat(history, method=gen.method, params=params)
                for event in stream:
                    if gen.cancel.is_set():
                        break
                    gen.inbox.append(event)  # thread-safe; never blocks
                self.post_message(GenFinished(gen.id))
            except Exception as exc:  # noqa: BLE001 - shown as a notification, never a crash
                self.post_message(GenFinished(gen.id, error_line(exc), hint_for(exc)))
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    try:
                        close()  # runs the strategy's `finally`: its cache rolls back
                    except Exception:  # noqa: BLE001
                        pass

    def _take_events(self, gen: Generation, now_or_never: bool = False) -> None:
        """Every `FRAME_S`: when a frame is due and events came, feed them all to the answer's
        state and draw one frame. A frame is due `UI_SHARE`'s worth of time after the previous one:
        the UI thread's CPU time since then (that frame's drawing, the screen's update, the rest)
        divided by the share, between `FRAME_S` and `MAX_FRAME_S`. So drawing costs the engine
        little where a frame is dear, and a cheap frame is drawn at the full rate. The answer's
        "done" ends it at once; `now_or_never` takes what is there whether a frame is due or not."""
        if gen.finished or gen is not self.current:
            return
        inbox, state, change = gen.inbox, gen.state, Change()
        now = time.monotonic()
        if not inbox or (now < gen.next_frame_at and not now_or_never):
            return
        while inbox:
            step = state.feed(inbox.popleft())
            gen.events += 1
            if step.done:
                self.finish(gen, "done")
                return
            change.absorb(step)
        self._frame(gen, change)
        cpu = time.thread_time()  # this (the UI) thread's
        if gen.cpu_mark is not None:
            gap = min(max((cpu - gen.cpu_mark) / self.UI_SHARE, self.FRAME_S), self.MAX_FRAME_S)
            gen.next_frame_at = now + gap
        gen.cpu_mark = cpu

    def _frame(self, gen: Generation, change: Change) -> None:
        """One frame of a streaming answer: save what is shown, then show what changed since the
        last frame (the store and the screen move together)."""
        gen.frames += 1
        state = gen.state
        self.store.update_message(gen.message_id, content=state.answer(), marks=state.marks(),
                                  threads=state.thread_record() if state.forked else None)
        if self.conversation is None or self.conversation.id != gen.conversation_id:
            return  # saved; another conversation is on screen
        try:
            with self.batch_update():
                self._show_change(gen, change)
        except NoMatches:  # the app is closing: the answer is saved above, the widgets are gone
            pass

    def _show_change(self, gen: Generation, change: Change) -> None:
        state = gen.state
        panes = self.panes
        for tid in change.opened:
            if tid not in change.closed:  # a thread that opened and closed within one frame
                panes.open(state.threads[tid], state)
        for tid in change.updated:
            panes.update_thread(tid)
        for tid in change.closed:
            panes.close(tid)
        if state.forked:
            panes.describe(state)
        if gen.view is not None and gen.view.is_attached:
            if gen.view.set_stream(state.answer_segments()):
                self.chat.follow()  # it grew by a line
        self._show_status(gen)

    def _show_status(self, gen: Generation) -> None:
        """The status bar's figures while an answer is written: at most once per `STATUS_S`
        (figures a reader can follow, a repaint less per frame); a frame that comes sooner
        leaves one update due at the end of the interval, so the latest figures always show."""
        if gen.finished or gen is not self.current:
            return
        if self.conversation is None or self.conversation.id != gen.conversation_id:
            return  # another conversation is on screen
        wait = gen.status_at + self.STATUS_S - time.monotonic()
        if wait > 0:
            if not gen.status_due:
                gen.status_due = True
                self.set_timer(wait, lambda: self._show_status(gen))
            return
        gen.status_at, gen.status_due = time.monotonic(), False
        try:
            self.status.show_state(gen.state, gen.method, "writing")
        except NoMatches:  # the app is closing
            pass

    def on_gen_finished(self, message: GenFinished) -> None:
        gen = self.current
        if gen is None or gen.finished or message.gen_id != gen.id:
            return
        self._take_events(gen, now_or_never=True)  # what the worker queued before it ended (its "done" finishes it)
        if gen.finished:
            return
        if message.error:
            self.finish(gen, "error", note=message.error)
            self.notify(f"{message.error}\n{message.hint}", title="The answer failed", severity="error",
                        timeout=20)
        else:
            self.finish(gen, "stopped")

    def finish(self, gen: Generation, status: str, note: str = "") -> None:
        gen.finished = True
        gen.status = status
        if gen.timer is not None:
            gen.timer.stop()
            gen.timer = None
        state = gen.state
        summary = " · ".join(x for x in (note, state.summary_line() if state.tokens else "") if x)
        self.store.update_message(gen.message_id, content=state.answer(), status=status, marks=state.marks(),
                                  threads=state.thread_record() if state.forked else None,
                                  stats={**state.figures(), "line": summary})
        self.last = gen
        self.current = None
        try:
            if gen.view is not None and gen.view.is_attached:
                gen.view.set_stream(state.answer_segments(), status=status, summary=summary)
                self.chat.follow()
            if self.conversation is not None and self.conversation.id == gen.conversation_id:
                self.panes.reset()
                self.status.show_state(state, gen.method, status)
        except NoMatches:  # the app is closing
            pass

    def _cancel(self, gen: Generation) -> None:
        """The worker closes the engine's stream at its next event; an engine with a `cancel()`
        hook (the fake one) is also told to let go of a step it is blocked in."""
        gen.cancel.set()
        hook = getattr(self.engine, "cancel", None)
        if callable(hook):
            hook()
