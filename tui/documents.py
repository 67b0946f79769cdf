"""Documents attached to a conversation: reading a file, counting its tokens, fitting the window.

`read_document(path, count)` reads a UTF-8 text file or raises `DocumentError` with one line for
the user (missing, a directory, binary or not UTF-8, empty, too large to be worth counting).
`compose(document, question)` is the user message the document goes into: it is stored as that
message's content, so the document stays in the conversation for follow-ups, byte for byte in the
same place (the engine's prefix reuse can keep its KV cache between turns). `prompt_tokens`
counts a whole conversation as the engine will encode it, so a prompt past the model's context
window is refused before any prefill. No Textual here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

#: a file larger than this many bytes per token of the context window is refused unread: no text
#: averages that many bytes a token, so it could never fit (and counting it would freeze the UI)
MAX_BYTES_PER_WINDOW_TOKEN = 64


class DocumentError(ValueError):
    """A file that cannot be attached; str() is the one line shown in the chat."""


@dataclass
class Document:
    name: str
    path: Path
    text: str
    tokens: int


def compose(document: Optional[Document], question: str) -> str:
    """The user message's content: the document, then the question."""
    if document is None:
        return question
    return f"Document: {document.name}\n\n{document.text.strip()}\n\nQuestion: {question}"


def parse_path(raw: str) -> str:
    """`/attach`'s argument: the rest of the line, surrounding quotes dropped."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return text


def read_document(raw_path: str, count: Callable[[str], int], window: Optional[int] = None) -> Document:
    """Read and count a text file; DocumentError (one line) for anything that is not one."""
    text_path = parse_path(raw_path)
    if not text_path:
        raise DocumentError("/attach needs a file: /attach PATH")
    path = Path(text_path).expanduser()
    shown = text_path
    if path.is_dir():
        raise DocumentError(f"Cannot attach {shown}: it is a directory, not a file")
    if not path.is_file():
        raise DocumentError(f"Cannot attach {shown}: no such file")
    try:
        size = path.stat().st_size
        if window and size > MAX_BYTES_PER_WINDOW_TOKEN * window:
            raise DocumentError(f"Cannot attach {shown}: {size:,} bytes is far past the model's context "
                                f"window of {window:,} tokens")
        data = path.read_bytes()
    except OSError as exc:
        raise DocumentError(f"Cannot attach {shown}: {exc.strerror or exc}") from None
    if b"\x00" in data[:65536]:
        raise DocumentError(f"Cannot attach {shown}: it is a binary file, not text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DocumentError(f"Cannot attach {shown}: it is not UTF-8 text") from None
    if not text.strip():
        raise DocumentError(f"Cannot attach {shown}: the file is empty")
    return Document(path.name, path.resolve(), text, count(text))


# -- counting with the engine's tokenizer --------------------------------------------------------
def _lm(engine):
    """The engine's model. (APAR's adapted tokenizer only adds its control tokens, so text counts
    the same there; `engine.lm_for("apar")` would load the adapter on the UI thread.)"""
    return getattr(engine, "lm", None)


def token_counter(engine) -> Callable[[str], int]:
    """len(tokenizer.encode(text)) with the engine's tokenizer."""
    tokenizer = getattr(_lm(engine), "tokenizer", None)
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        raise DocumentError("Cannot count tokens: the engine has no tokenizer")
    return lambda text: len(encode(text))


def context_window(engine) -> Optional[int]:
    window = getattr(_lm(engine), "context_length", None)
    return int(window) if window else None


def prompt_tokens(engine, messages: List[dict]) -> int:
    """The prompt the engine will prefill for these messages: its own chat encoding when it has
    one, else the sum of the messages' token counts."""
    lm = _lm(engine)
    encode_chat = getattr(lm, "encode_chat", None)
    if callable(encode_chat):
        return len(encode_chat(messages))
    count = token_counter(engine)
    return sum(count(m["content"]) for m in messages)


def check_fits(engine, messages: List[dict], document: Document) -> None:
    """DocumentError naming both counts when the prompt would not fit the context window."""
    window = context_window(engine)
    if not window:
        return
    total = prompt_tokens(engine, messages)
    if total >= window:
        raise DocumentError(f"{document.name} does not fit: the prompt would be {total:,} tokens "
                            f"(the document {document.tokens:,}), past the model's context window of "
                            f"{window:,} tokens. /detach it or start a new conversation (Ctrl+N)")
