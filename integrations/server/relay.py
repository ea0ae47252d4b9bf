"""The boundary between a backend's stream and an HTTP response (``Relay``), and the JSON
response every endpoint answers with (``json_response``)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from lazyllm import GenerationOutput

from .backends import GenerationStream

__all__ = ["Relay", "json_response"]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(), status_code=status,
                    media_type="application/json", headers=headers)


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


class Relay:
    """The boundary between a backend's stream and the HTTP response: reads a
    ``GenerationStream`` in a task of its own into a queue, so that the writer sends every
    event already there in one write: ``("delta", text)``, then ``("done",
    GenerationOutput)`` or ``("error", exc)``."""

    def __init__(self, stream: GenerationStream):
        self.stream = stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        items = aiter(self.stream)
        try:
            async for delta in items:
                self.queue.put_nowait(("delta", delta))
            if self.stream.output is None:
                raise RuntimeError("the backend's stream ended without a result")
            self.queue.put_nowait(("done", self.stream.output))
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

    async def result(self) -> GenerationOutput:
        """The whole result (a non-streaming request): raises the request's error."""
        async for batch in self.batches():
            kind, val = batch[-1]
            if kind == "error":
                raise val
            if kind == "done":
                return val
        raise RuntimeError("unreachable: the last batch ends the stream")
