"""Exceptions raised by lazyllm. Every public entry point raises one of these for bad input.

``LazyLLMError`` is the base; ``InvalidRequestError`` also derives from ``ValueError`` and
``ModelLoadError`` from ``OSError`` so that callers catching the builtin types keep working.
A failed request never stops the engine: the next request is served normally.
"""


class LazyLLMError(Exception):
    """Base class of every error raised by lazyllm."""


class InvalidRequestError(LazyLLMError, ValueError):
    """The request (question, chunks, sampling options...) is malformed."""


class ContextLengthError(InvalidRequestError):
    """The request does not fit in the model's context window."""


class UnsupportedModelError(LazyLLMError, ValueError):
    """The model's architecture is not one lazyllm implements."""


class ModelLoadError(LazyLLMError, OSError):
    """The model could not be found or loaded."""


class CacheCapacityError(LazyLLMError, RuntimeError):
    """The KV pool is too small to hold what one request needs."""


class RequestCancelled(LazyLLMError):
    """The request was cancelled by its caller."""
