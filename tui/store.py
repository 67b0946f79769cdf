"""Saved conversations: one SQLite file (WAL) in the user data directory.

The app writes an assistant message as it streams (every token event updates its row and
commits), so a process killed mid-answer (even `kill -9`) keeps everything already shown. A row
left in status `streaming` by a dead process is marked `interrupted` when the store next opens.
WAL + synchronous=NORMAL: a commit is a write into the WAL file (no fsync), safe against a killed
process; only a power cut may lose the last commits.

No Textual here: the store is plain Python, shared by the app, the CLI and the tests.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

DB_NAME = "chats.sqlite3"

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    title    TEXT NOT NULL DEFAULT 'New chat',
    method   TEXT NOT NULL DEFAULT 'ar',
    settings TEXT NOT NULL DEFAULT '{}',     -- JSON: max_tokens, temperature, ..., method options
    created  REAL NOT NULL,
    updated  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role            TEXT NOT NULL,               -- user | assistant
    content         TEXT NOT NULL DEFAULT '',    -- for APAR: the restored answer
    status          TEXT NOT NULL DEFAULT 'done',-- streaming | done | stopped | interrupted | error
    method          TEXT,
    marks           TEXT NOT NULL DEFAULT '[]',  -- JSON [[start, end], ...]: text from accepted drafts
    threads         TEXT NOT NULL DEFAULT '{}',  -- JSON {thread_id: {parent, text, done}} (forked answers)
    stats           TEXT NOT NULL DEFAULT '{}',  -- JSON: the figures shown under the answer; for a user
                                                 -- message with a document: {document: {name, tokens, question}}
    created         REAL NOT NULL,
    updated         REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


def data_dir() -> Path:
    """$MLX_SPECDEC_DATA, else the platform's user data directory (platformdirs)."""
    env = os.environ.get("MLX_SPECDEC_DATA")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("mlx-specdec"))


def default_db_path() -> Path:
    return data_dir() / DB_NAME


@dataclass
class Conversation:
    id: int
    title: str
    method: str
    settings: Dict[str, object]
    created: float
    updated: float


@dataclass
class StoredMessage:
    id: int
    conversation_id: int
    role: str
    content: str
    status: str = "done"
    method: Optional[str] = None
    marks: List[List[int]] = field(default_factory=list)
    threads: Dict[str, dict] = field(default_factory=dict)
    stats: Dict[str, object] = field(default_factory=dict)


class Store:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection, used only from the app's own (UI) thread.
        self.db = sqlite3.connect(str(path), isolation_level=None, timeout=5.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        # A row still `streaming` belongs to a process that died mid-answer.
        self.db.execute("UPDATE messages SET status='interrupted' WHERE status='streaming'")

    def close(self) -> None:
        self.db.close()

    @property
    def journal_mode(self) -> str:
        return self.db.execute("PRAGMA journal_mode").fetchone()[0]

    # -- conversations ----------------------------------------------------------------------
    def create_conversation(self, method: str = "ar", settings: Optional[dict] = None,
                            title: str = "New chat") -> Conversation:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations(title, method, settings, created, updated) VALUES (?,?,?,?,?)",
            (title, method, json.dumps(settings or {}), now, now))
        return self.conversation(cur.lastrowid)

    def conversation(self, conversation_id: int) -> Optional[Conversation]:
        row = self.db.execute("SELECT * FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        return _conversation(row) if row else None

    def conversations(self) -> List[Conversation]:
        """Newest activity first."""
        rows = self.db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC").fetchall()
        return [_conversation(r) for r in rows]

    def update_conversation(self, conversation_id: int, *, title: Optional[str] = None,
                            method: Optional[str] = None, settings: Optional[dict] = None) -> None:
        sets, values = ["updated=?"], [time.time()]
        if title is not None:
            sets.append("title=?")
            values.append(title)
        if method is not None:
            sets.append("method=?")
            values.append(method)
        if settings is not None:
            sets.append("settings=?")
            values.append(json.dumps(settings))
        self.db.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id=?", (*values, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))

    # -- messages ---------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str = "", status: str = "done",
                    method: Optional[str] = None, stats: Optional[dict] = None) -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO messages(conversation_id, role, content, status, method, stats, created, updated) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (conversation_id, role, content, status, method, json.dumps(stats or {}), now, now))
        self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (now, conversation_id))
        return cur.lastrowid

    def update_message(self, message_id: int, *, content: Optional[str] = None,
                       status: Optional[str] = None, marks: Optional[list] = None,
                       threads: Optional[dict] = None, stats: Optional[dict] = None) -> None:
        """One statement, committed at once (autocommit): what the screen shows is on disk."""
        sets, values = ["updated=?"], [time.time()]
        for name, value in (("content", content), ("status", status)):
            if value is not None:
                sets.append(f"{name}=?")
                values.append(value)
        for name, value in (("marks", marks), ("threads", threads), ("stats", stats)):
            if value is not None:
                sets.append(f"{name}=?")
                values.append(json.dumps(value))
        self.db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id=?", (*values, message_id))

    def messages(self, conversation_id: int) -> List[StoredMessage]:
        rows = self.db.execute("SELECT * FROM messages WHERE conversation_id=? ORDER BY id",
                               (conversation_id,)).fetchall()
        return [_message(r) for r in rows]

    def message(self, message_id: int) -> Optional[StoredMessage]:
        row = self.db.execute("SELECT * FROM messages WHERE id=?", (message_id,)).fetchone()
        return _message(row) if row else None

    # -- export -----------------------------------------------------------------------------
    def export_markdown(self, conversation_id: int) -> str:
        conv = self.conversation(conversation_id)
        if conv is None:
            raise KeyError(conversation_id)
        lines = [f"# {conv.title}", "",
                 f"_method: {conv.method}; settings: {_settings_line(conv.settings)}_", ""]
        for msg in self.messages(conversation_id):
            if msg.role == "user":
                lines += ["## You", "", msg.content, ""]
            else:
                head = f"## Assistant ({msg.method or conv.method})"
                if msg.status not in ("done",):
                    head += f" [{msg.status}]"
                lines += [head, "", msg.content, ""]
                if msg.stats.get("line"):
                    lines += [f"> {msg.stats['line']}", ""]
        return "\n".join(lines).rstrip() + "\n"


def _settings_line(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "defaults"


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(row["id"], row["title"], row["method"], json.loads(row["settings"] or "{}"),
                        row["created"], row["updated"])


def _message(row: sqlite3.Row) -> StoredMessage:
    return StoredMessage(row["id"], row["conversation_id"], row["role"], row["content"], row["status"],
                         row["method"], json.loads(row["marks"] or "[]"), json.loads(row["threads"] or "{}"),
                         json.loads(row["stats"] or "{}"))
