"""Structure extraction (APAR, Appendix B): which parts of an answer can be written in parallel.

An answer becomes a `ParagraphTree` of text pieces, in one of four kinds:

- `list`: an ordered list whose items all read `N. phrase: detail` (the paper's
  `(\\d+\\.)\\s+(.+?):(.+?)`), at least 3 items, every detail at least 10 characters. The root
  keeps each `N. phrase:` and forks there; the detail (from the character after the colon) is
  the child's stream. Text before the list and after the last item stays in the root.
- `paragraphs`: otherwise, paragraphs split on blank lines (at least 3); a paragraph of one line
  with at least two sentences forks after its first sentence (the root keeps the first sentence,
  the child writes the rest). Single-sentence paragraphs, multi-line blocks (lists, headings
  with text under them) and first "sentences" under 20 characters or ending in an abbreviation
  stay whole in the root. At least 3 forks, or the answer is not used.
- `unstructured`: code, math, URLs or other ambiguous markup (the reference's filters:
  code fences and backticks, <tags>, $, =, ---, http, multi-digit arithmetic). Kept as a
  negative: one node, no fork, so the model learns not to fork there.
- `none`: none of the above (e.g. a list without `phrase:` heads, one or two paragraphs);
  not used for training.

Every split keeps all characters: `tree.restore_text() == answer` always holds. Whitespace
around a fork point goes to the side that reads naturally: a child starts with the space after
the colon / sentence end, and the separator after a detail (newlines) stays in the root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .tree import ParagraphTree

MIN_ITEMS = 3
MIN_DETAIL_CHARS = 10
MIN_FORKS = 3
MIN_PARAGRAPHS = 3
MIN_FIRST_SENTENCE_CHARS = 20

AMBIGUOUS = re.compile(
    r"```|`|<[^<>\n]*>|[<>]|\$|=|---|https?://|www\.|\\\(|\\\[|\\frac|\d\d+ *[+x*×÷] *\d\d+",
    re.IGNORECASE,
)
ITEM_START = re.compile(r"^[ \t]*\d+\.[ \t]+", re.MULTILINE)
ITEM_HEAD = re.compile(r"[ \t]*\d+\.[ \t]+[^\n:]*?[^\s:][^\n:]*?:")  # "N. phrase:" on one line
BLANK_LINE = re.compile(r"\n[ \t]*\n")
COMPLETE_END = re.compile(r"(?<![0-9])[.!?](?=\s)|\n")  # not "2." of a list item
SENTENCE_END = re.compile(r"[.!?](?=\s+\S)")
ABBREVIATIONS = ("mr", "mrs", "ms", "dr", "st", "vs", "etc", "e.g", "i.e", "no", "fig", "approx", "jr", "sr")


@dataclass
class Extraction:
    kind: str  # "list" | "paragraphs" | "unstructured" | "none"
    tree: Optional[ParagraphTree]  # text pieces; None for "none"
    reason: str = ""

    @property
    def structured(self) -> bool:
        return self.kind in ("list", "paragraphs")

    @property
    def forks(self) -> int:
        return len(self.tree.threads) - 1 if self.tree is not None else 0


def is_ambiguous(text: str) -> bool:
    return AMBIGUOUS.search(text) is not None


def extract(answer: str) -> Extraction:
    """Classify an answer and build its paragraph tree (see the module docstring)."""
    if not answer.strip():
        return Extraction("none", None, "empty")
    if is_ambiguous(answer):
        tree: ParagraphTree[str] = ParagraphTree()
        tree.add(0, answer)
        return Extraction("unstructured", tree, "ambiguous markup")
    listed = extract_list(answer)
    if listed is not None:
        return Extraction("list", listed)
    paragraphs = extract_paragraphs(answer)
    if paragraphs is not None:
        return Extraction("paragraphs", paragraphs)
    return Extraction("none", None, "no ordered list of phrase: detail items and < 3 forkable paragraphs")


# -- ordered lists -------------------------------------------------------------------------------

def extract_list(answer: str) -> Optional[ParagraphTree]:
    starts = [m.start() for m in ITEM_START.finditer(answer)]
    if len(starts) < MIN_ITEMS:
        return None
    items: List[Tuple[int, int, int]] = []  # (colon end, detail end) per item, absolute offsets
    for i, start in enumerate(starts):
        head = ITEM_HEAD.match(answer, start)
        if head is None:
            return None  # every item must read "N. phrase: detail"
        colon_end = head.end()
        if i + 1 < len(starts):
            end = starts[i + 1]
        else:  # the last detail ends at the first blank line (or the end of the answer)
            blank = BLANK_LINE.search(answer, colon_end)
            end = blank.start() if blank else len(answer)
        detail = answer[colon_end:end].rstrip()
        if len(detail.strip()) < MIN_DETAIL_CHARS:
            return None
        items.append((colon_end, colon_end + len(detail)))
    tree: ParagraphTree[str] = ParagraphTree()
    cursor = 0
    for colon_end, detail_end in items:
        tree.add(0, answer[cursor:colon_end])
        child = tree.fork(0)
        tree.add(child, answer[colon_end:detail_end])
        cursor = detail_end
    if cursor < len(answer):
        tree.add(0, answer[cursor:])
    return tree


# -- paragraphs ----------------------------------------------------------------------------------

def _first_sentence_end(paragraph: str) -> Optional[int]:
    """Offset just past the first sentence's final punctuation, if the split looks safe."""
    for m in SENTENCE_END.finditer(paragraph):
        end = m.end()
        before = paragraph[:m.start()]
        word = re.split(r"\s", before)[-1].lower().rstrip(".")
        if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):  # "Dr." "e.g." "J."
            continue
        if word.isdigit():  # "1." at a line start, or "3.5" (no space: not matched anyway)
            continue
        return end if len(before.strip()) + 1 >= MIN_FIRST_SENTENCE_CHARS else None
    return None


def extract_paragraphs(answer: str) -> Optional[ParagraphTree]:
    pieces = BLANK_LINE.split(answer)
    separators = [m.group(0) for m in BLANK_LINE.finditer(answer)]
    if sum(1 for p in pieces if p.strip()) < MIN_PARAGRAPHS:
        return None
    tree: ParagraphTree[str] = ParagraphTree()
    forks = 0
    for i, paragraph in enumerate(pieces):
        split = None
        if "\n" not in paragraph.strip() and not ITEM_START.match(paragraph):
            split = _first_sentence_end(paragraph)
        rest = paragraph[split:] if split is not None else ""
        if split is not None and len(rest.strip()) >= MIN_DETAIL_CHARS:
            tree.add(0, paragraph[:split])
            child = tree.fork(0)
            body = rest.rstrip()
            tree.add(child, body)
            if len(body) < len(rest):
                tree.add(0, rest[len(body):])
            forks += 1
        elif paragraph:
            tree.add(0, paragraph)
        if i < len(separators):
            tree.add(0, separators[i])
    if forks < MIN_FORKS:
        return None
    return _merge_adjacent(tree)


def _merge_adjacent(tree: ParagraphTree) -> ParagraphTree:
    """Join neighbouring text pieces of a stream (fewer, longer pieces tokenise naturally)."""
    for thread, stream in tree.streams.items():
        merged: list = []
        for piece in stream:
            if merged and isinstance(piece, str) and isinstance(merged[-1], str):
                merged[-1] += piece
            else:
                merged.append(piece)
        tree.streams[thread] = merged
    return tree


def complete_part(answer: str, finished: bool) -> str:
    """An answer cut off by the length cap (no EOS) loses its unfinished tail (after the last
    sentence end or line break), so that the tree ends where the text does and training never
    teaches a thread to stop mid-sentence."""
    if finished:
        return answer
    ends = [m.end() for m in COMPLETE_END.finditer(answer)]
    return answer[: ends[-1]].rstrip() if ends else ""
