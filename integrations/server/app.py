"""The FastAPI app: endpoints, authentication, limits, disconnects and the server-sent
events writer, over any ``Backend`` (``create_app``)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lazyllm import GenerationOutput, LazyLLM
from lazyllm.errors import InvalidRequestError
from lazyllm.structured.call_stream import ToolCallDeltas

from .backends import Backend, GenerationStream, as_backend
from .choices import choice_seeds
from .choices import respond as respond_choices
from .completions import add_route as add_completions
from .embeddings import Embedder
from .embeddings import add_route as add_embeddings
from .errors import APIError, error_from_exception
from .metrics import ServerMetrics
from .openapi import add_route as add_openapi
from .preflight import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_NEW_TOKENS_LIMIT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_TOKENS,
)
from .protocol import (
    ChatCompletionRequest,
    completion_response,
    emits_tool_calls,
    logprobs_json,
    new_request_id,
    parse_chat_request,
    sse,
    stream_chunk,
    usage_json,
    validate_body,
)
from .relay import Relay as _Relay
from .relay import json_response as _json_response

log = logging.getLogger("lazyllm.server")

# how often a non-streaming request checks whether its client is still connected
DISCONNECT_POLL_S = 0.1
# the Retry-After of a 429: requests finish in seconds, so a second is a fair first wait
RETRY_AFTER_S = 1


def _error_response(e: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    if e.status == 429:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return _json_response(e.body(), e.status, headers)


def _check_limits(max_request_bytes, max_new_tokens_limit, default_max_tokens, max_concurrency, api_key) -> None:
    for name, v in (("max_request_bytes", max_request_bytes), ("max_new_tokens_limit", max_new_tokens_limit),
                    ("default_max_tokens", default_max_tokens), ("max_concurrency", max_concurrency)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidRequestError(f"{name} must be a positive int, got {v!r}")
    if api_key is not None and not api_key:
        raise InvalidRequestError("api_key must be a non-empty string or None")


class _Server:
    """The state and the request handling of one app (``create_app`` wires its methods to
    the routes)."""

    def __init__(self, backend: Backend, *, served: str, api_key: str | None, max_request_bytes: int,
                 max_concurrency: int, limits: dict[str, Any]):
        self.backend, self.served = backend, served
        self.accepted = {served, str(backend.model_name)}
        self.metrics = ServerMetrics(backend)
        self.key = api_key.encode() if api_key else None
        self.max_request_bytes, self.max_concurrency, self.limits = max_request_bytes, max_concurrency, limits
        self.started = int(time.time())
        self.in_flight = self.preparing = 0
        self.quality: str | None = None
        self._info: dict[str, Any] | None = None
        self.warmed = threading.Event()  # the backend's warm-up finished (or none was asked)

    def start_warmup(self, run: bool) -> None:
        """Run the backend's ``warmup()`` on a thread of its own, so ``/health`` answers at once
        and ``/ready`` when it is done; a failed warm-up is logged and the server serves
        without it."""
        fn = getattr(self.backend, "warmup", None)
        if not run or fn is None:
            self.warmed.set()
            return

        def work() -> None:
            try:
                fn()
            except Exception:  # noqa: BLE001  (serving slower beats not serving)
                log.exception("warm-up failed; serving without it")
            finally:
                self.warmed.set()

        threading.Thread(target=work, name="lazyllm-warmup", daemon=True).start()

    def is_ready(self) -> bool:
        ready = getattr(self.backend, "ready", None)
        return self.warmed.is_set() and (ready is None or bool(ready()))

    # -- errors and checks
    def counted(self, request: Request, e: APIError) -> Response:
        """The error response, counted once in ``lazyllm_http_requests_total``."""
        self.count(request, str(e.status))
        return _error_response(e)

    def count(self, request: Request, status: str) -> None:
        if not getattr(request.state, "counted", False):
            request.state.counted = True
            self.metrics.requests.labels(status, getattr(request.state, "mode", "unknown")).inc()

    def check_auth(self, request: Request) -> None:
        if self.key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is None:  # OpenAI's answer to a body without a model
            raise APIError(400, "you must provide a model parameter", param="model", code="missing_model")
        if name not in self.accepted:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.served!r}",
                           param="model", code="model_not_found")

    def check_quality(self, body: ChatCompletionRequest) -> None:
        if body.quality is not None and body.quality != self.quality:
            runs = f"the preset {self.quality!r}" if self.quality else "no preset (its own options)"
            raise APIError(400, f"quality: this server runs {runs}; a preset is chosen when the server starts "
                                "(lazyllm serve --quality ...), not per request", param="quality", code="unsupported")

    async def read_body(self, request: Request) -> bytes:
        limit = self.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "invalid Content-Length header")
            if int(length) > limit:
                raise APIError(413, f"the body is {length} bytes; the limit is {limit}", code="request_too_large")
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise APIError(413, f"the body is over the limit of {limit} bytes", code="request_too_large")
                parts.append(part)
        except ClientDisconnect:  # it left before sending the whole body: nothing ran, nobody reads an answer
            self.metrics.disconnects.inc()
            raise APIError(499, "the client disconnected while its request body was being read",
                           code="client_disconnected") from None
        return b"".join(parts)

    async def model_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = dict(await self.backend.model_info())
            self.quality = self._info.get("quality")
        return dict(self._info)

    async def model_card(self) -> dict[str, Any]:
        info = await self.model_info()
        card = {"id": self.served, "object": "model", "created": self.started, "owned_by": "lazyllm",
                "max_model_len": info.pop("max_context", None)}
        card.update({k: v for k, v in info.items() if k not in card})
        return card

    # -- chat completions
    def prepare(self, raw: bytes, request: Request) -> tuple[ChatCompletionRequest, Any]:
        """Parse, validate, check and tokenize one body (on a worker thread: the expensive
        part of a request, kept off the event loop). Raises ``APIError``."""
        body = validate_body(raw)
        request.state.mode = "true" if body.stream else "false"
        self.check_model(body.model)
        self.check_quality(body)
        req = parse_chat_request(body, **self.limits)
        check_length = getattr(self.backend, "check_length", None)
        try:
            if check_length is not None:  # a lower bound of the token count, before tokenizing
                texts = [m["content"] for m in req.sampling.get("messages") or ()]
                check_length(len(req.question or "") + len(req.system or "") + sum(map(len, texts))
                             + sum(len(c.text) for c in req.chunks))
            # a backend that validates here raises bad input before anything is sent
            received = getattr(request.state, "received_at", None)
            timed = {"received_at": received} if received is not None and getattr(
                self.backend, "takes_received_at", False) else {}
            streams = [self.backend.stream(req.question, req.chunks, req.system, **{**req.sampling, "seed": seed},
                                           **timed) for seed in choice_seeds(req.sampling["seed"], body.n or 1)]
            return body, streams[0] if len(streams) == 1 else streams  # several: n choices
        except Exception as e:
            raise error_from_exception(e) from None

    async def chat(self, request: Request) -> Response:
        request.state.received_at = time.perf_counter()  # where the request's TTFT counts from
        self.check_auth(request)
        raw = await self.read_body(request)
        await self.model_info()
        if self.in_flight + self.preparing >= self.max_concurrency:
            raise APIError(429, f"the server is at its limit of {self.max_concurrency} requests at once "
                                f"({self.in_flight} running, {self.preparing} being read); retry later",
                           code="too_many_requests")
        self.preparing += 1
        try:
            body, stream = await run_in_threadpool(self.prepare, raw, request)
        finally:
            self.preparing -= 1
        rid, created = new_request_id(), int(time.time())
        if isinstance(stream, list):
            return await respond_choices(self, request, body, stream, rid, created)
        if not body.stream:
            out = await self.complete(request, stream)
            if out is None:  # nobody reads it
                return Response(status_code=499)
            return _json_response(completion_response(out, model=self.served, request_id=rid, created=created))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        calls = ToolCallDeltas() if emits_tool_calls(body) else None
        return StreamingResponse(self.events(request, stream, rid, created, include_usage, calls),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def enter(self) -> None:
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def leave(self, request: Request, status: str) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        if status == "499":  # the client left (it disconnected, or the send failed)
            self.metrics.disconnects.inc()
        self.count(request, status)

    async def complete(self, request: Request, stream: GenerationStream) -> GenerationOutput | None:
        """A non-streaming request's result, or None when its client left first: the
        connection is polled while the request runs, and a request whose client left is
        cancelled (its pages released) and counted as a disconnect (499)."""
        self.enter()
        relay = _Relay(stream)
        waiter = asyncio.ensure_future(relay.result())
        status = "499"
        try:
            while not waiter.done():
                await asyncio.wait([waiter], timeout=DISCONNECT_POLL_S)
                if not waiter.done() and await request.is_disconnected():
                    return None
            out = waiter.result()
            self.metrics.observe(out)
            status = "200"
            return out
        except Exception as e:
            err = error_from_exception(e)
            status = str(err.status)
            raise err from None
        finally:
            if status == "499":
                relay.stop()
                waiter.cancel()
            self.leave(request, status)

    async def events(self, request: Request, stream: GenerationStream, rid: str, created: int,
                     include_usage: bool, calls: ToolCallDeltas | None = None) -> AsyncIterator[bytes]:
        """The server-sent events of a streaming request. Counted in flight, and submitted,
        once the response starts: one never started submits nothing. With ``calls``, the
        text is read as tool calls where it is calls (``delta.tool_calls``)."""
        self.enter()
        relay = _Relay(stream)
        status, outcome, served = "499", None, self.served
        try:
            yield sse(stream_chunk(rid, created, served, role="assistant", content=""))
            async for batch in relay.batches():
                data = []
                for kind, val in batch:
                    if kind == "delta" and calls is not None:
                        content, items = calls.feed(val)
                        if content is not None or items:
                            data.append(sse(stream_chunk(rid, created, served, content=content,
                                                         tool_calls=items or None)))
                    elif kind == "delta":
                        data.append(sse(stream_chunk(rid, created, served, content=val)))
                    elif kind == "done":
                        self.metrics.observe(val)
                        cut = val.tool_calls[-1] if val.tool_calls else None
                        rest = calls.flush(cut) if calls is not None else None
                        if rest:  # a call the length limit cut off: its arguments as far as generated
                            data.append(sse(stream_chunk(rid, created, served, tool_calls=rest)))
                        if val.logprobs is not None:  # scored once the answer is complete: in one chunk
                            data.append(sse(stream_chunk(rid, created, served, logprobs=logprobs_json(val))))
                        data.append(sse(stream_chunk(rid, created, served, finish_reason=val.finish_reason)))
                        if include_usage:
                            data.append(sse(stream_chunk(rid, created, served, usage=usage_json(val), out=val)))
                        outcome = "200"
                    else:
                        err = error_from_exception(val)
                        outcome = str(err.status)
                        data.append(sse(err.body()))
                if batch[-1][0] != "delta":
                    data.append(sse("[DONE]"))
                yield b"".join(data)
            status = outcome or status  # every event was sent: the client stayed to the end
        finally:
            if status == "499":
                relay.stop()
            self.leave(request, status)


def create_app(llm: LazyLLM | Backend, *, api_key: str | None = None, model_name: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT,
               default_max_tokens: int = DEFAULT_MAX_TOKENS, default_temperature: float = 0.0,
               max_concurrency: int = DEFAULT_MAX_CONCURRENCY, warmup: bool = True,
               embedder: Any = "minilm") -> FastAPI:
    """The FastAPI app serving ``llm`` (see the package docstring for the endpoints): a
    ``LazyLLM`` (served through a ``LocalBackend`` the app makes and closes) or any
    ``Backend`` (``ray_serve.RayBackend(handle)``: replicas behind the same endpoints).

    ``api_key``: when set, ``/v1`` requires ``Authorization: Bearer <api_key>``.
    ``model_name``: the id clients send as ``model`` (default: the backend's
    ``model_name``, which is accepted too; a request must name one of them, as OpenAI's).
    ``max_request_bytes``: larger bodies get 413. ``max_new_tokens_limit``: the most
    ``max_tokens`` a request may ask (more: 400); ``default_max_tokens`` when it asks
    none. ``default_temperature``: when the request sets none (0: greedy, as in process).
    ``max_concurrency``: requests served at once; more get 429 with ``Retry-After``.
    ``warmup``: run the backend's ``warmup()`` (``LazyLLM.warmup``: every kernel compiled and
    the CUDA graphs captured; a no-op where it already ran) on a thread from the start:
    ``/health`` answers at once (liveness), ``/ready`` and ``/health?ready`` answer 503 until
    it finished, then 200 (readiness). ``embedder``: what ``/v1/embeddings`` serves (the bundled
    MiniLM, loaded at its first request; any embedding model, ``server.embeddings.Embedder``;
    None: no embeddings).

    Body parsing, validation and tokenization run on worker threads, never on the event
    loop, so ``/health`` and other requests are answered while a large body is processed;
    a non-streaming request whose client disconnects is cancelled like a stream.

    ``app.state``: ``backend``, ``llm`` (the ``LazyLLM``, or None for another backend),
    ``model_name``, ``metrics`` (``ServerMetrics``).
    """
    _check_limits(max_request_bytes, max_new_tokens_limit, default_max_tokens, max_concurrency, api_key)
    backend = as_backend(llm)
    owns_backend = backend is not llm
    srv = _Server(backend, served=model_name or str(backend.model_name), api_key=api_key,
                  max_request_bytes=max_request_bytes, max_concurrency=max_concurrency,
                  limits=dict(max_new_tokens_limit=max_new_tokens_limit, default_max_tokens=default_max_tokens,
                              default_temperature=default_temperature))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        close = getattr(backend, "close", None)
        if owns_backend and close is not None:
            close()

    app = FastAPI(title="lazyllm", description="OpenAI-compatible chat completions with chunk KV reuse",
                  docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.backend, app.state.model_name, app.state.metrics = backend, srv.served, srv.metrics
    app.state.llm = getattr(backend, "llm", None)
    _routes(app, srv)
    embedder = embedder if embedder is None or isinstance(embedder, Embedder) else Embedder(embedder)
    add_embeddings(app, srv, embedder)
    add_completions(app, srv)
    add_openapi(app, sorted(srv.accepted), [] if embedder is None else [embedder.name])
    srv.start_warmup(warmup)
    return app


def _routes(app: FastAPI, srv: _Server) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return srv.counted(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return srv.counted(request, APIError(e.status_code, msg, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        return srv.counted(request, APIError(400, str(e)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        log.exception("error serving %s", request.url.path)
        return srv.counted(request, error_from_exception(e))

    def readiness() -> Response:
        if srv.is_ready():
            return _json_response({"status": "ready", "model": srv.served})
        return _json_response({"status": "warming up", "model": srv.served}, status=503)

    @app.get("/health")
    async def health(ready: str | None = None) -> Response:
        if ready is not None and ready.lower() not in ("0", "false", "no"):
            return readiness()  # /health?ready, for probes that take one path
        return _json_response({"status": "ok", "model": srv.served})

    @app.get("/ready")
    async def ready() -> Response:
        return readiness()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        srv.check_auth(request)
        return _json_response({"object": "list", "data": [await srv.model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        srv.check_auth(request)
        srv.check_model(model_id)
        return _json_response(await srv.model_card())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await srv.chat(request)


__all__ = ["create_app", "DISCONNECT_POLL_S", "RETRY_AFTER_S"]
