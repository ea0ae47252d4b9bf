"""Structured output and tool calling by grammar-constrained decoding.

``prepare`` turns a request's ``response_format`` / ``tools`` / ``tool_choice`` into a
``StructuredRequest``: the tools, and a constraint (``GrammarConstraint``, the engine's
``TokenConstraint``) whose ``finalize`` fills ``GenerationOutput.parsed`` /
``tool_calls`` once the request is done. The engine masks each constrained row's logits with
the constraint's bitmask before picking its token, so the output always follows the grammar;
only a stop by length (``finish_reason == "length"``) leaves it incomplete (then ``parsed`` is
None and ``text`` holds the partial output).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..types import GenerationOutput, ToolCall
from .bounds import JsonBounds
from .call_stream import ToolCallDeltas
from .formats import DEFAULT_MAX_STRING_LENGTH, ResponseFormat, format_instruction, normalize_response_format
from .grammar import GrammarCompiler, GrammarConstraint
from .schema_errors import check_refs
from .tools import Tool, new_call_id, normalize_tool_choice, normalize_tools, parse_tool_calls, tool_grammar

__all__ = ["GrammarCompiler", "GrammarConstraint", "JsonBounds", "StructuredRequest", "prepare",
           "normalize_response_format",
           "normalize_tools", "format_instruction", "Tool"]


@dataclass
class StructuredRequest:
    """What one request asked for, normalized: its tools and choice, its format, and the
    grammar string (None: nothing to constrain)."""

    tools: list[Tool] = field(default_factory=list)
    choice: str = "auto"
    fmt: ResponseFormat | None = None
    grammar: str | None = None

    @property
    def call_names(self) -> list[str]:
        """The tools a call may name under this request's ``tool_choice``."""
        if self.choice in ("auto", "required"):
            return [t.name for t in self.tools]
        return [t.name for t in self.tools if t.name == self.choice]

    @property
    def instruction(self) -> str | None:
        """What the prompt says about the answer's format (None: nothing); with tools, the
        tool section says it."""
        return None if self.tools and self.choice != "none" else format_instruction(self.fmt)

    def finalize(self, out: GenerationOutput) -> GenerationOutput:
        """Fill ``out.tool_calls`` (finish_reason ``"tool_calls"``) or ``out.parsed`` from the
        finished request's text."""
        if self.tools and self.choice != "none":
            # the complete calls; cut short by length, the finish reason stays "length" and the
            # last call comes as far as it was generated (OpenAI's answer)
            out.tool_calls = parse_tool_calls(out.text, self.tools)
            # the grammar's text answer never starts with "<": an answer that does is calls,
            # even one cut off before its call was named (its markup is never content)
            out.answer_is_calls = out.text.startswith("<")
            if out.finish_reason == "length":
                out.tool_calls += cut_call(out.text, self.call_names)
            if out.tool_calls:
                if out.finish_reason != "length":
                    out.finish_reason = "tool_calls"
                return out
        if self.fmt is not None and out.finish_reason == "stop":
            try:
                out.parsed = self.fmt.parse(out.text)
            except ValueError:  # a stop string cut the answer short: nothing complete to parse
                out.parsed = None
        return out


def prepare(compiler: GrammarCompiler | None, response_format: Any = None, tools: Any = None,
            tool_choice: Any = None, parallel_tool_calls: bool = False,
            max_string_length: int | None = DEFAULT_MAX_STRING_LENGTH,
            bounds: JsonBounds | None = None) -> StructuredRequest | None:
    """Normalize and compile (into ``compiler``'s cache) what a request asked for; None when
    it asked for nothing. JSON strings whose schema sets no ``maxLength`` are held to
    ``max_string_length`` characters (None: unbounded), and arrays and free values to
    ``bounds`` (``JsonBounds``, which also sets the string bound); with a ``compiler``, its
    own bounds.
    Raises ``InvalidRequestError`` for any malformed or unsupported part, before anything runs."""
    if response_format is None and tools is None and tool_choice is None:
        return None
    if compiler is not None:  # the engine's own bounds (LazyLLM(max_string_length=...)...)
        bounds = compiler.bounds
    elif bounds is None:
        bounds = JsonBounds(max_string_length=max_string_length)
    fmt = normalize_response_format(response_format, bounds)
    tl = normalize_tools(tools)
    if tool_choice is not None and not tl:
        from ..errors import InvalidRequestError

        raise InvalidRequestError("tool_choice needs tools")
    choice = normalize_tool_choice(tool_choice, tl)
    if tl:
        grammar = tool_grammar(tl, choice, fmt, parallel=bool(parallel_tool_calls),
                               bounds=bounds)
    else:
        grammar = fmt.grammar if fmt is not None else None
    schemas = [t.parameters for t in tl] + ([fmt.schema] if fmt is not None and fmt.schema is not None else [])
    check_refs(schemas)
    if grammar is not None and compiler is not None:
        compiler.compile(grammar, schemas)
    return StructuredRequest(tl, choice, fmt, grammar)


def cut_call(text: str, names: list[str] = ()) -> list[ToolCall]:
    """The call the length limit cut off at the end of ``text`` (its arguments as far as
    generated, ``ToolCall.partial``), as a list of one; empty when its name is not known yet
    (not complete, and what was written of it fits more than one of ``names``)."""
    reader = ToolCallDeltas(names)
    reader.feed(text)
    reader.flush()
    cut = reader.cut_call()
    return [] if cut is None else [ToolCall(new_call_id(), cut[0], {}, partial=cut[1])]
