"""Tool calls read out of generated text as it comes, in OpenAI's streamed shape.

The grammar fixes how calls are written (``<tool_call>{"name": "f", "arguments": {...}}
</tool_call>``, one a line; ``tools.py``) and that a text answer never starts with ``<``, so
the first character tells text from calls. The server streams what ``ToolCallDeltas`` gives
as ``delta.tool_calls``; the LangChain adapter as ``tool_call_chunks``; and a finished
answer cut off by the length limit keeps its last call as far as it was generated.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .tools import CALL_CLOSE, CALL_OPEN, new_call_id

__all__ = ["ToolCallDeltas"]

_CALL_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_.-]+)", "arguments": ')
_CALL_END = "}" + CALL_CLOSE
# a call's name is complete once its closing quote is written, before "arguments" comes
_NAMED = re.compile(r'\{"name": "([A-Za-z0-9_.-]+)"')


class ToolCallDeltas:
    """Reads a streamed answer that may be tool calls into OpenAI's deltas, as the text comes.

    Each call gives a delta ``{"index", "id", "type": "function", "function": {"name",
    "arguments": ""}}`` once its name is complete, then ``{"index", "function": {"arguments":
    fragment}}`` deltas whose fragments join to the arguments' JSON. ``feed`` returns
    ``(content, tool_call_items)``; ``flush`` at the end gives what was held back of a call
    the length limit cut off (its arguments as far as generated)."""

    def __init__(self, names: list[str] | tuple[str, ...] = ()):
        # the tools a call may name: a call cut off before its name was complete is named when
        # what was written of it fits one of them only
        self.names = tuple(names)
        self.mode: str | None = None  # "text" or "calls", from the first character
        self.buf, self.index, self.in_call, self.named = "", 0, False, False
        self.sent = ""  # the current call's arguments sent so far
        self.name = ""

    @property
    def calls(self) -> bool:
        """Whether the answer is calls (never text content)."""
        return self.mode == "calls"

    def feed(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        self.buf += text
        if self.mode is None and self.buf:
            self.mode = "calls" if self.buf.startswith("<") else "text"
        if self.mode != "calls":
            content, self.buf = self.buf or None, ""
            return content, []
        items: list[dict[str, Any]] = []
        while self._step(items):
            pass
        return None, items

    def flush(self, cut: Any = None) -> list[dict[str, Any]]:
        """The rest of a call left open at the end (cut off by the length limit). ``cut``: the
        finished answer's cut call (a ``ToolCall`` with ``partial``), which names a call whose
        name was not complete in the stream (the one tool it fits)."""
        items = self._flush()
        if cut is not None and cut.partial is not None and not (self.in_call and self.named):
            self._named(items, cut.name)
            items[-1]["id"] = cut.id
            self._args(items, cut.partial)
        return items

    def _flush(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.mode == "calls" and not self.in_call and self.buf.lstrip("\n") and CALL_OPEN.startswith(
                self.buf.lstrip("\n")):  # cut inside a call's opening
            self.in_call, self.named, self.buf = True, False, ""
        if self.in_call and not self.named and (name := self._cut_name()):
            self._named(items, name)
            self.buf = ""
        if self.in_call and self.named and self.buf:
            self._args(items, self.buf)
            self.buf = ""
        return items

    def _cut_name(self) -> str | None:
        """The name of the open call, complete or the one tool its written part fits."""
        if m := _NAMED.match(self.buf):
            return m.group(1)
        fits = [n for n in self.names if f'{{"name": "{n}"'.startswith(self.buf)]
        return fits[0] if len(fits) == 1 else None

    def cut_call(self) -> tuple[str, str] | None:
        """``(name, arguments so far)`` of the call left open at the end, after ``flush``;
        None when no named call is open."""
        return (self.name, self.sent) if self.in_call and self.named else None

    def _step(self, items: list[dict[str, Any]]) -> bool:
        """Consume what the buffer holds of the current call; True when more may follow."""
        if not self.in_call:
            self.buf = self.buf.lstrip("\n")
            if not self.buf.startswith(CALL_OPEN):
                return False  # a call's opening not complete yet
            self.buf, self.in_call, self.named = self.buf[len(CALL_OPEN):], True, False
        if not self.named:
            m = _CALL_HEAD.match(self.buf)
            if m is None:
                return False
            self._named(items, m.group(1))
            self.buf = self.buf[m.end():]
        end = self._args_end()
        if end is None:
            # hold back what may be the start of the call's closing "}</tool_call>"
            hold = next((k for k in range(min(len(_CALL_END), len(self.buf)), 0, -1)
                         if self.buf.endswith(_CALL_END[:k])), 0)
            self._args(items, self.buf[:len(self.buf) - hold])
            self.buf = self.buf[len(self.buf) - hold:]
            return False
        self._args(items, self.buf[:end])
        self.buf, self.in_call, self.index = self.buf[end + len(_CALL_END):], False, self.index + 1
        return True

    def _named(self, items: list[dict[str, Any]], name: str) -> None:
        self.name, self.named, self.sent = name, True, ""
        items.append({"index": self.index, "id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": ""}})

    def _args_end(self) -> int | None:
        """Where the arguments object ends (the closing may also occur inside a string)."""
        at = self.buf.find(_CALL_END)
        while at >= 0:
            try:
                json.loads(self.sent + self.buf[:at])
                return at
            except ValueError:
                at = self.buf.find(_CALL_END, at + 1)
        return None

    def _args(self, items: list[dict[str, Any]], fragment: str) -> None:
        if fragment:
            self.sent += fragment
            items.append({"index": self.index, "function": {"arguments": fragment}})
