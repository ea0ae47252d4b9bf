"""The one rule for how a request's text becomes prompt segments.

Earlier turns of a conversation are chat-template turns (``keeps_turns``) when the request
offers tools or the conversation already holds tool calls or tool results: those need the
model's tool format (``chat.build_conversation``: earlier turns stay turns, the documents at
the first user message). Any other conversation is folded (``fold_history``): its last user
turn is the question, the other turns follow it as a transcript, and the request is one user
turn of the RAG template (``PromptBuilder.build``), with a structured answer's format
instruction in its system text. ``LazyLLM.generate(messages=...)``, the LangChain and
LlamaIndex adapters and the server all decide with ``keeps_turns``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..engine.request import Segment
from ..errors import InvalidRequestError
from ..types import Chunk
from .chat import build_conversation, normalize_messages
from .prompt import PromptBuilder, check_text

HISTORY_HEADER = "Conversation so far:"
ROLE_LABELS = {"user": "User", "assistant": "Assistant", "tool": "Tool", "system": "System"}


def keeps_turns(messages: Iterable[Mapping] | None, tools) -> bool:
    """Whether a conversation's earlier turns go to the model as chat-template turns: when
    ``tools`` are offered, or a message (OpenAI-shaped) is a tool result (role ``tool`` or
    ``function``) or an assistant's ``tool_calls``. Otherwise they are folded into the question
    (``fold_history``)."""
    return bool(tools) or any(m.get("role") in ("tool", "function") or bool(m.get("tool_calls"))
                              for m in messages or ())


def fold_history(question: str, history: list[tuple[str, str]]) -> str:
    """The question text with earlier turns ``(role, text)`` appended as a transcript::

        <latest user message>

        Conversation so far:
        User: <earlier user message>
        Assistant: <earlier assistant message>

    The latest message comes first so that the ``Question:`` label the prompt puts in front of
    the question text stays attached to the actual question. ``role`` is ``user``,
    ``assistant`` or ``tool``."""
    turns = [(r, t.strip()) for r, t in history if t and t.strip()]
    if not turns:
        return question
    lines = [f"{ROLE_LABELS.get(r, r.title())}: {t}" for r, t in turns]
    return f"{question.strip()}\n\n{HISTORY_HEADER}\n" + "\n".join(lines)


def fold_turns(turns: list[tuple[str, str]], user: str = "user") -> str:
    """The question of a transcript of ``(role, text)`` turns: the last ``user`` turn, the
    others folded after it (``fold_history``). ``user`` names the user role in errors."""
    last = max((i for i, (r, _) in enumerate(turns) if r == "user"), default=None)
    if last is None:
        raise InvalidRequestError(f"the messages need a {user} message with text (the question)")
    return fold_history(turns[last][1], turns[:last] + turns[last + 1:])


def render_request(prompts: PromptBuilder, question: str | None, chunks: list[Chunk], system: str | None,
                   messages, structured) -> list[Segment]:
    """The segments of one request: ``question`` over ``chunks`` after ``system``, or the
    conversation ``messages`` with ``question`` (when given) as its last user turn;
    ``structured`` is the request's ``StructuredRequest`` or ``None``."""
    if messages is not None and not isinstance(messages, (list, tuple)):
        raise InvalidRequestError("messages must be a list of message dicts")
    if question is None and messages is None:
        raise InvalidRequestError("give a question, or the conversation as messages=")
    tools = structured.tools if structured is not None else []
    if keeps_turns([m for m in messages or () if isinstance(m, Mapping)], tools):
        return _conversation(prompts, question, chunks, system, messages, structured)
    if messages is not None:
        question, chunks, system = _folded(question, chunks, system, messages)
    instruction = structured.instruction if structured is not None else None
    if instruction:
        system = f"{system.strip()}\n\n{instruction}" if isinstance(system, str) and system.strip() else instruction
    return prompts.build(question, chunks, system)


def _folded(question, chunks, system, messages) -> tuple[str, list[Chunk], str | None]:
    """``(question, chunks, system)`` of a conversation without tools: system messages join
    ``system``, the chunks are the argument's or the ones a message carries, the earlier
    turns fold into the question."""
    msgs, _, own = normalize_messages(list(messages) + ([{"role": "user", "content": question}]
                                                        if question is not None else []))
    if own and chunks:
        raise InvalidRequestError("give chunks either as the argument or in one message, not both")
    parts = [system] if isinstance(system, str) and system.strip() else []
    parts += [m["content"] for m in msgs if m["role"] == "system" and m["content"].strip()]
    turns = [(m["role"], m["content"]) for m in msgs if m["role"] != "system" and m["content"].strip()]
    return fold_turns(turns), own or chunks, "\n\n".join(p.strip() for p in parts) or None


def _conversation(prompts, question, chunks, system, messages, structured) -> list[Segment]:
    msgs = list(messages) if messages is not None else []
    if question is not None:
        check_text(question, "question")
        msgs.append({"role": "user", "content": question})
    return build_conversation(prompts, msgs, chunks, system, structured.tools if structured else [],
                              structured.instruction if structured else None)


__all__ = ["HISTORY_HEADER", "fold_history", "fold_turns", "keeps_turns", "render_request"]
