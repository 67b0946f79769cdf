"""The messages the thread workers post to the UI thread, and the record of one answer being written."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Optional

from textual.message import Message

from .stream import StreamState
from .widgets import MessageView


# -- messages from the workers ---------------------------------------------------------------------
class LoadProgress(Message):
    def __init__(self, stage: str, step: int, total: int):
        super().__init__()
        self.stage, self.step, self.total = stage, step, total


class EngineReady(Message):
    def __init__(self, engine, support: Optional[dict] = None, warm_s: float = 0.0):
        super().__init__()
        #: support: per method, None where this model can run it, else why not (Engine.method_support)
        self.engine, self.support, self.warm_s = engine, support or {}, warm_s


class LoadFailed(Message):
    def __init__(self, error: str, hint: str):
        super().__init__()
        self.error, self.hint = error, hint


class GenFinished(Message):
    def __init__(self, gen_id: int, error: Optional[str] = None, hint: str = ""):
        super().__init__()
        self.gen_id, self.error, self.hint = gen_id, error, hint


@dataclass
class Generation:
    id: int
    conversation_id: int
    message_id: int
    method: str
    settings: dict
    state: StreamState
    cancel: threading.Event = field(default_factory=threading.Event)
    view: Optional[MessageView] = None
    finished: bool = False
    status: str = "streaming"
    #: engine events the worker appended and the UI has not taken yet (deque: thread-safe)
    inbox: Deque[Any] = field(default_factory=deque)
    timer: Any = None  # the Textual timer that looks at the inbox once a frame while it is written
    frames: int = 0  # frames drawn while it was written
    events: int = 0  # engine events taken
    status_at: float = 0.0  # when the status bar last showed its figures (time.monotonic)
    status_due: bool = False  # an update of the status bar is scheduled
    next_frame_at: float = 0.0  # the next frame is drawn no sooner (time.monotonic)
    cpu_mark: Optional[float] = None  # the UI thread's CPU time when the last frame was drawn
