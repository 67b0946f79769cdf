"""The Textual chat app. It talks to the engine only through `Engine.chat(...)`'s event stream
(see `tui.stream`), and counts an attached document's tokens with `engine.lm` (its tokenizer,
chat encoding and context window: `tui.documents`), so tests drive it with `tui.fake.FakeEngine`
as well as the real engine.

`tui.store`, `tui.stream`, `tui.hints`, `tui.documents` and `tui.fake` never import
Textual; `tui.app` does.
"""
