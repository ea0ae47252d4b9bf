"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over a generation backend: one
``LazyLLM`` in this process (``LocalBackend``), or Ray Serve replicas behind a deployment
handle (``lazyllm.integrations.ray_serve.RayBackend``). Both get the same app, endpoints,
validation, errors and metrics: ``create_app(llm_or_backend, ...)``.

Endpoints:

- ``POST /v1/chat/completions``: OpenAI's chat completions, streaming (server-sent
  events) or not; ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens
  whose KV was reused.
- ``GET /v1/models`` (and ``/v1/models/{id}``): the one model served.
- ``GET /health``: liveness. ``GET /metrics``: Prometheus text (cache hits, misses,
  resident bytes, pool pages; TTFT, queue-time and duration histograms; requests by
  status). Neither needs the API key.

Documents travel as chunks in a ``documents`` field next to ``messages`` (what the
``openai`` client sends with ``extra_body={"documents": [...]}`` and LangChain's
``ChatOpenAI(extra_body=...)`` likewise): each item is a string or
``{"text": ..., "id": ..., "metadata": {...}}`` and becomes a ``lazyllm.Chunk``, its KV
cached and reused by later requests at any position. Without it a request is plain chat.
The messages become the question, system prompt and history exactly as the in-process
adapters read them (``integrations._common.request_from_messages``).

Safe by default: ``main`` binds to 127.0.0.1; an API key, when set, is required as
``Authorization: Bearer <key>`` on ``/v1``; request bodies and ``max_tokens`` are capped;
bad input gets OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``)
with status 400, 401, 404, 413 or 429; a streaming client that disconnects cancels its
request (``GenerationStream.cancel``) and its pages are released.

A backend is anything with the ``Backend`` interface below (five members); the
translation is also available as plain functions: ``validate_body`` (bytes ->
``ChatCompletionRequest``), ``parse_chat_request`` (-> question, chunks, system, sampling),
``completion_response``, ``stream_chunk``, ``usage_json``, ``sse``, ``error_body`` and
``error_from_exception``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lazyllm import Chunk, GenerationOutput, LazyLLM
from lazyllm.api import TextStream
from lazyllm.errors import CacheCapacityError, ContextLengthError, InvalidRequestError, RequestCancelled

from ._common import request_from_messages

log = logging.getLogger("lazyllm.server")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_CONCURRENCY = 256

# -- errors ----------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered with OpenAI's error body and ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_from_exception(e: BaseException) -> APIError:
    """The ``APIError`` (status and body) for an exception raised while serving a request:
    lazyllm's bad-input errors are 400 (``ContextLengthError`` with code
    ``context_length_exceeded``), a KV pool too small for the request 503, anything else 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e))
    if isinstance(e, CacheCapacityError):
        return APIError(503, str(e), code="kv_cache_capacity")
    if isinstance(e, RequestCancelled):
        return APIError(408, f"request {e}", code="cancelled", type="timeout_error")
    return APIError(500, "internal server error", type="server_error")


def _json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(), status_code=status,
                    media_type="application/json", headers=headers)


def _error_response(e: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return _json_response(e.body(), e.status, headers)


# -- the request body ------------------------------------------------------------------

class DocumentIn(BaseModel):
    """One document of the ``documents`` extension (a plain string is accepted too)."""

    model_config = ConfigDict(extra="forbid")
    text: str
    id: str | int | None = None
    metadata: dict[str, Any] | None = None


class ChatMessageIn(BaseModel):
    """One chat message. ``content`` is a string, ``null`` (an assistant turn with tool
    calls) or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The body of ``POST /v1/chat/completions``: OpenAI's fields that apply to one
    text answer, ``top_k`` (as vLLM) and ``documents`` (the chunks). Unknown fields are
    ignored; known features lazyllm does not have (tools, ``n`` > 1, logprobs, penalties,
    non-text response formats) are refused with 400 rather than silently ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    documents: list[str | DocumentIn] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "DocumentIn", "ChatMessageIn",
               "StreamOptions"}


def _param(loc: tuple) -> str | None:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in _UNION_TAGS or "[" in str(p) or str(p).startswith(("function-", "literal")):
            continue  # pydantic's name of a union member, not a field
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or None


def _first_error(e: ValidationError) -> dict[str, Any]:
    """The most specific error: where a value matches no member of a union (``str`` or an
    object), pydantic reports one error per member; the deepest names the field."""
    errors = e.errors(include_url=False)
    return max(errors, key=lambda err: len((_param(tuple(err["loc"])) or "").replace("[", ".").split(".")))


def validate_body(raw: bytes | str) -> ChatCompletionRequest:
    """Parse and validate a request body (JSON, strict types: ``"5"`` is not a number).
    Raises ``APIError(400)`` naming the offending field (``param``, e.g. ``messages[0].role``)."""
    try:
        return ChatCompletionRequest.model_validate_json(raw, strict=True)
    except ValidationError as e:
        err = _first_error(e)
        if err["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
        param = _param(tuple(err["loc"]))
        if param is None and err["type"] == "model_type":
            raise APIError(400, "the body must be a JSON object") from None
        msg = err["msg"] if param is None else f"{param}: {err['msg']}"
        raise APIError(400, msg, param=param) from None


class ChatRequest(NamedTuple):
    """What one chat completion asks of the engine: ``llm.generate(question, chunks,
    system, **sampling)``."""

    question: str
    chunks: list[Chunk]
    system: str | None
    sampling: dict[str, Any]


def _unsupported(body: ChatCompletionRequest) -> None:
    def no(param: str, what: str) -> None:
        raise APIError(400, f"{param}: {what} is not supported by lazyllm", param=param, code="unsupported")

    if body.n not in (None, 1):
        no("n", "more than one choice")
    if body.tools or body.functions:
        no("tools" if body.tools else "functions", "tool calling")
    if body.logprobs or body.top_logprobs:
        no("logprobs", "returning log-probabilities")
    if body.presence_penalty or body.frequency_penalty:
        no("presence_penalty" if body.presence_penalty else "frequency_penalty", "a repetition penalty")
    if body.logit_bias:
        no("logit_bias", "a logit bias")
    if body.response_format and body.response_format.get("type", "text") != "text":
        no("response_format", f"response_format {body.response_format.get('type')!r}")


def _content_text(m: ChatMessageIn, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            param = f"messages[{i}].content[{j}]"
            raise APIError(400, f"{param}: lazyllm takes text content parts ({{'type': 'text', 'text': ...}}); "
                                f"got type {kind!r} (send documents in `documents`)", param=param)
        texts.append(part["text"])
    return "".join(texts)


def documents_to_chunks(documents: list[str | DocumentIn | dict] | None) -> list[Chunk]:
    """The ``documents`` extension as ``lazyllm.Chunk``s, in order."""
    chunks = []
    for d in documents or []:
        if isinstance(d, str):
            chunks.append(Chunk(d))
        else:
            if isinstance(d, dict):
                d = DocumentIn.model_validate(d)
            chunks.append(Chunk(d.text, id=None if d.id is None else str(d.id), metadata=dict(d.metadata or {})))
    return chunks


def parse_chat_request(body: ChatCompletionRequest | dict | bytes | str, *,
                       max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT,
                       default_max_tokens: int = DEFAULT_MAX_TOKENS,
                       default_temperature: float = 0.0) -> ChatRequest:
    """``(question, chunks, system, sampling)`` of a chat completion body.

    ``system``/``developer`` messages join into the system prompt; the last ``user``
    message with text is the question and the other turns are folded into it as a
    transcript (``integrations._common``); ``documents`` become the chunks. ``max_tokens``
    (or ``max_completion_tokens``) defaults to ``min(default_max_tokens,
    max_new_tokens_limit)`` and may not exceed the limit; ``temperature`` defaults to
    ``default_temperature`` (greedy). Raises ``APIError(400)`` for anything malformed.
    """
    if isinstance(body, (bytes, str)):
        body = validate_body(body)
    elif isinstance(body, dict):
        try:
            body = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = _first_error(e)
            param = _param(tuple(err["loc"]))
            raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
    _unsupported(body)
    turns = []
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else "tool" if m.role == "function" else m.role
        turns.append((role, _content_text(m, i), []))
    try:
        req = request_from_messages(turns)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="messages") from None
    try:
        chunks = documents_to_chunks(body.documents)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="documents") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, max_new_tokens_limit)
    elif max_tokens > max_new_tokens_limit:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{param}={max_tokens} is above this server's limit of {max_new_tokens_limit}",
                       param=param)
    stop = body.stop
    if isinstance(stop, list) and any(s == "" for s in stop) or stop == "":
        raise APIError(400, "stop: stop strings must not be empty", param="stop")
    sampling: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": default_temperature if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k is None else body.top_k,
        "seed": body.seed,
        "stop": stop or None,
    }
    return ChatRequest(req.question, chunks + req.chunks, req.system, sampling)


# -- the response bodies -----------------------------------------------------------------

def usage_json(out: GenerationOutput) -> dict[str, Any]:
    """OpenAI's ``usage`` object, ``prompt_tokens_details.cached_tokens`` included."""
    u = out.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _timings(out: GenerationOutput) -> dict[str, Any]:
    return {"ttft_s": out.ttft_s, "queue_s": out.queue_s, "total_s": out.total_s,
            "cached_chunk_tokens": out.usage.cached_chunk_tokens, "chunk_ids": list(out.chunk_ids)}


def completion_response(out: GenerationOutput, *, model: str, request_id: str | None = None,
                        created: int | None = None) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` object for one result; a ``lazyllm`` field adds TTFT,
    queue time and the chunk ids (clients ignore it)."""
    return {
        "id": request_id or new_request_id(),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                     "logprobs": None, "finish_reason": out.finish_reason}],
        "usage": usage_json(out),
        "system_fingerprint": None,
        "lazyllm": _timings(out),
    }


def stream_chunk(request_id: str, created: int, model: str, *, content: str | None = None,
                 role: str | None = None, finish_reason: str | None = None,
                 usage: dict[str, Any] | None = None, out: GenerationOutput | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``: a delta (``role`` and/or ``content``), the closing
    delta (``finish_reason``), or, with ``usage``, the final usage chunk (no choices; with
    ``out``, a ``lazyllm`` field adds TTFT, queue time and chunk ids)."""
    obj: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": None}
    if usage is not None:
        obj["choices"] = []
        obj["usage"] = usage
        if out is not None:
            obj["lazyllm"] = _timings(out)
        return obj
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    obj["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return obj


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (or the literal ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def new_request_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


# -- metrics -----------------------------------------------------------------------------

class _CacheCollector:
    """Reads the backend's ``cache_stats()`` (and ``engine_stats()`` when it has one) at
    scrape time."""

    COUNTERS = {"hits": "chunk lookups found in the cache", "misses": "chunk lookups not found",
                "reused_tokens": "prompt tokens whose KV was reused", "computed_tokens": "chunk tokens computed",
                "evictions": "cached chunks evicted", "evicted_tokens": "tokens of evicted chunks"}
    GAUGES = {"resident_bytes": "bytes of KV held by cached chunks", "resident_tokens": "tokens of cached chunks",
              "entries": "cached chunks", "pinned_entries": "cached chunks in use by a running request",
              "free_pages": "free pages of the KV pool", "pool_pages": "pages of the KV pool",
              "pool_bytes": "bytes of the KV pool", "hit_rate": "hits / lookups"}

    def __init__(self, backend: Backend):
        self.backend = backend

    def collect(self):
        s = self.backend.cache_stats()
        for k, doc in self.COUNTERS.items():
            if k in s:
                yield CounterMetricFamily(f"lazyllm_cache_{k}", doc, value=s[k])
        for k, doc in self.GAUGES.items():
            if k in s:
                yield GaugeMetricFamily(f"lazyllm_cache_{k}", doc, value=s[k])
        engine_stats = getattr(self.backend, "engine_stats", None)
        engine_metrics = (engine_stats() if engine_stats is not None else None) or {}
        for k in ("requests", "failed", "cancelled", "preemptions"):
            if isinstance(engine_metrics.get(k), (int, float)):
                yield CounterMetricFamily(f"lazyllm_engine_{k}", f"engine {k}", value=engine_metrics[k])


_LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of their own (one per app), over a
    ``Backend`` (or a ``LazyLLM``)."""

    def __init__(self, backend: Backend | LazyLLM):
        self.registry = CollectorRegistry()
        self.registry.register(_CacheCollector(as_backend(backend)))
        self.ttft = Histogram("lazyllm_ttft_seconds", "time from submission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("lazyllm_queue_seconds", "time waiting to be scheduled", buckets=_LATENCY_BUCKETS,
                               registry=self.registry)
        self.duration = Histogram("lazyllm_request_duration_seconds", "engine time of a request",
                                  buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("lazyllm_http_requests", "chat completion requests by status and mode",
                                ["status", "stream"], registry=self.registry)
        self.tokens = Counter("lazyllm_tokens", "tokens by kind", ["kind"], registry=self.registry)
        self.in_flight = Gauge("lazyllm_requests_in_flight", "chat completions being served",
                               registry=self.registry)
        self.disconnects = Counter("lazyllm_client_disconnects", "streams whose client left before the end",
                                   registry=self.registry)

    def observe(self, out: GenerationOutput) -> None:
        self.ttft.observe(out.ttft_s)
        self.queue.observe(out.queue_s)
        self.duration.observe(out.total_s)
        self.tokens.labels("prompt").inc(out.usage.prompt_tokens)
        self.tokens.labels("cached").inc(out.usage.cached_tokens)
        self.tokens.labels("completion").inc(out.usage.completion_tokens)


# -- streaming: engine thread -> event loop ------------------------------------------------

async def _event_batches(queue: asyncio.Queue) -> AsyncIterator[list[tuple[str, Any]]]:
    """The events of ``queue`` as they come, each batch every event already queued (one write
    for several tokens when the client reads slower than the engine decodes); the last batch
    ends with ``done`` or ``error``."""
    while True:
        batch = [await queue.get()]
        while batch[-1][0] == "delta" and not queue.empty():
            batch.append(queue.get_nowait())
        yield batch
        if batch[-1][0] != "delta":
            return


class _Pump:
    """Iterates a ``TextStream`` on a worker thread and hands its events to the event
    loop: ``("delta", text)``, then ``("done", GenerationOutput)`` or ``("error", exc)``.
    ``stop()`` (any thread, never blocks) cancels the request; the worker then closes the
    stream, which returns once the engine has released the request's pages."""

    def __init__(self, stream: TextStream, executor: ThreadPoolExecutor, loop: asyncio.AbstractEventLoop):
        self.stream, self.loop = stream, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopped = threading.Event()
        self.finished = loop.run_in_executor(executor, self._run)

    def _put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _run(self) -> None:
        try:
            if self.stopped.is_set():
                return
            for delta in self.stream:
                if self.stopped.is_set():
                    return
                self._put(("delta", delta))
            self._put(("done", self.stream.output))
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which answers with it
            self._put(("error", e))
        finally:
            self.stream.close()

    def stop(self) -> None:
        self.stopped.set()
        # TextStream's own cancel flag (a threading.Event): the engine drops the request at
        # its next step, even while the worker waits for its next event
        self.stream.cancel()

    def batches(self) -> AsyncIterator[list[tuple[str, Any]]]:
        return _event_batches(self.queue)


# -- backends ----------------------------------------------------------------------------------

class GenerationStream(Protocol):
    """One streaming request of a ``Backend``.

    ``async for item in stream`` submits the request (nothing is submitted before) and
    yields its text deltas (``str``), then its ``GenerationOutput`` as the last item; a
    failed request raises (lazyllm's errors, mapped by ``error_from_exception``).
    ``cancel()`` returns at once, may be called from the event loop while a task iterates
    the stream, and makes the backend drop the request and release its KV pages: the app
    calls it when a streaming client disconnects."""

    def __aiter__(self) -> AsyncIterator[str | GenerationOutput]: ...

    def cancel(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """What ``create_app`` serves. ``LocalBackend`` (one ``LazyLLM`` in this process) and
    ``ray_serve.RayBackend`` (a Ray Serve deployment handle) implement it.

    - ``model_name``: the model's id (the app also accepts the ``model_name`` it is given).
    - ``stream(question, chunks, system, **sampling)``: a ``GenerationStream``. Called in
      the request handler; a backend that can validate the request there raises bad input
      before the response starts (HTTP 400), one that cannot raises it from the stream
      (an error event).
    - ``async generate(question, chunks, system, **sampling) -> GenerationOutput``;
      cancelling the awaiting task cancels the request.
    - ``async model_info() -> dict``: ``max_context`` (int or None) and any other fields for
      the ``/v1/models`` card (``reuse``, ``chunk_context``).
    - ``cache_stats() -> dict``: ``LazyLLM.cache_stats()``'s counters, summed over replicas
      where there are several; read at every ``/metrics`` scrape, so cheap and without I/O
      (the latest figures the backend holds; ``{}`` when it has none yet).

    Optional: ``engine_stats() -> dict`` (``requests``, ``failed``, ``cancelled``,
    ``preemptions``) and ``close()`` (called at the app's shutdown when the app made the
    backend). ``sampling`` is ``parse_chat_request``'s: ``max_new_tokens``, ``temperature``,
    ``top_p``, ``top_k``, ``seed``, ``stop``."""

    model_name: str

    def stream(self, question: str, chunks: list[Chunk], system: str | None,
               **sampling: Any) -> GenerationStream: ...

    async def generate(self, question: str, chunks: list[Chunk], system: str | None,
                       **sampling: Any) -> GenerationOutput: ...

    async def model_info(self) -> dict[str, Any]: ...

    def cache_stats(self) -> dict[str, Any]: ...


class _LocalStream:
    """``GenerationStream`` of a ``TextStream``: a worker thread iterates it (``_Pump``)."""

    def __init__(self, stream: TextStream, executor: ThreadPoolExecutor):
        self.stream, self.executor = stream, executor
        self.pump: _Pump | None = None
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[str | GenerationOutput]:
        if self.cancelled:
            raise RequestCancelled("cancelled before it started")
        self.pump = _Pump(self.stream, self.executor, asyncio.get_running_loop())
        try:
            async for batch in self.pump.batches():
                for kind, val in batch:
                    if kind == "error":
                        raise val
                    yield val
        finally:
            self.pump.stop()  # a no-op once the request has finished

    def cancel(self) -> None:
        self.cancelled = True
        if self.pump is not None:
            self.pump.stop()


class LocalBackend:
    """The ``Backend`` of one ``LazyLLM`` in this process. Each running request holds one
    thread of its own pool (``max_workers``) while it iterates the engine's events; a
    stream is validated and tokenized by ``stream()``, so bad input raises before the
    response starts. ``close()`` stops the pool (the ``LazyLLM`` stays open: its owner
    closes it)."""

    def __init__(self, llm: LazyLLM, *, max_workers: int = DEFAULT_MAX_CONCURRENCY):
        self.llm = llm
        self.model_name = str(llm.model_name)
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="lazyllm-server")

    def stream(self, question: str, chunks: list[Chunk], system: str | None, **sampling: Any) -> _LocalStream:
        return _LocalStream(self.llm.stream(question, chunks, system, **sampling), self.executor)

    async def generate(self, question: str, chunks: list[Chunk], system: str | None,
                       **sampling: Any) -> GenerationOutput:
        stream = self.llm.stream(question, chunks, system, **sampling)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, _collect, stream)
        except asyncio.CancelledError:
            stream.cancel()
            raise

    async def model_info(self) -> dict[str, Any]:
        return {"max_context": self.llm.model.spec.max_context, "reuse": self.llm.reuse,
                "chunk_context": self.llm.chunk_context}

    def cache_stats(self) -> dict[str, Any]:
        return self.llm.cache_stats()

    def engine_stats(self) -> dict[str, Any]:
        return dict(getattr(getattr(self.llm, "engine", None), "metrics", None) or {})

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def as_backend(llm_or_backend: LazyLLM | Backend, **local_kwargs: Any) -> Backend:
    """``llm_or_backend`` itself when it is a ``Backend``, else a ``LocalBackend`` of it."""
    if isinstance(llm_or_backend, LazyLLM) or not isinstance(llm_or_backend, Backend):
        return LocalBackend(llm_or_backend, **local_kwargs)
    return llm_or_backend


class _Relay:
    """Reads a ``GenerationStream`` in a task of its own into a queue, so that the writer
    sends every event already there in one write: ``("delta", text)``, then
    ``("done", GenerationOutput)`` or ``("error", exc)``."""

    def __init__(self, stream: GenerationStream):
        self.stream = stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        items = aiter(self.stream)
        try:
            async for item in items:
                if isinstance(item, str):
                    self.queue.put_nowait(("delta", item))
                else:
                    self.queue.put_nowait(("done", item))
                    return
            self.queue.put_nowait(("error", RuntimeError("the backend's stream ended without a result")))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the writer, which answers with it
            self.queue.put_nowait(("error", e))
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()

    def stop(self) -> None:
        self.stream.cancel()
        self.task.cancel()

    def batches(self) -> AsyncIterator[list[tuple[str, Any]]]:
        return _event_batches(self.queue)


# -- the app ---------------------------------------------------------------------------------

def create_app(llm: LazyLLM | Backend, *, api_key: str | None = None, model_name: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT,
               default_max_tokens: int = DEFAULT_MAX_TOKENS, default_temperature: float = 0.0,
               max_concurrency: int = DEFAULT_MAX_CONCURRENCY) -> FastAPI:
    """The FastAPI app serving ``llm`` (see the module docstring for the endpoints): a
    ``LazyLLM`` (served through a ``LocalBackend`` the app makes and closes) or any
    ``Backend`` (``ray_serve.RayBackend(handle)``: replicas behind the same endpoints).

    ``api_key``: when set, ``/v1`` requires ``Authorization: Bearer <api_key>``.
    ``model_name``: the id clients send as ``model`` (default: the backend's
    ``model_name``, which is accepted too; a missing ``model`` means this one).
    ``max_request_bytes``: larger bodies get 413. ``max_new_tokens_limit``: the most
    ``max_tokens`` a request may ask (more: 400); ``default_max_tokens`` when it asks
    none. ``default_temperature``: when the request sets none (0: greedy, as in process).
    ``max_concurrency``: requests served at once (with a ``LazyLLM``, each holds a worker
    thread while its engine request runs); more get 429.

    ``app.state``: ``backend``, ``llm`` (the ``LazyLLM``, or None for another backend),
    ``model_name``, ``metrics`` (``ServerMetrics``), ``executor`` (the local backend's pool).
    """
    for name, v in (("max_request_bytes", max_request_bytes), ("max_new_tokens_limit", max_new_tokens_limit),
                    ("default_max_tokens", default_max_tokens), ("max_concurrency", max_concurrency)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidRequestError(f"{name} must be a positive int, got {v!r}")
    if api_key is not None and not api_key:
        raise InvalidRequestError("api_key must be a non-empty string or None")
    backend = as_backend(llm, max_workers=max_concurrency)
    owns_backend = backend is not llm
    served = model_name or str(backend.model_name)
    accepted = {served, str(backend.model_name)}
    metrics = ServerMetrics(backend)
    key = api_key.encode() if api_key else None
    in_flight = 0
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        close = getattr(backend, "close", None)
        if owns_backend and close is not None:
            close()

    app = FastAPI(title="lazyllm", description="OpenAI-compatible chat completions with chunk KV reuse",
                  docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.backend, app.state.model_name, app.state.metrics = backend, served, metrics
    app.state.llm = getattr(backend, "llm", None)
    app.state.executor = getattr(backend, "executor", None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return _error_response(APIError(e.status_code, msg, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        return _error_response(APIError(400, str(e)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        log.exception("error serving %s", request.url.path)
        return _error_response(error_from_exception(e))

    def check_auth(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "invalid Content-Length header")
            if int(length) > max_request_bytes:
                raise APIError(413, f"the body is {length} bytes; the limit is {max_request_bytes}",
                               code="request_too_large")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > max_request_bytes:
                raise APIError(413, f"the body is over the limit of {max_request_bytes} bytes",
                               code="request_too_large")
            parts.append(part)
        return b"".join(parts)

    def check_model(name: str | None) -> None:
        if name is not None and name not in accepted:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        return _json_response({"status": "ok", "model": served})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def model_card() -> dict[str, Any]:
        info = dict(await backend.model_info())
        card = {"id": served, "object": "model", "created": started, "owned_by": "lazyllm",
                "max_model_len": info.pop("max_context", None)}
        card.update({k: v for k, v in info.items() if k not in card})
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        return _json_response({"object": "list", "data": [await model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        check_auth(request)
        check_model(model_id)
        return _json_response(await model_card())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        nonlocal in_flight
        check_auth(request)
        body = validate_body(await read_body(request))
        check_model(body.model)
        question, chunks, system, sampling = parse_chat_request(
            body, max_new_tokens_limit=max_new_tokens_limit, default_max_tokens=default_max_tokens,
            default_temperature=default_temperature)
        mode = "true" if body.stream else "false"
        if in_flight >= max_concurrency:
            metrics.requests.labels("429", mode).inc()
            raise APIError(429, f"the server is serving {in_flight} requests, its limit; retry later",
                           code="too_many_requests")
        rid, created = new_request_id(), int(time.time())
        if not body.stream:
            in_flight += 1
            metrics.in_flight.inc()
            try:
                out = await backend.generate(question, chunks, system, **sampling)
            except Exception as e:
                err = error_from_exception(e)
                metrics.requests.labels(str(err.status), mode).inc()
                raise err from None
            finally:
                in_flight -= 1
                metrics.in_flight.dec()
            metrics.observe(out)
            metrics.requests.labels("200", mode).inc()
            return _json_response(completion_response(out, model=served, request_id=rid, created=created))

        try:  # a backend that validates here raises bad input before anything is sent
            stream = backend.stream(question, chunks, system, **sampling)
        except Exception as e:
            err = error_from_exception(e)
            metrics.requests.labels(str(err.status), mode).inc()
            raise err from None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[bytes]:
            nonlocal in_flight
            # counted, and submitted, once the response starts: one never started submits nothing
            in_flight += 1
            metrics.in_flight.inc()
            relay = _Relay(stream)
            complete = False
            try:
                yield sse(stream_chunk(rid, created, served, role="assistant", content=""))
                async for batch in relay.batches():
                    data = []
                    for kind, val in batch:
                        if kind == "delta":
                            data.append(sse(stream_chunk(rid, created, served, content=val)))
                        elif kind == "done":
                            metrics.observe(val)
                            data.append(sse(stream_chunk(rid, created, served, finish_reason=val.finish_reason)))
                            if include_usage:
                                data.append(sse(stream_chunk(rid, created, served, usage=usage_json(val), out=val)))
                        else:
                            err = error_from_exception(val)
                            metrics.requests.labels(str(err.status), mode).inc()
                            data.append(sse(err.body()))
                    if batch[-1][0] != "delta":
                        data.append(sse("[DONE]"))
                    yield b"".join(data)
                complete = True
            finally:
                in_flight -= 1
                metrics.in_flight.dec()
                if complete:
                    metrics.requests.labels("200", mode).inc()
                else:  # the client left (the task was cancelled or the send failed)
                    relay.stop()
                    metrics.disconnects.inc()
                    metrics.requests.labels("499", mode).inc()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def _collect(stream: TextStream) -> GenerationOutput:
    try:
        for _ in stream:
            pass
    finally:
        stream.close()
    return stream.output


# -- command line ----------------------------------------------------------------------------

def build_parser(prog: str = "lazyllm serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a LazyLLM over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=None,
                   help="transformers folder, .gguf file or hub id (default: the embedded default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer <key> on /v1 (default: the LAZYLLM_API_KEY variable)")
    p.add_argument("--model-name", default=None, help="the id clients send as `model` (default: the model's)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
                   help="the most max_tokens a request may ask")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY)
    p.add_argument("--reuse", default="lazy", choices=["lazy", "block", "prefix", "none"])
    p.add_argument("--chunk-context", default="isolated", choices=["isolated", "prefix"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--kv-disk-dir", default=None, help="persistent chunk KV tier (survives restarts)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--no-access-log", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """``lazyllm serve [model] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...``"""
    import os

    import uvicorn

    args = build_parser().parse_args(argv)
    api_key = args.api_key or os.environ.get("LAZYLLM_API_KEY") or None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("binding to %s without an API key: anyone who can reach it can use it", args.host)
    kw: dict[str, Any] = dict(reuse=args.reuse, chunk_context=args.chunk_context, device=args.device,
                              dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes, page_size=args.page_size,
                              trust_remote_code=args.trust_remote_code)
    if args.kv_disk_dir:
        kw["kv_disk_dir"] = args.kv_disk_dir
    llm = LazyLLM(args.model, **kw)
    app = create_app(llm, api_key=api_key, model_name=args.model_name, max_request_bytes=args.max_request_bytes,
                     max_new_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                     max_concurrency=args.max_concurrency)
    log.info("serving %s on http://%s:%d/v1", app.state.model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    access_log=not args.no_access_log)
    finally:
        llm.close()
    return 0


__all__ = [
    "create_app", "main", "build_parser", "Backend", "GenerationStream", "LocalBackend", "as_backend",
    "ChatCompletionRequest", "ChatRequest", "DocumentIn", "APIError",
    "validate_body", "parse_chat_request", "documents_to_chunks", "completion_response", "stream_chunk",
    "usage_json", "sse", "error_body", "error_from_exception", "new_request_id", "ServerMetrics",
]
