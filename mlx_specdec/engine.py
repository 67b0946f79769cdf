"""The engine's public API: load a model once, then stream `Event`s for prompts or chats.

    engine = Engine.load("default")
    for event in engine.generate("Why is the sky blue?", method="ar"):
        print(event.text, end="")

Everything the CLI, the bench and the chat app do goes through `Engine.generate`/`Engine.chat`.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

from .decoding import STRATEGIES, Event, GenerationParams, stream_events
from .errors import UserError
from .model.loader import LoadedModel, load_model


class UnknownMethod(UserError):
    pass


def check_method(method: str) -> None:
    if method not in STRATEGIES:
        raise UnknownMethod(f"unknown method {method!r} (choose from {', '.join(STRATEGIES)})")


class Engine:
    def __init__(self, lm: LoadedModel):
        self.lm = lm

    @classmethod
    def load(cls, model: Optional[str] = "default", dtype: str = "auto") -> "Engine":
        return cls(load_model(model, dtype=dtype))

    @property
    def methods(self) -> List[str]:
        return list(STRATEGIES)

    def generate_ids(self, prompt_ids: List[int], method: str = "ar",
                     params: Optional[GenerationParams] = None) -> Iterator[Event]:
        check_method(method)
        return stream_events(self.lm, list(prompt_ids), STRATEGIES[method], params or GenerationParams(), method)

    def generate(self, prompt: str, method: str = "ar", params: Optional[GenerationParams] = None,
                 chat_template: bool = True) -> Iterator[Event]:
        return self.generate_ids(self.lm.encode_prompt(prompt, chat=chat_template), method, params)

    def chat(self, messages: List[dict], method: str = "ar",
             params: Optional[GenerationParams] = None) -> Iterator[Event]:
        """messages: [{"role": "user"|"assistant"|"system", "content": str}, ...]"""
        return self.generate_ids(self.lm.encode_chat(messages), method, params)
