"""OpenAI's error body for the server: ``APIError`` (a status and the body), ``error_body``
and ``error_from_exception`` (lazyllm's errors mapped to statuses)."""
from __future__ import annotations

from typing import Any

from lazyllm.errors import CacheCapacityError, ContextLengthError, InvalidRequestError, RequestCancelled

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


__all__ = ["APIError", "error_body", "error_from_exception"]
