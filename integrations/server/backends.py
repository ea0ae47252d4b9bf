"""What the HTTP app serves: the ``Backend`` interface, its stream (``GenerationStream``),
and ``LocalBackend``, one ``LazyLLM`` in this process. ``ray_serve.RayBackend`` is the
other backend: Ray Serve replicas behind a deployment handle."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from lazyllm import Chunk, GenerationOutput, LazyLLM
from lazyllm.stream import TextStream

from .._common import engine_settings


class GenerationStream(Protocol):
    """One streaming request of a ``Backend``: the same interface as ``lazyllm.TextStream``
    (which ``LocalBackend`` returns as is) and ``ray_serve.RayStream``.

    ``async for delta in stream`` submits the request (nothing is submitted before) and
    yields its text deltas; once the iteration ends, ``output`` holds the request's
    ``GenerationOutput``. A failed request raises (lazyllm's errors, mapped by
    ``error_from_exception``). ``cancel()`` returns at once, may be called from the event
    loop while a task iterates the stream, and makes the backend drop the request and
    release its KV pages: the app calls it when a client disconnects."""

    output: GenerationOutput | None

    def __aiter__(self) -> AsyncIterator[str]: ...

    def cancel(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """What ``create_app`` serves. ``LocalBackend`` (one ``LazyLLM`` in this process) and
    ``ray_serve.RayBackend`` (a Ray Serve deployment handle) implement it.

    - ``model_name``: the model's id (the app also accepts the ``model_name`` it is given).
    - ``stream(question, chunks, system, **sampling)``: a ``GenerationStream``. The app
      calls it on a worker thread (it may validate and tokenize there); a backend that can
      validate the request there raises bad input before the response starts (HTTP 400),
      one that cannot raises it from the stream (an error event, or the status of a
      non-streaming request).
    - ``async model_info() -> dict``: ``max_context`` (int or None) and any other fields for
      the ``/v1/models`` card (``reuse``, ``chunk_context``, ``quality``...).
    - ``cache_stats() -> dict``: ``LazyLLM.cache_stats()``'s counters, summed over replicas
      where there are several; read at every ``/metrics`` scrape, so cheap and without I/O
      (the latest figures the backend holds; ``{}`` when it has none yet).

    Optional: ``engine_stats() -> dict`` (``requests``, ``failed``, ``cancelled``,
    ``preemptions``), ``engine_settings() -> dict`` (the options served, for the
    ``lazyllm_engine_info`` metric), ``check_length(chars: int)`` (raises ``ContextLengthError`` when a
    prompt of that many characters cannot fit, before anything is tokenized) and
    ``close()`` (called at the app's shutdown when the app made the backend), ``warmup()``
    (run on a thread when the app starts; ``/ready`` answers 503 until it returns) and
    ``ready() -> bool`` (readiness beyond that; absent: ready). ``sampling``
    is ``parse_chat_request``'s: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``seed``, ``stop``, and where the request sets them ``response_format``, ``tools``,
    ``tool_choice``, ``parallel_tool_calls`` and ``messages`` (then ``question`` is None):
    ``LazyLLM.generate``'s arguments. The stream's ``output`` carries ``tool_calls``. A backend
    whose ``takes_received_at`` is true also gets ``received_at``, the ``time.perf_counter()`` of
    the server's receipt of the request, so that its ``ttft_s`` counts from there."""

    model_name: str

    def stream(self, question: str, chunks: list[Chunk], system: str | None,
               **sampling: Any) -> GenerationStream: ...

    async def model_info(self) -> dict[str, Any]: ...

    def cache_stats(self) -> dict[str, Any]: ...


class LocalBackend:
    """The ``Backend`` of one ``LazyLLM`` in this process. Its streams are the engine's own
    ``TextStream``s, whose events wake the event loop from the engine thread (no thread is
    held per request). The ``LazyLLM`` stays open: its owner closes it."""

    takes_received_at = True  # same process: the server's receipt time is the engine's clock

    def __init__(self, llm: LazyLLM):
        self.llm = llm
        self.model_name = str(llm.model_name)
        self._max_token_chars = _max_token_chars(llm.tokenizer)

    def stream(self, question: str, chunks: list[Chunk], system: str | None, **sampling: Any) -> TextStream:
        return self.llm.stream(question, chunks, system, **sampling)

    def check_length(self, chars: int) -> None:
        """Refuse a prompt of ``chars`` characters that cannot fit the context, from a lower
        bound on its token count (no token is longer than the vocabulary's longest), so an
        oversized body costs no tokenization."""
        from lazyllm.errors import ContextLengthError

        limit = self.llm.model.spec.max_context
        if limit and self._max_token_chars and chars // self._max_token_chars > limit:
            raise ContextLengthError(f"the prompt has {chars} characters, at least "
                                     f"{chars // self._max_token_chars} tokens; the model's context is {limit}")

    async def model_info(self) -> dict[str, Any]:
        info = {"max_context": self.llm.model.spec.max_context}
        info.update(engine_settings(self.llm))
        return info

    def engine_settings(self) -> dict[str, Any]:
        return engine_settings(self.llm)

    def cache_stats(self) -> dict[str, Any]:
        return self.llm.cache_stats()

    def warmup(self) -> dict[str, Any]:
        return self.llm.warmup()

    def ready(self) -> bool:
        return self.llm.ready

    def engine_stats(self) -> dict[str, Any]:
        return dict(getattr(getattr(self.llm, "engine", None), "metrics", None) or {})


def _max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry
    (a byte-level BPE entry has one character per byte, a SentencePiece entry one per
    character; byte-fallback and special tokens are longer than what they decode to). 0
    when the tokenizer has no vocabulary to read."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        return 0


def as_backend(llm_or_backend: LazyLLM | Backend, **local_kwargs: Any) -> Backend:
    """``llm_or_backend`` itself when it is a ``Backend``, else a ``LocalBackend`` of it."""
    if isinstance(llm_or_backend, LazyLLM) or not isinstance(llm_or_backend, Backend):
        return LocalBackend(llm_or_backend, **local_kwargs)
    return llm_or_backend
