"""The chat with a thinking model's answer: the thought is drawn apart from the answer, folded to
one line under the message's head (live while it is written: its latest words), opened and folded
again by a click; the answer keeps its accepted-draft marks; the stored message is the model's
text as written. Snapshots (pytest-textual-snapshot, 80x24, the fake engine) of the thought being
written, folded, and opened; update with `--snapshot-update` after a deliberate change of the look."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pytest_textual_snapshot")

from tui.fake import FakeEngine  # noqa: E402
from tui.thought import split_segments  # noqa: E402

from test_tui_snapshots import SIZE, app_for, asking, wait_for  # noqa: E402

THOUGHT = "The user asks about the sky. Rayleigh scattering: shorter wavelengths scatter more."
ANSWER = "The sky looks blue because air scatters blue light more than red light."
THINKING = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


def test_segments_split_into_the_thought_and_the_answer_with_their_marks():
    segments = [["<think>\nHm, ", False], ["let me see.\n</thi", True], ["nk>\n\nFour", True], [" it is.", False]]
    thought = split_segments(segments)
    assert (thought.text, thought.live) == ("Hm, let me see.", False)
    assert thought.answer == [["Four", True], [" it is.", False]]
    assert split_segments([["<think>\nHm, let me see.\n</th", False]]) == ("Hm, let me see.", True, [])
    assert split_segments([["<thi", False]]) == ("", True, [])
    assert split_segments([["Four.", False]]) is None
    assert split_segments([["Let me see.</think>Four.", False]]).answer == [["Four.", False]]  # opened by the prompt


def answer_view(app):
    return app.query("MessageView.-assistant").last()


def test_the_thought_is_apart_folded_live_then_opened_by_a_click(tmp_path):
    engine = FakeEngine(answer=THINKING, hold_after=[6])
    app = app_for(tmp_path, engine, method="ar")

    async def run():
        async with app.run_test(size=SIZE) as pilot:
            await asking("Why is the sky blue?", until_done=False, engine=engine)(pilot)
            live = answer_view(app).shown.plain
            assert "▸ thinking… The user asks about" in live and "<think>" not in live
            engine.release()
            await wait_for(pilot, lambda: app.last is not None and app.current is None)
            await pilot.pause(0.1)
            view = answer_view(app)
            folded = view.shown.plain
            assert "▸ thought · 12 words (click to show)" in folded and ANSWER in folded
            assert "Rayleigh" not in folded and "think>" not in folded
            assert view.text == THINKING  # the message as the model wrote it (saved as such)
            await pilot.click(view)
            await pilot.pause(0.1)
            opened = view.shown.plain
            assert f"▾ thought (click to fold)\n{THOUGHT}\n\n{ANSWER}" in opened
            await pilot.click(view)
            await pilot.pause(0.1)
            assert view.shown.plain == folded

    asyncio.run(run())


def test_snapshot_thinking_live(tmp_path, snap_compare):
    engine = FakeEngine(answer=THINKING, hold_after=[9])
    app = app_for(tmp_path, engine, method="ar")
    try:
        assert snap_compare(app, terminal_size=SIZE,
                            run_before=asking("Why is the sky blue?", until_done=False, engine=engine))
    finally:
        engine.release()


def test_snapshot_thinking_answer_folded(tmp_path, snap_compare):
    app = app_for(tmp_path, FakeEngine(answer=THINKING), method="redrafter")
    assert snap_compare(app, terminal_size=SIZE, run_before=asking("Why is the sky blue?"))


def test_snapshot_thinking_answer_opened(tmp_path, snap_compare):
    app = app_for(tmp_path, FakeEngine(answer=THINKING), method="redrafter")
    ask = asking("Why is the sky blue?")

    async def run_before(pilot):
        await ask(pilot)
        await pilot.click(answer_view(pilot.app))
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
