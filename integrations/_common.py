"""Framework-neutral glue shared by the LangChain, LlamaIndex and chromadb adapters.

Everything here speaks ``lazyllm`` types only (``LazyLLM``, ``Chunk``,
``GenerationOutput``); the framework modules translate their own message and document
types into a :class:`RagRequest` and back.

Conversation history
--------------------
Whether earlier turns stay chat-template turns or are folded into the question text is one
rule, ``lazyllm.inputs.conversation.keeps_turns`` (turns with tools or tool turns, folded
otherwise, as ``fold_history`` writes them); every adapter and the server decide with it.
Documents are never folded into the text: they always travel as chunks, whichever message
carried them.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lazyllm import Chunk, GenerationOutput, InvalidRequestError, LazyLLM
from lazyllm.inputs.conversation import fold_turns
from lazyllm.presets import QUALITY_OPTIONS
from lazyllm.stream import TextStream


@dataclass
class RagRequest:
    """What one call to the engine needs: the question, the documents as chunks (in
    retrieval order) and the shared system prompt."""

    question: str
    chunks: list[Chunk] = field(default_factory=list)
    system: str | None = None


def request_from_messages(messages: Iterable[tuple[str, str, list[Chunk]]], system_parts: list[str] | None = None,
                          user: str = "user") -> RagRequest:
    """The request a chat transcript asks, each message given as ``(role, text, chunks)``
    (the framework adapters read their own message types into that): every message's
    chunks, in order; ``system`` messages' text after ``system_parts``; the other messages
    with text as turns (``request_from_turns``). ``user`` names the user role in errors."""
    system_parts = list(system_parts or [])
    chunks: list[Chunk] = []
    turns: list[tuple[str, str]] = []
    for role, text, docs in messages:
        chunks.extend(docs)
        if role == "system":
            system_parts.append(text)
        elif text.strip():
            turns.append((role, text))
    return request_from_turns(turns, chunks, system_parts, user=user)


def request_from_turns(turns: list[tuple[str, str]], chunks: list[Chunk], system_parts: list[str],
                       user: str = "user") -> RagRequest:
    """The request a chat transcript asks: the last ``user`` turn is the question, the
    other turns are folded into it (``fold_history``), system texts are joined."""
    return RagRequest(fold_turns(turns, user), chunks, join_system(system_parts))


def join_system(parts: list[str]) -> str | None:
    parts = [p.strip() for p in parts if p and p.strip()]
    return "\n\n".join(parts) if parts else None


# -- sampling options --------------------------------------------------------------

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "timeout")


def sampling_kwargs(**kw: Any) -> dict[str, Any]:
    """The ``LazyLLM.generate`` keyword arguments among ``kw``, ``None`` values dropped."""
    return {k: v for k, v in kw.items() if k in SAMPLING_KEYS and v is not None}


def call_sampling(defaults: dict[str, Any], options: dict[str, Any], owner: str) -> dict[str, Any]:
    """The sampling options of one call: the model's ``defaults`` (a value for each of
    ``SAMPLING_KEYS``) overridden by the per-call ``options``. ``max_tokens`` (the
    LangChain and OpenAI name) stands for ``max_new_tokens`` and wins over it; any other
    option raises ``InvalidRequestError`` naming ``owner``, rather than being ignored.
    Values are kept as given (``None`` included): the adapters differ there."""
    opts = dict(options)
    if "max_tokens" in opts:
        opts["max_new_tokens"] = opts.pop("max_tokens")
    unknown = set(opts) - set(SAMPLING_KEYS)
    if unknown:
        raise InvalidRequestError(f"unsupported options for {owner}: {sorted(unknown)}")
    return {**defaults, **opts}


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
        out["stop"] = list(kw.pop("stop_strings"))
    kw.pop("return_full_text", None)  # we never echo the prompt
    if kw:
        raise InvalidRequestError(f"unsupported generation options for lazyllm: {sorted(kw)}")
    if do_sample is False:
        out["temperature"] = 0.0
    elif do_sample and not out.get("temperature"):
        out["temperature"] = 1.0
    return out


def device_from_hf(device: Any, device_map: Any = None) -> str | None:
    """transformers pipelines take ``device=-1`` for CPU and ``device=0`` for cuda:0;
    a ``device_map`` string (``"cuda"``, ``"cpu"``) counts when ``device`` is not given,
    a dict one (a multi-device placement) does not."""
    if device is None:
        dev = None
    elif isinstance(device, int):
        dev = "cpu" if device < 0 else f"cuda:{device}"
    else:
        dev = str(device)
    return dev or (device_map if isinstance(device_map, str) else None)


def engine_kwargs_from_hf(model_kwargs: dict[str, Any] | None,
                          engine_kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
    """``(LazyLLM keyword arguments, dtype)`` from transformers' ``model_kwargs``
    (``trust_remote_code``, ``dtype``/``torch_dtype``) added to ``engine_kwargs``; any
    other model option raises, rather than being silently ignored."""
    ek = dict(engine_kwargs or {})
    mk = dict(model_kwargs or {})
    if "trust_remote_code" in mk:
        ek["trust_remote_code"] = mk.pop("trust_remote_code")
    dtype = mk.pop("dtype", mk.pop("torch_dtype", None))
    if mk:
        raise InvalidRequestError(f"unsupported model_kwargs for lazyllm: {sorted(mk)}")
    return ek, dtype


# -- the engine ----------------------------------------------------------------------

def engine_options(given: dict[str, Any], engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The ``LazyLLM`` keyword arguments of an adapter: the options its caller set, as named
    arguments (``given``) or in ``engine_kwargs``, and nothing else, so that the engine's
    defaults and a ``quality`` preset apply as they do to ``LazyLLM`` itself."""
    ek = dict(engine_kwargs or {})
    both = sorted(k for k in set(given) & set(ek) if given[k] != ek[k])
    if both:
        raise InvalidRequestError(f"{', '.join(both)} given twice, as an argument and in engine_kwargs")
    return {**ek, **given}


def model_to_run(llm: Any, *names: str | None) -> str | None:
    """The model an adapter's caller asked for under any of its argument names (``model``,
    ``model_name``, ``model_name_or_path``; empty counts as not given), or ``None``. Raises
    ``InvalidRequestError`` where the names disagree, or where an engine ``llm`` was given too
    and runs another model (the name would be reported while that model runs)."""
    given = list(dict.fromkeys(n for n in names if n))
    if len(given) > 1:
        raise InvalidRequestError(f"two different models given: {given[0]!r} and {given[1]!r}")
    name = given[0] if given else None
    if llm is not None and name is not None and name != llm.model_name:
        raise InvalidRequestError(f"the engine given as llm= runs {llm.model_name!r}, not {name!r}; "
                                  "give the engine or the model's name, not both")
    return name


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
        "cached_chunk_tokens": out.usage.cached_chunk_tokens,
        "completion_tokens": out.usage.completion_tokens,
        "total_tokens": out.usage.total_tokens,
        "finish_reason": out.finish_reason,
        "ttft_s": out.ttft_s,
        "total_s": out.total_s,
        "chunk_ids": list(out.chunk_ids),
    }


def engine_settings(llm: Any) -> dict[str, Any]:
    """The engine options a served ``LazyLLM`` runs with (the ``/v1/models`` card and the
    ``lazyllm_engine_info`` metric): the quality preset and the options it resolves to."""
    out: dict[str, Any] = {"quality": getattr(llm, "quality", None)}
    for name in QUALITY_OPTIONS:
        if hasattr(llm, name):
            out[name] = getattr(llm, name)
    return out
