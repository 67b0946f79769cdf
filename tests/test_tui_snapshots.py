"""Snapshots (pytest-textual-snapshot) of the chat app's main states at 80x24, on the fake engine.

Update after a deliberate change of the look: `pytest tests/test_tui_snapshots.py --snapshot-update`
(then look at the SVGs in tests/__snapshots__/). Drawn with Textual 8.x (pinned in pyproject).
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("pytest_textual_snapshot")

from tui.app import ChatApp  # noqa: E402
from tui.fake import FakeEngine  # noqa: E402

SIZE = (80, 24)


def app_for(tmp_path, engine, **kwargs):
    kwargs.setdefault("baseline", 10.0)
    return ChatApp(engine=engine, db_path=tmp_path / "chats.sqlite3", home=tmp_path, **kwargs)


async def wait_for(pilot, condition, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await pilot.pause(0.01)
    raise AssertionError("condition not reached")


def asking(question, until_done=True, engine=None, keys=()):
    async def run_before(pilot):
        app = pilot.app
        await wait_for(pilot, lambda: app.engine is not None)
        app.query_one("#prompt").value = question
        await pilot.press("enter")
        if until_done:
            await wait_for(pilot, lambda: app.last is not None and app.current is None)
        else:
            await wait_for(pilot, engine.holding.is_set)
        await pilot.pause(0.1)
        for key in keys:
            await pilot.press(key)
            await pilot.pause(0.1)

    return run_before


def test_snapshot_loading(tmp_path, snap_compare):
    gate = threading.Event()

    def loader(progress):
        progress("loading default weights", 1, 4)
        gate.wait(10)
        return FakeEngine()

    class GatedApp(ChatApp):
        def on_unmount(self) -> None:  # the snapshot is taken: let the load finish
            gate.set()
            super().on_unmount()

    app = GatedApp(loader=loader, db_path=tmp_path / "chats.sqlite3", home=tmp_path, baseline=10.0)

    async def run_before(pilot):
        await wait_for(pilot, lambda: pilot.app.load_stage.startswith("loading"))
        await pilot.pause(0.1)

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    finally:
        gate.set()


def test_snapshot_redrafter_answer_dark(tmp_path, snap_compare):
    app = app_for(tmp_path, FakeEngine(), method="redrafter")
    assert snap_compare(app, terminal_size=SIZE, run_before=asking("Why is the sky blue?"))


def test_snapshot_redrafter_answer_light(tmp_path, snap_compare):
    app = app_for(tmp_path, FakeEngine(), method="redrafter", theme="textual-light")
    assert snap_compare(app, terminal_size=SIZE, run_before=asking("Why is the sky blue?"))


def test_snapshot_apar_threads_live(tmp_path, snap_compare):
    engine = FakeEngine(hold_after=[12])
    app = app_for(tmp_path, engine, method="apar")
    try:
        assert snap_compare(app, terminal_size=SIZE,
                            run_before=asking("Tips for sleep?", until_done=False, engine=engine))
    finally:
        engine.release()


def test_snapshot_stopped_with_esc(tmp_path, snap_compare):
    engine = FakeEngine(hold_after=[9])
    app = app_for(tmp_path, engine, method="ar")
    try:
        assert snap_compare(app, terminal_size=SIZE,
                            run_before=asking("Why is the sky blue?", until_done=False, engine=engine,
                                              keys=["escape"]))
    finally:
        engine.release()


def test_snapshot_help(tmp_path, snap_compare):
    app = app_for(tmp_path, FakeEngine())
    assert snap_compare(app, terminal_size=SIZE, run_before=asking("Hi", keys=["f1"]))


def test_snapshot_settings(tmp_path, snap_compare):
    app = app_for(tmp_path, FakeEngine(), method="redrafter")
    assert snap_compare(app, terminal_size=SIZE, run_before=asking("Hi", keys=["ctrl+o"]))


def test_snapshot_error_notification(tmp_path, snap_compare):
    from mlx_specdec.errors import ContextOverflow

    engine = FakeEngine(fail=ContextOverflow("prompt has 9000 tokens but the context window of fake-llm is 8192"))
    app = app_for(tmp_path, engine)
    assert snap_compare(app, terminal_size=SIZE, run_before=asking("A very long question"))


def test_snapshot_document_and_triforce(tmp_path, snap_compare):
    """A TriForce answer to a message that carried a document (its chip in the message, both
    levels' acceptance under the answer and in the status bar), and a second document attached."""
    (tmp_path / "notes.txt").write_text("The lighthouse keeper on Marrow Island is Edwin Calloway.\n")
    (tmp_path / "chapter-2.md").write_text("He has kept the light for thirty-one years.\n" * 20)
    app = app_for(tmp_path, FakeEngine(), method="triforce")

    async def run_before(pilot):
        await wait_for(pilot, lambda: pilot.app.engine is not None)
        await pilot.press("ctrl+b")  # the conversation list hidden: the whole width for the chat
        for line in (f"/attach {tmp_path / 'notes.txt'}", "Who keeps the light?"):
            pilot.app.query_one("#prompt").value = line
            await pilot.press("enter")
        await wait_for(pilot, lambda: pilot.app.last is not None and pilot.app.current is None)
        pilot.app.query_one("#prompt").value = f"/attach {tmp_path / 'chapter-2.md'}"
        await pilot.press("enter")
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
