"""The paragraph tree of one APAR answer, and restoring the answer by traversing it.

Each thread writes one stream: pieces (token ids, or text in training data) and `Fork` markers
where it forked a child. The child's stream is the detail that belongs at that point; the parent's
stream goes on with the next sibling paragraph. Restoring the answer expands every marker into the
child's (restored) stream, depth first:

    root:   "1. Sleep:" <Fork 1> "\n2. Diet:" <Fork 2> "\n\nIn short..."
    1:      " keep a schedule."          2: " eat greens."
    answer: "1. Sleep: keep a schedule.\n2. Diet: eat greens.\n\nIn short..."

The same tree gives the training streams (`stream`: a thread's pieces with markers as [Fork]) and
every thread's root path (`root_path`: what the thread attends to when it decodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Generic, Iterable, List, Optional, TypeVar, Union

P = TypeVar("P")  # a piece: a token id (int) or a text (str)


@dataclass(frozen=True)
class Fork:
    """Marker in a thread's stream: here the thread forked `child`."""

    child: int


class ParagraphTree(Generic[P]):
    def __init__(self) -> None:
        self.streams: Dict[int, List[Union[P, Fork]]] = {0: []}
        self.parent: Dict[int, Optional[int]] = {0: None}
        self.depth: Dict[int, int] = {0: 0}

    # -- building ----------------------------------------------------------------------------
    def add(self, thread: int, *pieces: P) -> None:
        self.streams[thread].extend(pieces)

    def fork(self, parent: int, child: Optional[int] = None) -> int:
        """Mark a fork at the current end of `parent`'s stream; returns the child's thread id."""
        if child is None:
            child = max(self.streams) + 1
        if child in self.streams:
            raise ValueError(f"thread {child} exists")
        self.streams[parent].append(Fork(child))
        self.streams[child] = []
        self.parent[child] = parent
        self.depth[child] = self.depth[parent] + 1
        return child

    # -- reading -----------------------------------------------------------------------------
    @property
    def threads(self) -> List[int]:
        return list(self.streams)

    @property
    def forked(self) -> bool:
        return len(self.streams) > 1

    @property
    def max_depth(self) -> int:
        return max(self.depth.values())

    def children(self, thread: int) -> List[int]:
        return [p.child for p in self.streams[thread] if isinstance(p, Fork)]

    def own(self, thread: int) -> List[P]:
        """The thread's own pieces, without its fork markers."""
        return [p for p in self.streams[thread] if not isinstance(p, Fork)]

    def restore(self, thread: int = 0) -> List[P]:
        """The answer in reading order: every fork marker replaced by the child's restored stream."""
        out: List[P] = []
        for piece in self.streams[thread]:
            if isinstance(piece, Fork):
                out.extend(self.restore(piece.child))
            else:
                out.append(piece)
        return out

    def restore_text(self) -> str:
        return "".join(self.restore())  # type: ignore[arg-type]

    def stream(self, thread: int, fork_piece: P) -> List[P]:
        """The thread's stream as it decodes it: fork markers written as `fork_piece`."""
        return [fork_piece if isinstance(p, Fork) else p for p in self.streams[thread]]

    def root_path(self, thread: int, fork_piece: P, child_piece: P) -> List[P]:
        """Everything `thread` attends to after the prompt: each ancestor's stream up to and
        including the [Fork] that led here, a [Child], then the thread's own stream."""
        parent = self.parent[thread]
        if parent is None:
            return self.stream(thread, fork_piece)
        path = self.root_path(parent, fork_piece, child_piece)
        own_parent_stream = self.stream(parent, fork_piece)
        cut = self.streams[parent].index(Fork(thread)) + 1  # parent's pieces up to its [Fork]
        path = path[: len(path) - len(own_parent_stream) + cut]
        return path + [child_piece] + self.stream(thread, fork_piece)

    def map(self, fn) -> "ParagraphTree":
        """A tree of the same shape with every piece p replaced by the pieces fn(p) (a list)."""
        tree: ParagraphTree = ParagraphTree()
        tree.parent, tree.depth = dict(self.parent), dict(self.depth)
        tree.streams = {}
        for thread, pieces in self.streams.items():
            out: list = []
            for p in pieces:
                out.extend([p] if isinstance(p, Fork) else fn(p))
            tree.streams[thread] = out
        return tree

    def __repr__(self) -> str:
        return f"ParagraphTree({self.streams!r})"


# -- from the event stream ---------------------------------------------------------------------

def tree_from_events(events: Iterable) -> ParagraphTree[int]:
    """Rebuild the token tree of one answer from `Event`s (token / thread_start events).

    A `thread_start` event for child c with parent p marks p's fork at the point reached by p's
    tokens so far; the child's own tokens follow in its events.
    """
    tree: ParagraphTree[int] = ParagraphTree()
    for event in events:
        if event.kind == "thread_start" and event.parent_id is not None:
            if event.thread_id not in tree.streams:
                tree.fork(event.parent_id, event.thread_id)
        elif event.kind == "token" and event.tokens:
            if event.thread_id not in tree.streams:  # a thread seen without its start event
                tree.streams[event.thread_id] = []
                tree.parent[event.thread_id] = None
                tree.depth[event.thread_id] = 0
            tree.add(event.thread_id, *event.tokens)
    return tree


def restore_tokens(events: Iterable) -> List[int]:
    """The whole answer's token ids in reading order, from an APAR (or any) event stream.

    For a single-thread method this is simply thread 0's tokens."""
    return tree_from_events(events).restore()


def restore_answer(events: Iterable, tokenizer) -> str:
    """The whole answer's text: the restored token ids decoded in one go (exact, unlike joining
    per-thread text deltas, whose streaming detokenisers trim a thread's leading space)."""
    return tokenizer.decode(restore_tokens(events))
