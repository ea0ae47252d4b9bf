"""A conversation (OpenAI-shaped messages, tools, documents) as prefix / chunk / suffix
segments.

The documents go where the first user message starts (or at the message that carries its own
``"chunks"``, e.g. a retriever tool's result): everything rendered before them is the prefix,
everything after (later turns, tool calls and results, the generation prompt) the suffix.
An agent's later steps keep the same prefix and the same chunks, so both are reused.

Tools reach the prompt through the model's chat template when it takes ``tools`` and writes
calls as ``<tool_call>`` (Hermes, Qwen, SmolLM3 templates); otherwise through the documented
fallback: a system-message section listing the tools as JSON and the call format, assistant
calls written as ``<tool_call>`` lines, tool results as ``<tool_response>`` user turns.
"""
from __future__ import annotations

import json
from typing import Any

from ..engine.request import Segment
from ..errors import InvalidRequestError
from ..structured.tools import CALL_CLOSE, CALL_OPEN, Tool
from ..types import Chunk, ToolCall
from .prompt import DOC_HEADER, DOCUMENTS_MARK, PromptBuilder
from .prompt import check_text as _check_text

__all__ = ["build_conversation", "normalize_messages", "FALLBACK_TOOL_PROMPT"]

FALLBACK_TOOL_PROMPT = (
    "You can call these tools (JSON Schema of each one's arguments):\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, answer with one line per call: "
    f'{CALL_OPEN}{{{{"name": <tool name>, "arguments": <arguments object>}}}}{CALL_CLOSE}\n'
    "Otherwise answer the user directly.")


def _template_takes_tools(tok) -> bool:
    t = getattr(tok, "chat_template", None)
    return isinstance(t, str) and "tools" in t and CALL_OPEN in t


def _content(i: int, m: dict) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, list):  # OpenAI content parts: text only
        parts = []
        for p in c:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise InvalidRequestError(f"messages[{i}]: only text content parts are supported")
            parts.append(p["text"])
        c = "".join(parts)
    if not isinstance(c, str):
        raise InvalidRequestError(f"messages[{i}].content must be a str or a list of text parts")
    return c


def _calls(i: int, m: dict) -> list[ToolCall]:
    out = []
    for c in m.get("tool_calls") or []:
        if isinstance(c, ToolCall):
            out.append(c)
            continue
        fn = c.get("function", c) if isinstance(c, dict) else None
        args = fn.get("arguments", {}) if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise InvalidRequestError(f"messages[{i}]: tool call arguments are not JSON: {args!r}") from None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, dict):
            raise InvalidRequestError(f"messages[{i}].tool_calls: each needs a function name and dict arguments")
        out.append(ToolCall(str(c.get("id") or ""), fn["name"], args))
    return out


def normalize_messages(messages: list, native: bool = False) -> tuple[list[dict], int | None, list[Chunk]]:
    """Messages for the template (``native``: tool calls and results in the template's own
    format), the index of the one that carries its own chunks, those; raises
    ``InvalidRequestError`` for a malformed message."""
    out, at, chunks, ids = [], None, [], set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"messages[{i}] must be a dict with role system, user, assistant or tool")
        role, text = m["role"], _content(i, m)
        if m.get("chunks"):
            if at is not None:
                raise InvalidRequestError("only one message may carry chunks")
            at, chunks = len(out), [c if isinstance(c, Chunk) else Chunk(str(c)) for c in m["chunks"]]
        if role == "assistant" and m.get("tool_calls"):
            calls = _calls(i, m)
            ids.update(c.id for c in calls if c.id)
            if native:
                out.append({"role": "assistant", "content": text, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]})
            else:
                lines = "\n".join(CALL_OPEN + json.dumps({"name": c.name, "arguments": c.arguments}) + CALL_CLOSE
                                  for c in calls)
                out.append({"role": "assistant", "content": (text + "\n" if text else "") + lines})
            continue
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid not in ids:
                raise InvalidRequestError(f"messages[{i}]: tool result for unknown tool_call_id {tid!r} (the "
                                          f"earlier assistant messages made calls {sorted(ids)})")
            if native:
                out.append({"role": "tool", "content": text, "tool_call_id": tid})
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
            continue
        out.append({"role": role, "content": text})
    return out, at, chunks


def _render_plain(msgs: list[dict], bos: str) -> str:
    """A conversation for a model without a chat template (a base model): one paragraph per
    turn, ``Role: text``, ending with ``Assistant:``."""
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in msgs]
    return bos + "\n\n".join(turns) + "\n\nAssistant:"


def _add_system(msgs: list[dict], text: str, at: int | None, first: bool = False) -> int | None:
    """Put ``text`` into the leading system message (made if absent; before its content when
    ``first``); returns ``at`` shifted when a message was inserted."""
    if msgs and msgs[0]["role"] == "system":
        old = msgs[0]["content"]
        msgs[0] = {"role": "system", "content": f"{text}\n\n{old}" if first else f"{old}\n\n{text}"}
        return at
    msgs.insert(0, {"role": "system", "content": text})
    return None if at is None else at + 1


def build_conversation(prompts: PromptBuilder, messages: list, chunks: list[Chunk], system: str | None,
                       tools: list[Tool], instruction: str | None = None) -> list[Segment]:
    """Segments of ``messages`` (plus ``system`` and ``instruction``, e.g. the answer's
    format, in the leading system message) with ``chunks`` at the first user message (or the
    documents a message carries in ``"chunks"``)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of message dicts")
    tok = prompts.tok
    native = bool(tools) and _template_takes_tools(tok)
    msgs, at, own = normalize_messages(list(messages), native)
    if own and chunks:
        raise InvalidRequestError("give chunks either as the argument or in one message, not both")
    chunks = own or chunks
    if system:
        _check_text(system, "system")
        at = _add_system(msgs, system, at, first=True)
    if tools and not native:
        listing = "\n".join(json.dumps(t.to_openai()["function"]) for t in tools)
        at = _add_system(msgs, FALLBACK_TOOL_PROMPT.format(tools=listing), at)
    if instruction:
        at = _add_system(msgs, instruction, at)
    if at is None:
        at = next((k for k, m in enumerate(msgs) if m["role"] == "user"), None)
        if at is None:
            raise InvalidRequestError("messages need a user message")
    # the split point: the prefix (system, tools, turns before it) is the same at every step
    msgs[at] = {**msgs[at], "content": f"{DOC_HEADER if chunks else ''}{DOCUMENTS_MARK}{msgs[at]['content']}"}
    for i, c in enumerate(chunks):
        _check_text(c.text, f"chunks[{i}].text")
    kw: dict[str, Any] = {"tools": [t.to_openai() for t in tools]} if native else {}
    if not getattr(tok, "chat_template", None):
        rendered = _render_plain(msgs, tok.bos_token or "")
    else:
        try:
            rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
        except Exception as e:  # templates raise their own errors for conversations they refuse
            raise InvalidRequestError(f"the model's chat template refused the messages: {e}") from None
    pre, post = rendered.split(DOCUMENTS_MARK)
    segs = [Segment("prefix", prompts.encode(pre))]
    segs += prompts.chunk_segments(chunks)  # keyed as in every other request
    segs.append(Segment("suffix", prompts.encode(post)))
    return segs
