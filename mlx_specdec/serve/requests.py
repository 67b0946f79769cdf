"""OpenAI request bodies -> what the engine runs, and errors in OpenAI's shape.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

400 for a malformed body or a bad field, 401 without the API key, 404 for another model's name,
413 for a prompt past the context window. Standard fields: model, messages (chat) or prompt
(completions), max_tokens / max_completion_tokens, temperature, top_p, seed, frequency_penalty,
presence_penalty, stop, stream, stream_options.include_usage, n (1 only); a sampling field left out
takes the model's default (sampling_defaults.py). Extensions: repetition_penalty and
repetition_context_size (mlx-lm's), `method` (ar, redrafter, apar, triforce, ...)
and that method's settings by their names (beam_width, budget, ...), parsed and bounded by the
method registry (settings.py), as the CLI parses its flags: a bad value is a 400 naming the field.
Thinking models (Qwen3): `thinking` (on/off, or a boolean) or vLLM's and SGLang's
`chat_template_kwargs: {"enable_thinking": false}` sets the template's switch; `separate_reasoning`
(SGLang's name; default false) returns the thought as `reasoning_content` and `content` the answer alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..decoding import GenerationParams
from ..penalties import Unsupported, check_method
from ..sampling_defaults import fill
from ..settings import SAMPLING, SettingError, all_settings, resolve

DEFAULT_MAX_TOKENS = 256
MAX_BODY_BYTES = 4 << 20  # a request body past this is a 413, read no further
MAX_STOP_CHARS = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    prompt_ids: List[int]
    method: str
    params: GenerationParams
    stream: bool
    include_usage: bool
    separate_reasoning: bool = False  # the thought as reasoning_content, content the answer alone
    opens_thought: bool = False  # the prompt leaves a <think> open: the answer starts in the thought


def _sampling(body: dict, name: str, field: Optional[str] = None):
    """A sampling field by the registry's type and bounds (None when absent)."""
    field = field or name
    value = body.get(field)
    if value is None:
        return None
    setting = next(s for s in SAMPLING if s.name == name)
    try:
        return setting.parse(value, json=True)
    except SettingError as error:
        raise ApiError(400, f"'{field}' {error.detail}", field) from None


def _thinking(body: dict, given: Optional[bool]) -> Optional[bool]:
    """The template's thinking switch: `thinking`, or chat_template_kwargs.enable_thinking (vLLM's
    and SGLang's field; the only template argument taken); the two must agree where both are given."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return given
    if not isinstance(kwargs, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    other = sorted(k for k in kwargs if k != "enable_thinking")
    if other:
        raise ApiError(400, f"'chat_template_kwargs' takes enable_thinking only, not {other[0]!r}",
                       "chat_template_kwargs")
    value = kwargs.get("enable_thinking")
    if value is None:
        return given
    if not isinstance(value, bool):
        raise ApiError(400, "'chat_template_kwargs.enable_thinking' must be a boolean",
                       "chat_template_kwargs.enable_thinking")
    if given is not None and given != value:
        raise ApiError(400, "'thinking' and 'chat_template_kwargs.enable_thinking' disagree", "thinking")
    return value


def _messages(body: dict) -> List[Dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user or assistant", f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts (with string text) are supported",
                               f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({"role": message["role"], "content": content})
    return out


def parse(body, lm, model_id: str, methods: List[str], default_method: str, chat: bool,
          aliases: Sequence[str] = (), defaults: Optional[Dict[str, object]] = None) -> Request:
    """A validated request; raises ApiError. `model` may be the served id or an alias (the spec the
    server was started with, e.g. 'default'); defaults: the sampling a field left out takes."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id and model not in aliases:
        raise ApiError(404, f"the model '{model}' does not exist here; this server serves '{model_id}'", "model",
                       code="model_not_found")
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise ApiError(400, "'n' must be 1", "n")
    sampling = {s.name: _sampling(body, s.name) for s in SAMPLING}
    sampling["max_tokens"] = _sampling(body, "max_tokens", "max_completion_tokens") or sampling["max_tokens"]
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stop)):
        raise ApiError(400, f"'stop' must be a string or a list of up to 4 strings of at most {MAX_STOP_CHARS} "
                       "characters", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    method = body.get("method", default_method)
    if not isinstance(method, str) or method not in methods:
        raise ApiError(400, f"unknown method {method!r} (this server runs {', '.join(methods)})", "method")
    known = all_settings()
    try:
        options = resolve(method, {k: v for k, v in body.items() if k in known}, json=True)
    except SettingError as error:
        raise ApiError(400, f"'{error.name}' {error.detail}", error.name) from None
    sampling["thinking"] = _thinking(body, sampling["thinking"]) if chat else None
    separate = body.get("separate_reasoning", False)
    if not isinstance(separate, bool):
        raise ApiError(400, "'separate_reasoning' must be a boolean", "separate_reasoning")
    if chat:
        ids = lm.encode_chat(_messages(body), thinking=sampling["thinking"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", "prompt")
        ids = lm.encode_prompt(prompt, chat=False)
    window = lm.context_length
    wanted = sampling.pop("max_tokens") or DEFAULT_MAX_TOKENS
    if len(ids) >= window:
        raise ApiError(413, f"the prompt has {len(ids)} tokens; the context window of {model_id} is {window}",
                       "messages" if chat else "prompt", code="context_length_exceeded")
    given = {name: value for name, value in sampling.items() if value is not None}
    try:
        check_method(method, GenerationParams(**given))
    except Unsupported as error:
        raise ApiError(400, str(error), error.param) from None
    given = fill(given, defaults or {}, method)
    params = GenerationParams(max_tokens=min(wanted, window - len(ids)), stop=tuple(stop or ()), options=options,
                              **given)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = (stream_options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    opens = False
    if chat and separate:
        from ..reasoning import prompt_opens_thought

        opens = prompt_opens_thought(lm.tokenizer, ids)
    return Request(ids, method, params, stream, include_usage, separate and chat, opens)
