"""Printing an answer as it streams: one thread's text deltas, or APAR's tree read in order."""

from __future__ import annotations

import sys


class AnswerPrinter:
    """Streams an answer to stdout; `text` is the answer so far (kept if Ctrl-C stops it).

    One thread streams its text deltas as they come. APAR (`restore=True`) writes several
    paragraphs at once, so its answer is the tree read in order (`restore_answer`): printed each
    time no forked thread is live (what is restored then is final), with a live thread count on
    stderr meanwhile. `finish()` prints whatever is restored, unfinished threads included."""

    def __init__(self, tokenizer, verbose: bool, restore: bool = False):
        self.tokenizer, self.verbose, self.restore = tokenizer, verbose, restore
        self.seen: list = []
        self.live: set = set()
        self.status_shown = False
        self.text = ""

    def feed(self, event) -> None:
        self.seen.append(event)
        if event.kind == "thread_start":
            self.live.add(event.thread_id)
        elif event.kind == "thread_end":
            self.live.discard(event.thread_id)
        if event.kind == "done":
            self.finish()
            if self.verbose:
                print(event.stats.summary(), file=sys.stderr)
        elif not self.restore:
            if event.kind == "token":
                self._write(self.text + event.text)
        elif not self.live:
            self._write(self._restored())
        elif event.kind == "token" and sys.stderr.isatty():
            print(f"\r[{len(self.live) + 1} threads writing]", end="", file=sys.stderr, flush=True)
            self.status_shown = True

    def finish(self) -> None:
        """The end of the answer (done, or stopped): print what is left, then a newline."""
        if self.restore:
            self._write(self._restored(), final=True)
        sys.stdout.write("\n")
        sys.stdout.flush()

    def _restored(self) -> str:
        from ..apar.tree import restore_answer

        return restore_answer(self.seen, self.tokenizer)

    def _write(self, text: str, final: bool = False) -> None:
        if not final:
            text = text.rstrip("\ufffd")  # a character whose bytes are not all decoded yet
        if self.status_shown:
            print("\r" + " " * 24 + "\r", end="", file=sys.stderr, flush=True)
            self.status_shown = False
        # The decoded prefix of an answer is normally a prefix of the whole; if a detokeniser
        # ever disagrees, keep printing (the screen may differ by a character, the text never).
        if len(text) > len(self.text):
            sys.stdout.write(text[len(self.text):])
            sys.stdout.flush()
        self.text = text


def print_answer(engine, events, verbose: bool, method: str) -> str:
    printer = AnswerPrinter(engine.lm.tokenizer, verbose, restore=method == "apar")
    try:
        for event in events:
            printer.feed(event)
    except KeyboardInterrupt:
        printer.finish()  # what was written stays on screen, unfinished APAR threads included
        raise
    return printer.text
