"""``response_format`` in every shape a caller may give it, normalized to one grammar.

Accepted: a Pydantic model class, a JSON Schema dict, OpenAI's ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": ..., "strict": ...}}`` and ``{"type": "json_object"}``,
``{"type": "text"}`` (no constraint), ``lazyllm.Regex(pattern)``, a list of strings (one of
them, exactly), and ``lazyllm.Grammar(text)`` (Lark, or GBNF/EBNF, converted to Lark).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import DEFAULT_MAX_STRING_LENGTH
from ..errors import InvalidRequestError
from ..types import Grammar, Regex
from .bounds import JsonBounds, bounded

__all__ = ["ResponseFormat", "normalize_response_format", "format_instruction", "JSON_STYLE", "bounded",
           "strict_closed", "JsonBounds", "DEFAULT_MAX_STRING_LENGTH"]

# JSON as models write it (", " and ": "), one fixed spelling: free whitespace lets a small
# model pad forever, and fixed separators keep the output short
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ResponseFormat:
    """A normalized ``response_format``: ``kind`` (``json_schema``, ``json_object``,
    ``regex``, ``choice``, ``grammar``), the llguidance grammar string, the JSON Schema for
    the JSON kinds, and ``parse(text)`` giving the parsed value (Pydantic instance, dict,
    str)."""

    kind: str
    grammar: str
    schema: dict | None
    parse: Callable[[str], Any]


def _styled(schema: dict) -> dict:
    out = dict(schema)
    guidance = dict(JSON_STYLE)
    guidance.update(out.get("x-guidance") or {})
    out["x-guidance"] = guidance
    return out


def json_grammar(schema: dict, bounds: JsonBounds | int | None = None) -> str:
    """The llguidance grammar string of a JSON Schema, its open ends held to ``bounds``
    (``JsonBounds``; an int or None: the string bound, the others at their defaults)."""
    import llguidance

    try:
        text = json.dumps(_styled(JsonBounds.of(bounds).apply(schema)), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"the JSON Schema is not serializable as JSON: {e}") from None
    return llguidance.LLMatcher.grammar_from_json_schema(text)


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    properties and says nothing about others: what a Pydantic model keeps anyway (it drops
    unknown keys), so the model is not left to invent keys that would be thrown away."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k != "const" and k != "enum" and k != "default" else v for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or isinstance(kind, list) and "object" in kind or "properties" in schema


def strict_closed(schema: Any, where: str = "schema") -> Any:
    """``schema`` as OpenAI's strict mode reads it: every object closed to its ``properties``
    (``additionalProperties: false``, written in where it is missing). An object that admits
    other keys (``additionalProperties`` true or a schema) is refused, naming it (``where``:
    the schema's place in the request), as OpenAI refuses it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if _is_object(out):
        extra = out.get("additionalProperties", False)
        if extra is not False:
            raise InvalidRequestError(f"{where}: strict mode closes every object, so additionalProperties must be "
                                      f"false (or left out), got {json.dumps(extra)}; set strict false to allow "
                                      "other keys")
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {n: strict_closed(v, f"{where}.{key}.{n}") for n, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_closed(v, f"{where}.{key}[{i}]") for i, v in enumerate(out[key])]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_closed(out[key], f"{where}.{key}")
        elif isinstance(out.get(key), list):  # items as a list (draft 4-7 tuples)
            out[key] = [strict_closed(v, f"{where}.{key}[{i}]") for i, v in enumerate(out[key])]
    return out


def _pydantic_model(obj) -> type | None:
    try:
        from pydantic import BaseModel
    except ImportError:  # pragma: no cover - pydantic ships with transformers' dependencies
        return None
    return obj if isinstance(obj, type) and issubclass(obj, BaseModel) else None


def _schema_format(schema: Any, parse: Callable[[str], Any] | None = None,
                   bounds: JsonBounds | int | None = DEFAULT_MAX_STRING_LENGTH) -> ResponseFormat:
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"a JSON Schema must be a dict, got {type(schema).__name__}")
    return ResponseFormat("json_schema", json_grammar(schema, bounds), schema, parse or json.loads)


def _openai_format(rf: dict, bounds: JsonBounds | int | None) -> ResponseFormat | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
        return ResponseFormat("json_object", json_grammar(schema, bounds), schema, json.loads)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        # as OpenAI: without a schema there is nothing to hold the answer to
        raise InvalidRequestError('response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                  '"schema": {...}}')
    # strict or not, the output is held to the schema (a grammar cannot follow it loosely);
    # strict also closes every object, as OpenAI's strict mode does
    schema = js["schema"]
    if js.get("strict") is True:
        schema = strict_closed(schema, "response_format.json_schema.schema")
    return _schema_format(schema, bounds=bounds)


def _choice_format(choices: list) -> ResponseFormat:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("a list response_format must be non-empty strings (the allowed answers)")
    import llguidance

    # JSON string escapes are Lark's string-literal escapes
    body = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    return ResponseFormat("choice", llguidance.grammar_from("lark", f"start: {body}\n"), None, str)


def _text_format(kind: str, spec: Regex | Grammar) -> ResponseFormat:
    import llguidance

    if kind == "regex":
        if not isinstance(spec.pattern, str) or not spec.pattern:
            raise InvalidRequestError("Regex pattern must be a non-empty str")
        return ResponseFormat("regex", llguidance.LLMatcher.grammar_from_regex(spec.pattern), None, str)
    if not isinstance(spec.text, str) or not spec.text.strip():
        raise InvalidRequestError("Grammar text must be a non-empty str")
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(spec.text)
    except Exception as e:  # the converter raises its own error types for bad GBNF
        raise InvalidRequestError(f"invalid grammar: {e}") from None
    return ResponseFormat("grammar", llguidance.grammar_from("lark", lark), None, str)


def format_instruction(fmt: ResponseFormat | None) -> str | None:
    """The sentence the prompt gains for a JSON format: the grammar holds the output to the
    schema, but a model that reads the schema also fills it sensibly (and ends its strings)."""
    if fmt is None or fmt.schema is None:
        return None
    if fmt.kind == "json_object":
        return "Answer with a JSON object."
    return "Answer with a JSON object that follows this JSON Schema:\n" + json.dumps(fmt.schema, ensure_ascii=False)


def normalize_response_format(rf: Any, bounds: JsonBounds | int | None = DEFAULT_MAX_STRING_LENGTH
                              ) -> ResponseFormat | None:
    """``response_format`` -> ``ResponseFormat`` (``None`` for no constraint); raises
    ``InvalidRequestError`` for a shape it does not know. The grammar itself is checked when
    it is compiled (``GrammarCompiler.compile``). JSON strings without a ``maxLength`` are
    held to ``bounds`` (``JsonBounds``: strings, arrays, the nesting of free values; an int or
    None: the string bound, the others at their defaults)."""
    if rf is None:
        return None
    model = _pydantic_model(rf)
    if model is not None:
        return _schema_format(closed(model.model_json_schema()), model.model_validate_json, bounds)
    if isinstance(rf, Regex):
        return _text_format("regex", rf)
    if isinstance(rf, Grammar):
        return _text_format("grammar", rf)
    if isinstance(rf, (list, tuple)):
        return _choice_format(list(rf))
    if isinstance(rf, dict):
        if rf.get("type") in ("text", "json_object", "json_schema") and (
                rf.get("type") != "json_schema" or "json_schema" in rf):
            return _openai_format(rf, bounds)
        return _schema_format(rf, bounds=bounds)
    raise InvalidRequestError(
        "response_format must be a Pydantic model class, a JSON Schema dict, {'type': 'json_object'}, "
        f"{{'type': 'json_schema', ...}}, lazyllm.Regex, lazyllm.Grammar or a list of strings; got {rf!r}")
