"""A message that grows while it is written, drawn without wrapping all of it again each frame.

Text is wrapped one line (up to a line break) at a time, so the strips of a content are the strips
of its part up to a line break followed by the strips of the part after it, and so are heights.
`GrowingText` draws a streamed message that way: the strips and height of its complete lines are
kept (`KeptLines`, owned by the message's view) and extended as more lines complete; only the line
being written is wrapped again each frame. It draws exactly what the whole content draws; where
that could differ (a text selection, whose line numbers count from the top) it draws the whole.
`update_sized` shows a new content with a layout pass only when its height changed, and repaints
only the rows from the first one that may differ (the rows of complete lines stay as drawn).
"""

from __future__ import annotations

from typing import Callable, Generic, List, Optional, Tuple, TypeVar, Union

from textual.content import Content
from textual.geometry import Region
from textual.strip import Strip
from textual.style import Style
from textual.visual import RenderOptions, Visual

T = TypeVar("T")


def _rules_key(rules) -> Tuple:
    get = rules.get
    return (get("text_align", "left"), get("text_overflow", "fold"), get("text_wrap", "wrap"), get("line_pad", 0))


class _Kept(Generic[T]):
    """One measure (strips, or a height) of a message's text up to a line break; brought to a
    later line break by measuring only the lines added since."""

    def __init__(self) -> None:
        self.text: Optional[str] = None  # what was measured (None: nothing yet)
        self.key: Optional[Tuple] = None  # the width, style and rules it was measured with
        self.value: Optional[T] = None

    def upto(self, whole: Content, cut: int, key: Tuple, measure: Callable[[Content], T]) -> T:
        """`measure(whole[:cut])`, where `whole.plain[cut]` is a line break."""
        text, plain = self.text, whole.plain
        if (text is not None and key == self.key and plain.startswith(text)
                and (cut == len(text) or (cut > len(text) and plain[len(text)] == "\n"))):
            if cut > len(text):  # plain[len(text)] is the line break after what was measured
                self.value = self.value + measure(whole[len(text) + 1:cut])
        else:
            self.value = measure(whole[:cut])
        self.text, self.key = plain[:cut], key
        return self.value


class KeptLines:
    """The complete lines of one growing message: their strips and their height. `reset()` when
    the message changed other than by growing at its end."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.strips: _Kept[List[Strip]] = _Kept()
        self.height: _Kept[int] = _Kept()
        #: rows of complete lines as last drawn: they stay as they are while the message grows
        self.drawn_rows: Optional[int] = None


class GrowingText(Visual):
    """`whole` drawn as its complete lines (kept in `lines`) and the line after them."""

    def __init__(self, whole: Content, lines: KeptLines):
        self.whole = whole
        self.lines = lines
        self.cut = whole.plain.rfind("\n")  # the last line break: the line being written is after it
        self._tail: Optional[Content] = None

    def __str__(self) -> str:
        return str(self.whole)

    @property
    def tail(self) -> Content:
        if self._tail is None:
            self._tail = self.whole[self.cut + 1:]
        return self._tail

    def render_strips(self, width: int, height: Optional[int], style: Style, options: RenderOptions) -> List[Strip]:
        if self.cut < 0 or not width or options.selection is not None:
            return self.whole.render_strips(width, height, style, options)
        key = (width, style, options.post_style, _rules_key(options.rules))

        def render(part: Content) -> List[Strip]:
            return part.render_strips(width, None, style, options)

        strips = self.lines.strips.upto(self.whole, self.cut, key, render) + render(self.tail)
        return strips if height is None else strips[:height]

    def kept_rows(self) -> int:
        """Rows of the complete lines (after `get_height`): what later growth leaves as it is."""
        return self.lines.height.value if self.cut >= 0 and self.lines.height.value is not None else 0

    def get_height(self, rules, width: int) -> int:
        if self.cut < 0 or width <= 0:
            return self.whole.get_height(rules, width)
        kept = self.lines.height.upto(self.whole, self.cut, (width, _rules_key(rules)),
                                      lambda part: part.get_height(rules, width))
        return kept + self.tail.get_height(rules, width)

    def get_optimal_width(self, rules, container_width: int) -> int:
        return self.whole.get_optimal_width(rules, container_width)

    def get_minimal_width(self, rules) -> int:
        return self.whole.get_minimal_width(rules)


def update_sized(widget, content: Union[Content, GrowingText], same_rows: int = 0) -> bool:
    """`widget.update(content)` with a layout pass only when the content's height at the widget's
    width changed: a layout re-arranges the whole screen, a repaint draws this widget alone, and
    only its rows from `same_rows` on (the rows above are drawn as they were). Returns whether it
    asked for a layout."""
    width = widget.content_size.width
    size = (width, content.get_height(widget.styles, width)) if width > 0 else None
    layout = size is None or size != getattr(widget, "_drawn_size", None)
    widget._drawn_size = size
    if not layout and 0 < same_rows < size[1]:
        widget._dirty_rows = Region(0, same_rows, width, size[1] - same_rows)
    try:
        widget.update(content, layout=layout)
    finally:
        widget._dirty_rows = None
    return layout
