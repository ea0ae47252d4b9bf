"""``POST /v1/embeddings``: OpenAI's embeddings endpoint over the embedder the server is
given (``create_app(embedder=...)``): by default the bundled MiniLM (``integrations/minilm.py``,
loaded at the first request), or any object with ``encode(texts) -> (n, dim)`` array (a
``MiniLMEncoder``, a sentence-transformers model), or a callable ``texts -> (n, dim)``, or a
LangChain ``Embeddings`` (``embed_documents``). The vectors are the embedder's own, as float
lists or (``encoding_format: "base64"``, what the OpenAI client asks by default) little-endian
float32 bytes."""
from __future__ import annotations

import base64
import json
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from .errors import APIError

__all__ = ["EmbeddingRequest", "Embedder", "MAX_INPUTS", "embeddings_response", "validate_embedding_body"]

MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


class EmbeddingRequest(BaseModel):
    """The body of ``POST /v1/embeddings`` (OpenAI's fields; an unknown one is 400)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class Embedder:
    """What ``/v1/embeddings`` runs: ``name`` (the id clients send as ``model``) and
    ``embed(texts) -> (n, dim)`` float32 array, from the object the server was given."""

    def __init__(self, embedder: Any = "minilm", name: str | None = None):
        if isinstance(embedder, str) and embedder != "minilm":
            raise ValueError(f"embedder must be 'minilm', None or an embedding model, got {embedder!r}")
        self._given = embedder
        if name is None and embedder == "minilm":
            from lazyllm.integrations.minilm import MODEL_NAME as name
        self.name = name or str(getattr(embedder, "model_name", None) or type(embedder).__name__)

    def embed(self, texts: list[str]) -> np.ndarray:
        e = self._given
        if e == "minilm":
            from lazyllm.integrations.minilm import embed

            return embed(texts)
        if hasattr(e, "encode"):
            vecs = e.encode(texts)
        elif hasattr(e, "embed_documents"):
            vecs = e.embed_documents(texts)
        else:
            vecs = e(texts)
        return np.asarray(vecs, dtype=np.float32).reshape(len(texts), -1)


def validate_embedding_body(raw: bytes) -> EmbeddingRequest:
    """Parse and validate a body (strict types); raises ``APIError(400)`` naming the field."""
    from .protocol import parse_body

    return parse_body(EmbeddingRequest, raw)


def texts_of(body: EmbeddingRequest) -> list[str]:
    """The request's texts; token-id inputs and empty texts are refused (400)."""
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise APIError(400, "input: give at least one text", param="input")
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"input: at most {MAX_INPUTS} texts per request, got {len(texts)}", param="input")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise APIError(400, "input: lazyllm embeds text; send strings, not token ids", param="input",
                           code="unsupported")
        if not t:
            raise APIError(400, f"input[{i}]: an empty string cannot be embedded", param="input")
    if body.encoding_format not in ("float", "base64"):
        raise APIError(400, f"encoding_format: 'float' or 'base64', got {body.encoding_format!r}",
                       param="encoding_format")
    return texts


def embeddings_response(vectors: np.ndarray, *, model: str, encoding_format: str, tokens: int,
                        dimensions: int | None) -> dict[str, Any]:
    """OpenAI's embeddings list for ``vectors`` ``(n, dim)``."""
    if dimensions is not None and dimensions != vectors.shape[1]:
        raise APIError(400, f"dimensions: this embedding model gives {vectors.shape[1]} dimensions and cannot be "
                            f"shortened, got {dimensions}", param="dimensions", code="unsupported")
    data = []
    for i, v in enumerate(vectors):
        emb: Any = base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode() \
            if encoding_format == "base64" else [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def count_tokens(embedder: Embedder, texts: list[str]) -> int:
    """Prompt tokens for ``usage``: the embedder's tokenizer where it has one, else words."""
    given = embedder._given
    tok = None
    if given == "minilm":
        from lazyllm.integrations.minilm import get_encoder

        tok = get_encoder().tokenizer
    else:
        tok = getattr(given, "tokenizer", None)
    if tok is not None and callable(tok):
        return sum(len(ids) for ids in tok(texts, truncation=True)["input_ids"])
    return sum(len(t.split()) for t in texts)


def add_route(app: Any, srv: Any, embedder: Embedder | None) -> None:
    """Register ``POST /v1/embeddings`` on ``app`` (``srv``: the app's ``_Server``, for its
    key, body limit and metrics); without an embedder it answers 404 saying so."""
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        srv.check_auth(request)
        if embedder is None:
            raise APIError(404, "this server serves no embedding model (start it with --embedder minilm)",
                           code="not_found")
        raw = await srv.read_body(request)
        body = await run_in_threadpool(validate_embedding_body, raw)
        if body.model is None:
            raise APIError(400, "you must provide a model parameter", param="model", code="missing_model")
        if body.model != embedder.name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server embeds with "
                                f"{embedder.name!r}", param="model", code="model_not_found")
        texts = texts_of(body)
        try:
            vectors, tokens = await run_in_threadpool(lambda: (embedder.embed(texts), count_tokens(embedder, texts)))
        except Exception as e:  # the embedder's own failure (a missing package, a bad model)
            raise APIError(503, f"the embedding model failed: {e}", type="server_error") from None
        out = embeddings_response(vectors, model=embedder.name, encoding_format=body.encoding_format,
                                  tokens=tokens, dimensions=body.dimensions)
        srv.count(request, "200")
        return Response(json.dumps(out, separators=(",", ":")).encode(), media_type="application/json")
