"""Methods the loaded model cannot run, in the chat: the settings screen marks them, and a
conversation set to one answers with plain decoding, saying why once (never an error per answer)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textual")

from textual.widgets import Select  # noqa: E402

from tui.fake import PLAIN_ANSWER, FakeEngine  # noqa: E402
from tui.widgets import MessageView  # noqa: E402
from test_tui_frames import ask, make_app, until  # noqa: E402

WHY = "SmolLM2 has no [Fork]/[Child] control tokens and no APAR adapter"


class NoAparEngine(FakeEngine):
    def method_support(self):
        return {m: (WHY if m == "apar" else None) for m in self.methods}


def test_an_unavailable_method_answers_plainly_and_says_why_once(tmp_path):
    engine = NoAparEngine()
    notes = []

    async def run():
        app = make_app(tmp_path, engine, method="apar")
        original = app.notify
        app.notify = lambda message, **kw: (notes.append((kw.get("title", ""), message)), original(message, **kw))
        async with app.run_test(size=(120, 30)) as pilot:
            for question in ("Tips for sleep?", "And for focus?"):
                await ask(pilot, question)
                await until(pilot, lambda: app.last is not None and app.current is None)
                app.last = None
            assert [c["method"] for c in engine.calls] == ["ar", "ar"]
            views = [v for v in app.query(MessageView) if v.role == "assistant"]
            assert [v.text for v in views] == [PLAIN_ANSWER, PLAIN_ANSWER] and views[-1].method == "ar"
            assert app.store.conversation(app.conversation.id).method == "apar"  # the conversation keeps its own
            await pilot.press("ctrl+o")
            await pilot.pause(0.1)
            options = dict((value, str(label)) for label, value in app.screen.query_one("#method", Select)._options)
            assert options["apar"].endswith("· not for this model") and "not for" not in options["ar"]

    asyncio.run(run())
    told = [n for n in notes if "not available" in n[0]]
    assert len(told) == 1 and told[0][0] == "APAR is not available for this model" and WHY in told[0][1]
