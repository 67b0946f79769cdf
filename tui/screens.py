"""Modal screens: the method + settings of a conversation, the path of a document to attach, help."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Collapsible, Input, Label, Select, Static

from mlx_specdec.settings import METHODS, SAMPLING, Setting, SettingError

from .widgets import METHOD_LABELS

#: the chat's sampling fields (the registry's, with the chat's own longer default answer)
CHAT_DEFAULTS = {"max_tokens": 512}
SAMPLING_FIELDS: Tuple[Setting, ...] = SAMPLING
#: every setting a conversation keeps, with its default (method settings as the registry declares them)
DEFAULT_SETTINGS: Dict[str, object] = {
    **{s.name: CHAT_DEFAULTS.get(s.name, s.default) for s in SAMPLING},
    **{s.name: s.default for m in METHODS.values() for s in m.settings},
}


def method_fields(method: str) -> Tuple[Setting, ...]:
    spec = METHODS.get(method)
    return spec.settings if spec else ()


def parse_settings(raw: Dict[str, str], method: str, current: Optional[dict] = None) -> Dict[str, object]:
    """The screen's text fields (sampling + this method's) -> typed settings, the other methods'
    kept from `current`; ValueError with a readable line on bad input (the registry's wording)."""
    out: Dict[str, object] = {**DEFAULT_SETTINGS, **(current or {})}
    for setting in SAMPLING_FIELDS + method_fields(method):
        if setting.name not in raw:
            continue
        text = str(raw[setting.name] or "").strip()
        if not text and setting.default is None:
            out[setting.name] = None
            continue
        try:
            value = setting.parse(text)
        except SettingError as error:
            raise ValueError(f"{setting.label} {error.detail}") from None
        out[setting.name] = setting.show(value) if setting.values else value
    return out


class SettingsScreen(ModalScreen[Optional[dict]]):
    """Method and settings of the current conversation, made from the method registry: the
    sampling fields, then the chosen method's settings, its expert ones folded. Returns
    {'method', 'settings'} or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    #settings-box { width: 64; max-width: 100%; height: auto; max-height: 100%;
                    border: round $accent; background: $surface; padding: 0 1; }
    #settings-fields { height: 16; }
    .settings-grid { grid-size: 2; grid-columns: 26 1fr; grid-rows: 1; grid-gutter: 0 1; height: auto; }
    .settings-grid Label { width: 100%; color: $text-muted; }
    .settings-grid Input, .settings-grid Select { width: 100%; }
    .settings-grid Input { background: $boost; }
    .method-fields { height: auto; }
    .method-fields Collapsible { padding: 0; border: none; background: $surface; }
    #settings-buttons { height: auto; align: right middle; margin-top: 1; }
    #settings-buttons Button { margin-left: 1; }
    """

    def __init__(self, methods: List[str], method: str, settings: dict, unavailable: Optional[dict] = None):
        super().__init__()
        self.methods = methods
        self.unavailable = unavailable or {}  # method -> why this model cannot run it
        self.method = method if method in methods else methods[0]
        self.settings = {**DEFAULT_SETTINGS, **settings}

    def _field(self, setting: Setting):
        yield Label(setting.label, id=f"label-{setting.name}")
        value = self.settings.get(setting.name)
        if setting.kind in ("bool", "choice"):
            choices = setting.choices or ("on", "off")
            shown = setting.show(value) if setting.kind == "bool" or setting.values else value
            yield Select([(c, c) for c in choices], value=shown if shown in choices else choices[0],
                         allow_blank=False, compact=True, id=f"field-{setting.name}")
        else:
            yield Input("" if value is None else str(value), compact=True, id=f"field-{setting.name}")

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-box") as box:
            box.border_title = "Method and settings (this conversation)"
            yield from self._fields()
            with Horizontal(id="settings-buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Save", id="save", variant="primary", compact=True)

    def _fields(self) -> ComposeResult:
        with VerticalScroll(id="settings-fields"):
            with Grid(classes="settings-grid"):
                yield Label("method")
                yield Select([(f"{METHOD_LABELS.get(m, m)} ({m})" + (" · not for this model" if m in self.unavailable
                                                                      else ""), m) for m in self.methods],
                             value=self.method,
                             allow_blank=False, compact=True, id="method")
                for setting in SAMPLING_FIELDS:
                    yield from self._field(setting)
            for method in self.methods:
                fields = method_fields(method)
                if not fields:
                    continue
                with Vertical(classes="method-fields", id=f"fields-{method}") as group:
                    group.display = method == self.method
                    with Grid(classes="settings-grid"):
                        for setting in fields:
                            if not setting.expert:
                                yield from self._field(setting)
                    with Collapsible(title=f"{METHOD_LABELS.get(method, method)}: expert settings", collapsed=True):
                        with Grid(classes="settings-grid"):
                            for setting in fields:
                                if setting.expert:
                                    yield from self._field(setting)

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "method":
            for group in self.query(".method-fields"):
                group.display = group.id == f"fields-{event.value}"

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_save()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        method = self.query_one("#method", Select).value
        names = [s.name for s in SAMPLING_FIELDS + method_fields(method)]
        raw = {name: self.query_one(f"#field-{name}").value for name in names}
        try:
            settings = parse_settings(raw, method, self.settings)
        except ValueError as exc:
            self.notify(str(exc), title="Setting not saved", severity="error")
            return
        self.dismiss({"method": method, "settings": settings})


class AttachScreen(ModalScreen[Optional[str]]):
    """A one-line prompt for the path of a document to attach. Returns the path, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    AttachScreen { align: center middle; }
    #attach-box { width: 64; max-width: 100%; height: auto; border: round $accent; background: $surface;
                  padding: 0 1; }
    #attach-path { background: $boost; }
    #attach-note { color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        with Vertical(id="attach-box") as box:
            box.border_title = "Attach a text file (Esc cancels)"
            yield Input(placeholder="path of a UTF-8 text file, e.g. ~/notes.txt", compact=True, id="attach-path")
            yield Static("It goes into the conversation with your next message.", id="attach-note")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


KEYS = [
    ("Enter", "send the question"),
    ("Esc", "stop the answer now (the text so far is kept)"),
    ("Ctrl+N", "new conversation"),
    ("Ctrl+O", "method and settings of this conversation"),
    ("Ctrl+L", "attach a text file (or type /attach PATH; /detach removes it)"),
    ("Ctrl+S", "export this conversation to Markdown"),
    ("Ctrl+B", "show / hide the conversation list"),
    ("Ctrl+T", "light / dark theme"),
    ("F1", "this help"),
    ("Ctrl+Q", "quit"),
]

HELP_TEXT = """\
[b]Methods.[/b] [i]plain[/i] (ar) is the model's own decoding. [i]ReDrafter[/i] drafts several \
tokens with a small head and verifies them in one forward: text from accepted drafts is \
[$text-success underline]green and underlined[/]. [i]APAR[/i] forks a thread per paragraph: \
each live thread gets a pane, nested under the thread that forked it, and closes when it \
finishes; the answer assembles above. [i]TriForce[/i] is for long prompts such as an \
attached document: the model over a small retrieval cache (budget: keys per head) drafts γ \
tokens for one full-cache verify, helped by a cheaper drafter below it (the bottom level: \
n-gram lookup by default).

[b]Documents.[/b] [i]/attach PATH[/i] or Ctrl+L attaches a text file (its tokens shown above the \
input); it goes into your next message, ahead of the question, and stays in the conversation.

[b]Status bar.[/b] tokens/s, tokens per forward, draft acceptance (TriForce: its bottom and \
middle levels'), and the speed-up over this model's plain speed measured on this machine (once, \
then cached).

[b]Saved.[/b] Conversations are written to an SQLite file in your user data directory as the \
answer streams: a partial answer survives even a killed process."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "close", "Close"), Binding("f1", "close", "Close"), Binding("q", "close", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    #help-box { width: 76; max-width: 100%; height: auto; max-height: 100%; border: round $accent;
                background: $surface; padding: 0 1; }
    #help-keys { height: auto; margin-bottom: 1; }
    #help-text { height: auto; }
    """

    def compose(self) -> ComposeResult:
        from textual.content import Content

        keys = Content("\n").join(Content.assemble((f"{key:<8}", "bold $text-accent"), what) for key, what in KEYS)
        with VerticalScroll(id="help-box") as box:
            box.border_title = "Help (Esc closes)"
            yield Static(keys, id="help-keys")
            yield Static(HELP_TEXT, id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)
