"""Requests as tagged strings, for string-in, string-out models: the system prompt and each
document become tagged sections (``<lazyllm-document id="...">...</lazyllm-document>``) that
``decode_prompt`` lifts back out as ``system`` and chunks."""
from __future__ import annotations

import html
import json
import re

from lazyllm import Chunk, InvalidRequestError

from ._common import RagRequest, join_system

_TAG = re.compile(r'<lazyllm-(system|document)((?:\s+[a-z_]+="[^"]*")*)>\n(.*?)\n</lazyllm-\1>\n?', re.S)
_ATTR = re.compile(r'([a-z_]+)="([^"]*)"')


def _section(kind: str, text: str, attrs: dict[str, str] | None = None) -> str:
    close = f"\n</lazyllm-{kind}>"
    if close in f"\n{text}\n":
        raise InvalidRequestError(f"text contains the reserved tag </lazyllm-{kind}>")
    a = "".join(f' {k}="{html.escape(v, quote=True)}"' for k, v in (attrs or {}).items())
    return f"<lazyllm-{kind}{a}>\n{text}{close}\n"


def format_chunk(chunk: Chunk) -> str:
    attrs = {}
    if chunk.id is not None:
        attrs["id"] = chunk.id
    if chunk.metadata:
        attrs["metadata"] = json.dumps(chunk.metadata, default=str, sort_keys=True)
    return _section("document", chunk.text, attrs)


def encode_prompt(req: RagRequest) -> str:
    """The string form of a request: a tagged system section, tagged document sections,
    then the question. ``decode_prompt`` inverts it exactly."""
    head = _section("system", req.system) if req.system else ""
    return head + "".join(format_chunk(c) for c in req.chunks) + req.question


def decode_prompt(prompt: str) -> RagRequest:
    """Tagged sections of ``prompt`` become ``system`` and chunks (in order); the rest,
    with runs of blank lines squeezed, is the question."""
    system_parts, chunks = [], []

    def take(m: re.Match) -> str:
        kind, attrs, text = m.group(1), dict(_ATTR.findall(m.group(2))), m.group(3)
        attrs = {k: html.unescape(v) for k, v in attrs.items()}
        if kind == "system":
            system_parts.append(text)
        else:
            meta = json.loads(attrs["metadata"]) if "metadata" in attrs else {}
            chunks.append(Chunk(text, id=attrs.get("id"), metadata=meta))
        return ""

    rest = _TAG.sub(take, prompt)
    rest = re.sub(r"\n{3,}", "\n\n", rest).strip()
    return RagRequest(rest, chunks, join_system(system_parts))
