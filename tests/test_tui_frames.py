"""Streaming an answer into the chat at the engine's speed: the worker queues events without ever
waiting for the UI, the UI draws at most one frame per `FRAME_S` however many events came, and a
message that grows by appending shows exactly what a one-shot render of the same segments shows
(text, accepted-draft highlighting, cursor, the line under it)."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("textual")

from textual.app import App  # noqa: E402
from textual.content import Content  # noqa: E402

from tui.fake import PLAIN_ANSWER, FakeEngine  # noqa: E402
from tui.stream import Change  # noqa: E402
from tui.widgets import ACCEPTED_STYLE, METHOD_LABELS, STATUS_NOTES, MessageView  # noqa: E402
from test_tui import make_app, until  # noqa: E402  (the chat app on a fake engine; waiting on it)

LONG_ANSWER = " ".join([PLAIN_ANSWER] * 12)


def one_shot(view: MessageView) -> Content:
    """The whole message rendered from scratch from its segments, status and summary."""
    parts = [("Assistant", "bold $text-secondary"), (f" · {METHOD_LABELS.get(view.method, view.method)}", "$text-muted"),
             "\n"]
    parts += [(t, ACCEPTED_STYLE) if a else t for t, a in view.segments]
    if view.status == "streaming":
        parts.append(("▍", "$text-accent"))
    note = STATUS_NOTES.get(view.status) if view.status not in ("done", "streaming") else None
    tail = " · ".join(x for x in (note, view.summary) if x)
    if tail:
        parts += ["\n", (f"[{tail}]", "italic $text-muted")]
    return Content.assemble(*parts)


def drawn(content: Content):
    """What a content draws: its text and its styled character ranges."""
    spans = sorted((s.start, s.end, str(s.style)) for s in content.spans if s.start < s.end)
    return content.plain, spans


def styled_chars(content: Content, style: str) -> str:
    return "".join(content.plain[s.start:s.end] for s in content.spans if str(s.style) == style)


async def ask(pilot, text: str):
    app = pilot.app
    await until(pilot, lambda: app.engine is not None)
    app.query_one("#prompt").value = text
    await pilot.press("enter")


def test_streamed_answer_draws_what_a_one_shot_render_draws(tmp_path, monkeypatch):
    """Many small ReDrafter events: at every frame and at the end, the appended message is the
    one-shot render of its segments; the accepted drafts are the highlighted characters."""
    frames = []
    set_stream = MessageView.set_stream

    def checked(self, segments, status=None, summary=None):
        grew = set_stream(self, segments, status, summary)
        frames.append((drawn(self.shown), drawn(one_shot(self))))
        return grew

    monkeypatch.setattr(MessageView, "set_stream", checked)

    async def run():
        app = make_app(tmp_path, FakeEngine(answer=LONG_ANSWER, delay=0.002), method="redrafter")
        app.MAX_FRAME_S = app.FRAME_S  # many frames: each is checked
        async with app.run_test(size=(100, 30)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, lambda: app.last is not None and app.current is None)
            await pilot.pause(0.05)
            [view] = [v for v in app.query(MessageView) if v.role == "assistant"]
            assert view.text == LONG_ANSWER and view.status == "done"
            accepted = "".join(t for t, a in view.segments if a)
            assert accepted and accepted != LONG_ANSWER
            assert styled_chars(view.shown, ACCEPTED_STYLE) == accepted
            # a fresh view of the same message (as reopening the conversation draws it)
            fresh = MessageView("assistant", method=view.method, status=view.status,
                                segments=[list(s) for s in view.segments], summary=view.summary)
            await app.chat.mount(fresh)
            await pilot.pause(0.05)
            assert drawn(fresh.shown) == drawn(view.shown) == drawn(one_shot(view))
            assert fresh.size == view.size  # the same lines

    asyncio.run(run())
    assert len(frames) > 3
    assert all(got == want for got, want in frames)


def test_message_view_rebuilds_when_earlier_segments_change(tmp_path):
    """An APAR answer is restored anew each frame (a thread's text lands mid-answer): the kept
    content is dropped when the segments it was built from changed."""
    steps = [
        [["Here", True], [" are", False]],
        [["Here", True], [" are", False], [" tips", True]],
        [["Here", True], [" are", False], [" tips", True], [":", False]],
        [["Here", True], [" are three", False], [" tips", True], [":\n1.", False]],  # an earlier one changed
        [["Here are three tips:\n1. Sleep.", False]],  # forked: one plain segment
        [["Here are three tips:\n1. Sleep.\n2. Eat.", False]],
    ]

    class Host(App):
        def compose(self):
            yield MessageView("assistant", method="redrafter", status="streaming", segments=[])

    async def run():
        app = Host()
        async with app.run_test(size=(60, 20)) as pilot:
            view = app.query_one(MessageView)
            for segments in steps:
                view.set_stream([list(s) for s in segments])
                assert drawn(view.shown) == drawn(one_shot(view)), segments
                await pilot.pause(0.01)
            view.set_stream(view.segments, status="stopped", summary="3 tok")
            assert drawn(view.shown) == drawn(one_shot(view))

    asyncio.run(run())


def test_frames_coalesce_a_fast_stream(tmp_path):
    """Events faster than the frame rate: far fewer frames than events, yet every event is shown
    and saved, and the status bar ends with the same figures."""

    async def run():
        engine = FakeEngine(answer=LONG_ANSWER, delay=0.003)  # ~300 events a second
        app = make_app(tmp_path, engine, method="ar")
        async with app.run_test(size=(100, 30)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, lambda: app.last is not None and app.current is None)
            gen = app.last
            assert gen.events == len(LONG_ANSWER.split()) + 1  # every token event and "done"
            assert gen.frames < gen.events / 3
            [view] = [v for v in app.query(MessageView) if v.role == "assistant"]
            assert view.text == LONG_ANSWER
            assert app.store.messages(gen.conversation_id)[-1].content == LONG_ANSWER
            assert "plain done" in str(app.status.render())

    asyncio.run(run())


def test_the_worker_never_waits_for_the_ui(tmp_path):
    """With the UI thread busy (blocked here), the worker runs the engine's stream to its end; the
    UI then takes everything it queued in one go."""

    async def run():
        engine = FakeEngine(answer=LONG_ANSWER, delay=0.0)
        app = make_app(tmp_path, engine, method="redrafter")
        async with app.run_test(size=(100, 30)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, lambda: engine.calls)
            deadline = time.monotonic() + 5.0
            while engine.finished == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # the UI's loop is blocked: no message is handled meanwhile
            assert engine.finished == 1  # the whole stream ran without the UI
            await until(pilot, lambda: app.last is not None and app.current is None)
            assert app.last.frames <= 2  # all of it at once
            [view] = [v for v in app.query(MessageView) if v.role == "assistant"]
            assert view.text == LONG_ANSWER and view.status == "done"

    asyncio.run(run())


def test_change_absorb_keeps_each_thread_once_in_order():
    change = Change(opened=[1], updated=[0, 1])
    change.absorb(Change(opened=[2], closed=[1], updated=[1, 2, 0]))
    change.absorb(Change(done=True))
    assert (change.opened, change.closed, change.updated, change.done) == ([1, 2], [1], [0, 1, 2], True)


def test_a_growing_message_repaints_only_rows_that_stay_as_a_full_repaint_draws_them():
    """Word by word, a message of several wrapped lines with accepted drafts: after every frame
    the rows the view kept from earlier frames are the rows a full repaint draws (the partial
    repaint leaves nothing stale), and most frames repaint only the rows being written."""
    words = ("\n".join(f"{i}. " + PLAIN_ANSWER for i in range(1, 5))).split(" ")
    partial = []

    class Host(App):
        def compose(self):
            yield MessageView("assistant", method="redrafter", status="streaming", segments=[])

    def lines(view):
        return [strip.text for strip in view.render_lines(view.region.reset_offset)]

    async def run():
        app = Host()
        async with app.run_test(size=(50, 40)) as pilot:
            view = app.query_one(MessageView)
            segments = []
            for i, word in enumerate(words):
                segments.append([(" " if i else "") + word, i % 3 == 1])
                view.set_stream([list(s) for s in segments])
                partial.append(bool(view._styles_cache._dirty_lines) and
                               len(view._styles_cache._dirty_lines) < view.size.height)
                await pilot.pause(0.005)
                kept = lines(view)
                view._styles_cache.clear()
                view.refresh()
                await pilot.pause(0.005)
                assert kept == lines(view), i

    asyncio.run(run())
    assert sum(partial) > len(words) / 2


def test_auto_says_in_the_status_bar_and_the_summary_what_it_chose(tmp_path):
    """`--method auto`: the status bar names the method chosen from the answer's first frame on,
    and the answer's summary (saved) says what and why."""
    from tui.fake import AUTO_CHOICE

    engine = FakeEngine(methods=("ar", "redrafter", "auto"), hold_after=[2])

    async def run():
        app = make_app(tmp_path, engine, method="auto")
        async with app.run_test(size=(120, 30)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, lambda: engine.holding.is_set())
            await pilot.pause(app.STATUS_S + 0.1)
            assert "auto: ReDrafter writing" in str(app.status.render())
            assert "acc " in str(app.status.render())  # ReDrafter's figures, as for redrafter itself
            engine.release()
            await until(pilot, lambda: app.last is not None and app.current is None)
            assert "auto: ReDrafter done" in str(app.status.render())
            line = app.store.messages(app.last.conversation_id)[-1].stats["line"]
            assert line.startswith(f"auto chose redrafter: {AUTO_CHOICE['why']}")
            assert engine.calls[-1]["method"] == "auto"

    asyncio.run(run())


@pytest.mark.parametrize("cpu_per_frame", [0.02, 0.004, 0.0005])
def test_frames_are_spaced_by_what_they_cost_the_ui_thread(tmp_path, monkeypatch, cpu_per_frame):
    """The UI thread's CPU clock (faked) advances `cpu_per_frame` per frame: each frame's next one is
    due that cost / UI_SHARE later, held between FRAME_S and MAX_FRAME_S; the whole answer is
    still shown and saved."""
    import types

    import tui.workers as workers

    clock = {"cpu": 0.0}

    def thread_time():
        clock["cpu"] += cpu_per_frame
        return clock["cpu"]

    monkeypatch.setattr(workers, "time", types.SimpleNamespace(monotonic=time.monotonic, thread_time=thread_time))
    gaps = []
    take = workers.GenerationMixin._take_events

    def recorded(self, gen, now_or_never=False):
        frames, before = gen.frames, time.monotonic()
        take(self, gen, now_or_never)
        if gen.frames > frames and gen.cpu_mark is not None and frames > 0:
            gaps.append(gen.next_frame_at - before)

    monkeypatch.setattr(workers.GenerationMixin, "_take_events", recorded)

    async def run():
        engine = FakeEngine(answer=LONG_ANSWER, delay=0.005)
        app = make_app(tmp_path, engine, method="ar")
        async with app.run_test(size=(100, 30)) as pilot:
            await ask(pilot, "Why is the sky blue?")
            await until(pilot, lambda: app.last is not None and app.current is None, timeout=30)
            want = min(max(cpu_per_frame / app.UI_SHARE, app.FRAME_S), app.MAX_FRAME_S)
            assert gaps and all(want <= gap < want + 0.01 for gap in gaps), (want, gaps)  # + the take's own time
            [view] = [v for v in app.query(MessageView) if v.role == "assistant"]
            assert view.text == LONG_ANSWER
            assert app.store.messages(app.last.conversation_id)[-1].content == LONG_ANSWER

    asyncio.run(run())
