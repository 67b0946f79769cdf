"""The messages the thread workers post to the UI thread, and the record of one answer being written."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from textual.message import Message

from .stream import StreamState
from .widgets import MessageView


# -- messages from the workers ---------------------------------------------------------------------
class LoadProgress(Message):
    def __init__(self, stage: str, step: int, total: int):
        super().__init__()
        self.stage, self.step, self.total = stage, step, total


class EngineReady(Message):
    def __init__(self, engine, baseline: Optional[float]):
        super().__init__()
        self.engine, self.baseline = engine, baseline


class LoadFailed(Message):
    def __init__(self, error: str, hint: str):
        super().__init__()
        self.error, self.hint = error, hint


class GenEvent(Message):
    def __init__(self, gen_id: int, event):
        super().__init__()
        self.gen_id, self.event = gen_id, event


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
