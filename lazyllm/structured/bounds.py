"""Bounds on what a JSON Schema leaves open, so that a weak model held to it still finishes.

Under a grammar the model cannot write invalid JSON, but it can keep writing valid JSON: a
string never closed, an array that repeats its item, objects opened inside objects. Each is
bounded where the schema sets no bound of its own (``JsonBounds``): strings by
``max_string_length`` characters, arrays by ``max_array_length`` items, and a value the
schema leaves free (``{"type": "object"}``, ``{}``, the values of an object's other keys, an
array without ``items``) by ``max_json_depth`` levels of nesting. The schema's own structure,
and its own ``maxLength`` / ``maxItems``, are kept as written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import DEFAULT_MAX_ARRAY_LENGTH, DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_STRING_LENGTH

__all__ = ["JsonBounds", "bounded", "limited"]

# keywords that say nothing about the value: a schema of only these admits any JSON value
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                "x-guidance"}
_FIXED = ("const", "enum", "default", "examples")
_ANY = "lazyllm_any_"  # the $defs of free values, by the levels of nesting they may still open


@dataclass(frozen=True)
class JsonBounds:
    """What a JSON Schema's open ends are held to (``None``: unbounded): the longest string
    (characters), the most items of an array, the deepest nesting of a free value (the
    answer's top level counts as one)."""

    max_string_length: int | None = DEFAULT_MAX_STRING_LENGTH
    max_array_length: int | None = DEFAULT_MAX_ARRAY_LENGTH
    max_json_depth: int | None = DEFAULT_MAX_JSON_DEPTH

    @classmethod
    def of(cls, bounds: JsonBounds | int | None) -> JsonBounds:
        """``bounds``, or the bounds of a bare string length (arrays and depth at their defaults)."""
        return bounds if isinstance(bounds, JsonBounds) else cls(max_string_length=bounds)

    def apply(self, schema: Any) -> Any:
        """``schema`` with every bound written in where it sets none."""
        return bounded(limited(schema, self.max_array_length, self.max_json_depth), self.max_string_length)


def bounded(schema: Any, max_length: int | None) -> Any:
    """``schema`` with ``maxLength: max_length`` on every string that sets no length, pattern,
    format or fixed values of its own: under a grammar a weak model that never closes its
    string would otherwise write until the token limit (``None``: no bound)."""
    if max_length is None:
        return schema
    if isinstance(schema, list):
        return [bounded(x, max_length) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _FIXED else bounded(v, max_length) for k, v in schema.items()}
    kind = out.get("type")
    if (kind == "string" or isinstance(kind, list) and "string" in kind) and not (
            {"maxLength", "pattern", "format", "enum", "const"} & out.keys()):
        out["maxLength"] = max_length
    return out


def _free(schema: Any) -> bool:
    return schema is True or isinstance(schema, dict) and not set(schema) - _ANNOTATIONS


def _has(schema: dict, kind: str) -> bool:
    t = schema.get("type")
    return t == kind or isinstance(t, list) and kind in t


class _Limiter:
    """Walks a schema, tracking how many levels of nesting a value may still open at each
    place (``left``; None: unbounded), and writes the bounds in."""

    def __init__(self, max_items: int | None, max_depth: int | None):
        self.max_items, self.max_depth, self.top = max_items, max_depth, -1

    def free(self, left: int | None) -> dict:
        """A free value that may open ``left`` more levels."""
        k = max(left, 0)
        self.top = max(self.top, k)
        return {"$ref": f"#/$defs/{_ANY}{k}"}

    def walk(self, s: Any, left: int | None) -> Any:
        if _free(s):
            return s if left is None else self.free(left)
        if not isinstance(s, dict):
            return s
        out = dict(s)
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(out.get(key), list):
                out[key] = [self.walk(v, left) for v in out[key]]
        for key in ("if", "then", "else"):
            out[key] = self.walk(out[key], left) if key in out else None
            if out[key] is None:
                del out[key]
        for key in ("$defs", "definitions"):  # where a definition is used is not known here
            if isinstance(out.get(key), dict):
                out[key] = {n: self.walk(v, self.max_depth) for n, v in out[key].items()}
        inner = None if left is None else left - 1
        if _has(out, "object") or "properties" in out:
            for key in ("properties", "patternProperties"):
                if isinstance(out.get(key), dict):
                    out[key] = {n: self.walk(v, inner) for n, v in out[key].items()}
            extra = out.get("additionalProperties", True)
            if extra is not False:
                out["additionalProperties"] = self.walk(extra, inner)
        if _has(out, "array") or "items" in out or "prefixItems" in out:
            items = out.get("items", True)
            out["items"] = [self.walk(v, inner) for v in items] if isinstance(items, list) else self.walk(items, inner)
            if isinstance(out.get("prefixItems"), list):
                out["prefixItems"] = [self.walk(v, inner) for v in out["prefixItems"]]
            if self.max_items is not None and "maxItems" not in out:
                out["maxItems"] = max(self.max_items, out.get("minItems", 0))
            if out["items"] is True:
                del out["items"]
        return out

    def definitions(self) -> dict:
        """The ``$defs`` of the free values used: level 0 scalars, each level above also arrays
        and objects of the level below."""
        defs: dict[str, Any] = {}
        scalars = [{"type": "null"}, {"type": "boolean"}, {"type": "number"}, {"type": "string"}]
        for k in range(self.top + 1):
            alts = list(scalars)
            if k > 0:
                below = {"$ref": f"#/$defs/{_ANY}{k - 1}"}
                array = {"type": "array", "items": below}
                if self.max_items is not None:
                    array["maxItems"] = self.max_items
                alts += [array, {"type": "object", "additionalProperties": below}]
            defs[f"{_ANY}{k}"] = {"anyOf": alts}
        return defs


def limited(schema: Any, max_items: int | None, max_depth: int | None) -> Any:
    """``schema`` with ``maxItems: max_items`` on every array that sets none (at least its
    ``minItems``), and every value it leaves free nested at most ``max_depth`` levels deep,
    counted from the top (``None``: that bound off)."""
    if max_items is None and max_depth is None:
        return schema
    limiter = _Limiter(max_items, max_depth)
    out = limiter.walk(schema, max_depth)
    if limiter.top >= 0:
        if not isinstance(out, dict) or "$ref" in out and set(out) - {"$ref"}:
            out = {"allOf": [out]}
        out = {**out, "$defs": {**(out.get("$defs") or {}), **limiter.definitions()}}
    return out
