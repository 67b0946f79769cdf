"""An answer's thought and its answer apart: `<think> ... </think>` (Qwen3's thinking mode, and
the reasoning models that write the same tags) before the answer proper.

The chat shows the thought folded beside the answer, live while it streams; the server returns it
as `reasoning_content` beside `content` where a client asks for the answer alone
(`separate_reasoning`), as vLLM's and SGLang's reasoning parsers do. Both read the same stream of
text deltas through `ThoughtSplitter`, which holds back only what could still be the start of a
tag, so a tag split across deltas is never shown as text. An answer whose first words are not
`<think>` has no thought; a prompt that ends inside an open `<think>` (templates that open the
thought themselves) starts in the thought (`opens_thought`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

OPEN, CLOSE = "<think>", "</think>"


def opens_thought(prompt_text: str) -> bool:
    """The prompt (its decoded tail) leaves a `<think>` open: the answer starts inside the thought."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def prompt_opens_thought(tokenizer, prompt_ids: List[int], tail: int = 16) -> bool:
    try:
        return opens_thought(tokenizer.decode(list(prompt_ids[-tail:])))
    except Exception:  # a tokenizer that cannot decode these ids: no thought opened
        return False


def _held(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag` (held back until the next delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThoughtSplitter:
    """Text deltas -> (thought delta, answer delta). The thought is the text between the tags
    (newlines right inside them dropped), the answer what follows `</think>` (its leading newlines
    dropped, as Qwen3's template drops them from history), or the whole text where none opens."""

    def __init__(self, inside: bool = False):
        self.state = "thought-start" if inside else "start"
        self.had_thought = inside  # a thought opened (it may be empty)
        self.pending = ""
        self.thought: List[str] = []
        self.answer: List[str] = []

    @property
    def thinking(self) -> bool:
        """Inside the thought now (its end not yet written)."""
        return self.state in ("thought-start", "thought")

    def feed(self, delta: str) -> Tuple[str, str]:
        thought, answer = self._feed(self.pending + delta)
        self.thought.append(thought)
        self.answer.append(answer)
        return thought, answer

    def flush(self) -> Tuple[str, str]:
        """The end of the answer: what was held back, where it belongs."""
        rest, self.pending = self.pending, ""
        if self.state in ("start", "answer", "answer-start"):
            out = ("", rest.lstrip("\n") if self.state == "answer-start" else rest)
        else:
            out = (rest.rstrip("\n"), "")
        self.thought.append(out[0])
        self.answer.append(out[1])
        return out

    def _feed(self, text: str) -> Tuple[str, str]:
        self.pending = ""
        thought, answer = "", ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self.had_thought = "thought-start", True
                    text = stripped[len(OPEN):]
                elif OPEN.startswith(stripped):  # whitespace, or the tag's beginning: wait
                    self.pending = text
                    return thought, answer
                else:
                    self.state = "answer"
            elif self.state == "thought-start":
                text = text.lstrip("\n")
                if text:
                    self.state = "thought"
            elif self.state == "thought":
                end = text.find(CLOSE)
                if end >= 0:
                    thought += text[:end].rstrip("\n")
                    self.state = "answer-start"
                    text = text[end + len(CLOSE):]
                    continue
                held = _held(text, CLOSE)
                body = text[: len(text) - held]
                keep = held + len(body) - len(body.rstrip("\n"))  # newlines right before the tag are dropped
                thought += text[: len(text) - keep]
                self.pending = text[len(text) - keep:]
                return thought, answer
            elif self.state == "answer-start":
                text = text.lstrip("\n")
                if text:
                    self.state = "answer"
            else:
                answer += text
                text = ""
        return thought, answer

    @property
    def thought_text(self) -> str:
        return "".join(self.thought)

    @property
    def answer_text(self) -> str:
        return "".join(self.answer)


def split_thought(text: str, inside: bool = False) -> Tuple[Optional[str], str]:
    """(the thought, or None where the text has none; the answer) of a whole answer."""
    splitter = ThoughtSplitter(inside)
    splitter.feed(text)
    splitter.flush()
    return (splitter.thought_text if splitter.had_thought else None), splitter.answer_text
