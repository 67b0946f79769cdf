"""`mlx-specdec serve`: an OpenAI-compatible HTTP API over one loaded model (Starlette on uvicorn).

    POST /v1/chat/completions   chat (streaming as server-sent events, or one JSON response)
    POST /v1/completions        raw text completion
    GET  /v1/models             the one served model, with the methods it supports (and why not)
    GET  /health                {"status": "ok", "waiting": queued requests}

Every method of the engine, losslessly, picked per request (`method`, extension field). `usage`
carries the token counts; `speculation` the method's figures (tokens per forward, drafts accepted
of drafted, the method's own statistics); `sampling` the sampling the answer was written with
(the request's fields, the rest the model's defaults). Requests queue first come first served on one
generation thread (worker.py); a client that disconnects is stopped at its next event and its
cache rolled back. The engine keeps a prompt cache over several conversations (cache/prefix.py:
LRU, bounded in entries and bytes): a follow-up that repeats the earlier messages does not prefill
them again, and `usage.prompt_tokens_details.cached_tokens` says how many it skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Optional

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import UserError
from ..reasoning import ThoughtSplitter, split_thought
from ..sampling_defaults import in_force
from .requests import MAX_BODY_BYTES, ApiError, parse
from .worker import DONE, GenerationWorker, Job


def _speculation(stats) -> dict:
    extra = {k: v for k, v in stats.extra.items() if isinstance(v, (int, float, str, bool))}
    if isinstance(stats.extra.get("auto"), dict):  # `auto`: what it chose and why
        extra["auto"] = dict(stats.extra["auto"])
    return dict(method=stats.method, forward_passes=stats.forward_passes,
                tokens_per_forward=round(stats.tokens_per_forward, 3), drafted=stats.drafted,
                accepted=stats.accepted, **extra)


def _finish(stats, job: Job) -> str:
    """stop (EOS or a stop string), length (max_tokens or the window), or cancelled (the client left,
    or the server is stopping)."""
    if job.cancelled.is_set():
        return "cancelled"
    return "length" if getattr(stats, "finish_reason", "") == "length" else "stop"


async def _next_item(job: Job, request: HttpRequest, state: dict):
    """The job's next event; None once the client has gone (the job is then cancelled). A
    non-streaming client that leaves is noticed within half a second, events or not."""
    while True:
        if "getter" not in state:
            state["getter"] = asyncio.ensure_future(job.events.get())
        done, _ = await asyncio.wait([state["getter"]], timeout=0.5)
        now = time.monotonic()
        if not done or now - state.get("checked", now) >= 0.5 or "checked" not in state:
            state["checked"] = now
            if await request.is_disconnected():
                job.cancelled.set()
                state.pop("getter").cancel()
                return None
        if done:
            return state.pop("getter").result()


def _usage(prompt_tokens: int, stats) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens resumed from the
    prompt cache (a method that cannot resume from it reports 0)."""
    completion = stats.generated_tokens if stats is not None else 0
    cached = getattr(stats, "cached_tokens", 0) if stats is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def create_app(worker: GenerationWorker, method: str = "ar", api_key: Optional[str] = None,
               model_spec: Optional[str] = None) -> Starlette:
    """worker: a GenerationWorker whose engine has loaded (`wait_ready`); model_spec: what the
    server was started with (`--model`), accepted as `model` beside the served id."""
    engine = worker.wait_ready()
    model_id = engine.lm.name
    methods = list(engine.methods)
    defaults = engine.sampling_defaults[0]

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def authorised(request: HttpRequest) -> bool:
        return api_key is None or request.headers.get("authorization", "") == f"Bearer {api_key}"

    async def read(request: HttpRequest, chat: bool):
        if not authorised(request):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           kind="authentication_error", code="invalid_api_key")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}")
        except RecursionError:
            raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
        # the base model's tokenizer and window (no MLX here: an APAR adapter loads on the generation thread)
        return parse(body, engine.lm, model_id, methods, method, chat, aliases=[model_spec] if model_spec else [],
                     defaults=defaults)

    async def complete(request: HttpRequest, chat: bool):
        try:
            req = await read(request, chat)
        except ApiError as exc:
            return error(exc)
        job = worker.submit(Job(req.prompt_ids, req.method, req.params, asyncio.get_running_loop()))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if req.stream:
            return StreamingResponse(_stream(request, job, req, ident, created, kind, chat, model_id),
                                     media_type="text/event-stream")
        text, stats, state = [], None, {}
        try:
            while True:
                item = await _next_item(job, request, state)
                if item is None:  # the client left: nobody reads an answer
                    return JSONResponse({}, status_code=499)
                if item is DONE:
                    break
                if isinstance(item, Exception):
                    return error(_as_api_error(item))
                if item.kind == "token" and item.thread_id == 0:
                    text.append(item.text)
                elif item.kind == "done":
                    stats = item.stats
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        content = "".join(text)
        choice = {"index": 0, "finish_reason": _finish(stats, job), "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": content}} if chat else {"text": content})
        if req.separate_reasoning:  # the thought apart: content is the answer alone
            thought, answer = split_thought(content, req.opens_thought)
            choice["message"].update(content=answer, reasoning_content=thought)
        body = {"id": ident, "object": kind, "created": created, "model": model_id, "choices": [choice],
                "usage": _usage(len(req.prompt_ids), stats), "sampling": in_force(req.params)}
        if stats is not None:
            body["speculation"] = _speculation(stats)
        return JSONResponse(body)

    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    async def models(request: HttpRequest):
        if not authorised(request):
            return error(ApiError(401, "a valid API key is required", kind="authentication_error",
                                  code="invalid_api_key"))
        methods_info = {name: {"supported": why is None, **({"why_not": why} if why else {})}
                        for name, why in worker.support.items()}
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                                         "owned_by": "mlx-specdec", "methods": methods_info}]})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.stop()  # the generation thread ends after the request it is on

    async def health(request: HttpRequest):
        store = getattr(engine, "prefix_store", None)
        cache = {"entries": store.entries, "bytes": store.nbytes, "max_bytes": store.max_bytes} if store else None
        return JSONResponse({"status": "ok", "model": model_id, "waiting": worker.waiting, "running": worker.running,
                             "stalled": worker.stalled, "prompt_cache": cache})

    app = Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"]),
                            Route("/health", health, methods=["GET"])],
                    lifespan=lifespan)
    return app


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, UserError):
        return ApiError(400, str(exc))
    return ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")


async def _stream(request: HttpRequest, job: Job, req, ident: str, created: int, kind: str, chat: bool, model_id: str):
    """Server-sent events: one chunk per text delta, a last chunk with the finish reason, the usage
    (with stream_options.include_usage), then [DONE]. A client gone at a chunk cancels the job."""
    def chunk(delta: Optional[str], finish: Optional[str] = None, extra: Optional[dict] = None,
              field: str = "content") -> str:
        if chat:
            choice = {"index": 0, "delta": {} if delta is None else {field: delta}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish}
        body = {"id": ident, "object": kind + ".chunk" if chat else kind, "created": created, "model": model_id,
                "choices": [choice]}
        body.update(extra or {})
        return f"data: {json.dumps(body)}\n\n"

    stats = None
    splitter = ThoughtSplitter(req.opens_thought) if req.separate_reasoning else None

    def deltas(text: str, end: bool = False):
        """A text delta as chunks: the thought's as reasoning_content, the answer's as content."""
        if splitter is None:
            if text:
                yield chunk(text)
            return
        for field, part in zip(("reasoning_content", "content"), splitter.flush() if end else splitter.feed(text)):
            if part:
                yield chunk(part, field=field)

    try:
        if chat:
            yield f"data: {json.dumps({'id': ident, 'object': kind + '.chunk', 'created': created, 'model': model_id, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}, 'finish_reason': None}]})}\n\n"
        while True:
            item = await job.events.get()
            if item is DONE:
                break
            if isinstance(item, Exception):
                yield f"data: {json.dumps(_as_api_error(item).body())}\n\n"
                break
            if item.kind == "token" and item.thread_id == 0 and item.text:
                for line in deltas(item.text):
                    yield line
            elif item.kind == "done":
                stats = item.stats
            if await request.is_disconnected():
                job.cancelled.set()
                return
        for line in deltas("", end=True):
            yield line
        last = {"sampling": in_force(req.params)}
        if stats is not None:
            last["speculation"] = _speculation(stats)
        yield chunk(None, _finish(stats, job), last)
        if req.include_usage:
            usage = {"id": ident, "object": kind + ".chunk" if chat else kind, "created": created, "model": model_id,
                     "choices": [], "usage": _usage(len(req.prompt_ids), stats)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if stats is None:  # the response ended early (client gone, server stopping): stop the job
            job.cancelled.set()
