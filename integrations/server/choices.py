"""``n`` > 1 on chat completions: ``n`` requests of the same prompt submitted together, each
its own choice. They share the prompt's cached KV (the system prefix and the documents'
chunks, computed once in the modes that cache chunks); a seeded request draws choice ``i``
with ``seed + i``, so the choices differ and each is reproducible. At most ``MAX_CHOICES``."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lazyllm import GenerationOutput

from .errors import error_from_exception
from .protocol import completion_response, logprobs_json, sse, stream_chunk, usage_json
from .relay import Relay, json_response

__all__ = ["MAX_CHOICES", "choice_seeds", "respond"]

MAX_CHOICES = 8


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """Each choice's seed: ``seed + i`` (None: each draws its own)."""
    return [None if seed is None else seed + i for i in range(n)]


def _usage(outs: list[GenerationOutput]) -> dict[str, Any]:
    """One prompt, ``n`` completions (OpenAI counts the prompt once)."""
    u = usage_json(outs[0])
    done = sum(o.usage.completion_tokens for o in outs)
    cached = max(o.usage.cached_tokens for o in outs)
    return {**u, "completion_tokens": done, "total_tokens": u["prompt_tokens"] + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def respond(srv: Any, request: Request, body: Any, streams: list, rid: str, created: int) -> Response:
    """The answer to a request with several choices, streamed or not."""
    if not body.stream:
        tasks = [asyncio.ensure_future(srv.complete(request, s)) for s in streams]
        try:
            outs = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        if any(o is None for o in outs):
            return Response(status_code=499)
        obj = completion_response(outs[0], model=srv.served, request_id=rid, created=created)
        obj["choices"] = [{**completion_response(o, model=srv.served)["choices"][0], "index": i}
                          for i, o in enumerate(outs)]
        obj["usage"] = _usage(outs)
        return json_response(obj)
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_events(srv, request, streams, rid, created, usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _indexed(chunk: dict[str, Any], i: int) -> dict[str, Any]:
    chunk["choices"][0]["index"] = i
    return chunk


async def _events(srv: Any, request: Request, streams: list, rid: str, created: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """The choices' events as they come, each chunk with its choice's ``index``."""
    srv.enter()
    relays = [Relay(s) for s in streams]
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, relay: Relay) -> None:
        async for batch in relay.batches():
            for kind, val in batch:
                merged.put_nowait((i, kind, val))

    pumps = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(relays)]
    status, outs, served = "499", {}, srv.served
    try:
        yield b"".join(sse(_indexed(stream_chunk(rid, created, served, role="assistant", content=""), i))
                       for i in range(len(relays)))
        while len(outs) < len(relays):
            i, kind, val = await merged.get()
            if kind == "delta":
                yield sse(_indexed(stream_chunk(rid, created, served, content=val), i))
            elif kind == "done":
                srv.metrics.observe(val)
                outs[i] = val
                data = [sse(_indexed(stream_chunk(rid, created, served, logprobs=logprobs_json(val)), i))
                        ] if val.logprobs is not None else []
                data.append(sse(_indexed(stream_chunk(rid, created, served, finish_reason=val.finish_reason), i)))
                yield b"".join(data)
            else:
                err = error_from_exception(val)
                status = str(err.status)
                yield sse(err.body()) + sse("[DONE]")
                return
        tail = [sse(stream_chunk(rid, created, served, usage=_usage([outs[i] for i in sorted(outs)])))] \
            if include_usage else []
        yield b"".join([*tail, sse("[DONE]")])
        status = "200"
    finally:
        for p in pumps:
            p.cancel()
        if status != "200":
            for r in relays:
                r.stop()
        srv.leave(request, status)
