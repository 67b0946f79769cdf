"""A thinking model's thought, shown apart from its answer: folded to one line under the message's
head (live while it is written: its latest words), opened by a click on the message.

The stored message keeps the text as the model wrote it, `<think>...</think>` included (Qwen3's
template leaves earlier thoughts out of the next prompt by itself); only the view splits it. The
answer keeps its segments' accepted-draft marks.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

from textual.content import Content

from mlx_specdec.reasoning import CLOSE, OPEN

THOUGHT_STYLE = "italic $text-muted"
LIVE_PREFIX = "▸ thinking… "


class Thought(NamedTuple):
    text: str  # the thought so far, without its tags and the newlines just inside them
    live: bool  # still being written (no `</think>` yet)
    answer: List[List]  # the answer's segments: [text, accepted] after the thought


def _held(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_segments(segments: List[List]) -> Optional[Thought]:
    """The thought and the answer of a message's segments, or None where it has no thought: its
    text does not start with `<think>` (after whitespace) and has no `</think>` (a template that
    opens the thought itself: the model's text then starts inside it)."""
    text = "".join(t for t, _ in segments)
    body = text.lstrip()
    start = len(text) - len(body)
    if body.startswith(OPEN):
        start += len(OPEN)
    elif body and OPEN.startswith(body):  # the tag itself is being written
        return Thought("", True, [])
    elif CLOSE not in text:
        return None
    else:
        start = 0
    end = text.find(CLOSE, start)
    if end < 0:
        shown = text[start:len(text) - _held(text, CLOSE)]
        return Thought(shown.strip("\n"), True, [])
    answer_at = end + len(CLOSE)
    answer_at += len(text[answer_at:]) - len(text[answer_at:].lstrip("\n"))
    return Thought(text[start:end].strip("\n"), False, _segments_from(segments, answer_at))


def _segments_from(segments: List[List], at: int) -> List[List]:
    out, pos = [], 0
    for text, accepted in segments:
        end = pos + len(text)
        if end > at:
            out.append([text[max(at - pos, 0):], accepted])
        pos = end
    return out or [["", False]]


def apart(segments: List[List], opened: bool, assistant: bool = True, width: int = 80):
    """(a key that changes when the thought's drawing does, the thought's content, the answer's
    segments) of a message drawn `width` cells wide; for a message without a thought (None,
    nothing, its segments)."""
    thought = split_segments(segments) if assistant else None
    if thought is None:
        return None, Content(""), segments
    return (thought.text, thought.live, opened, width), thought_content(thought, opened, width), thought.answer


def thought_content(thought: Thought, opened: bool, width: int = 80) -> Content:
    """The thought's lines under the message's head, ending in a line break."""
    words = len(thought.text.split())
    if thought.live:
        room = max(width - len(LIVE_PREFIX) - 1, 8)  # the folded line stays one line
        last = thought.text.rsplit("\n", 1)[-1]
        last = last if len(last) <= room else "…" + last[-room + 1:]
        head = Content.assemble((LIVE_PREFIX, "bold $text-muted"), (last, THOUGHT_STYLE))
        if opened:
            head = Content.assemble(("▾ thinking…", "bold $text-muted"), "\n", (thought.text, THOUGHT_STYLE))
        return head + Content("\n")
    if opened:
        return Content.assemble(("▾ thought", "bold $text-muted"), (" (click to fold)", "$text-muted"), "\n",
                                (thought.text, THOUGHT_STYLE), "\n\n")
    return Content.assemble(("▸ thought", "bold $text-muted"),
                            (f" · {words} word{'s' if words != 1 else ''} (click to show)", "$text-muted"), "\n")
