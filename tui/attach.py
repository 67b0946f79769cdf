"""Attaching a document to a conversation, as a mixin of `ChatApp`.

`/attach PATH` typed in the input, or Ctrl+L (a small path prompt), reads a UTF-8 text file and
counts its tokens with the engine's tokenizer; a chip above the input shows its name and count
until the next message takes it, or `/detach` (or a click on the chip) removes it. Each
conversation has its own attachment. The message that takes it is stored as "Document: NAME,
the text, Question: ..." (`tui.documents.compose`) and stays in the conversation, unchanged, for
follow-ups. Whatever cannot be attached or would not fit the model's context window is one line
in the chat (`Notice`), before any prefill.
"""

from __future__ import annotations

from typing import Dict, Optional

from .documents import Document, DocumentError, check_fits, compose, context_window, read_document, token_counter
from .screens import AttachScreen
from .widgets import DocumentChip, Notice

COMMANDS = ("/attach", "/detach")


class AttachMixin:
    """Keeps `attachments` (conversation id -> Document); uses the app's engine, conversation,
    store, chat and `history()`."""

    attachments: Dict[int, Document]

    @property
    def chip(self) -> DocumentChip:
        return self.query_one("#doc-chip", DocumentChip)

    def say(self, line: str) -> None:
        """One line in the chat (not saved)."""
        self.chat.mount(Notice(line))
        self.chat.scroll_end(animate=False)

    def run_command(self, text: str) -> bool:
        """/attach PATH and /detach; False for anything else (a message)."""
        word, _, rest = text.partition(" ")
        if word not in COMMANDS:
            return False
        if word == "/attach":
            self.attach(rest)
        elif rest.strip():
            self.say("/detach takes no argument: it removes the attached document")
        else:
            self.detach()
        return True

    def action_attach(self) -> None:
        def chosen(path: Optional[str]) -> None:
            if path:
                self.attach(path)

        self.push_screen(AttachScreen(), chosen)

    def attach(self, raw_path: str) -> None:
        conv = self.conversation
        if conv is None:
            return
        if self.engine is None:
            self.say("The model is still loading: attach the file when it is ready (its tokens are "
                     "counted with the model's tokenizer)")
            return
        try:
            document = read_document(raw_path, token_counter(self.engine), context_window(self.engine))
            self._check(document, "")
        except DocumentError as exc:
            self.say(str(exc))
            return
        self.attachments[conv.id] = document
        self.show_chip()

    def detach(self) -> None:
        conv = self.conversation
        if conv is None or self.attachments.pop(conv.id, None) is None:
            self.say("No document is attached")
        self.show_chip()

    def on_document_chip_removed(self, message: DocumentChip.Removed) -> None:
        self.detach()

    def show_chip(self) -> None:
        conv = self.conversation
        document = self.attachments.get(conv.id) if conv is not None else None
        self.chip.show(document.name if document else None, document.tokens if document else None)

    def document_for(self, question: str) -> Optional[Document]:
        """The current conversation's attached document, checked to fit with the conversation and
        this question (DocumentError naming the counts if it does not); None when none is attached."""
        conv = self.conversation
        document = self.attachments.get(conv.id) if conv is not None else None
        if document is not None and self.engine is not None:
            self._check(document, question)
        return document

    def take_document(self) -> None:
        """The message took the document: the chip goes."""
        if self.conversation is not None:
            self.attachments.pop(self.conversation.id, None)
        self.show_chip()

    def _check(self, document: Document, question: str) -> None:
        messages = self.history(self.conversation.id) + [{"role": "user", "content": compose(document, question)}]
        check_fits(self.engine, messages, document)
