"""The one rule for how a request's text becomes prompt segments.

A request with ``messages`` (a conversation so far) or with tools is rendered as chat-template
turns (``chat.build_conversation``: earlier turns stay turns, the documents at
the first user message); any other request is one user turn of the RAG template
(``PromptBuilder.build``), with a structured answer's format instruction in its system text.
"""
from __future__ import annotations

from ..engine.request import Segment
from ..errors import InvalidRequestError
from ..types import Chunk
from .chat import build_conversation
from .prompt import PromptBuilder, check_text


def render_request(prompts: PromptBuilder, question: str | None, chunks: list[Chunk], system: str | None,
                   messages, structured) -> list[Segment]:
    """The segments of one request: ``question`` over ``chunks`` after ``system``, or the
    conversation ``messages`` with ``question`` (when given) as its last user turn;
    ``structured`` is the request's ``StructuredRequest`` or ``None``."""
    if messages is not None or (structured is not None and structured.tools):
        return _conversation(prompts, question, chunks, system, messages, structured)
    instruction = structured.instruction if structured is not None else None
    if instruction:
        system = f"{system.strip()}\n\n{instruction}" if isinstance(system, str) and system.strip() else instruction
    return prompts.build(question, chunks, system)


def _conversation(prompts, question, chunks, system, messages, structured) -> list[Segment]:
    msgs = list(messages) if messages is not None else []
    if messages is not None and not isinstance(messages, (list, tuple)):
        raise InvalidRequestError("messages must be a list of message dicts")
    if question is not None:
        check_text(question, "question")
        msgs.append({"role": "user", "content": question})
    return build_conversation(prompts, msgs, chunks, system, structured.tools if structured else [],
                              structured.instruction if structured else None)


__all__ = ["render_request"]
