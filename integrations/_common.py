"""Framework-neutral glue shared by the LangChain, LlamaIndex and chromadb adapters.

Everything here speaks ``lazyllm`` types only (``LazyLLM``, ``Chunk``,
``GenerationOutput``); the framework modules translate their own message and document
types into a :class:`RagRequest` and back.

Conversation history
--------------------
The engine renders one request as a single user turn of the model's chat template:
``[system][documents...][question]``, where the documents are cached chunks. Chat
frameworks send whole conversations, so earlier turns are folded into the question text,
after the question itself, like this::

    <latest user message>

    Conversation so far:
    User: <earlier user message>
    Assistant: <earlier assistant message>

The latest message comes first so that the ``Question:`` label the engine puts in front
of the question text stays attached to the actual question. Documents are never folded
into this text: they always travel as chunks, whichever message carried them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lazyllm import Chunk, GenerationOutput, InvalidRequestError, LazyLLM
from lazyllm.api import TextStream

HISTORY_HEADER = "Conversation so far:"
ROLE_LABELS = {"user": "User", "assistant": "Assistant", "tool": "Tool", "system": "System"}


@dataclass
class RagRequest:
    """What one call to the engine needs: the question, the documents as chunks (in
    retrieval order) and the shared system prompt."""

    question: str
    chunks: list[Chunk] = field(default_factory=list)
    system: str | None = None


def fold_history(question: str, history: list[tuple[str, str]]) -> str:
    """The question text with earlier turns ``(role, text)`` appended as a transcript
    (see the module docstring). ``role`` is ``user``, ``assistant`` or ``tool``."""
    turns = [(r, t.strip()) for r, t in history if t and t.strip()]
    if not turns:
        return question
    lines = [f"{ROLE_LABELS.get(r, r.title())}: {t}" for r, t in turns]
    return f"{question.strip()}\n\n{HISTORY_HEADER}\n" + "\n".join(lines)


def request_from_turns(turns: list[tuple[str, str]], chunks: list[Chunk], system_parts: list[str],
                       user: str = "user") -> RagRequest:
    """The request a chat transcript asks: the last ``user`` turn is the question, the
    other turns are folded into it (``fold_history``), system texts are joined."""
    last_user = max((i for i, (r, _) in enumerate(turns) if r == "user"), default=None)
    if last_user is None:
        raise InvalidRequestError(f"the messages need a {user} message with text (the question)")
    history = turns[:last_user] + turns[last_user + 1:]
    return RagRequest(fold_history(turns[last_user][1], history), chunks, join_system(system_parts))


def join_system(parts: list[str]) -> str | None:
    parts = [p.strip() for p in parts if p and p.strip()]
    return "\n\n".join(parts) if parts else None


# -- sampling options --------------------------------------------------------------

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "timeout")


def sampling_kwargs(**kw: Any) -> dict[str, Any]:
    """The ``LazyLLM.generate`` keyword arguments among ``kw``, ``None`` values dropped."""
    return {k: v for k, v in kw.items() if k in SAMPLING_KEYS and v is not None}


def hf_generate_kwargs(kw: dict[str, Any] | None) -> dict[str, Any]:
    """Map transformers-style generation options (``pipeline_kwargs`` of
    ``HuggingFacePipeline``, ``generate_kwargs`` of ``HuggingFaceLLM``) to ours, so that
    swapping those classes for ours keeps working. ``do_sample=False`` means greedy;
    options with no counterpart (``repetition_penalty``...) raise, rather than being
    silently ignored."""
    out: dict[str, Any] = {}
    kw = dict(kw or {})
    do_sample = kw.pop("do_sample", None)
    for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed"):
        if k in kw:
            out[k] = kw.pop(k)
    if "stop_strings" in kw:
        out["stop"] = kw.pop("stop_strings")
    kw.pop("return_full_text", None)  # we never echo the prompt
    if kw:
        raise InvalidRequestError(f"unsupported generation options for lazyllm: {sorted(kw)}")
    if do_sample is False:
        out["temperature"] = 0.0
    elif do_sample and not out.get("temperature"):
        out["temperature"] = 1.0
    return out


def device_from_hf(device: Any) -> str | None:
    """transformers pipelines take ``device=-1`` for CPU and ``device=0`` for cuda:0."""
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu" if device < 0 else f"cuda:{device}"
    return str(device)


# -- the engine ----------------------------------------------------------------------

def build_engine(*args: Any, **kwargs: Any) -> LazyLLM:
    """``LazyLLM(*args, **kwargs)`` for an adapter that builds its own engine (the core
    stops every engine at interpreter exit)."""
    return LazyLLM(*args, **kwargs)


def resolve_lazyllm(obj: Any) -> LazyLLM:
    """The ``LazyLLM`` behind ``obj``: a ``LazyLLM`` itself or any of our adapters."""
    if isinstance(obj, LazyLLM):
        return obj
    for attr in ("llm", "lazyllm"):
        inner = getattr(obj, attr, None)
        if isinstance(inner, LazyLLM):
            return inner
    raise InvalidRequestError(
        f"expected a LazyLLM or a lazyllm integration model, got {type(obj).__name__}")


def GenerationStream(llm: LazyLLM, request: RagRequest, **sampling: Any) -> TextStream:
    """Text deltas of one request (``for`` or ``async for``), with the full
    ``GenerationOutput`` (usage, TTFT, finish reason) in ``.output`` once the iteration
    ends: ``LazyLLM.stream``, taking a ``RagRequest``."""
    return llm.stream(request.question, request.chunks, request.system, **sampling)


def usage_dict(out: GenerationOutput) -> dict[str, Any]:
    """Flat, JSON-friendly summary of one result (for framework metadata fields)."""
    return {
        "prompt_tokens": out.usage.prompt_tokens,
        "cached_tokens": out.usage.cached_tokens,
        "completion_tokens": out.usage.completion_tokens,
        "total_tokens": out.usage.total_tokens,
        "finish_reason": out.finish_reason,
        "ttft_s": out.ttft_s,
        "total_s": out.total_s,
        "chunk_ids": list(out.chunk_ids),
    }
