"""``TextStream``: the text deltas of one engine request, for ``for`` or ``async for``."""
from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from .types import GenerationOutput

if TYPE_CHECKING:
    from .engine.engine import Engine
    from .engine.request import Request


class TextStream:
    """Text deltas of one request, for ``for`` or ``async for``; once the iteration ends,
    ``output`` holds the ``GenerationOutput`` (usage, TTFT, finish reason).

    The request is validated when the stream is made (bad input raises at once) and
    submitted when iteration starts. Stopping early (``break``, ``close()``, task
    cancellation) cancels the request; ``close()`` returns once the engine has released
    the request's pages. It is the stream across the boundary between the engine thread and
    its caller: a thread waits on the request's queue; under ``async for`` the engine thread
    wakes the event loop directly, so no thread is held per request.
    """

    # how long close() waits for the engine to retire a cancelled request (it does so at
    # its next step; only a wedged engine takes longer)
    CLOSE_TIMEOUT_S = 30.0

    def __init__(self, engine: Engine, req: Request):
        self._engine, self._req = engine, req
        self._sync: Iterator[str] | None = None
        self._submitted = self._over = False
        self.output: GenerationOutput | None = None

    def _take(self, kind, val) -> str | None:
        """The delta of one engine event; ``None`` when the stream is over (raises the
        request's error)."""
        if kind == "delta":
            return val
        self._over = True
        if kind == "error":
            raise val
        self.output = val
        return None

    def _submit(self) -> None:
        self._submitted = True
        self._engine.submit(self._req)

    def _iterate(self) -> Iterator[str]:
        self._submit()
        try:
            while (delta := self._take(*self._req.events.get())) is not None:
                yield delta
        finally:
            self.cancel()

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        if self._sync is None:
            self._sync = self._iterate()
        return next(self._sync)

    async def __aiter__(self) -> AsyncIterator[str]:
        # the engine thread wakes the event loop itself (no thread waits for the events):
        # the request's queue is replaced, before submission, by one that signals the loop
        events = _LoopQueue(asyncio.get_running_loop())
        self._req.events = events
        self._submit()
        try:
            while True:
                await events.ready.wait()
                events.ready.clear()
                while True:
                    try:
                        event = events.get_nowait()
                    except queue.Empty:
                        break
                    if (delta := self._take(*event)) is None:
                        return
                    yield delta
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Ask the engine to stop the request (a no-op once it has finished). Returns at once
        and may be called from any thread, also while another thread iterates the stream,
        which then ends with ``RequestCancelled``; ``close()`` also waits for the pages."""
        self._req.cancelled.set()

    def close(self) -> None:
        """Stop the stream: cancel the request and wait (up to ``CLOSE_TIMEOUT_S``) until the
        engine has released its pages, so ``cache_stats()`` right after shows none pinned."""
        if self._sync is not None:
            self._sync.close()
        self.cancel()
        if self._submitted and not self._over:
            try:
                while True:
                    kind, _ = self._req.events.get(timeout=self.CLOSE_TIMEOUT_S)
                    if kind != "delta":
                        break
            except queue.Empty:
                pass
            self._over = True


class _LoopQueue(queue.Queue):
    """The event queue of a request iterated with ``async for``: each event the engine
    thread puts also sets ``ready`` on the event loop (thread-safe), which the iterator
    awaits before draining every event queued so far."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self._loop = loop
        self.ready = asyncio.Event()

    def _put(self, item) -> None:  # under the queue's lock, from Queue.put
        super()._put(item)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self.ready.set)
