"""The Textual chat app. It talks to the engine only through `Engine.chat(...)`'s event stream
(see `tui.stream`), so tests drive it with `tui.fake.FakeEngine` as well as the real engine.

`tui.store`, `tui.stream`, `tui.baseline`, `tui.hints` and `tui.fake` never import Textual; `tui.app` does.
"""
