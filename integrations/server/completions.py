"""``POST /v1/completions``: OpenAI's legacy text completions. The prompt is completed as
written (``LazyLLM.generate(prompt, raw=True)``: no chat template), after the ``documents``
extension's chunks, whose KV is cached and reused as in chat; streamed or not; ``logprobs: k``
gives the legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from lazyllm import GenerationOutput

from .errors import APIError, error_from_exception
from .protocol import DocumentIn, StreamOptions, documents_to_chunks, parse_body, sse, usage_json
from .relay import Relay

__all__ = ["CompletionRequest", "completion_body", "add_route"]


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (OpenAI's fields, ``top_k`` and ``documents``)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str]
    documents: list[str | DocumentIn] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None
    user: str | None = None


def completion_body(raw: bytes, max_tokens_limit: int) -> tuple[CompletionRequest, str, dict[str, Any]]:
    """``(body, prompt, generate's arguments)`` of a request; ``APIError(400)`` for what
    lazyllm does not do (several prompts or choices, echo, suffix, penalties, logit bias)."""
    body = parse_body(CompletionRequest, raw)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise APIError(400, "prompt: lazyllm completes one prompt per request", param="prompt", code="unsupported")
    for name, bad in (("n", body.n not in (None, 1)), ("best_of", body.best_of not in (None, 1)),
                      ("echo", bool(body.echo)), ("suffix", body.suffix is not None),
                      ("presence_penalty", bool(body.presence_penalty)),
                      ("frequency_penalty", bool(body.frequency_penalty)), ("logit_bias", bool(body.logit_bias))):
        if bad:
            raise APIError(400, f"{name}: not supported by lazyllm's completions", param=name, code="unsupported")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default here
    if max_tokens > max_tokens_limit:
        raise APIError(400, f"max_tokens={max_tokens} is above this server's limit of {max_tokens_limit}",
                       param="max_tokens")
    if body.stop == "" or isinstance(body.stop, list) and ("" in body.stop or len(body.stop) > 4):
        raise APIError(400, "stop: up to 4 non-empty stop strings", param="stop")
    sampling = {"max_new_tokens": max_tokens, "temperature": 1.0 if body.temperature is None else body.temperature,
                "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": body.top_k or 0, "seed": body.seed,
                "stop": body.stop or None, "raw": True}
    if body.logprobs is not None:
        sampling.update(logprobs=True, top_logprobs=body.logprobs)
    return body, prompts[0], sampling


def _logprobs(out: GenerationOutput) -> dict[str, Any] | None:
    """The legacy ``logprobs`` object (tokens, their log-probabilities, the top ones as
    ``{token: logprob}``, each token's character offset in the text)."""
    if out.logprobs is None:
        return None
    offsets, at = [], 0
    for t in out.logprobs:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in out.logprobs], "token_logprobs": [t.logprob for t in out.logprobs],
            "top_logprobs": [{x.token: x.logprob for x in t.top_logprobs} for t in out.logprobs],
            "text_offset": offsets}


def _chunk(rid: str, created: int, model: str, text: str, finish: str | None,
           logprobs: dict | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def add_route(app: Any, srv: Any) -> None:
    """Register ``POST /v1/completions`` on ``app`` (``srv``: the app's ``_Server``)."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        request.state.received_at = time.perf_counter()
        srv.check_auth(request)
        raw = await srv.read_body(request)
        if srv.in_flight + srv.preparing >= srv.max_concurrency:
            raise APIError(429, f"the server is at its limit of {srv.max_concurrency} requests at once; retry later",
                           code="too_many_requests")
        body, prompt, sampling = await run_in_threadpool(completion_body, raw, srv.limits["max_new_tokens_limit"])
        request.state.mode = "true" if body.stream else "false"
        srv.check_model(body.model)
        try:
            chunks = documents_to_chunks(body.documents)
            stream = await run_in_threadpool(lambda: srv.backend.stream(prompt, chunks, None, **sampling))
        except APIError:
            raise
        except Exception as e:
            raise error_from_exception(e) from None
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        if not body.stream:
            out = await srv.complete(request, stream)
            if out is None:
                return Response(status_code=499)
            obj = {**_chunk(rid, created, srv.served, out.text, out.finish_reason, _logprobs(out)),
                   "usage": usage_json(out)}
            return Response(json.dumps(obj, ensure_ascii=False).encode(), media_type="application/json")
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_events(srv, request, stream, rid, created, usage), media_type="text/event-stream")


async def _events(srv: Any, request: Request, stream: Any, rid: str, created: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed completion (counted as the chat's are)."""
    srv.enter()
    relay, status, served = Relay(stream), "499", srv.served
    try:
        async for batch in relay.batches():
            data = []
            for kind, val in batch:
                if kind == "delta":
                    data.append(sse(_chunk(rid, created, served, val, None)))
                elif kind == "done":
                    srv.metrics.observe(val)
                    data.append(sse(_chunk(rid, created, served, "", val.finish_reason, _logprobs(val))))
                    if include_usage:
                        data.append(sse({**_chunk(rid, created, served, "", None), "choices": [],
                                         "usage": usage_json(val)}))
                    data.append(sse("[DONE]"))
                    status = "200"
                else:
                    err = error_from_exception(val)
                    data += [sse(err.body()), sse("[DONE]")]
                    status = str(err.status)
            yield b"".join(data)
    finally:
        if status == "499":
            relay.stop()
        srv.leave(request, status)
