"""The chat app (tui/) driven with Textual's Pilot against a fake engine that streams ReDrafter-like
accepted/drafted tokens and APAR-like forked threads (tui/fake.py): thread panes open and close
with the threads, Esc cancels at once, the status bar follows the stream, and the saved rows are
exactly what was shown."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys

import pytest

from mlx_specdec.decoding.redrafter import DEFAULT_DRAFT_CUTOFF
from mlx_specdec.settings import resolve

pytest.importorskip("textual")

from tui.app import ChatApp  # noqa: E402
from tui.fake import PLAIN_ANSWER, FakeEngine  # noqa: E402
from tui.store import Store  # noqa: E402
from tui.stream import fork_restore  # noqa: E402
from tui.widgets import MessageView, ThreadPane  # noqa: E402

APAR_ANSWER = ("Here are three tips:\n1. Keep a fixed bedtime. Even on weekends. Set an alarm.\n"
               "2. Avoid screens late at night.\n3. Keep the room cool and dark.")


def make_app(tmp_path, engine=None, **kwargs):
    kwargs.setdefault("baseline", 10.0)
    return ChatApp(engine=engine or FakeEngine(), db_path=tmp_path / "chats.sqlite3", home=tmp_path, **kwargs)


async def until(pilot, condition, timeout: float = 5.0):
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await pilot.pause(0.01)
    raise AssertionError("condition not reached")


async def ask(pilot, text: str):
    app = pilot.app
    await until(pilot, lambda: app.engine is not None)
    await pilot.click("#prompt")
    app.query_one("#prompt").value = text
    await pilot.press("enter")
    await until(pilot, lambda: app.current is not None or app.last is not None)


def assistant_views(app):
    return [v for v in app.query(MessageView) if v.role == "assistant"]


def rows(path):
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM messages ORDER BY id")]
    finally:
        db.close()


def test_redrafter_answer_streams_with_accepted_drafts_marked(tmp_path):
    async def run():
        app = make_app(tmp_path, method="redrafter")
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, lambda: app.current is None)
            view = assistant_views(app)[-1]
            assert view.text == PLAIN_ANSWER
            accepted = "".join(t for t, a in view.segments if a)
            assert accepted and accepted != PLAIN_ANSWER  # drafts and the model's own tokens
            status = str(app.status.render())
            assert "ReDrafter done" in status and "23.3 tok/s" in status and "2.20 tok/fwd" in status
            assert "acc 24%" in status and "×2.33 vs plain 10.0" in status  # of 5 drafts a step (L = 6)
            saved = rows(tmp_path / "chats.sqlite3")
            assert [(r["role"], r["status"]) for r in saved] == [("user", "done"), ("assistant", "done")]
            assert saved[1]["content"] == view.text
            import json

            marks = json.loads(saved[1]["marks"])
            assert "".join(view.text[a:b] for a, b in marks) == accepted

    asyncio.run(run())


def test_apar_thread_panes_open_nested_and_close(tmp_path):
    engine = FakeEngine(hold_after=[12])

    async def run():
        app = make_app(tmp_path, engine=engine, method="apar")
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Tips for sleep?")
            await until(pilot, engine.holding.is_set)
            await pilot.pause(0.05)
            panes = {p.view.thread_id: p for p in app.query(ThreadPane)}
            assert set(panes) == {1, 2, 3, 4}  # thread 0 is the main view
            order = [p.view.thread_id for p in app.query(ThreadPane)]
            assert order.index(4) == order.index(1) + 1  # nested right under its parent
            assert panes[4].styles.margin.left == 2 and panes[1].styles.margin.left == 0
            assert "4 threads, 4 live, depth 2" in str(app.panes.border_title)
            assert "threads 4/4" in str(app.status.render())
            shown = assistant_views(app)[-1].text
            assert shown.startswith("Here are three tips:\n1. Keep a fixed bedtime.")
            assert rows(tmp_path / "chats.sqlite3")[-1]["content"] == shown  # saved as shown
            engine.release()
            await until(pilot, lambda: app.current is None)
            assert not list(app.query(ThreadPane)) and not app.panes.has_class("-active")
            view = assistant_views(app)[-1]
            assert view.text == APAR_ANSWER
            saved = rows(tmp_path / "chats.sqlite3")[-1]
            assert saved["content"] == APAR_ANSWER and saved["status"] == "done"

    asyncio.run(run())


def test_panes_follow_thread_start_and_end_events(tmp_path):
    """Hold the stream at every forward: the open panes are exactly the live forked threads."""
    engine = FakeEngine(hold_after=list(range(1, 20)))
    opened_at, closed_at = {}, {}

    async def run():
        app = make_app(tmp_path, engine=engine, method="apar")
        app.MAX_FRAME_S = app.FRAME_S  # a frame for every forward: this test looks at each
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Tips for sleep?")
            step = 0
            while app.current is not None:
                await until(pilot, lambda: engine.holds > step or app.current is None)
                # every event before the hold shown (the UI drains its inbox once a frame)
                await until(pilot, lambda: app.current is None or len(app.current.state.events) >= engine.yielded)
                await pilot.pause(0.03)
                if app.current is None:
                    break
                step += 1
                live = {v.thread_id for v in app.current.state.live_threads()}
                shown = {p.view.thread_id for p in app.query(ThreadPane)}
                assert shown == live, step
                for t in shown:
                    opened_at.setdefault(t, step)
                for t in set(opened_at) - shown:
                    closed_at.setdefault(t, step)
                engine.release()
            assert not list(app.query(ThreadPane))  # the last ones close with the answer
            for t in set(opened_at) - set(closed_at):
                closed_at[t] = step + 1

    asyncio.run(run())
    assert set(opened_at) == {1, 2, 3, 4} and set(closed_at) == {1, 2, 3, 4}
    assert opened_at[1] < opened_at[2] < opened_at[3] < opened_at[4]
    assert closed_at[4] > opened_at[4] and closed_at[2] < closed_at[3]


def test_esc_stops_at_once_and_keeps_the_text(tmp_path):
    engine = FakeEngine(hold_after=[5])

    async def run():
        app = make_app(tmp_path, engine=engine, method="ar")
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, engine.holding.is_set)
            await pilot.pause(0.05)
            shown = assistant_views(app)[-1].text
            assert shown == "The sky looks blue because"
            await pilot.press("escape")  # while the engine is still blocked mid-answer
            assert app.current is None
            view = assistant_views(app)[-1]
            assert view.status == "stopped" and view.text == shown
            assert "stopped" in str(app.status.render())
            saved = rows(tmp_path / "chats.sqlite3")[-1]
            assert (saved["content"], saved["status"]) == (shown, "stopped")
            engine.release()  # the worker wakes, sees the stop and closes the stream
            await until(pilot, lambda: engine.closed == 1)
            await pilot.pause(0.05)
            assert engine.finished == 0
            assert rows(tmp_path / "chats.sqlite3")[-1]["content"] == shown  # late events ignored
            engine.hold_after = []
            await ask(pilot, "And at sunset?")  # the next answer runs (the engine lock was freed)
            await until(pilot, lambda: app.current is None)
            assert assistant_views(app)[-1].text == PLAIN_ANSWER
            history = engine.calls[-1]["messages"]
            assert [m["role"] for m in history] == ["user", "assistant", "user"]
            assert history[1]["content"] == shown  # the stopped answer stays in the conversation

    asyncio.run(run())


def test_status_bar_updates_while_streaming(tmp_path):
    engine = FakeEngine(hold_after=[3, 6])

    async def run():
        app = make_app(tmp_path, engine=engine, method="redrafter")
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            seen = []
            for hold in (1, 2):
                await until(pilot, lambda: engine.holds == hold and engine.holding.is_set())
                await pilot.pause(app.STATUS_S + 0.1)  # the figures show within STATUS_S
                seen.append(str(app.status.render()))
                engine.release()
            await until(pilot, lambda: app.current is None)
            seen.append(str(app.status.render()))
            assert all("ReDrafter writing" in s for s in seen[:2]) and "ReDrafter done" in seen[2]
            assert len(set(seen)) == 3  # the figures moved
            # 3 forwards (the default L = 6: 5 drafts each): steps of 1, 3, 1 tokens -> 5 tokens,
            # 2 of 3 x 5 drafts accepted
            assert "1.67 tok/fwd" in seen[0] and "acc 13%" in seen[0]

    asyncio.run(run())


def test_partial_answer_is_on_disk_and_restored_after_a_crash(tmp_path):
    engine = FakeEngine(hold_after=[7])

    async def run():
        app = make_app(tmp_path, engine=engine, method="ar")
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, engine.holding.is_set)
            await pilot.pause(0.05)
            shown = assistant_views(app)[-1].text
            # another process reads the file while the answer is half-written
            saved = rows(tmp_path / "chats.sqlite3")[-1]
            assert (saved["content"], saved["status"]) == (shown, "streaming")
            engine.release()
        return shown

    shown = asyncio.run(run())
    # a restart after a crash: the streaming row is shown as interrupted, text intact
    store = Store(tmp_path / "chats.sqlite3")
    [conv] = store.conversations()
    last = store.messages(conv.id)[-1]
    assert last.content.startswith(shown) and store.journal_mode == "wal"


def test_reopen_shows_every_conversation_and_their_messages(tmp_path):
    async def first():
        app = make_app(tmp_path, method="redrafter")
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "First question")
            await until(pilot, lambda: app.current is None)
            await pilot.press("ctrl+n")
            await ask(pilot, "Second question")
            await until(pilot, lambda: app.current is None)

    async def second():
        app = make_app(tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.05)
            titles = [str(item.query_one(".title").render()) for item in app.query("ConversationItem")]
            assert titles == ["Second question", "First question"]
            texts = [v.text for v in app.query(MessageView)]
            assert texts == ["Second question", PLAIN_ANSWER]
            await pilot.click("ConversationItem:last-of-type")
            await pilot.pause(0.05)
            assert [v.text for v in app.query(MessageView)][0] == "First question"
            accepted = [t for v in assistant_views(app) for t, a in v.segments if a]
            assert accepted  # ReDrafter marks come back from the store

    asyncio.run(first())
    asyncio.run(second())


def test_settings_choose_method_and_options_per_conversation(tmp_path):
    engine = FakeEngine()

    async def run():
        app = make_app(tmp_path, engine=engine, method="ar")
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.engine is not None)
            await pilot.press("ctrl+o")
            await pilot.pause(0.05)
            screen = app.screen
            screen.query_one("#method").value = "redrafter"
            screen.query_one("#field-beam_width").value = "3"
            screen.query_one("#field-beam_length").value = "4"
            screen.query_one("#field-max_tokens").value = "6"
            await pilot.click("#save")
            await pilot.pause(0.05)
            conv = app.store.conversation(app.conversation.id)
            assert conv.method == "redrafter" and conv.settings["beam_width"] == 3
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, lambda: app.current is None)
            call = engine.calls[-1]
            assert call["method"] == "redrafter"
            assert call["params"].options == resolve("redrafter", {"beam_width": 3, "beam_length": 4})
            assert call["params"].options["draft_cutoff"] == DEFAULT_DRAFT_CUTOFF
            assert call["params"].max_tokens == 6
            # a bad value is refused with a notification; the screen stays open
            await pilot.press("ctrl+o")
            await pilot.pause(0.05)
            app.screen.query_one("#field-temperature").value = "hot"
            await pilot.click("#save")
            await pilot.pause(0.05)
            assert app.screen.__class__.__name__ == "SettingsScreen"
            assert any("temperature" in n.message for n in app._notifications)
            await pilot.press("escape")

    asyncio.run(run())


def test_export_markdown_and_help(tmp_path):
    async def run():
        app = make_app(tmp_path, method="ar", export_dir=tmp_path / "out")
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, lambda: app.current is None)
            await pilot.press("ctrl+s")
            [path] = list((tmp_path / "out").glob("*.md"))
            text = path.read_text()
            assert "## You\n\nWhy is the sky blue?" in text and PLAIN_ANSWER in text
            await pilot.press("f1")
            await pilot.pause(0.05)
            assert app.screen.__class__.__name__ == "HelpScreen"
            await pilot.press("escape")
            await pilot.pause(0.05)
            assert app.screen.__class__.__name__ != "HelpScreen"

    asyncio.run(run())


def test_errors_are_notifications_not_crashes(tmp_path):
    from mlx_specdec.errors import ContextOverflow, ModelNotFound

    async def generation_error():
        engine = FakeEngine(fail=ContextOverflow("prompt has 9000 tokens but the context window is 8192"))
        app = make_app(tmp_path, engine=engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Hello")
            await until(pilot, lambda: app.current is None)
            [note] = [n for n in app._notifications if n.severity == "error"]
            assert "context window" in note.message and "Ctrl+N" in note.message
            assert rows(tmp_path / "chats.sqlite3")[-1]["status"] == "error"

    def failing_loader(progress):
        progress("loading weights", 1, 4)
        raise ModelNotFound("no model at 'nowhere'")

    async def load_error():
        app = ChatApp(loader=failing_loader, db_path=tmp_path / "other.sqlite3", home=tmp_path, baseline=1.0)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.load_stage == "failed")
            [note] = [n for n in app._notifications if n.severity == "error"]
            assert "no model at 'nowhere'" in note.message and "--model" in note.message
            app.query_one("#prompt").value = "Hello?"
            await pilot.press("enter")  # no crash: a second notification
            assert len(app._notifications) == 2 and app.is_running

    asyncio.run(generation_error())
    asyncio.run(load_error())


def test_question_typed_while_loading_is_sent_when_ready(tmp_path):
    import threading

    gate = threading.Event()
    engine = FakeEngine()

    def slow_loader(progress):
        progress("loading weights", 1, 4)
        gate.wait(5)
        return engine

    async def run():
        app = ChatApp(loader=slow_loader, db_path=tmp_path / "c.sqlite3", home=tmp_path, baseline=10.0)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.load_stage == "loading weights")
            assert app.query_one("#load-box").has_class("-loading")
            app.query_one("#prompt").value = "Early question"
            await pilot.press("enter")  # the UI answers while the load runs
            assert app.engine is None and app._pending == "Early question"
            gate.set()
            await until(pilot, lambda: app.last is not None)
            assert assistant_views(app)[-1].text == PLAIN_ANSWER

    asyncio.run(run())


class StatingEngine(FakeEngine):
    """A fake that warms up and states plain decoding's rate as the engine does (engine_measured.py):
    on its first event, then in the stats at the context the answer averaged (or none)."""

    def __init__(self, plain_at_done):
        super().__init__()
        self.plain_at_done, self.warmed = plain_at_done, []

    def warm_up(self, method, params, progress):
        progress(f"warming up {method}")
        self.warmed.append((method, params.temperature, params.top_p))
        return 1.5

    def chat(self, messages, method="ar", params=None):
        first = True
        for event in super().chat(messages, method, params):
            if first:
                event.plain_tps, first = 4.0, False
            if event.kind == "done" and self.plain_at_done:
                event.stats.extra["plain_tps"] = self.plain_at_done
            yield event


@pytest.mark.parametrize("plain_at_done", [5.0, None])
def test_the_speedup_is_against_the_plain_rate_the_engine_states_or_none(tmp_path, plain_at_done):
    engine = StatingEngine(plain_at_done)

    async def run():
        app = ChatApp(engine=engine, db_path=tmp_path / "c.sqlite3", home=tmp_path, method="redrafter",
                      settings={"temperature": 0.7, "top_p": 0.9})
        async with app.run_test(size=(160, 24)) as pilot:
            await until(pilot, lambda: app.engine is not None)
            assert "warmed up in 1.5 s" in str(app.status.render())
            await ask(pilot, "Hello there")
            return app.last.state, str(app.status.render())

    state, status = asyncio.run(run())
    assert engine.warmed == [("redrafter", 0.7, 0.9)]  # the chat's own method and sampling, at load
    if plain_at_done:
        assert state.plain_tps == plain_at_done and f"vs plain {plain_at_done:.1f}" in status
        assert state.speedup == pytest.approx(state.decode_tps / plain_at_done)
    else:  # stated at the start, but nothing comparable at the context the answer reached
        assert state.speedup is None and "vs plain" not in status and "plain 4.0" not in status


def test_fork_restore_splices_children_at_their_fork_points():
    engine = FakeEngine()
    events = list(engine.chat([{"role": "user", "content": "x"}], "apar", None))
    assert fork_restore(events) == APAR_ANSWER
    from tui.stream import default_restore

    restore = default_restore(engine)  # the engine's own APAR restore, when the module is there
    assert restore(events) == APAR_ANSWER


def test_the_engine_never_imports_textual():
    code = ("import sys, mlx_specdec.engine, mlx_specdec.cli, mlx_specdec.bench, mlx_specdec.decoding; "
            "sys.exit(1 if any(m == 'textual' or m.startswith('textual.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_events_arriving_while_the_widgets_are_torn_down_are_still_saved(tmp_path):
    """On quit, the worker's last events can arrive after the status bar and panes are gone (a
    race CI once hit): they must be saved, never raise."""
    engine = FakeEngine(hold_after=[7])

    async def run():
        app = make_app(tmp_path, engine=engine, method="ar")
        async with app.run_test(size=(80, 24)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, engine.holding.is_set)
            await app.query_one("#status").remove()
            engine.release()
            await until(pilot, lambda: app.current is None)
            return app.last.status

    assert asyncio.run(run()) == "done"
    saved = rows(tmp_path / "chats.sqlite3")[-1]
    assert saved["content"] == PLAIN_ANSWER
