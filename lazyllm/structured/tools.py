"""Tools in OpenAI's function-tool shape: validation, the grammar of a call, and parsing calls
out of the generated text.

A call is written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format
of Hermes / Qwen / SmolLM3 chat templates), several calls one per line. Under
``tool_choice="required"`` or a named tool the grammar admits only calls (of that tool); under
``"auto"`` it admits calls or a text answer without call markup (the ``response_format``'s
when one is given);
``"none"`` leaves the output unconstrained and never parses calls.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..types import ToolCall
from .bounds import JsonBounds
from .formats import DEFAULT_MAX_STRING_LENGTH, JSON_STYLE, ResponseFormat, closed, strict_closed
from .schema_errors import has_ref

__all__ = ["Tool", "normalize_tools", "normalize_tool_choice", "tool_grammar", "parse_tool_calls", "CALL_OPEN",
           "CALL_CLOSE"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def to_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _tool(i: int, t: Any) -> Tool:
    if not isinstance(t, dict):
        raise InvalidRequestError(f"tools[{i}] must be a dict in OpenAI's function-tool shape, got {type(t).__name__}")
    if t.get("type", "function") != "function":
        raise InvalidRequestError(f"tools[{i}]: only type 'function' is supported, got {t.get('type')!r}")
    fn = t.get("function", t)
    if not isinstance(fn, dict):
        raise InvalidRequestError(f"tools[{i}].function must be a dict")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"tools[{i}]: name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise InvalidRequestError(f"tools[{i}] ({name}): description must be a str")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise InvalidRequestError(f"tools[{i}] ({name}): parameters must be a JSON Schema of type 'object', "
                                  f"got {params!r}")
    if fn.get("strict") is True:  # OpenAI's strict function: every object of the arguments closed
        params = strict_closed(params, f"tools[{i}].function.parameters")
    return Tool(name, desc, params)


def normalize_tools(tools: Any) -> list[Tool]:
    """OpenAI function-tool dicts (``{"type": "function", "function": {...}}`` or the bare
    ``{"name", "description", "parameters"}``) -> ``Tool``s; raises ``InvalidRequestError``
    for a malformed tool or a repeated name (the parameter schemas are checked when the
    call grammar compiles)."""
    if tools is None:
        return []
    if isinstance(tools, dict) or not isinstance(tools, (list, tuple)):
        raise InvalidRequestError("tools must be a list of tool dicts")
    out = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t.name for t in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise InvalidRequestError(f"tool names must be unique; repeated: {sorted(dup)}")
    return out


def normalize_tool_choice(choice: Any, tools: list[Tool]) -> str:
    """``"auto"``, ``"required"``, ``"none"``, a tool name or OpenAI's ``{"type": "function",
    "function": {"name": ...}}`` -> ``"auto"``, ``"required"``, ``"none"`` or the tool name."""
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        choice = fn.get("name") if isinstance(fn, dict) else None
        if choice is None:
            raise InvalidRequestError('tool_choice dict must be {"type": "function", "function": {"name": ...}}')
    if choice == "any":  # LangChain's spelling of "required"
        choice = "required"
    if not isinstance(choice, str):
        raise InvalidRequestError(f"tool_choice must be 'auto', 'required', 'none' or a tool name, got {choice!r}")
    if choice in ("auto", "required", "none"):
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice='required' needs tools")
        return choice
    if choice not in {t.name for t in tools}:
        raise InvalidRequestError(f"tool_choice names {choice!r}, which is not among the tools "
                                  f"{[t.name for t in tools]}")
    return choice


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` (``#``, ``#/$defs/X``...) pointing under ``base``
    instead of the document root."""
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        elif k in ("const", "enum", "default", "examples"):
            out[k] = v
        else:
            out[k] = _rebased(v, base)
    return out


def call_schema(tools: list[Tool], bounds: JsonBounds | int | None = DEFAULT_MAX_STRING_LENGTH) -> dict:
    """JSON Schema of one call: ``{"name": <const>, "arguments": <that tool's parameters>}``
    for any of ``tools`` (the arguments' open ends held to ``bounds``, ``JsonBounds``)."""
    # arguments closed to the listed parameters (as OpenAI's strict mode does): a tool's
    # function would reject or drop an invented one
    defs, alts = {}, []
    for t in tools:
        args = JsonBounds.of(bounds).apply(closed(t.parameters))
        if has_ref(args):
            # the parameters' $refs point into their own document ("#/$defs/Address", "#" for a
            # recursive model), which is no longer the root once nested in the call: keep the
            # whole parameter schema under the call's $defs and point its refs there
            key = f"args_{t.name}"
            defs[key] = _rebased(args, f"#/$defs/{key}")
            args = {"$ref": f"#/$defs/{key}"}
        alts.append({"type": "object", "properties": {"name": {"const": t.name}, "arguments": args},
                     "required": ["name", "arguments"], "additionalProperties": False})
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    if defs:
        schema = {**schema, "$defs": defs}
    return {**schema, "x-guidance": JSON_STYLE}


def tool_grammar(tools: list[Tool], choice: str, text_format: ResponseFormat | None,
                 parallel: bool = False, bounds: JsonBounds | int | None = DEFAULT_MAX_STRING_LENGTH) -> str | None:
    """The llguidance (Lark) grammar of the answer under ``choice``; None when unconstrained
    (``"none"`` without a ``response_format``). ``parallel``: several calls, one per line
    (else exactly one: small models otherwise tend to repeat a call)."""
    import llguidance

    if choice == "none":
        return text_format.grammar if text_format is not None else None
    chosen = tools if choice in ("auto", "required") else [t for t in tools if t.name == choice]
    body = json.dumps(call_schema(chosen, bounds))
    rules = ['calls: call ("\\n" call)*' if parallel else "calls: call",
             f'call: "{CALL_OPEN}" call_json "{CALL_CLOSE}"', f"call_json: %json {body}"]
    if choice != "auto":
        start = "start: calls"
    elif text_format is None:
        # a text answer does not start like a call (so its first character tells text from
        # calls) and holds no call markup anywhere: a model echoing the prompt's call format
        # in text would otherwise hand the caller a call as content
        start = "start: calls | text"
        rules.append(r"text: TEXT")
        rules.append(r"TEXT: /[^<][\s\S]*/ & ~/[\s\S]*<\/?tool_call>[\s\S]*/")
    elif text_format.schema is not None:
        start = "start: calls | answer"
        answer = JsonBounds.of(bounds).apply(text_format.schema)
        rules.append(f"answer: %json {json.dumps({**answer, 'x-guidance': JSON_STYLE})}")
    else:
        raise InvalidRequestError("with tools, response_format must be a JSON Schema, a Pydantic model or json_object")
    return llguidance.grammar_from("lark", "\n".join([start, *rules]) + "\n")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, tools: list[Tool]) -> list[ToolCall]:
    """The complete calls in ``text`` (those the grammar admitted: known name, arguments a
    JSON object); a call cut off by the length limit is not one."""
    known = {t.name for t in tools}
    calls = []
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("name") in known and isinstance(obj.get("arguments", {}), dict):
            calls.append(ToolCall(new_call_id(), obj["name"], obj.get("arguments", {})))
    return calls
