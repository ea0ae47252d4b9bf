"""lazyllm: an in-process RAG LLM backend with zero-copy chunk-KV reuse (deferred RoPE).

>>> from lazyllm import LazyLLM, Chunk
>>> llm = LazyLLM()                               # embedded default model, offline
>>> out = llm.generate("Who wrote it?", chunks=["doc one ...", Chunk("doc two ...", id="d2")])
>>> out.text, out.usage.cached_tokens, out.ttft_s
"""
from .api import LazyLLM
from .errors import (
    CacheCapacityError,
    ContextLengthError,
    InvalidRequestError,
    LazyLLMError,
    ModelLoadError,
    RequestCancelled,
    UnsupportedModelError,
)
from .stream import TextStream
from .types import Chunk, GenerationOutput, Grammar, Regex, SamplingParams, ScoreOutput, ToolCall, Usage

__version__ = "0.1.0"

__all__ = [
    "LazyLLM", "TextStream", "Chunk", "GenerationOutput", "SamplingParams", "ScoreOutput", "Usage", "Regex",
    "Grammar", "ToolCall",
    "LazyLLMError", "InvalidRequestError", "ContextLengthError", "ModelLoadError",
    "UnsupportedModelError", "CacheCapacityError", "RequestCancelled",
]
