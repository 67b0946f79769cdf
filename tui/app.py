"""The chat app: conversation list, conversation, input; live thread panes; status bar.

Never frozen: the model loads in a thread worker that reports its stages to a progress bar;
each answer is generated in a thread worker that posts one message per engine event; the UI
thread alone touches widgets and the SQLite store, so what is saved is exactly what is shown.
Esc stops an answer at once: the UI marks it stopped and ignores the worker's later messages;
the worker closes the engine's stream at its next event (the engine rolls its cache back).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.widgets import Footer, Input, ProgressBar, Static

from .screens import DEFAULT_SETTINGS, METHOD_OPTIONS, HelpScreen, SettingsScreen
from .store import Conversation, Store, data_dir, default_db_path
from .stream import Restore, StreamState, default_restore
from .widgets import (ChatLog, ConversationItem, ConversationList, MessageView, StatusBar, ThreadPanes,
                      marks_to_segments, method_label)

Loader = Callable[[Callable[[str, int, int], None]], object]

HINTS = {
    "ContextOverflow": "The conversation no longer fits the model's context window: start a new "
                       "one (Ctrl+N) or lower max tokens (Ctrl+O).",
    "ModelNotFound": "Check --model (a model directory, .gguf file or Hugging Face repo id), or run "
                     "`mlx-specdec fetch` for the default model.",
    "CorruptModel": "The model files are damaged: delete that model directory and fetch or convert it again.",
    "UnsupportedModel": "mlx-specdec runs Llama-family models: choose another --model.",
    "DrafterMismatch": "The draft head was trained for another model: pass --drafter DIR for this "
                       "model, or choose another method (Ctrl+O).",
    "NoDrafter": "Train one with `mlx-specdec train-drafter` and pass --drafter DIR, or choose "
                 "another method (Ctrl+O).",
    "UnknownMethod": "Choose another method (Ctrl+O).",
    "NoControlTokens": "APAR needs a model with [Fork]/[Child] tokens: train an adapter with "
                       "`mlx-specdec train-apar`, or choose another method (Ctrl+O).",
    "AdapterMismatch": "The APAR adapter was trained for another model: pass a matching one, or "
                       "choose another method (Ctrl+O).",
}


def hint_for(exc: BaseException) -> str:
    for cls in type(exc).__mro__:
        if cls.__name__ in HINTS:
            return HINTS[cls.__name__]
    text = str(exc).lower()
    if "adapter" in text or "drafter" in text:
        return "Pass a matching --drafter/adapter for this model, or choose another method (Ctrl+O)."
    if "context" in text:
        return HINTS["ContextOverflow"]
    return "Change the method or settings (Ctrl+O) or start a new conversation (Ctrl+N)."


def error_line(exc: BaseException) -> str:
    from mlx_specdec.errors import UserError

    if isinstance(exc, UserError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


# -- messages from the workers ---------------------------------------------------------------------
class LoadProgress(Message):
    def __init__(self, stage: str, step: int, total: int):
        super().__init__()
        self.stage, self.step, self.total = stage, step, total


class EngineReady(Message):
    def __init__(self, engine, baseline: Optional[float]):
        super().__init__()
        self.engine, self.baseline = engine, baseline


class LoadFailed(Message):
    def __init__(self, error: str, hint: str):
        super().__init__()
        self.error, self.hint = error, hint


class GenEvent(Message):
    def __init__(self, gen_id: int, event):
        super().__init__()
        self.gen_id, self.event = gen_id, event


class GenFinished(Message):
    def __init__(self, gen_id: int, error: Optional[str] = None, hint: str = ""):
        super().__init__()
        self.gen_id, self.error, self.hint = gen_id, error, hint


@dataclass
class Generation:
    id: int
    conversation_id: int
    message_id: int
    method: str
    settings: dict
    state: StreamState
    cancel: threading.Event = field(default_factory=threading.Event)
    view: Optional[MessageView] = None
    finished: bool = False
    status: str = "streaming"


def make_params(settings: dict, method: str):
    from mlx_specdec.decoding.base import GenerationParams

    options = {k: settings[k] for k in METHOD_OPTIONS.get(method, ()) if settings.get(k) is not None}
    return GenerationParams(max_tokens=int(settings.get("max_tokens", 512)),
                            temperature=float(settings.get("temperature", 0.0)),
                            top_p=float(settings.get("top_p", 1.0)), seed=settings.get("seed"),
                            options=options)


def engine_decoder(engine) -> Optional[Callable[[List[int]], str]]:
    decode = getattr(engine, "decode", None)
    if callable(decode):
        return decode
    tokenizer = getattr(getattr(engine, "lm", None), "tokenizer", None)
    return getattr(tokenizer, "decode", None)


def real_loader(model: str = "default", dtype: str = "auto", drafter: Optional[str] = "auto",
                apar_adapter: Optional[str] = "auto") -> Loader:
    """Load the engine in stages (fetch/convert the default model once, then load weights)."""

    def load(progress: Callable[[str, int, int], None]):
        from mlx_specdec.engine import Engine

        if model in (None, "", "default", "default-f16", "default-4bit"):
            from mlx_specdec.model.default import default_model_dir, ensure_default_model

            variant = "4bit" if model == "default-4bit" else "f16"
            if not (default_model_dir(variant) / "config.json").exists():
                progress("downloading and converting the default model (once, 93 MB)", 0, 4)
            ensure_default_model(variant, quiet=True)
        progress(f"loading {model} weights", 1, 4)
        return Engine.load(model, dtype=dtype, drafter=drafter, apar_adapter=apar_adapter)

    return load


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40] or "conversation"


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("chat.tcss")  # absolute: subclasses elsewhere find it too
    TITLE = "mlx-specdec chat"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+o", "settings", "Method"),
        Binding("ctrl+s", "export", "Export"),
        Binding("ctrl+b", "toggle_sidebar", "Chats"),
        Binding("ctrl+t", "toggle_theme", "Theme", show=False),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, *, engine=None, loader: Optional[Loader] = None, store: Optional[Store] = None,
                 db_path: Optional[Path] = None, home: Optional[Path] = None, restore: Optional[Restore] = None,
                 baseline: Optional[float] = None, measure_baseline: bool = True, method: str = "ar",
                 settings: Optional[dict] = None, model_label: str = "default",
                 export_dir: Optional[Path] = None, theme: str = "textual-dark"):
        super().__init__()
        self._engine_given = engine
        self._loader = loader or real_loader()
        self._store_given = store
        self._db_path = db_path
        self.home = Path(home) if home else data_dir()
        self._restore_given = restore
        self.restore = restore or default_restore()
        self.baseline = baseline
        self._measure_baseline = measure_baseline and baseline is None
        self.default_method = method
        self.default_settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.model_label = model_label
        self.export_dir = Path(export_dir) if export_dir else self.home / "exports"
        self._start_theme = theme
        self.engine = None
        self.store: Optional[Store] = None
        self.conversation: Optional[Conversation] = None
        self.current: Optional[Generation] = None
        self.last: Optional[Generation] = None
        self._gen_ids = 0
        self._engine_lock = threading.Lock()
        self._pending: Optional[str] = None
        self.load_stage = "starting"

    # -- layout -----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="sidebar"):
                yield Static("Conversations", id="sidebar-title")
                yield ConversationList(id="conversations")
            with Vertical(id="main"):
                yield Static("", id="conv-header")
                with Vertical(id="load-box"):
                    yield Static("", id="load-stage")
                    yield ProgressBar(total=4, show_eta=False, id="load-bar")
                yield ChatLog(id="chat")
                yield ThreadPanes(id="threads")
                yield Input(placeholder="Ask something… (Enter sends · Esc stops · F1 help)", id="prompt")
        yield StatusBar("", id="status")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.theme = self._start_theme
        try:
            self.store = self._store_given or Store(self._db_path or default_db_path())
        except Exception as exc:  # noqa: BLE001 - unreadable file, locked, full disk
            self.notify(f"Cannot open the conversation store ({exc}); this session is not saved.\n"
                        "Check the user data directory, or pass --db PATH.", severity="error", timeout=15)
            self.store = Store(":memory:")
        conversations = self.store.conversations()
        if conversations:
            self.show_conversation(conversations[0].id)
        else:
            self.new_conversation()
        prompt = self.query_one("#prompt", Input)
        prompt.focus()
        if self.is_headless:
            prompt.cursor_blink = False  # tests and snapshots: a steady screen
        self.query_one("#load-box").add_class("-loading")
        self.status.show_text(f"loading {self.model_label}…")
        self.run_worker(self._load, thread=True, group="load", name="load model")

    @property
    def status(self) -> StatusBar:
        return self.query_one("#status", StatusBar)

    @property
    def chat(self) -> ChatLog:
        return self.query_one("#chat", ChatLog)

    @property
    def panes(self) -> ThreadPanes:
        return self.query_one("#threads", ThreadPanes)

    # -- loading (thread worker) ------------------------------------------------------------
    def _load(self) -> None:
        def progress(stage: str, step: int, total: int) -> None:
            self.post_message(LoadProgress(stage, step, total))

        try:
            engine = self._engine_given if self._engine_given is not None else self._loader(progress)
            baseline = self.baseline
            if self._measure_baseline:
                from mlx_specdec.decoding.base import GenerationParams

                from .baseline import cached_plain_speed, plain_speed

                if cached_plain_speed(engine, self.home) is None:
                    progress("measuring the model's plain speed on this machine (once)", 3, 4)
                try:
                    with self._engine_lock:
                        baseline = plain_speed(engine, self.home, GenerationParams)
                except Exception:  # noqa: BLE001 - no speed-up figure, but a working chat
                    baseline = None
            progress("ready", 4, 4)
            self.post_message(EngineReady(engine, baseline))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a notification
            self.post_message(LoadFailed(error_line(exc), hint_for(exc)))

    def on_load_progress(self, message: LoadProgress) -> None:
        self.load_stage = message.stage
        self.query_one("#load-stage", Static).update(f"{message.stage}…")
        self.query_one("#load-bar", ProgressBar).update(total=message.total, progress=message.step)
        self.status.show_text(f"{self.model_label}: {message.stage}…")

    def on_engine_ready(self, message: EngineReady) -> None:
        self.engine = message.engine
        if self._restore_given is None:
            self.restore = default_restore(self.engine)
        self.baseline = message.baseline or None
        self.query_one("#load-box").remove_class("-loading")
        lm = getattr(self.engine, "lm", None)
        self.model_label = lm.describe() if hasattr(lm, "describe") else self.model_label
        self.update_header()
        plain = f" · plain speed {self.baseline:.1f} tok/s" if self.baseline else ""
        self.status.show_text(f"ready: {self.model_label}{plain}")
        if self._pending is not None:
            text, self._pending = self._pending, None
            self.ask(text)

    def on_load_failed(self, message: LoadFailed) -> None:
        self.query_one("#load-box").remove_class("-loading")
        self.load_stage = "failed"
        self.status.show_text(f"model not loaded: {message.error}")
        self.notify(f"{message.error}\n{message.hint}", title="Cannot load the model",
                    severity="error", timeout=30)

    # -- conversations ----------------------------------------------------------------------
    def new_conversation(self) -> None:
        current = self.conversation
        if current is not None and not self.store.messages(current.id):
            return  # already on an empty conversation
        conv = self.store.create_conversation(self.default_method, dict(self.default_settings))
        self.show_conversation(conv.id)

    def show_conversation(self, conversation_id: int) -> None:
        self.conversation = self.store.conversation(conversation_id)
        chat = self.chat
        chat.remove_children()
        gen = self.current
        for msg in self.store.messages(conversation_id):
            summary = str(msg.stats.get("line", "")) if msg.role == "assistant" else ""
            view = MessageView(msg.role, message_id=msg.id, method=msg.method or "", status=msg.status,
                               segments=marks_to_segments(msg.content, msg.marks), summary=summary)
            if gen is not None and not gen.finished and gen.message_id == msg.id:
                gen.view = view
                view.segments = gen.state.answer_segments()
            chat.mount(view)
        chat.scroll_end(animate=False)
        if gen is None or gen.finished or gen.conversation_id != conversation_id:
            self.panes.reset()
        self.update_header()
        self.refresh_list()

    def refresh_list(self) -> None:
        lv = self.query_one("#conversations", ConversationList)
        lv.clear()
        index = None
        for i, conv in enumerate(self.store.conversations()):
            lv.append(ConversationItem(conv.id, conv.title, conv.method))
            if self.conversation and conv.id == self.conversation.id:
                index = i
        if index is not None:
            lv.index = index

    def update_header(self) -> None:
        conv = self.conversation
        if conv is None:
            return
        self.query_one("#conv-header", Static).update(
            f"{conv.title} · {method_label(conv.method, conv.settings)} · {self.model_label}")

    @on(ConversationList.Selected, "#conversations")
    def _picked(self, event: ConversationList.Selected) -> None:
        item = event.item
        if isinstance(item, ConversationItem) and (self.conversation is None or item.conversation_id != self.conversation.id):
            self.show_conversation(item.conversation_id)
            self.query_one("#prompt", Input).focus()

    # -- asking -----------------------------------------------------------------------------
    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.current is not None and not self.current.finished:
            self.notify("An answer is still being written: Esc stops it.", severity="warning")
            return
        event.input.value = ""
        if self.engine is None:
            if self.load_stage == "failed":
                self.notify("No model is loaded: restart with a working --model.", severity="error")
                event.input.value = text
                return
            self._pending = text
            self.notify("The model is still loading: your question is sent when it is ready.")
            return
        self.ask(text)

    def ask(self, text: str) -> None:
        conv = self.store.conversation(self.conversation.id)
        history = [{"role": m.role, "content": m.content} for m in self.store.messages(conv.id)
                   if m.content and m.role in ("user", "assistant")]
        if not history:
            title = text.splitlines()[0][:48]
            self.store.update_conversation(conv.id, title=title)
            conv.title = title
            self.conversation = conv
        self.store.add_message(conv.id, "user", text)
        self.chat.add(MessageView("user", text))
        history.append({"role": "user", "content": text})
        message_id = self.store.add_message(conv.id, "assistant", "", status="streaming", method=conv.method)
        view = self.chat.add(MessageView("assistant", message_id=message_id, method=conv.method,
                                         status="streaming", segments=[]))
        self._gen_ids += 1
        state = StreamState(conv.method, decode=engine_decoder(self.engine), restore=self.restore,
                            baseline_tps=self.baseline)
        gen = Generation(self._gen_ids, conv.id, message_id, conv.method, dict(conv.settings), state, view=view)
        self.current = gen
        self.panes.reset()
        self.update_header()
        self.refresh_list()
        self.status.show_state(state, conv.method, self.baseline, "prefill")
        try:
            params = make_params({**self.default_settings, **conv.settings}, conv.method)
        except (TypeError, ValueError) as exc:
            self.post_message(GenFinished(gen.id, f"bad settings: {exc}", "Fix them with Ctrl+O."))
            return
        self.run_worker(lambda: self._generate(gen, history, params), thread=True, group="generate",
                        name=f"answer {gen.id}")

    def _generate(self, gen: Generation, history: List[dict], params) -> None:
        """Thread worker: one engine stream -> one message per event. Holds the engine lock, so a
        new answer waits for a stopped one to close its stream."""
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
                    self.post_message(GenEvent(gen.id, event))
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

    def on_gen_event(self, message: GenEvent) -> None:
        gen = self.current
        if gen is None or gen.finished or message.gen_id != gen.id:
            return  # a stopped answer's late events
        state = gen.state
        change = state.feed(message.event)
        if change.done:
            self.finish(gen, "done")
            return
        self.store.update_message(gen.message_id, content=state.answer(), marks=state.marks(),
                                  threads=state.thread_record() if state.forked else None)
        if self.conversation is None or self.conversation.id != gen.conversation_id:
            return  # saved; another conversation is on screen
        try:
            self._show_change(gen, change)
        except NoMatches:  # the app is closing: the answer is saved above, the widgets are gone
            pass

    def _show_change(self, gen: Generation, change) -> None:
        state = gen.state
        panes = self.panes
        for tid in change.opened:
            panes.open(state.threads[tid], state)
        for tid in change.updated:
            panes.update_thread(tid)
        for tid in change.closed:
            panes.close(tid)
        if state.forked:
            panes.describe(state)
        if gen.view is not None and gen.view.is_attached:
            gen.view.set_stream(state.answer_segments())
            self.chat.follow()
        self.status.show_state(state, gen.method, self.baseline, "writing")

    def on_gen_finished(self, message: GenFinished) -> None:
        gen = self.current
        if gen is None or gen.finished or message.gen_id != gen.id:
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
                self.status.show_state(state, gen.method, self.baseline, status)
        except NoMatches:  # the app is closing
            pass

    # -- actions ----------------------------------------------------------------------------
    def action_stop(self) -> None:
        gen = self.current
        if gen is None or gen.finished:
            return
        self._cancel(gen)
        self.finish(gen, "stopped")

    def action_new_chat(self) -> None:
        self.new_conversation()
        self.query_one("#prompt", Input).focus()

    def action_settings(self) -> None:
        if self.conversation is None:
            return
        methods = list(getattr(self.engine, "methods", None) or ["ar", "mlx-lm", "redrafter"])
        conv = self.store.conversation(self.conversation.id)

        def saved(result: Optional[dict]) -> None:
            if not result:
                return
            self.store.update_conversation(conv.id, method=result["method"], settings=result["settings"])
            self.show_conversation(conv.id)
            self.notify(f"{method_label(result['method'], result['settings'])} for this conversation")

        self.push_screen(SettingsScreen(methods, conv.method, conv.settings), saved)

    def action_export(self) -> None:
        if self.conversation is None:
            return
        try:
            text = self.store.export_markdown(self.conversation.id)
            self.export_dir.mkdir(parents=True, exist_ok=True)
            path = self.export_dir / f"{self.conversation.id:04d}-{slug(self.conversation.title)}.md"
            path.write_text(text)
        except OSError as exc:
            self.notify(f"Cannot export: {exc}\nPass --export-dir to write elsewhere.", severity="error")
            return
        self.notify(f"Saved {path}", title="Exported to Markdown")

    def action_toggle_sidebar(self) -> None:
        self.query_one("#sidebar").toggle_class("-hidden")

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        self.exit()

    def on_unmount(self) -> None:
        if self.current is not None:
            self._cancel(self.current)

    def _cancel(self, gen: Generation) -> None:
        """The worker closes the engine's stream at its next event; an engine with a `cancel()`
        hook (the fake one) is also told to let go of a step it is blocked in."""
        gen.cancel.set()
        hook = getattr(self.engine, "cancel", None)
        if callable(hook):
            hook()
