"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over a generation backend: one
``LazyLLM`` in this process (``LocalBackend``), or Ray Serve replicas behind a deployment
handle (``lazyllm.integrations.ray_serve.RayBackend``). Both get the same app, endpoints,
validation, errors and metrics: ``create_app(llm_or_backend, ...)``.

Endpoints:

- ``POST /v1/chat/completions``: OpenAI's chat completions, streaming (server-sent
  events) or not; ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens
  whose KV was reused.
- ``GET /v1/models`` (and ``/v1/models/{id}``): the one model served.
- ``GET /health``: liveness. ``GET /ready`` (or ``/health?ready``): readiness, 503 until the
  warm-up finished (every kernel compiled, the CUDA graphs captured), then 200.
  ``GET /metrics``: Prometheus text (cache hits, misses, resident bytes, pool pages; TTFT,
  queue-time and duration histograms; requests by status; kernels compiled after ready).
  None of them needs the API key.

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
with status 400, 401, 404, 413 or 429 (with ``Retry-After``), every status counted in the
metrics; a client that disconnects, streaming or not, cancels its request
(``GenerationStream.cancel``) and its pages are released. Parsing, validation and
tokenization run on worker threads, off the event loop. docs/server.md is the user's guide.

Modules: ``protocol`` (OpenAI's request and response bodies as pydantic models and pure
functions: ``validate_body`` (bytes -> ``ChatCompletionRequest``), ``parse_chat_request``
(-> question, chunks, system, sampling), ``completion_response``, ``stream_chunk``,
``usage_json``, ``sse``), ``errors`` (OpenAI's error body: ``APIError``, ``error_body``,
``error_from_exception``), ``backends`` (the
``Backend`` interface and ``LocalBackend``), ``metrics`` (Prometheus), ``app``
(``create_app``) and ``cli`` (``lazyllm serve``).

Streams, one per boundary: ``lazyllm.TextStream`` carries a request's deltas from the engine
thread to its caller (here, the event loop, woken by the engine thread); ``ray_serve.RayStream``
from a Ray replica to the ingress; the server's ``relay.Relay`` from either (a ``GenerationStream``)
to the HTTP response; ``remote.RemoteStream`` from the HTTP response to a Python client.

The package imports its modules on first use of a name (``from lazyllm.integrations.server
import create_app``): ``lazyllm serve`` checks its flags (``cli``, ``preflight``) before the
app, the protocol and the engine are imported.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lazyllm.extras import lazy_exports, require

# found, not imported: ``lazyllm serve`` checks its flags before it pays for them
require("server", "fastapi", "uvicorn", "prometheus_client", load=False)

if TYPE_CHECKING:
    from lazyllm.structured.call_stream import ToolCallDeltas

    from .app import create_app
    from .backends import Backend, GenerationStream, LocalBackend, as_backend
    from .cli import build_parser, main
    from .errors import APIError, error_body, error_from_exception
    from .metrics import ServerMetrics
    from .protocol import (
        ChatCompletionRequest,
        ChatRequest,
        DocumentIn,
        completion_response,
        documents_to_chunks,
        new_request_id,
        parse_chat_request,
        sse,
        stream_chunk,
        usage_json,
        validate_body,
    )

# each export's module
_EXPORTS = {
    "ToolCallDeltas": "lazyllm.structured.call_stream", "create_app": ".app",
    **dict.fromkeys(("Backend", "GenerationStream", "LocalBackend", "as_backend"), ".backends"),
    **dict.fromkeys(("build_parser", "main"), ".cli"),
    **dict.fromkeys(("APIError", "error_body", "error_from_exception"), ".errors"),
    "ServerMetrics": ".metrics",
    **dict.fromkeys(("ChatCompletionRequest", "ChatRequest", "DocumentIn", "completion_response",
                     "documents_to_chunks", "new_request_id", "parse_chat_request", "sse", "stream_chunk",
                     "usage_json", "validate_body"), ".protocol"),
}


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "create_app", "main", "build_parser", "Backend", "GenerationStream", "LocalBackend", "as_backend",
    "ChatCompletionRequest", "ChatRequest", "DocumentIn", "APIError", "ToolCallDeltas",
    "validate_body", "parse_chat_request", "documents_to_chunks", "completion_response", "stream_chunk",
    "usage_json", "sse", "error_body", "error_from_exception", "new_request_id", "ServerMetrics",
]
