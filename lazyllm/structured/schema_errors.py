"""One-line errors for JSON Schemas the grammar library cannot turn into a grammar.

llguidance reports a schema it cannot express either when it compiles (its own message, which
may be long) or, for a schema that describes no value at all, only at the first token mask,
as a dump of its parser state. A caller needs one line that names the cause: a ``$ref`` loop
(found by resolving the references with ``referencing``, the JSON Schema reference resolver
``jsonschema`` uses), nesting past the library's depth limit, or the library's message on one line, cut short.
"""
from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError

__all__ = ["grammar_error", "ref_loop", "missing_ref", "check_refs", "has_ref", "MAX_MESSAGE_CHARS"]

# a message is one line a person reads: the library's message, cut here
MAX_MESSAGE_CHARS = 300
# keywords whose subschemas describe the same value as their parent, so a reference through
# them consumes no output: a cycle through only these never ends
_SAME_VALUE = ("allOf", "anyOf", "oneOf")
_BASE = "urn:lazyllm:schema"


def ref_loop(schema: Any) -> list[str] | None:
    """A ``$ref`` chain of ``schema`` that loops back to where it started without describing
    any value (``["#/$defs/A", "#/$defs/B", "#/$defs/A"]``), or None. Every subschema is a
    start: a loop may sit where generation reaches it late (a property deep inside)."""
    if not isinstance(schema, (dict, bool)):
        return None
    from referencing import Registry
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    resolver = Registry().with_resource(_BASE, DRAFT202012.create_resource(schema)).resolver(_BASE)

    def walk(node: Any, res, trail: list[str], seen: dict[int, int]) -> list[str] | None:
        if not isinstance(node, dict):
            return None
        if id(node) in seen:
            return trail[seen[id(node)]:]
        seen = {**seen, id(node): len(trail) - 1}  # where the ref that led here is
        ref = node.get("$ref")
        if isinstance(ref, str):
            try:
                target = res.lookup(ref)
            except Unresolvable:
                return None  # the grammar library names a missing target itself
            found = walk(target.contents, target.resolver, [*trail, ref], seen)
            if found:
                return found
        for key in _SAME_VALUE:
            for sub in node.get(key) or []:
                found = walk(sub, res, trail, seen)
                if found:
                    return found
        return None

    for pointer, node in _subschemas(schema, "#"):
        chain = walk(node, resolver, [pointer], {})
        if chain and len(chain) > 1:
            return chain
    return None


def _subschemas(node: Any, pointer: str):
    """``(JSON pointer, dict)`` of every object in ``node``, outermost first."""
    if isinstance(node, dict):
        yield pointer, node
        for k, v in node.items():
            if k not in ("const", "enum", "default", "examples"):
                yield from _subschemas(v, f"{pointer}/{str(k).replace('~', '~0').replace('/', '~1')}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _subschemas(v, f"{pointer}/{i}")


def has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return isinstance(schema.get("$ref"), str) or any(has_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(has_ref(v) for v in schema)


def missing_ref(schema: Any) -> tuple[str, str] | None:
    """``(where, ref)`` of the first ``$ref`` of ``schema`` that points to nothing the schema
    defines (``("#/properties/a", "#/$defs/Missing")``), or None."""
    from referencing import Registry
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    resolver = Registry().with_resource(_BASE, DRAFT202012.create_resource(schema)).resolver(_BASE)
    for pointer, node in _subschemas(schema, "#"):
        ref = node.get("$ref")
        if isinstance(ref, str):
            try:
                resolver.lookup(ref)
            except Unresolvable:
                return pointer, ref
    return None


def check_refs(schemas: list[Any]) -> None:
    """Raise ``InvalidRequestError`` for a ``$ref`` to a missing definition (the grammar library
    would answer with a listing of its internals) or a ``$ref`` loop in any of ``schemas`` (the
    library finds one only when generation reaches it, a tool's argument deep inside a call),
    so they are looked for before anything runs."""
    for s in schemas:
        if not has_ref(s):
            continue
        missing = missing_ref(s)
        if missing:
            raise InvalidRequestError(f"invalid JSON Schema: the $ref {missing[1]!r} at {missing[0]} points to no "
                                      "definition in the schema (references to other documents are not fetched)")
        chain = ref_loop(s)
        if chain:
            raise InvalidRequestError("unsupported or invalid grammar: " + _loop_message(chain))


def _loop_message(chain: list[str]) -> str:
    return "the JSON Schema's $ref loops without describing a value: " + " -> ".join(chain)


def grammar_error(message: str, schemas: list[Any] = ()) -> str:
    """The one-line reason a grammar was refused, from llguidance's ``message`` and the JSON
    Schemas the grammar was built from."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    if "recursion limit exceeded" in message:
        return ("the JSON Schema is nested too deeply for the grammar library (its JSON may nest at most "
                "128 objects and arrays, about 60 levels of nested properties)")
    if first.startswith(("NoExtensionBias", "<state>")) or "<state>" in message:
        for s in schemas:
            chain = ref_loop(s)
            if chain:
                return _loop_message(chain)
        return "the grammar admits no output at all (a JSON Schema that no value satisfies?)"
    line = " ".join(message.split())
    if len(line) > MAX_MESSAGE_CHARS:
        line = line[:MAX_MESSAGE_CHARS - 3] + "..."
    return line
