"""Tools and structured output through a lazyllm server, for ``RemoteLazyLLM``: the
``LazyLLM.generate`` arguments (``messages``, ``tools``, ``tool_choice``, ``response_format``,
``parallel_tool_calls``) as the OpenAI request fields the server takes, and its answer read
back into a ``GenerationOutput`` as an in-process engine fills it (``tool_calls``, ``parsed``).

A streamed answer's ``delta.tool_calls`` are turned back into the text the model wrote
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the format the grammar fixes), so
a stream over HTTP yields the same deltas as one in process and the adapters read calls out
of either the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lazyllm import Chunk, GenerationOutput, InvalidRequestError
from lazyllm.structured.formats import ResponseFormat, normalize_response_format
from lazyllm.structured.tools import CALL_CLOSE, CALL_OPEN, normalize_tool_choice, normalize_tools
from lazyllm.types import ToolCall

__all__ = ["STRUCTURED_OPTIONS", "RemoteAsk", "request_fields", "StreamedCalls"]

STRUCTURED_OPTIONS = ("messages", "tools", "tool_choice", "response_format", "parallel_tool_calls")


@dataclass
class RemoteAsk:
    """What a request asked that its answer is read with: the response format (parses the
    content) and whether calls may come."""

    fmt: ResponseFormat | None = None
    tools: bool = False

    def finish(self, out: GenerationOutput, calls: list[dict] | None) -> GenerationOutput:
        """``out`` with the server's ``tool_calls`` (OpenAI items) and the parsed answer."""
        out.tool_calls = [_tool_call(c) for c in calls or []]
        if self.fmt is not None and not out.tool_calls and out.finish_reason == "stop":
            try:
                out.parsed = self.fmt.parse(out.text)
            except ValueError:  # a stop string cut the answer short: nothing complete to parse
                out.parsed = None
        return out


def _tool_call(item: dict) -> ToolCall:
    fn = item.get("function") or {}
    text = fn.get("arguments") or ""
    try:
        args = json.loads(text)
    except ValueError:  # cut off by the length limit: the arguments as far as generated
        return ToolCall(item.get("id") or "", fn.get("name") or "", {}, partial=text)
    return ToolCall(item.get("id") or "", fn.get("name") or "", args)


def _message(i: int, m: Any) -> tuple[dict, list[Chunk]]:
    """An OpenAI message of the server's request (tool call arguments as JSON strings), and the
    documents the message carries in ``"chunks"``."""
    if not isinstance(m, dict):
        raise InvalidRequestError(f"messages[{i}] must be a dict")
    out = {k: v for k, v in m.items() if k != "chunks"}
    chunks = [c if isinstance(c, Chunk) else Chunk(str(c)) for c in m.get("chunks") or []]
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            if isinstance(c, ToolCall):
                c = c.to_openai()
            fn = c.get("function", c) if isinstance(c, dict) else None
            if not isinstance(fn, dict):
                raise InvalidRequestError(f"messages[{i}].tool_calls: each needs a function name and arguments")
            args = fn.get("arguments", {})
            calls.append({"id": c.get("id") or "", "type": "function", "function": {
                "name": fn.get("name"), "arguments": args if isinstance(args, str) else json.dumps(args)}})
        out["tool_calls"] = calls
    return out, chunks


def _response_format(rf: Any) -> tuple[dict | None, ResponseFormat | None]:
    fmt = normalize_response_format(rf)
    if fmt is None:
        return None, None
    if fmt.kind == "json_object":
        return {"type": "json_object"}, fmt
    if fmt.kind != "json_schema":
        raise InvalidRequestError("through a server, response_format must be a JSON Schema, a Pydantic model or "
                                  f"json_object ({fmt.kind} formats need an in-process engine)")
    name = rf.__name__ if isinstance(rf, type) else (rf.get("json_schema") or {}).get("name") \
        if isinstance(rf, dict) and rf.get("type") == "json_schema" else None
    return {"type": "json_schema", "json_schema": {"name": name or "response", "schema": fmt.schema,
                                                   "strict": True}}, fmt


def request_fields(question: str | None, system: str | None, options: dict[str, Any]
                   ) -> tuple[list[dict], list[Chunk], dict[str, Any], RemoteAsk]:
    """``(messages, documents the messages carry, other request fields, RemoteAsk)`` for a
    call with ``options`` (the structured ones, popped from it)."""
    opts = {k: options.pop(k) for k in STRUCTURED_OPTIONS if k in options}
    messages: list[dict] = []
    carried: list[Chunk] = []
    if opts.get("messages") is not None:
        if not isinstance(opts["messages"], (list, tuple)):
            raise InvalidRequestError("messages must be a list of message dicts")
        for i, m in enumerate(opts["messages"]):
            msg, chunks = _message(i, m)
            carried += chunks
            messages.append(msg)
    if system:
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{system}\n\n{messages[0].get('content') or ''}"}
        else:
            messages.insert(0, {"role": "system", "content": system})
    if question is not None:
        if not isinstance(question, str):
            raise InvalidRequestError(f"question must be a str, got {type(question).__name__}")
        messages.append({"role": "user", "content": question})
    if not messages:
        raise InvalidRequestError("a request needs a question or messages")
    fields: dict[str, Any] = {}
    tools = normalize_tools(opts.get("tools"))
    if tools:
        fields["tools"] = [t.to_openai() for t in tools]
        fields["parallel_tool_calls"] = bool(opts.get("parallel_tool_calls"))
    if opts.get("tool_choice") is not None:
        choice = normalize_tool_choice(opts["tool_choice"], tools)
        fields["tool_choice"] = choice if choice in ("auto", "required", "none") else {
            "type": "function", "function": {"name": choice}}
    rf, fmt = _response_format(opts.get("response_format"))
    if rf is not None:
        fields["response_format"] = rf
    return messages, carried, fields, RemoteAsk(fmt, bool(tools) and fields.get("tool_choice") != "none")


class StreamedCalls:
    """A stream's ``delta.tool_calls`` items joined into calls, and written back as the text
    the model generated (``text(items)``; ``close()`` ends the last call when the answer
    finished with its calls)."""

    def __init__(self):
        self.calls: list[dict] = []

    def text(self, items: list[dict]) -> str:
        out = []
        for item in items:
            fn = item.get("function") or {}
            if "id" in item or item.get("index", 0) >= len(self.calls):
                if self.calls:
                    out.append("}" + CALL_CLOSE + "\n")
                self.calls.append({"id": item.get("id") or "", "type": "function",
                                   "function": {"name": fn.get("name") or "", "arguments": ""}})
                out.append(CALL_OPEN + '{"name": ' + json.dumps(fn.get("name") or "") + ', "arguments": ')
            frag = fn.get("arguments") or ""
            if frag:
                self.calls[-1]["function"]["arguments"] += frag
                out.append(frag)
        return "".join(out)

    def close(self, finish_reason: str | None) -> str:
        return "}" + CALL_CLOSE if self.calls and finish_reason == "tool_calls" else ""
