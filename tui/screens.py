"""Modal screens: the method + settings of a conversation, the path of a document to attach, help."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from mlx_specdec.decoding.redrafter import DEFAULT_BEAM_LENGTH, DEFAULT_BEAM_WIDTH, DEFAULT_DRAFT_CUTOFF
from mlx_specdec.decoding.triforce import BOTTOMS, DEFAULT_BUDGET, DEFAULT_GAMMA

from .widgets import METHOD_LABELS

#: (key, label, kind, default, methods it applies to; None = all). A kind that is a tuple of
#: strings is a choice among them (a select box).
FIELDS: List[Tuple[str, str, object, object, Optional[Tuple[str, ...]]]] = [
    ("max_tokens", "max tokens", int, 512, None),
    ("temperature", "temperature (0 = greedy)", float, 0.0, None),
    ("top_p", "top-p", float, 1.0, None),
    ("seed", "seed (empty = random)", int, None, None),
    ("beam_width", "beam width W", int, DEFAULT_BEAM_WIDTH, ("redrafter",)),
    ("beam_length", "beam length L", int, DEFAULT_BEAM_LENGTH, ("redrafter",)),
    ("draft_cutoff", "draft cutoff (0: all)", float, DEFAULT_DRAFT_CUTOFF, ("redrafter",)),
    ("max_threads", "max live threads", int, 32, ("apar",)),
    ("max_depth", "max fork depth (0: none)", int, 2, ("apar",)),
    ("budget", "budget", int, DEFAULT_BUDGET, ("triforce",)),
    ("gamma", "gamma γ", int, DEFAULT_GAMMA, ("triforce",)),
    ("bottom", "bottom level", tuple(BOTTOMS), "ngram" if "ngram" in BOTTOMS else BOTTOMS[0], ("triforce",)),
]
#: settings passed as `GenerationParams.options` (method-specific), per method
METHOD_OPTIONS = {"redrafter": ("beam_width", "beam_length", "draft_cutoff"), "apar": ("max_threads", "max_depth"),
                  "triforce": ("budget", "gamma", "bottom")}
#: the smallest retrieval budget the engine's triforce takes
MIN_BUDGET = 16
DEFAULT_SETTINGS: Dict[str, object] = {k: d for k, _, _, d, _ in FIELDS}


def parse_settings(raw: Dict[str, str]) -> Dict[str, object]:
    """Text fields -> typed settings; ValueError with a readable line on bad input."""
    out: Dict[str, object] = {}
    for key, label, kind, default, _ in FIELDS:
        text = str(raw.get(key) or "").strip()
        if isinstance(kind, tuple):
            if text not in kind:
                raise ValueError(f"{label} is {' or '.join(kind)}, not {text!r}")
            out[key] = text
            continue
        if not text:
            if default is not None:
                raise ValueError(f"{label} is empty")
            out[key] = None
            continue
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{label}: {text!r} is not a {'whole ' if kind is int else ''}number") from None
        out[key] = value
    if out["max_tokens"] < 1:
        raise ValueError("max tokens must be at least 1")
    if out["temperature"] < 0:
        raise ValueError("temperature must be >= 0")
    if not 0 < out["top_p"] <= 1:
        raise ValueError("top-p must be in (0, 1]")
    for key in ("beam_width", "max_threads", "gamma"):
        if out[key] < 1:
            raise ValueError(f"{key.replace('_', ' ')} must be at least 1")
    if out["max_depth"] < 0:
        raise ValueError("max fork depth must be at least 0")
    if out["beam_length"] < 2:
        raise ValueError("beam length must be at least 2")
    if not 0 <= out["draft_cutoff"] <= 1:
        raise ValueError("draft cutoff must be in [0, 1]")
    if out["budget"] < MIN_BUDGET:
        raise ValueError(f"budget must be at least {MIN_BUDGET}")
    return out


class SettingsScreen(ModalScreen[Optional[dict]]):
    """Method and settings of the current conversation. Returns {'method', 'settings'} or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    #settings-box { width: 60; max-width: 100%; height: auto; max-height: 100%;
                    border: round $accent; background: $surface; padding: 0 1; }
    #settings-grid { grid-size: 2; grid-columns: 26 1fr; grid-rows: 1; grid-gutter: 0 1; height: auto; }
    #settings-grid Label { width: 100%; color: $text-muted; }
    #settings-grid Input, #settings-grid Select { width: 100%; }
    #settings-grid Input { background: $boost; }
    #settings-buttons { height: auto; align: right middle; margin-top: 1; }
    #settings-buttons Button { margin-left: 1; }
    """

    def __init__(self, methods: List[str], method: str, settings: dict):
        super().__init__()
        self.methods = methods
        self.method = method
        self.settings = {**DEFAULT_SETTINGS, **settings}

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-box") as box:
            box.border_title = "Method and settings (this conversation)"
            with Grid(id="settings-grid"):
                yield Label("method")
                yield Select([(f"{METHOD_LABELS.get(m, m)} ({m})", m) for m in self.methods],
                             value=self.method if self.method in self.methods else self.methods[0],
                             allow_blank=False, compact=True, id="method")
                for key, label, kind, default, methods in FIELDS:
                    note = f" ({'/'.join(methods)})" if methods else ""
                    yield Label(label + note)
                    value = self.settings.get(key)
                    if isinstance(kind, tuple):
                        yield Select([(c, c) for c in kind], value=value if value in kind else default,
                                     allow_blank=False, compact=True, id=f"field-{key}")
                    else:
                        yield Input("" if value is None else str(value), compact=True, id=f"field-{key}")
            with Horizontal(id="settings-buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Save", id="save", variant="primary", compact=True)

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
        raw = {key: self.query_one(f"#field-{key}").value for key, *_ in FIELDS}
        try:
            settings = parse_settings(raw)
        except ValueError as exc:
            self.notify(str(exc), title="Setting not saved", severity="error")
            return
        self.dismiss({"method": self.query_one("#method", Select).value, "settings": settings})


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
