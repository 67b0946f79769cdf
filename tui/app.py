"""The chat app: conversation list, conversation, input; live thread panes; status bar.

Never frozen: the model loads in a thread worker that reports its stages to a progress bar;
each answer is generated in a thread worker that queues the engine's events, which the UI thread
takes and draws at most once a frame; the UI thread alone touches widgets and the SQLite store, so
what is saved is exactly what is shown.
Esc stops an answer at once: the UI marks it stopped and ignores the worker's later messages;
the worker closes the engine's stream at its next event (the engine rolls its cache back).
The workers and the handlers of their messages are in `tui.workers`, attaching a document to a
conversation (`/attach`, Ctrl+L) in `tui.attach`; this module is the layout, the conversations,
the keys and their actions.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Optional

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Input, ProgressBar, Static

from .attach import AttachMixin
from .documents import DocumentError
from .messages import Generation
from .screens import DEFAULT_SETTINGS, HelpScreen, SettingsScreen
from .store import Conversation, Store, data_dir, default_db_path
from .stream import Restore, default_restore
from .widgets import (ChatLog, ConversationItem, ConversationList, DocumentChip, MessageView, StatusBar,
                      ThreadPanes, marks_to_segments, method_label)
from .workers import GenerationMixin, Loader, LoadingMixin, real_loader  # tui.cli imports real_loader from here


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40] or "conversation"


class ChatApp(LoadingMixin, GenerationMixin, AttachMixin, App):
    CSS_PATH = Path(__file__).with_name("chat.tcss")  # absolute: subclasses elsewhere find it too
    TITLE = "mlx-specdec chat"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+o", "settings", "Method"),
        Binding("ctrl+l", "attach", "Attach"),
        Binding("ctrl+s", "export", "Export"),
        Binding("ctrl+b", "toggle_sidebar", "Chats"),
        Binding("ctrl+t", "toggle_theme", "Theme", show=False),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, *, engine=None, loader: Optional[Loader] = None, store: Optional[Store] = None,
                 db_path: Optional[Path] = None, home: Optional[Path] = None, restore: Optional[Restore] = None,
                 baseline: Optional[float] = None, method: str = "ar",
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
        self.baseline = baseline  # a fixed plain speed for an engine that states none (tests, demos)
        self.default_method = method
        self.default_settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.model_label = model_label
        self.export_dir = Path(export_dir) if export_dir else self.home / "exports"
        self._start_theme = theme
        self.engine = None
        self.unavailable: dict = {}  # method -> why this model cannot run it
        self._told_unavailable: set = set()
        self.store: Optional[Store] = None
        self.conversation: Optional[Conversation] = None
        self.current: Optional[Generation] = None
        self.last: Optional[Generation] = None
        self._gen_ids = 0
        self._engine_lock = threading.Lock()
        self._pending: Optional[str] = None
        self.attachments = {}  # conversation id -> the Document its next message takes
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
                yield DocumentChip(id="doc-chip")
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
            document = msg.stats.get("document") if msg.role == "user" else None
            view = MessageView(msg.role, message_id=msg.id, method=msg.method or "", status=msg.status,
                               segments=marks_to_segments(msg.content, msg.marks), summary=summary,
                               document=document if isinstance(document, dict) else None)
            if gen is not None and not gen.finished and gen.message_id == msg.id:
                gen.view = view
                view.segments = gen.state.answer_segments()
            chat.mount(view)
        chat.scroll_end(animate=False)
        if gen is None or gen.finished or gen.conversation_id != conversation_id:
            self.panes.reset()
        self.update_header()
        self.refresh_list()
        self.show_chip()

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

    # -- asking (the answer itself: `GenerationMixin` in tui.workers) -----------------------
    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.run_command(text):  # /attach PATH, /detach
            event.input.value = ""
            return
        if self.current is not None and not self.current.finished:
            self.notify("An answer is still being written: Esc stops it.", severity="warning")
            return
        try:
            document = self.document_for(text)  # counted before any prefill
        except DocumentError as exc:
            self.say(str(exc))  # the question stays in the input
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
        if document is not None:
            self.take_document()
        self.ask(text, document)

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

        self.push_screen(SettingsScreen(methods, conv.method, conv.settings, self.unavailable), saved)

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
