"""The chat screen's widgets: messages, live thread panes, the status bar, the conversation list,
the attached document's chip and the chat's one-line notices."""

from __future__ import annotations

from typing import Dict, List, Optional

from textual.containers import VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.widgets import Label, ListItem, ListView, Static

from mlx_specdec.decoding.redrafter import DEFAULT_BEAM_LENGTH, DEFAULT_BEAM_WIDTH, DEFAULT_DRAFT_CUTOFF

from .growing import GrowingText, KeptLines, update_sized
from .stream import StreamState, ThreadView
from .thought import apart, split_segments

#: how text that came from accepted drafts is shown: the theme's success colour, underlined (an
#: underline reads on light and dark themes and without colour)
ACCEPTED_STYLE = "$text-success underline"
METHOD_LABELS = {"ar": "plain", "mlx-lm": "mlx-lm", "redrafter": "ReDrafter", "apar": "APAR",
                 "triforce": "TriForce", "auto": "auto"}


def method_label(method: str, settings: Optional[dict] = None) -> str:
    label = METHOD_LABELS.get(method, method)
    settings = settings or {}
    if method == "redrafter":
        label += f" W{settings.get('beam_width', DEFAULT_BEAM_WIDTH)} L{settings.get('beam_length', DEFAULT_BEAM_LENGTH)}"
        cutoff = float(settings.get("draft_cutoff", DEFAULT_DRAFT_CUTOFF) or 0.0)
        label += f" cut {cutoff:g}" if cutoff > 0 else ""
    elif method == "apar":
        label += f" ≤{settings.get('max_threads', 32)} threads, depth ≤{settings.get('max_depth', 2)}"
    elif method == "triforce":
        label += (f" budget {settings.get('budget', 512)} γ{settings.get('gamma', 6)}"
                  f" {settings.get('bottom', 'ngram')}")
    temp = float(settings.get("temperature", 0.0) or 0.0)
    label += " greedy" if temp <= 0 else f" T={temp:g}"
    return label


def segments_content(segments: List[List]) -> Content:
    parts = []
    for text, accepted in segments:
        parts.append((text, ACCEPTED_STYLE) if accepted else text)
    return Content.assemble(*parts) if parts else Content("")


def marks_to_segments(text: str, marks: List[List[int]]) -> List[List]:
    out, pos = [], 0
    for start, end in sorted(marks):
        start, end = max(start, pos), min(end, len(text))
        if start >= end:
            continue
        if start > pos:
            out.append([text[pos:start], False])
        out.append([text[start:end], True])
        pos = end
    if pos < len(text):
        out.append([text[pos:], False])
    return out


STATUS_NOTES = {"stopped": "stopped (Esc)", "interrupted": "interrupted: the app was closed mid-answer",
                "error": "error", "streaming": "…"}


class MessageView(Static):
    """One message. A streamed assistant message grows by appending: the content of its complete
    segments is kept, and each update adds what came after them. A thinking model's thought is
    drawn apart, folded under the head (thought.py); a click opens or folds it."""

    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; }
    """

    def __init__(self, role: str, text: str = "", *, message_id: Optional[int] = None,
                 method: str = "", status: str = "done", segments: Optional[List[List]] = None,
                 summary: str = "", document: Optional[dict] = None):
        super().__init__(classes=f"-{role}")
        #: a user message that carries a document: {"name", "tokens", "question"} (the stored
        #: content is the document + the question; the view shows the chip and the question)
        self.document = document
        self.role = role
        self.message_id = message_id
        self.method = method
        self.status = status
        self.segments = segments if segments is not None else [[text, False]]
        self.summary = summary
        #: the segments drawn whole (all but the last, which may still grow) and the content of the
        #: head and of them; a new update appends to it while they are unchanged
        self._kept: List[List] = []
        self._kept_content: Optional[Content] = None
        self._lines = KeptLines()  # the wrapped complete lines of a streamed message
        self.shown: Content = Content("")  # what the view draws
        self.thought_open = False  # the thought (if any) shown whole rather than folded
        self._thought_key: Optional[tuple] = None  # the thought drawn in the kept content

    def on_mount(self) -> None:
        self.refresh_content()

    def refresh(self, *regions, **options):
        """A refresh asked for by `update_sized` repaints only the rows that changed."""
        rows = getattr(self, "_dirty_rows", None)
        if rows is not None and not regions and not options.get("layout"):
            regions = (rows,)
        return super().refresh(*regions, **options)

    def set_stream(self, segments: List[List], status: Optional[str] = None, summary: Optional[str] = None) -> bool:
        """Show these segments (and status, summary); True when the view's height changed."""
        self.segments = segments
        if status is not None:
            self.status = status
        if summary is not None:
            self.summary = summary
        return self.refresh_content()

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)

    def _head(self) -> Content:
        if self.role == "user":
            head = Content.assemble(("You", "bold $text-primary"))
            if self.document:
                chip = f" ▤ {self.document['name']} · {self.document['tokens']:,} tokens "
                head = head.append(Content.assemble("  ", (chip, "$text-accent on $panel")))
            return head
        return Content.assemble(("Assistant", "bold $text-secondary"),
                                (f" · {METHOD_LABELS.get(self.method, self.method)}", "$text-muted"))

    def _head_and_body(self) -> Content:
        """The head, a line break and the body: the kept content, and the segments after it."""
        if self.role == "user" and self.document:
            return Content.assemble(self._head(), "\n", str(self.document.get("question", "")))
        segments, kept = self.segments, len(self._kept)
        key, thought, segments = apart(segments, self.thought_open, self.role == "assistant",
                                       self.content_region.width or 80)
        if self._kept_content is None or segments[:kept] != self._kept or key != self._thought_key:
            self._kept, kept, self._thought_key = [], 0, key
            self._kept_content = Content.assemble(self._head(), "\n") + thought
            self._lines.reset()
        complete = len(segments) - 1
        if complete > kept:
            self._kept_content = self._kept_content + segments_content(segments[kept:complete])
            self._kept = self._kept + [list(s) for s in segments[kept:complete]]
            kept = complete
        return self._kept_content + segments_content(segments[kept:])

    def on_click(self) -> None:
        if self.role == "assistant" and split_segments(self.segments) is not None:
            self.thought_open = not self.thought_open
            self.refresh_content()

    def refresh_content(self) -> bool:
        """Draw the message; True when its height changed (a layout pass was asked for)."""
        content = self._head_and_body()
        if self.role == "assistant" and self.status == "streaming":
            content = content + Content.assemble(("▍", "$text-accent"))
        note = STATUS_NOTES.get(self.status) if self.status not in ("done", "streaming") else None
        tail = " · ".join(x for x in (note, self.summary) if x)
        if tail and self.role == "assistant":
            content = content + Content.assemble("\n", (f"[{tail}]", "italic $text-muted"))
        self.shown = content
        if self.status == "streaming":  # wrap only the line being written, draw only its rows
            growing, lines = GrowingText(content, self._lines), self._lines
            same = lines.drawn_rows or 0
            grew = update_sized(self, growing, same_rows=same)
            lines.drawn_rows = growing.kept_rows()
            return grew
        self._lines.reset()
        return update_sized(self, content)


class Notice(Static):
    """One line in the chat that is not a message (a file that cannot be attached, ...); shown,
    never saved."""

    DEFAULT_CSS = """
    Notice { height: auto; margin: 0 0 1 0; padding: 0 1; color: $text-error; }
    """

    def __init__(self, text: str):
        super().__init__(Content(text))
        self.text = text


class DocumentChip(Static):
    """The attached document, above the input: its name and token count. A click removes it."""

    DEFAULT_CSS = """
    DocumentChip { height: 1; width: auto; max-width: 100%; display: none; margin: 0 1;
                   padding: 0 1; background: $accent-muted; color: $text; }
    DocumentChip.-attached { display: block; }
    """

    def __init__(self, **kwargs):
        super().__init__("", **kwargs)
        self.name_shown: Optional[str] = None
        self.tokens: Optional[int] = None

    class Removed(Message):
        """The user clicked the chip: detach the document."""

    def on_click(self) -> None:
        if self.name_shown is not None:
            self.post_message(self.Removed())

    def show(self, name: Optional[str], tokens: Optional[int] = None) -> None:
        self.name_shown, self.tokens = name, tokens
        if name is None:
            self.remove_class("-attached")
            self.update("")
            return
        self.update(Content.assemble(("▤ ", "bold"), (name, "bold"), f" · {tokens:,} tokens",
                                     ("  ✕ /detach", "$text-muted")))
        self.add_class("-attached")

    @property
    def text(self) -> str:
        return str(self.render()) if self.name_shown else ""


class ChatLog(VerticalScroll):
    """The conversation; follows the end while the user has not scrolled up."""

    DEFAULT_CSS = """
    ChatLog { height: 1fr; padding: 0 1; }
    """

    def add(self, view: MessageView) -> MessageView:
        self.mount(view)
        self.scroll_end(animate=False)
        return view

    def follow(self) -> None:
        if self.max_scroll_y - self.scroll_y <= 3:
            self.scroll_end(animate=False)


class ThreadPane(Static):
    """A live forked thread: its id, parent, token count and the tail of its text."""

    DEFAULT_CSS = """
    ThreadPane { height: auto; max-height: 3; border-left: outer $accent; padding: 0 0 0 1; }
    """

    def __init__(self, view: ThreadView):
        super().__init__(id=f"thread-{view.thread_id}", classes="thread-pane")
        self.view = view
        self.styles.margin = (0, 0, 0, 2 * max(view.depth - 1, 0))

    def on_mount(self) -> None:
        self.refresh_content()

    def refresh_content(self) -> None:
        view = self.view
        parent = "root" if view.parent_id in (None, 0) else f"thread {view.parent_id}"
        head = Content.assemble((f"thread {view.thread_id}", "bold $text-accent"),
                                (f" ← {parent} · {view.tokens} tok", "$text-muted"))
        tail = view.text.replace("\n", " ⏎ ").strip()
        width = max((self.size.width or 60) - 3, 20)
        if len(tail) > 2 * width:
            tail = "…" + tail[-(2 * width - 1):]
        update_sized(self, Content.assemble(head, "\n", tail))


class ThreadPanes(VerticalScroll):
    """Live panes of the forked threads, nested under their parents; a pane closes when its
    thread finishes. The border title tells how the paragraph tree has grown."""

    DEFAULT_CSS = """
    ThreadPanes { height: auto; max-height: 45%; display: none; border: round $accent; padding: 0 1; }
    ThreadPanes.-active { display: block; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.panes: Dict[int, ThreadPane] = {}
        self.border_title = "paragraph tree"

    def reset(self) -> None:
        for pane in list(self.panes.values()):
            pane.remove()
        self.panes.clear()
        self.remove_class("-active")

    def open(self, view: ThreadView, state: StreamState) -> None:
        if view.thread_id in self.panes:
            return
        pane = ThreadPane(view)
        self.panes[view.thread_id] = pane
        # nested under its parent: after the parent's pane and the panes already under it
        after = self._last_descendant(view.parent_id, state)
        if after is not None:
            self.mount(pane, after=after)
        else:
            self.mount(pane)
        self.add_class("-active")

    def _last_descendant(self, parent: Optional[int], state: StreamState) -> Optional[ThreadPane]:
        if parent not in self.panes:
            return None
        last = self.panes[parent]
        for tid, pane in self.panes.items():
            ancestor = state.threads[tid].parent_id
            while ancestor is not None and ancestor != parent and ancestor in state.threads:
                ancestor = state.threads[ancestor].parent_id
            if ancestor == parent and tid != parent and pane.parent is self:
                children = list(self.children)
                if children.index(pane) > children.index(last):
                    last = pane
        return last

    def update_thread(self, tid: int) -> None:
        pane = self.panes.get(tid)
        if pane is not None:
            pane.refresh_content()

    def close(self, tid: int) -> None:
        pane = self.panes.pop(tid, None)
        if pane is not None:
            pane.remove()
        if not self.panes:
            self.remove_class("-active")

    def describe(self, state: StreamState) -> None:
        total = len(state.threads) - 1
        live = len(state.live_threads())
        depth = max((v.depth for v in state.threads.values()), default=0)
        self.border_title = f"paragraph tree · {total} threads, {live} live, depth {depth}"


class StatusBar(Static):
    """One line: method, tok/s, tokens per forward, acceptance, speed-up against plain speed."""

    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; color: $text; padding: 0 1; }
    """

    def show_text(self, text: str) -> None:
        self._shown = None
        self.update(Content(text))

    def show_state(self, state: StreamState, method: str, phase: str) -> None:
        """The figures, shortened where the line would not fit the bar: the speed-up without the
        plain speed first, then TriForce's level names, then no speed-up (the line under the
        answer keeps it)."""
        width = self.size.width  # the content width (inside the padding)
        for short in (0, 1, 2, 3):
            text = " │ ".join(self._parts(state, method, phase, short))
            if not width or len(text) <= width:
                break
        if text != getattr(self, "_shown", None):
            self._shown = text
            self.update(Content(text), layout=False)  # one line, always: no layout

    @staticmethod
    def _parts(state: StreamState, method: str, phase: str, short: int) -> List[str]:
        label = METHOD_LABELS.get(method, method)
        if state.chosen:  # `auto`: the method it chose for this answer
            method = state.chosen["chose"]
            label = f"{label}: {METHOD_LABELS.get(method, method)}"
        parts = [f"{label} {phase}", f"{state.decode_tps:.1f} tok/s"]
        levels = state.triforce_levels()
        if method == "triforce" or levels is not None:
            # TriForce: each forward counted is a full-cache verify; acceptance at both levels
            # (the bottom level's only once the answer's stats are in)
            bottom, middle, per_full = levels or (None, state.acceptance, state.tokens_per_forward)
            parts.append(f"{per_full:.2f} tok/full fwd")
            names = ("bottom", "middle") if short < 2 else ("bot", "mid")
            shown = [f"{'–' if v is None else f'{v:.0%}'}" for v in (bottom, middle)]
            parts.append(f"acc {names[0]} {shown[0]} · {names[1]} {shown[1]}")
        else:
            parts.append(f"{state.tokens_per_forward:.2f} tok/fwd")
            acceptance = state.acceptance
            if acceptance is not None:
                parts.append(f"acc {acceptance:.0%}")
            elif method == "redrafter":
                parts.append("acc –")
        speedup, plain = state.speedup, state.plain_tps
        if speedup is not None:
            if short < 3:
                parts.append(f"×{speedup:.2f} vs plain {plain:.1f}" if not short else f"×{speedup:.2f}")
        elif plain:
            parts.append(f"plain {plain:.1f} tok/s")
        if state.forked:
            parts.append(f"threads {len(state.live_threads())}/{len(state.threads) - 1}")
        return parts


class ConversationItem(ListItem):
    def __init__(self, conversation_id: int, title: str, method: str):
        super().__init__(Label(title, classes="title"), Label(METHOD_LABELS.get(method, method), classes="method"))
        self.conversation_id = conversation_id


class ConversationList(ListView):
    DEFAULT_CSS = """
    ConversationList { height: 1fr; }
    ConversationList ConversationItem { height: 2; padding: 0 1; }
    ConversationList .method { color: $text-muted; }
    """
