"""How an engine option is declared, and everything made from the declarations.

An option is one dataclass field (``lazyllm.options.EngineOptions``) made by ``opt``: its
name, its type (the annotation), its default, its bounds or choices (or a check of its own),
a one-line ``help`` and, where one line is not enough, the full ``doc``. From the fields alone
come the configuration's validation (``field_problems``), ``LazyLLM``'s signature
(``options_signature``), its docstring (``options_docstring``), docs/guide.md's option table
(``options_markdown``), the ``LazyLLM`` attributes that read the running configuration
(``attr``), and the command line's flags (``lazyllm.integrations.server.cli.add_engine_flags``,
from ``help``, ``choices``, the type and ``parse``/``metavar``): adding an option is one field.

Plain Python, no lazyllm imports: a command line checks its flags before it pays for torch.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# a check of its own: (option name, value) -> a sentence for each problem (none: valid)
Check = Callable[[str, Any], list]


@dataclass(frozen=True)
class Interval:
    """The values a number option may take, written as in mathematics: ``"[0, 1]"``, ``"(0, 1]"``,
    ``"[1, inf)"``."""

    text: str
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> Interval:
        m = re.fullmatch(r"([\[(])\s*([-\w.]+)\s*,\s*([-\w.]+)\s*([\])])", text)
        if m is None:
            raise ValueError(f"bounds must read like '[0, 1]' or '(0, inf)', got {text!r}")
        return cls(text, float(m[2]), float(m[3]), m[1] == "[", m[4] == "]")

    def __contains__(self, v) -> bool:
        above = v >= self.low if self.low_closed else v > self.low
        below = v <= self.high if self.high_closed else v < self.high
        return bool(above and below)

    def said(self, integer: bool) -> str:
        """``"an int >= 1"``, ``"an int in [1, 64]"``, ``"in (0, 1]"``..."""
        if integer and self.high == math.inf:
            return f"an int {'>=' if self.low_closed else '>'} {self.low:g}"
        return f"an int in {self.text}" if integer else f"in {self.text}"


def opt(default: Any, help: str, *, doc: str | None = None, choices: tuple | None = None,
        bounds: str | None = None, check: Check | None = None, attr: bool = False, flag: bool = True,
        parse: Callable[[str], Any] | None = None, metavar: str | None = None,
        with_previous: bool = False) -> Any:
    """Declare an option (a dataclass field): ``default``; ``help``, its one line (a flag's
    help); ``doc``, the full text where one line is not enough (``LazyLLM``'s docstring and
    the guide's table; ``help`` otherwise); ``choices``, the values it takes, or ``bounds``,
    the interval a number lies in (``"[0, 1]"``), or ``check``, a test of its own; ``attr``:
    ``llm.<name>`` reads it from the running configuration; ``flag``: a command-line flag
    (not for Python objects); ``parse``/``metavar``: how a flag's text becomes the value;
    ``with_previous``: documented together with the option declared before it."""
    meta: dict[str, Any] = {"help": help, "doc": doc or help, "attr": attr, "flag": flag,
                            "with_previous": with_previous}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if bounds is not None:
        meta["bounds"] = Interval.parse(bounds)
    for key, v in (("check", check), ("parse", parse), ("metavar", metavar)):
        if v is not None:
            meta[key] = v
    return field(default=default, metadata=meta)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_TYPE_TESTS: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool), "int": is_int, "float": is_number, "str": lambda v: isinstance(v, str)}
_SAID = {"bool": "a bool", "int": "an int", "float": "a number", "str": "a str"}


def _type_text(f: dataclasses.Field) -> str:
    t = f.type
    return t if isinstance(t, str) else t.__name__ if isinstance(t, type) else str(t)


def kind(f: dataclasses.Field) -> tuple[str, bool]:
    """``(base type, whether None is a value)`` of a field's annotation: ``"int | None"`` is
    ``("int", True)``; a type that is not ``bool``/``int``/``float``/``str`` is its own name
    (checked by the field's ``check``, if any)."""
    parts = [p.strip() for p in _type_text(f).split("|")]
    return parts[0], "None" in parts[1:]


def field_problems(f: dataclasses.Field, v: Any) -> list[str]:
    """A sentence naming ``f`` for each way ``v`` breaks its declaration (none: valid)."""
    m = f.metadata
    base, none_ok = kind(f)
    if v is None and none_ok:
        return []
    if "check" in m:
        return list(m["check"](f.name, v))
    if "choices" in m:
        return [] if v in m["choices"] else [f"{f.name} must be one of {m['choices']}, got {v!r}"]
    test = _TYPE_TESTS.get(base)
    if test is None:  # a Python object without a check: taken as given
        return []
    bounds = m.get("bounds")
    if test(v) and (bounds is None or v in bounds):
        return []
    said = _SAID[base] if bounds is None else bounds.said(base == "int")
    return [f"{f.name} must be {said}{' or None' if none_ok else ''}, got {v!r}"]


def normalized(f: dataclasses.Field, v: Any) -> Any:
    """``v`` in its declared type where that is a number (``1`` and ``1.0`` the same option)."""
    return float(v) if kind(f)[0] == "float" and is_number(v) else v


# -- what is made from the declarations ------------------------------------------------------
def _doc_groups(cls) -> list[tuple[list[dataclasses.Field], str]]:
    """``(fields, text)``: each option with its doc, those declared ``with_previous`` joined to
    the group before them."""
    groups: list[tuple[list[dataclasses.Field], str]] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("with_previous") and groups:
            groups[-1][0].append(f)
        else:
            groups.append(([f], f.metadata.get("doc", "")))
    return groups


def options_docstring(cls, indent: str = "    ") -> str:
    """Every option of ``cls`` as numpy-style parameter entries (``LazyLLM``'s docstring ends
    with them)."""
    out = []
    for fs, text in _doc_groups(cls):
        out += textwrap.wrap(f"{', '.join(f.name for f in fs)} : {text}", 92, initial_indent=indent,
                             subsequent_indent=indent * 2, break_long_words=False, break_on_hyphens=False)
    return "\n".join(out) + "\n"


def options_markdown(cls) -> str:
    """Every option of ``cls`` as a markdown table: docs/guide.md's option table."""
    rows = ["| option | default | what it does |", "| --- | --- | --- |"]
    for fs, text in _doc_groups(cls):
        shown = ", ".join(f"`{f.default!r}`" for f in fs)
        rows.append(f"| {', '.join(f'`{f.name}`' for f in fs)} | {shown} | {text.replace('``', '`')} |")
    return "\n".join(rows) + "\n"


def options_signature(cls, head: list[inspect.Parameter], not_given: set[str]) -> inspect.Signature:
    """``head`` then every option of ``cls`` as a keyword-only parameter with its default;
    an option in ``not_given`` (one a preset sets) defaults to ``None``, "not given"."""
    params = list(head)
    for f in dataclasses.fields(cls):
        t, default = _type_text(f), f.default
        if f.name in not_given:
            t, default = (t if kind(f)[1] else f"{t} | None"), None
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=t))
    return inspect.Signature(params)


__all__ = ["Interval", "opt", "kind", "field_problems", "normalized", "options_docstring", "options_markdown",
           "options_signature", "is_int", "is_number"]
