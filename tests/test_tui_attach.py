"""Documents in the chat app and TriForce in it, driven with Textual's Pilot on the fake engine:
/attach (and Ctrl+L) shows a chip with the document's token count, the next message carries the
document and the conversation keeps it for follow-ups; every file that cannot be attached, and a
document that would not fit the context window, is one line in the chat before any prefill;
TriForce is chosen in Ctrl+O with its budget, gamma and bottom level, and the status bar shows
both of its levels' acceptance."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textual")

from mlx_specdec.decoding.base import Event, GenerationStats  # noqa: E402
from mlx_specdec.decoding.triforce import BOTTOMS  # noqa: E402
from mlx_specdec.settings import resolve  # noqa: E402
from tui.app import ChatApp  # noqa: E402
from tui.fake import PLAIN_ANSWER, FakeEngine  # noqa: E402
from tui.store import Store  # noqa: E402
from tui.stream import StreamState  # noqa: E402
from tui.widgets import MessageView, Notice  # noqa: E402

from test_tui import make_app, until  # noqa: E402  (the same app and wait helpers)

DOC = ("The lighthouse keeper on Marrow Island is Edwin Calloway.\n"
       "He has kept the light for thirty-one years; his dog is called Biscuit.\n")


async def type_line(pilot, text: str):
    app = pilot.app
    await until(pilot, lambda: app.engine is not None)
    app.query_one("#prompt").value = text
    await pilot.press("enter")
    await pilot.pause(0.02)


async def ask(pilot, text: str):
    app = pilot.app
    before = app.last
    await type_line(pilot, text)
    await until(pilot, lambda: app.current is None and app.last is not before)


def notices(app):
    return [n.text for n in app.query(Notice)]


def chip(app) -> str:
    return app.query_one("#doc-chip").text


def composed(question: str, text: str = DOC, name: str = "notes.txt") -> str:
    return f"Document: {name}\n\n{text.strip()}\n\nQuestion: {question}"


def test_attach_shows_a_chip_and_the_next_message_carries_the_document(tmp_path):
    doc = tmp_path / "notes.txt"
    doc.write_text(DOC)
    engine = FakeEngine()
    tokens = len(engine.lm.tokenizer.encode(DOC))  # the engine's tokenizer

    async def run():
        app = make_app(tmp_path, engine=engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await type_line(pilot, f"/attach {doc}")
            assert app.query_one("#doc-chip").display
            assert "notes.txt" in chip(app) and f"{tokens} tokens" in chip(app)
            assert app.query_one("#prompt").value == "" and not notices(app) and not engine.calls
            await ask(pilot, "Who keeps the light?")
            first = engine.calls[-1]["messages"]
            assert first == [{"role": "user", "content": composed("Who keeps the light?")}]
            assert chip(app) == "" and not app.query_one("#doc-chip").display  # the message took it
            [user] = [v for v in app.query(MessageView) if v.role == "user"]
            assert user.document == {"name": "notes.txt", "tokens": tokens, "question": "Who keeps the light?"}
            assert "notes.txt" in str(user.render()) and "lighthouse keeper on" not in str(user.render())
            await ask(pilot, "And his dog?")  # a follow-up: the document stays, in the same place
            follow = engine.calls[-1]["messages"]
            assert follow[:2] == first + [{"role": "assistant", "content": PLAIN_ANSWER}]
            assert follow[2] == {"role": "user", "content": "And his dog?"}
            assert app.conversation.title == "Who keeps the light?"

    asyncio.run(run())
    store = Store(tmp_path / "chats.sqlite3")  # saved as sent; reopened, the chip comes back
    [conv] = store.conversations()
    first = store.messages(conv.id)[0]
    assert first.content == composed("Who keeps the light?") and first.stats["document"]["tokens"] == tokens

    async def reopen():
        app = make_app(tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.05)
            user = [v for v in app.query(MessageView) if v.role == "user"][0]
            assert user.document["name"] == "notes.txt" and "Who keeps the light?" in str(user.render())

    asyncio.run(reopen())


def test_ctrl_l_prompts_for_a_path_and_detach_removes_the_document(tmp_path):
    doc = tmp_path / "my notes.txt"
    doc.write_text(DOC)
    engine = FakeEngine()

    async def run():
        app = make_app(tmp_path, engine=engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.engine is not None)
            await pilot.press("ctrl+l")
            await pilot.pause(0.05)
            assert app.screen.__class__.__name__ == "AttachScreen"
            app.screen.query_one("#attach-path").value = str(doc)  # a path with a space
            await pilot.press("enter")
            await pilot.pause(0.05)
            assert app.screen.__class__.__name__ != "AttachScreen"
            assert "my notes.txt" in chip(app)
            await type_line(pilot, "/detach")
            assert chip(app) == "" and not notices(app)
            await type_line(pilot, f'/attach "{doc}"')  # quoted works too
            assert "my notes.txt" in chip(app)
            await pilot.click("#doc-chip")  # a click removes it
            await pilot.pause(0.05)
            assert chip(app) == ""
            await type_line(pilot, "/detach")
            assert notices(app) == ["No document is attached"]
            await ask(pilot, "Plain question")
            assert engine.calls[-1]["messages"] == [{"role": "user", "content": "Plain question"}]
            await pilot.press("ctrl+l")
            await pilot.pause(0.05)
            await pilot.press("escape")  # cancelled: nothing attached
            await pilot.pause(0.05)
            assert chip(app) == "" and app.screen.__class__.__name__ != "AttachScreen"

    asyncio.run(run())


@pytest.mark.parametrize("case, content, line", [
    ("missing", None, "no such file"),
    ("directory", "dir", "it is a directory, not a file"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "it is a binary file, not text"),
    ("latin-1", "café au lait, crème brûlée\n".encode("latin-1"), "it is not UTF-8 text"),
    ("empty", b"", "the file is empty"),
    ("blank", b" \n\n\t\n", "the file is empty"),
])
def test_a_file_that_cannot_be_attached_is_one_line_in_the_chat(tmp_path, case, content, line):
    path = tmp_path / f"{case}.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    engine = FakeEngine()

    async def run():
        app = make_app(tmp_path, engine=engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await type_line(pilot, f"/attach {path}")
            assert notices(app) == [f"Cannot attach {path}: {line}"]
            assert chip(app) == "" and app.is_running
            assert not engine.calls and not app.store.messages(app.conversation.id)

    asyncio.run(run())


def test_a_document_past_the_context_window_is_refused_before_prefill(tmp_path):
    engine = FakeEngine()
    engine.lm.context_length = 120
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    big.write_text(" ".join(f"w{i}" for i in range(150)))
    small.write_text(" ".join(f"w{i}" for i in range(90)))
    big_tokens = len(engine.lm.tokenizer.encode(big.read_text()))

    async def run():
        app = make_app(tmp_path, engine=engine)
        async with app.run_test(size=(80, 24)) as pilot:
            # too long on its own: refused at /attach, naming the prompt, the document and the window
            await type_line(pilot, f"/attach {big}")
            prompt = len(engine.lm.encode_chat([{"role": "user", "content": composed("", big.read_text(),
                                                                                      "big.txt")}]))
            assert notices(app) == [
                f"big.txt does not fit: the prompt would be {prompt} tokens (the document {big_tokens}), past "
                "the model's context window of 120 tokens. /detach it or start a new conversation (Ctrl+N)"]
            assert chip(app) == ""
            # fits alone; with the conversation and a long question it does not: refused at Enter,
            # the question stays in the input and the document stays attached
            await type_line(pilot, f"/attach {small}")
            assert "small.txt" in chip(app) and len(notices(app)) == 1
            question = "Tell me " + "very " * 30 + "much"
            await type_line(pilot, question)
            assert len(notices(app)) == 2 and "small.txt does not fit: the prompt would be" in notices(app)[1]
            assert "context window of 120 tokens" in notices(app)[1]
            assert app.query_one("#prompt").value == question and "small.txt" in chip(app)
            assert not engine.calls and not app.store.messages(app.conversation.id)  # nothing was prefilled
            await ask(pilot, "Short?")  # a short question fits
            assert engine.calls[-1]["messages"][-1]["content"] == composed("Short?", small.read_text(), "small.txt")

    asyncio.run(run())


def test_attach_while_the_model_loads_is_one_line(tmp_path):
    import threading

    gate = threading.Event()

    def loader(progress):
        gate.wait(5)
        return FakeEngine()

    doc = tmp_path / "notes.txt"
    doc.write_text(DOC)

    async def run():
        app = ChatApp(loader=loader, db_path=tmp_path / "c.sqlite3", home=tmp_path, baseline=10.0)
        async with app.run_test(size=(80, 24)) as pilot:
            app.query_one("#prompt").value = f"/attach {doc}"
            await pilot.press("enter")
            await pilot.pause(0.02)
            assert len(notices(app)) == 1 and "still loading" in notices(app)[0] and chip(app) == ""
            gate.set()
            await until(pilot, lambda: app.engine is not None)
            await type_line(pilot, f"/attach {doc}")  # ready: now it attaches
            assert "notes.txt" in chip(app)

    asyncio.run(run())


def test_triforce_is_chosen_in_ctrl_o_with_its_budget_and_reaches_the_params(tmp_path):
    engine = FakeEngine()

    async def run():
        app = make_app(tmp_path, engine=engine, method="ar")
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.engine is not None)
            await pilot.press("ctrl+o")
            await pilot.pause(0.05)
            screen = app.screen
            assert screen.query_one("#field-budget").value == "512"  # the engine's default
            bottom = screen.query_one("#field-bottom")
            assert [value for _, value in bottom._options] == list(BOTTOMS) and bottom.value == "ngram"
            screen.query_one("#method").value = "triforce"
            screen.query_one("#field-budget").value = "256"
            screen.query_one("#field-gamma").value = "4"
            bottom.value = "none"
            await pilot.click("#save")
            await pilot.pause(0.05)
            conv = app.store.conversation(app.conversation.id)
            assert conv.method == "triforce" and conv.settings["budget"] == 256
            assert "TriForce budget 256 γ4 none" in str(app.query_one("#conv-header").render())
            await ask(pilot, "Why is the sky blue?")
            call = engine.calls[-1]
            assert call["method"] == "triforce"
            assert call["params"].options == resolve("triforce", {"budget": 256, "gamma": 4, "bottom": "none"})
            assert "TriForce done" in str(app.status.render())
            await pilot.press("ctrl+o")  # a budget below the engine's minimum is refused on Save
            await pilot.pause(0.05)
            app.screen.query_one("#field-budget").value = "8"
            await pilot.click("#save")
            await pilot.pause(0.05)
            assert app.screen.__class__.__name__ == "SettingsScreen"
            assert any("budget takes a whole number from 16" in n.message for n in app._notifications)
            await pilot.press("escape")

    asyncio.run(run())


def triforce_state(baseline=10.6) -> StreamState:
    state = StreamState("triforce", baseline_tps=baseline)
    state.feed(Event("token", 0, None, [1], "a", elapsed_s=0.2))
    state.feed(Event("token", 0, None, [2, 3, 4, 5, 6, 7], "bcdefg", drafted=6, accepted=5, elapsed_s=0.6))
    stats = GenerationStats(method="triforce", generated_tokens=7, decode_s=6 / 14.94, forward_passes=2,
                            drafted=6, accepted=5)
    stats.extra.update(budget=512, bottom="ngram", gamma=6, bottom_acceptance=0.62, middle_acceptance=0.95,
                       tokens_per_full_forward=6.7)
    state.feed(Event("done", stats=stats))
    return state


@pytest.mark.parametrize("width, want", [
    (140, "TriForce done │ 14.9 tok/s │ 6.70 tok/full fwd │ acc bottom 62% · middle 95% │ ×1.41 vs plain 10.6"),
    (80, "TriForce done │ 14.9 tok/s │ 6.70 tok/full fwd │ acc bot 62% · mid 95% │ ×1.41"),
    (76, "TriForce done │ 14.9 tok/s │ 6.70 tok/full fwd │ acc bot 62% · mid 95%"),
])
def test_status_bar_shows_both_triforce_levels(tmp_path, width, want):
    async def run():
        app = make_app(tmp_path, baseline=10.6)
        async with app.run_test(size=(width, 24)) as pilot:
            await until(pilot, lambda: app.engine is not None)
            app.status.show_state(triforce_state(), "triforce", "done")
            await pilot.pause(0.02)
            assert str(app.status.render()) == want
            assert len(want) <= width - 2  # the bar has one column of padding each side

    asyncio.run(run())
    line = triforce_state().summary_line()  # the line under the answer (saved with it)
    assert line == "7 tok · 14.9 tok/s · 6.70 tok/full fwd · acc bottom 62% · middle 95% · budget 512 · x1.41 vs plain"
    assert triforce_state().figures()["middle_acceptance"] == 0.95


def test_live_triforce_status_before_the_stats_arrive():
    state = StreamState("triforce", baseline_tps=10.0)
    state.feed(Event("token", 0, None, [1], "a", elapsed_s=0.2))
    state.feed(Event("token", 0, None, [2, 3, 4, 5], "bcde", drafted=6, accepted=3, elapsed_s=0.4))
    from tui.widgets import StatusBar

    parts = StatusBar._parts(state, "triforce", "writing", 0)
    assert parts[2:4] == ["2.50 tok/full fwd", "acc bottom – · middle 50%"]  # the top verify's drafts
