"""Tool calling and structured output for ``ChatLazyLLM``: LangChain messages as OpenAI-shaped
messages for ``LazyLLM.generate(messages=...)``, tool calls back as ``AIMessage.tool_calls``
(streamed as ``tool_call_chunks``), ``bind_tools`` and ``with_structured_output``.

Documents in the conversation (``text-plain`` blocks, or a tool's ``artifact`` that is a list
of ``Document``s, e.g. from a retriever tool with ``response_format="content_and_artifact"``)
travel as chunks: the first message that carries documents keeps them as the request's chunks
(their KV is reused at every later step of an agent); documents of later messages are written
into that message's text (a request has one run of chunks).
"""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("langchain", "langchain_core")

from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.documents import Document
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticToolsParser
from langchain_core.output_parsers.pydantic import PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from lazyllm import Chunk, GenerationOutput, InvalidRequestError
from lazyllm.structured.call_stream import ToolCallDeltas
from lazyllm.structured.formats import closed
from lazyllm.structured.schema_errors import has_ref

STRUCTURED_KWARGS = ("tools", "tool_choice", "response_format", "parallel_tool_calls")
CALL_OPEN = "<tool_call>"

Parts = Callable[[BaseMessage], tuple[str, str, list[Chunk]]]


def pop_structured(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the tool / format options out of a call's keyword arguments."""
    return {k: kwargs.pop(k) for k in STRUCTURED_KWARGS if k in kwargs}


def turn_kinds(messages: Sequence[BaseMessage]) -> list[dict]:
    """Each message's role and tool calls, OpenAI-shaped, for ``keeps_turns``."""
    return [{"role": "tool" if isinstance(m, ToolMessage) else m.type,
             "tool_calls": m.tool_calls if isinstance(m, AIMessage) else None} for m in messages]


def _artifact_chunks(m: BaseMessage) -> list[Chunk]:
    art = getattr(m, "artifact", None)
    if isinstance(art, (list, tuple)) and art and all(isinstance(d, Document) for d in art):
        return [Chunk(d.page_content, id=None if d.id is None else str(d.id), metadata=dict(d.metadata)) for d in art]
    return []


def to_openai_messages(messages: Iterable[BaseMessage], parts: Parts) -> list[dict]:
    """OpenAI-shaped message dicts of a LangChain conversation (``parts`` gives a message's
    role, text and document chunks); the first message with documents carries them as
    ``"chunks"``, system messages join into one leading system message."""
    out, system, carried = [], [], False
    for m in messages:
        role, text, chunks = parts(m)
        chunks = chunks + _artifact_chunks(m)
        if role == "system":
            system.append(text)
            continue
        d: dict[str, Any] = {"role": role, "content": text}
        if chunks and not carried:
            d["chunks"], carried = chunks, True
        elif chunks:  # a request has one run of chunks: later documents go inline
            d["content"] = "\n\n".join([c.text for c in chunks] + ([text] if text else []))
        if isinstance(m, AIMessage) and m.tool_calls:
            d["tool_calls"] = [{"id": c.get("id") or "", "type": "function",
                                "function": {"name": c["name"], "arguments": c.get("args") or {}}}
                               for c in m.tool_calls]
        if isinstance(m, ToolMessage):
            d["tool_call_id"] = m.tool_call_id
            if getattr(m, "status", "success") == "error":
                d["content"] = f"Error: {d['content']}"
        elif role not in ("user", "assistant"):
            raise InvalidRequestError(f"unsupported message role {role!r} in a tool conversation")
        out.append(d)
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(s for s in system if s)})
    return out


def lc_tool_calls(out: GenerationOutput) -> list[dict]:
    return [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"} for c in out.tool_calls
            if c.partial is None]


def ai_message(out: GenerationOutput, **meta: Any) -> AIMessage:
    """The ``AIMessage`` of a result: text content, or empty content and ``tool_calls``; a call
    cut off by the length limit is an ``invalid_tool_calls`` entry with its arguments as far as
    generated, and the call markup never reaches ``content``."""
    calls = lc_tool_calls(out)
    cut = [{"name": c.name, "args": c.partial, "id": c.id, "error": "cut off by the length limit",
            "type": "invalid_tool_call"} for c in out.tool_calls if c.partial is not None]
    content = "" if calls or cut or out.answer_is_calls or out.text.startswith(CALL_OPEN) else out.text
    return AIMessage(content=content, tool_calls=calls, invalid_tool_calls=cut, **meta)


class CallHold:
    """Reads a stream that may be tool calls (``active``): text passes as content, calls come
    out as ``tool_call_chunks`` as they are generated (the name first, then argument fragments
    that join to the arguments' JSON), so the call markup never reaches ``content``."""

    def __init__(self, active: bool):
        self.reader = ToolCallDeltas() if active else None
        self.pending: list[dict] = []

    def feed(self, delta: str) -> str | None:
        """The content to send for ``delta`` (with ``message``), or None for nothing yet."""
        if self.reader is None:
            return delta or None
        content, items = self.reader.feed(delta)
        self.pending += [_lc_chunk(i) for i in items]
        return (content or "") if content or self.pending else None

    def message(self, content: str) -> AIMessageChunk:
        """The message chunk of what ``feed`` released: its content and the call chunks."""
        chunks, self.pending = _joined(self.pending), []
        return AIMessageChunk(content=content, tool_call_chunks=chunks)

    def last(self, out: GenerationOutput) -> list[dict]:
        """The call chunks still held at the end: the rest of a call the length limit cut off."""
        if self.reader is None:
            return []
        return _joined([_lc_chunk(i) for i in self.reader.flush(out.tool_calls[-1] if out.tool_calls else None)])


def _joined(chunks: list[dict]) -> list[dict]:
    """One chunk per call: LangChain adds message chunks up by index, and two of one index in
    the same message would not be joined."""
    out: dict[int, dict] = {}
    for c in chunks:
        if c["index"] in out:
            out[c["index"]]["args"] += c["args"]
        else:
            out[c["index"]] = dict(c)
    return list(out.values())


def _lc_chunk(item: dict) -> dict:
    fn = item.get("function") or {}
    return {"name": fn.get("name"), "args": fn.get("arguments") or "", "id": item.get("id"),
            "index": item["index"], "type": "tool_call_chunk"}


def last_chunk_message(out: GenerationOutput, hold: CallHold, **meta: Any) -> AIMessageChunk:
    return AIMessageChunk(content="", tool_call_chunks=hold.last(out), chunk_position="last", **meta)


def tool_choice_arg(tool_choice: Any, tools: list[dict]) -> Any:
    """LangChain's ``tool_choice`` spellings as lazyllm's."""
    if tool_choice is None or tool_choice is False:
        return None
    if tool_choice is True or tool_choice == "any":
        return "required"
    if isinstance(tool_choice, dict) and "name" in tool_choice and "function" not in tool_choice:
        return tool_choice["name"]
    return tool_choice


def _openai_tool(t: Any) -> dict:
    """OpenAI's tool dict of ``t``. LangChain inlines a Pydantic model's ``$ref``s and writes
    a recursive one's self-reference as ``{}`` (any value), so a call that follows it would not
    validate against the model: a model whose schema has ``$ref``s keeps it as Pydantic writes
    it (``$defs`` and all), which the grammar follows."""
    spec = convert_to_openai_tool(t)
    model = t if isinstance(t, type) else getattr(t, "tool_call_schema", None) if isinstance(t, BaseTool) else None
    if isinstance(model, type) and issubclass(model, BaseModel):
        schema = model.model_json_schema()
        if has_ref(schema):
            schema.pop("title", None)
            schema.pop("description", None)  # the tool's, already in the spec
            spec["function"]["parameters"] = schema
    return spec


def bind_tools(model: Runnable, tools: Sequence[Any], tool_choice: Any = None, **kwargs: Any) -> Runnable:
    """``model.bind`` of OpenAI-shaped tools (from functions, Pydantic classes, ``@tool``s,
    dicts) and the choice."""
    formatted = [_openai_tool(t) for t in tools]
    choice = tool_choice_arg(tool_choice, formatted)
    if choice is not None:
        kwargs["tool_choice"] = choice
    if kwargs.pop("strict", None):  # as ChatOpenAI: OpenAI's strict functions (every object closed)
        formatted = [{**t, "function": {**t["function"], "strict": True}} for t in formatted]
    return model.bind(tools=formatted, **kwargs)


def _complete_answer(msg: BaseMessage) -> BaseMessage:
    """``msg``, when the model finished its answer; raises ``OutputParserException`` when the
    length limit cut it (``with_structured_output(include_raw=True)`` then gives ``parsed``
    None and this as ``parsing_error``)."""
    if getattr(msg, "response_metadata", {}).get("finish_reason") == "length":
        raise OutputParserException("the answer was cut off by the length limit (finish_reason 'length') before it "
                                    "was complete, so there is nothing to parse; raise max_tokens",
                                    llm_output=msg.content if isinstance(msg.content, str) else None)
    return msg


def _is_pydantic(schema: Any) -> bool:
    """A Pydantic model class: v2, or v1 (``pydantic.v1``), which LangChain still takes."""
    return isinstance(schema, type) and is_basemodel_subclass(schema)


def with_structured_output(model: Any, schema: Any, *, method: str = "json_schema", include_raw: bool = False,
                           **kwargs: Any) -> Runnable:
    """``BaseChatModel.with_structured_output`` on grammar-constrained decoding.

    ``method``: ``"json_schema"`` (the answer is held to the schema), ``"function_calling"``
    (a forced call of a tool whose parameters are the schema) or ``"json_mode"`` (any JSON
    object; the prompt has to ask for the keys)."""
    strict = bool(kwargs.pop("strict", None))
    if kwargs:
        raise InvalidRequestError(f"unsupported with_structured_output arguments: {sorted(kwargs)}")
    if schema is None and method != "json_mode":
        raise InvalidRequestError(f"method={method!r} needs a schema")
    fmt = {"kwargs": {"method": method}, "schema": convert_to_json_schema(schema) if schema is not None else None}
    if method == "function_calling":
        tool = convert_to_openai_tool(schema)
        name = tool["function"]["name"]
        llm = bind_tools(model, [schema], tool_choice=name, ls_structured_output_format=fmt, strict=strict)
        parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if _is_pydantic(schema)
                            else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
    elif method in ("json_schema", "json_mode"):
        if method == "json_schema":
            if isinstance(schema, type) and issubclass(schema, BaseModel):
                rf = schema  # the engine holds the answer to it and parses into it
            elif _is_pydantic(schema):  # pydantic.v1: its schema, closed to its fields as the
                rf = closed(convert_to_json_schema(schema))  # engine closes a v2 class's
            else:
                rf = convert_to_json_schema(schema)
                if strict:  # as ChatOpenAI: OpenAI's strict json_schema (every object closed)
                    rf = {"type": "json_schema", "json_schema": {"name": rf.get("title") or "response",
                                                                 "schema": rf, "strict": True}}
        else:
            rf = {"type": "json_object"}
        llm = model.bind(response_format=rf, ls_structured_output_format=fmt)
        parser = PydanticOutputParser(pydantic_object=schema) if _is_pydantic(schema) else JsonOutputParser()
    else:
        raise InvalidRequestError(f"method must be json_schema, function_calling or json_mode, got {method!r}")
    # a cut answer is never parsed as complete: LangChain's JSON parsers close what was cut
    # (an array, an object) and the tool parsers read a cut call as no call (None)
    parser = RunnableLambda(_complete_answer) | parser
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    failed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")
