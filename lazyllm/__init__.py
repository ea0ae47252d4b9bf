"""lazyllm: an in-process RAG LLM backend with zero-copy chunk-KV reuse (deferred RoPE).

>>> from lazyllm import LazyLLM, Chunk
>>> llm = LazyLLM()                               # embedded default model, offline
>>> out = llm.generate("Who wrote it?", chunks=["doc one ...", Chunk("doc two ...", id="d2")])
>>> out.text, out.usage.cached_tokens, out.ttft_s

``LazyLLM`` is imported on first use (it brings torch and transformers): the ``lazyllm``
command checks its arguments before paying for them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    CacheCapacityError,
    ContextLengthError,
    InvalidRequestError,
    LazyLLMError,
    ModelLoadError,
    RequestCancelled,
    UnsupportedModelError,
)
from .extras import lazy_exports
from .stream import TextStream
from .types import Chunk, GenerationOutput, Grammar, Regex, SamplingParams, ScoreOutput, TokenLogprob, ToolCall, Usage

if TYPE_CHECKING:
    from .api import LazyLLM
    from .kernels.options import KernelOptions

__version__ = "0.1.0"


# torch is imported on first use
__getattr__ = lazy_exports(__name__, {"LazyLLM": ".api", "KernelOptions": ".kernels.options"})

__all__ = [
    "LazyLLM", "TextStream", "Chunk", "GenerationOutput", "SamplingParams", "ScoreOutput", "Usage", "Regex",
    "Grammar", "ToolCall", "TokenLogprob", "KernelOptions",
    "LazyLLMError", "InvalidRequestError", "ContextLengthError", "ModelLoadError",
    "UnsupportedModelError", "CacheCapacityError", "RequestCancelled",
]
