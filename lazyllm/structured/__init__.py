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

from ..types import GenerationOutput
from .formats import ResponseFormat, format_instruction, normalize_response_format
from .grammar import GrammarCompiler, GrammarConstraint
from .tools import Tool, normalize_tool_choice, normalize_tools, parse_tool_calls, tool_grammar

__all__ = ["GrammarCompiler", "GrammarConstraint", "StructuredRequest", "prepare", "normalize_response_format",
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
    def instruction(self) -> str | None:
        """What the prompt says about the answer's format (None: nothing); with tools, the
        tool section says it."""
        return None if self.tools and self.choice != "none" else format_instruction(self.fmt)

    def finalize(self, out: GenerationOutput) -> GenerationOutput:
        """Fill ``out.tool_calls`` (finish_reason ``"tool_calls"``) or ``out.parsed`` from the
        finished request's text."""
        if self.tools and self.choice != "none":
            # the complete calls; cut short by length, the finish reason stays "length" (the
            # last, partial call is dropped)
            out.tool_calls = parse_tool_calls(out.text, self.tools)
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
            tool_choice: Any = None, parallel_tool_calls: bool = False) -> StructuredRequest | None:
    """Normalize and compile (into ``compiler``'s cache) what a request asked for; None when
    it asked for nothing. Raises ``InvalidRequestError`` for any malformed or unsupported
    part, before anything runs."""
    if response_format is None and tools is None and tool_choice is None:
        return None
    fmt = normalize_response_format(response_format)
    tl = normalize_tools(tools)
    if tool_choice is not None and not tl:
        from ..errors import InvalidRequestError

        raise InvalidRequestError("tool_choice needs tools")
    choice = normalize_tool_choice(tool_choice, tl)
    if tl:
        grammar = tool_grammar(tl, choice, fmt, parallel=bool(parallel_tool_calls))
    else:
        grammar = fmt.grammar if fmt is not None else None
    if grammar is not None and compiler is not None:
        compiler.compile(grammar)
    return StructuredRequest(tl, choice, fmt, grammar)
