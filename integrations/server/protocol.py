"""The OpenAI chat-completions protocol: the request body as pydantic models (a field a
feature adds is one more model field, validated with the rest), its translation into a
``LazyLLM.generate`` call (``parse_chat_request``), the response bodies (``completion_response``,
``stream_chunk``, ``usage_json``, ``sse``); OpenAI's error body (``APIError``,
``error_body``, ``error_from_exception``) is ``errors.py``'s. Pure functions: no app, no engine."""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lazyllm import Chunk, GenerationOutput
from lazyllm.errors import InvalidRequestError
from lazyllm.inputs.conversation import keeps_turns
from lazyllm.structured.tools import CALL_OPEN

from .._common import request_from_messages
from .errors import APIError
from .preflight import DEFAULT_MAX_NEW_TOKENS_LIMIT, DEFAULT_MAX_TOKENS

# -- the request body ------------------------------------------------------------------

class DocumentIn(BaseModel):
    """One document of the ``documents`` extension (a plain string is accepted too)."""

    model_config = ConfigDict(extra="forbid")
    text: str
    id: str | int | None = None
    metadata: dict[str, Any] | None = None


class ChatMessageIn(BaseModel):
    """One chat message. ``content`` is a string, ``null`` (an assistant turn with tool
    calls) or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The body of ``POST /v1/chat/completions``: OpenAI's fields, ``top_k`` (as vLLM),
    ``documents`` (the chunks) and ``quality`` (the server's preset, see ``create_app``).
    As OpenAI, an unknown field is refused with 400 ("Unrecognized request argument"), and
    so are known features lazyllm does not have (legacy ``functions``, ``n`` > 1 with tools,
    penalties, audio), rather than silently ignored. Fields that do not
    change the answer (``user``, ``metadata``, ``store``...) are accepted.

    A feature adds its fields here (validated with the rest, strict types) and reads them in
    ``parse_chat_request``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN and Infinity are not numbers here
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    documents: list[str | DocumentIn] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=8)  # choices.MAX_CHOICES
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    quality: str | None = None
    # accepted, no effect on the answer
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # refused unless they ask for what lazyllm does anyway (text out, no audio)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "DocumentIn", "ChatMessageIn",
               "StreamOptions"}


def _param(loc: tuple) -> str | None:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in _UNION_TAGS or "[" in str(p) or str(p).startswith(("function-", "literal")):
            continue  # pydantic's name of a union member, not a field
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or None


def _first_error(e: ValidationError) -> dict[str, Any]:
    """The most specific error: where a value matches no member of a union (``str`` or an
    object), pydantic reports one error per member; the deepest names the field."""
    errors = e.errors(include_url=False)
    return max(errors, key=lambda err: len((_param(tuple(err["loc"])) or "").replace("[", ".").split(".")))


def parse_body(model: type[BaseModel], raw: bytes | str) -> Any:
    """``raw`` parsed and validated as ``model`` (JSON, strict types: ``"5"`` is not a number),
    for every endpoint. Raises ``APIError(400)`` naming the offending field (``param``, e.g.
    ``messages[0].role``)."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        err = _first_error(e)
        if err["type"] == "json_invalid" and "recursion limit" in err["msg"]:
            # valid JSON, nested past the parser's depth: most likely a deep JSON Schema, which
            # the grammar library could not take either
            raise APIError(400, "the body nests JSON objects and arrays too deeply for the parser (a JSON Schema "
                                "may nest about 60 levels of properties)", code="too_deep") from None
        if err["type"] == "json_invalid":
            lone = _LONE_SURROGATE.search(raw if isinstance(raw, str) else raw.decode("utf-8", "replace"))
            why = (f"{lone.group(0)} is half of a UTF-16 surrogate pair without its other half, not a character"
                   if lone and "escape" in err["msg"] else err["msg"])
            raise APIError(400, f"the body is not valid JSON: {why}", code="invalid_json") from None
        param = _param(tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                           code="unknown_parameter") from None
        if param is None and err["type"] == "model_type":
            raise APIError(400, "the body must be a JSON object") from None
        msg = err["msg"] if param is None else f"{param}: {err['msg']}"
        raise APIError(400, msg, param=param) from None


def validate_body(raw: bytes | str) -> ChatCompletionRequest:
    """A chat completion request (``parse_body``), with OpenAI's rule for ``stream_options``."""
    body = parse_body(ChatCompletionRequest, raw)
    if body.stream_options is not None and not body.stream:  # as OpenAI
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return body


# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or a \uDC00-\uDFFF one not after one
_LONE_SURROGATE = re.compile(r"(?<!\\)\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             r"|(?<![dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


class ChatRequest(NamedTuple):
    """What one chat completion asks of the engine: ``llm.generate(question, chunks,
    system, **sampling)``. With tools or a tool round trip in the conversation,
    ``question`` is None and ``sampling["messages"]`` carries the conversation."""

    question: str | None
    chunks: list[Chunk]
    system: str | None
    sampling: dict[str, Any]


def _unsupported(body: ChatCompletionRequest) -> None:
    def no(param: str, what: str) -> None:
        raise APIError(400, f"{param}: {what} is not supported by lazyllm", param=param, code="unsupported")

    if body.n not in (None, 1) and body.tools and body.tool_choice != "none":
        no("n", "more than one choice with tools")
    if body.functions or body.function_call is not None:
        no("functions" if body.functions else "function_call", "the legacy function-calling fields (use tools)")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: logprobs must be set to true when top_logprobs is used",
                       param="top_logprobs")
    if body.presence_penalty or body.frequency_penalty:
        no("presence_penalty" if body.presence_penalty else "frequency_penalty", "a repetition penalty")
    if body.logit_bias:
        no("logit_bias", "a logit bias")
    _openai_refusals(body)
    rf = body.response_format
    if rf is not None and rf.get("type") not in ("text", "json_object", "json_schema"):
        no("response_format", f"response_format type {rf.get('type')!r} (text, json_object, json_schema are)")
    if body.modalities not in (None, ["text"]) or body.audio:
        no("modalities" if body.modalities not in (None, ["text"]) else "audio", "audio output")
    for name in ("prediction", "web_search_options", "reasoning_effort", "verbosity"):
        if getattr(body, name) is not None:
            no(name, name.replace("_", " "))


MAX_STOP = 4  # OpenAI's limit on stop sequences


def _openai_refusals(body: ChatCompletionRequest) -> None:
    """What OpenAI refuses although lazyllm could take it: a client written against this
    server must keep working against OpenAI, and the reverse."""
    if body.tools is not None and not body.tools:
        raise APIError(400, "tools: [] is too short; leave tools out for no tools", param="tools",
                       code="empty_array")
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOP:
        raise APIError(400, f"stop: at most {MAX_STOP} stop sequences, got {len(body.stop)}", param="stop")
    if isinstance(body.tool_choice, str) and body.tool_choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice: a string must be 'none', 'auto' or 'required', got {body.tool_choice!r}; "
                            'name a tool with {"type": "function", "function": {"name": ...}}', param="tool_choice")
    rf = body.response_format
    if rf is not None and rf.get("type") == "json_schema" and not isinstance(
            (rf.get("json_schema") or {}).get("schema"), dict):
        raise APIError(400, "response_format.json_schema.schema: a json_schema response format needs its schema "
                            "(a JSON Schema object)", param="response_format.json_schema.schema")


def _content_text(m: ChatMessageIn, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            param = f"messages[{i}].content[{j}]"
            raise APIError(400, f"{param}: lazyllm takes text content parts ({{'type': 'text', 'text': ...}}); "
                                f"got type {kind!r} (send documents in `documents`)", param=param)
        texts.append(part["text"])
    return "".join(texts)


def _needs_conversation(body: ChatCompletionRequest) -> bool:
    """Tools, or a conversation with tool calls or results, go to the engine as messages (the
    calls and results are rendered in the model's tool format, not folded into a question):
    ``keeps_turns``, the rule every entry point follows."""
    return keeps_turns([{"role": m.role, "tool_calls": (m.model_extra or {}).get("tool_calls")}
                        for m in body.messages], body.tools)


def conversation_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as ``LazyLLM.generate(messages=...)`` takes them: ``developer`` is
    ``system``; assistant ``tool_calls`` and tool ``tool_call_id`` kept."""
    out = []
    for i, m in enumerate(body.messages):
        if m.role == "function":
            raise APIError(400, f"messages[{i}]: role 'function' is the legacy format; send role 'tool' with "
                                "tool_call_id", param=f"messages[{i}].role")
        extra = m.model_extra or {}
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _content_text(m, i)}
        calls = extra.get("tool_calls")
        if calls is not None:
            if m.role != "assistant" or not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls: a list, on an assistant message",
                               param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = calls
        if m.role == "tool":
            if not isinstance(extra.get("tool_call_id"), str):
                raise APIError(400, f"messages[{i}].tool_call_id: a tool message needs the id of the call it "
                                    "answers", param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = extra["tool_call_id"]
        out.append(msg)
    return out


def _structured_args(body: ChatCompletionRequest, messages: list[dict] | None) -> dict[str, Any]:
    """The engine's structured-output arguments of a request (only those it sets). The
    engine validates them (schemas compiled, tool names checked) when the request is built,
    so bad ones are a 400 before anything runs."""
    out: dict[str, Any] = {}
    if messages is not None:
        out["messages"] = messages
    if body.response_format is not None and body.response_format.get("type") != "text":
        out["response_format"] = body.response_format
    if body.tools:
        out["tools"] = body.tools
        # one call per answer unless the client asks for several: OpenAI's default is parallel,
        # but a small model allowed several tends to repeat its call
        out["parallel_tool_calls"] = bool(body.parallel_tool_calls)
    if body.tool_choice is not None:
        out["tool_choice"] = body.tool_choice
    return out


def emits_tool_calls(body: ChatCompletionRequest) -> bool:
    """Whether the answer may be tool calls (then a stream's text is read as calls)."""
    return bool(body.tools) and body.tool_choice != "none"


def documents_to_chunks(documents: list[str | DocumentIn | dict] | None) -> list[Chunk]:
    """The ``documents`` extension as ``lazyllm.Chunk``s, in order."""
    chunks = []
    for d in documents or []:
        if isinstance(d, str):
            chunks.append(Chunk(d))
        else:
            if isinstance(d, dict):
                d = DocumentIn.model_validate(d)
            chunks.append(Chunk(d.text, id=None if d.id is None else str(d.id), metadata=dict(d.metadata or {})))
    return chunks


def parse_chat_request(body: ChatCompletionRequest | dict | bytes | str, *,
                       max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT,
                       default_max_tokens: int = DEFAULT_MAX_TOKENS,
                       default_temperature: float = 0.0) -> ChatRequest:
    """``(question, chunks, system, sampling)`` of a chat completion body.

    ``system``/``developer`` messages join into the system prompt; the last ``user``
    message with text is the question and the other turns are folded into it as a
    transcript (``integrations._common``); ``documents`` become the chunks. With ``tools``,
    or assistant ``tool_calls`` / ``tool`` messages in the conversation, the messages go to
    the engine as they are (``sampling["messages"]``, question None) and the documents attach
    to the first user message. ``response_format``, ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` join ``sampling`` (the engine's arguments). ``max_tokens``
    (or ``max_completion_tokens``) defaults to ``min(default_max_tokens,
    max_new_tokens_limit)`` and may not exceed the limit; ``temperature`` defaults to
    ``default_temperature`` (greedy). Raises ``APIError(400)`` for anything malformed.
    """
    if isinstance(body, (bytes, str)):
        body = validate_body(body)
    elif isinstance(body, dict):
        try:
            body = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = _first_error(e)
            param = _param(tuple(err["loc"]))
            raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
    _unsupported(body)
    if _needs_conversation(body):
        question, own_chunks, system = None, [], None  # all in the messages
        messages = conversation_messages(body)
    else:
        turns = []
        for i, m in enumerate(body.messages):
            role = "system" if m.role == "developer" else "tool" if m.role == "function" else m.role
            turns.append((role, _content_text(m, i), []))
        try:
            req = request_from_messages(turns)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="messages") from None
        question, own_chunks, system, messages = req.question, req.chunks, req.system, None
    try:
        chunks = documents_to_chunks(body.documents)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="documents") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, max_new_tokens_limit)
    elif max_tokens > max_new_tokens_limit:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{param}={max_tokens} is above this server's limit of {max_new_tokens_limit}",
                       param=param)
    stop = body.stop
    if isinstance(stop, list) and any(s == "" for s in stop) or stop == "":
        raise APIError(400, "stop: stop strings must not be empty", param="stop")
    sampling: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": default_temperature if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k is None else body.top_k,
        "seed": body.seed,
        "stop": stop or None,
    }
    if body.logprobs:
        sampling["logprobs"] = True
        sampling["top_logprobs"] = body.top_logprobs or 0
    sampling.update(_structured_args(body, messages))
    return ChatRequest(question, chunks + own_chunks, system, sampling)


# -- the response bodies -----------------------------------------------------------------

def usage_json(out: GenerationOutput) -> dict[str, Any]:
    """OpenAI's ``usage`` object, ``prompt_tokens_details.cached_tokens`` included."""
    u = out.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _timings(out: GenerationOutput) -> dict[str, Any]:
    return {"ttft_s": out.ttft_s, "engine_ttft_s": out.engine_ttft_s, "queue_s": out.queue_s, "total_s": out.total_s,
            "cached_chunk_tokens": out.usage.cached_chunk_tokens, "chunk_ids": list(out.chunk_ids)}


def logprobs_json(out: GenerationOutput) -> dict[str, Any] | None:
    """OpenAI's ``choices[].logprobs`` of a result (None when it asked for none)."""
    if out.logprobs is None:
        return None
    return {"content": [t.to_openai() for t in out.logprobs], "refusal": None}


def _message(out: GenerationOutput) -> dict[str, Any]:
    """The assistant message: its calls (content null: the text was only calls), or, cut off
    before a call's name was known, neither content nor calls; or text."""
    if out.tool_calls:
        return {"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in out.tool_calls]}
    if out.answer_is_calls or out.text.startswith(CALL_OPEN):
        return {"role": "assistant", "content": None}
    return {"role": "assistant", "content": out.text}


def completion_response(out: GenerationOutput, *, model: str, request_id: str | None = None,
                        created: int | None = None) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` object for one result; a ``lazyllm`` field adds TTFT,
    queue time and the chunk ids (clients ignore it)."""
    return {
        "id": request_id or new_request_id(),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "message": _message(out), "logprobs": logprobs_json(out),
                     "finish_reason": out.finish_reason}],
        "usage": usage_json(out),
        "system_fingerprint": None,
        "lazyllm": _timings(out),
    }


def stream_chunk(request_id: str, created: int, model: str, *, content: str | None = None,
                 role: str | None = None, finish_reason: str | None = None,
                 usage: dict[str, Any] | None = None, out: GenerationOutput | None = None,
                 tool_calls: list[dict[str, Any]] | None = None,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``: a delta (``role``, ``content`` and/or ``tool_calls``
    items from ``ToolCallDeltas``), the closing
    delta (``finish_reason``), or, with ``usage``, the final usage chunk (no choices; with
    ``out``, a ``lazyllm`` field adds TTFT, queue time and chunk ids)."""
    obj: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": None}
    if usage is not None:
        obj["choices"] = []
        obj["usage"] = usage
        if out is not None:
            obj["lazyllm"] = _timings(out)
        return obj
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    obj["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    return obj


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (or the literal ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def new_request_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex
