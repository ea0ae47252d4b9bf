"""The server's own OpenAPI document (``GET /openapi.json``): every endpoint, its request body
(from the same pydantic models that validate it, so the document cannot drift from what is
accepted) and every response it may give, success and error, with their bodies' schemas. A
client generator reads it, and ``tests/server/test_server_fuzz.py`` fuzzes the app from it
(schemathesis): no 500, and no response outside what is written here."""
from __future__ import annotations

from typing import Any

__all__ = ["openapi_document", "add_route"]

_REF = "#/components/schemas/{model}"
_STR_OR_NULL = {"anyOf": [{"type": "string"}, {"type": "null"}]}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": _STR_OR_NULL, "code": _STR_OR_NULL}}}}

_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
_TOKEN = {"type": "object", "required": ["token", "logprob", "bytes"], "properties": {
    "token": {"type": "string"}, "logprob": {"type": "number"},
    "bytes": {"type": "array", "items": {"type": "integer"}}}}
_LOGPROBS = {"anyOf": [{"type": "null"}, {"type": "object", "required": ["content"], "properties": {"content": {
    "type": "array", "items": {**_TOKEN, "properties": {**_TOKEN["properties"], "top_logprobs": {
        "type": "array", "items": _TOKEN}}}}}}]}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer", "minimum": 0}, "completion_tokens": {"type": "integer", "minimum": 0},
    "total_tokens": {"type": "integer", "minimum": 0}}}
CHAT_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                   "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": USAGE,
    "choices": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "logprobs": _LOGPROBS,
            "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
            "message": {"type": "object", "required": ["role", "content"], "properties": {
                "role": {"const": "assistant"}, "content": _STR_OR_NULL,
                "tool_calls": {"type": "array", "minItems": 1, "items": _TOOL_CALL}}}}}}}}
TEXT_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": USAGE, "choices": {"type": "array", "items": {
        "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "text": {"type": "string"},
            "finish_reason": {"enum": ["stop", "length", None]}}}}}}
EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"const": "list"}, "model": {"type": "string"},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"]},
    "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"], "properties": {
        "object": {"const": "embedding"}, "index": {"type": "integer"},
        "embedding": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "number"}}]}}}}}}
MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}}}
STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    what = {400: "bad input", 401: "missing or wrong API key", 404: "unknown model or route", 405: "wrong method",
            413: "body over the size limit", 429: "at the concurrency limit", 503: "not available"}
    return {str(c): _json({"$ref": _REF.format(model="Error")}, what[c]) for c in codes}


def _body(model: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(model=model)}}}}


def _model_schemas(models: list[str], embedders: list[str]) -> dict[str, Any]:
    """The request bodies' schemas, from the pydantic models that validate them; ``model`` is
    required and names one of this server's ``models`` (``embedders`` for embeddings)."""
    from .completions import CompletionRequest
    from .embeddings import EmbeddingRequest
    from .protocol import ChatCompletionRequest

    out: dict[str, Any] = {}
    for model, names in ((ChatCompletionRequest, models), (CompletionRequest, models), (EmbeddingRequest, embedders)):
        schema = model.model_json_schema(ref_template=_REF)
        out.update(schema.pop("$defs", {}))
        schema["properties"]["model"] = {"enum": sorted(names)} if names else {"type": "string"}
        schema["required"] = sorted({*schema.get("required", []), "model"})
        out[model.__name__] = schema
    return out


def openapi_document(models: list[str] = (), embedders: list[str] = (), title: str = "lazyllm") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the app's endpoints (``models``: the ids chat requests may
    name; ``embedders``: the embedding model's, empty when none is served)."""
    secured = [{"bearer": []}]
    chat_ok = {"description": "the completion, or with stream: server-sent chat.completion.chunk events",
               "content": {"application/json": {"schema": {"$ref": _REF.format(model="ChatCompletion")}},
                           "text/event-stream": {"schema": {"type": "string"}}}}
    paths = {
        "/v1/chat/completions": {"post": {"operationId": "createChatCompletion", "security": secured,
                                          "requestBody": _body("ChatCompletionRequest"),
                                          "responses": {"200": chat_ok, **_errors(400, 401, 404, 413, 429)}}},
        "/v1/completions": {"post": {"operationId": "createCompletion", "security": secured,
                                     "requestBody": _body("CompletionRequest"),
                                     "responses": {"200": {**chat_ok, "content": {
                                         "application/json": {"schema": {"$ref": _REF.format(model="TextCompletion")}},
                                         "text/event-stream": {"schema": {"type": "string"}}}},
                                         **_errors(400, 401, 404, 413, 429)}}},
        "/v1/embeddings": {"post": {"operationId": "createEmbedding", "security": secured,
                                    "requestBody": _body("EmbeddingRequest"),
                                    "responses": {"200": _json({"$ref": _REF.format(model="Embeddings")},
                                                               "the vectors"), **_errors(400, 401, 404, 413, 503)}}},
        "/v1/models": {"get": {"operationId": "listModels", "security": secured, "responses": {
            "200": _json({"type": "object", "required": ["object", "data"], "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": _REF.format(model="Model")}}}},
                "the served model"), **_errors(401)}}},
        "/v1/models/{model_id}": {"get": {
            "operationId": "retrieveModel", "security": secured,
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _json({"$ref": _REF.format(model="Model")}, "the model"), **_errors(401, 404)}}},
        "/health": {"get": {"operationId": "health", "parameters": [
            {"name": "ready", "in": "query", "required": False, "schema": {"type": "string"}}],
            "responses": {"200": _json(STATUS, "alive (or ready)"), "503": _json(STATUS, "warming up")}}},
        "/ready": {"get": {"operationId": "ready", "responses": {"200": _json(STATUS, "ready"),
                                                                  "503": _json(STATUS, "warming up")}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {
            "description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    schemas = {"Error": ERROR, "ChatCompletion": CHAT_COMPLETION, "TextCompletion": TEXT_COMPLETION,
               "Embeddings": EMBEDDINGS, "Model": MODEL,
               **_model_schemas(list(models), list(embedders))}
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"}, "paths": paths,
            "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def add_route(app: Any, models: list[str], embedders: list[str]) -> None:
    """Serve the document at ``GET /openapi.json`` (no key needed: it holds no data)."""
    from fastapi.responses import JSONResponse

    doc = openapi_document(models, embedders)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(doc)
