"""LangChain messages and lazyllm requests: retrieved ``Document``s as chunk-carrying message
blocks (``documents_to_messages``, ``to_chunks``, ``chunk_prompt``), messages back into a
request (``messages_to_request``: the blocks become chunks, the system messages the shared
prefix, the last human message the question), and documents as tagged sections of a string
prompt (``format_documents``) for the string LLM. The models in ``langchain.py`` use these;
see that module's docstring for the block format.
"""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("langchain", "langchain_core")

import base64
import binascii
from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import RunnableLambda

from lazyllm import Chunk, InvalidRequestError

from ._common import RagRequest, request_from_messages
from .tagged import format_chunk

# -- documents -> message blocks -------------------------------------------------------


def document_block(doc: Document | str, *, title_key: str | None = None) -> dict[str, Any]:
    """A LangChain v1 ``text-plain`` content block for one retrieved document: the text,
    the document ``id`` (if any), ``extras`` = the document metadata and, with
    ``title_key``, ``title`` = that metadata field."""
    if isinstance(doc, str):
        return {"type": "text-plain", "mime_type": "text/plain", "text": doc}
    if not isinstance(doc, Document):
        raise InvalidRequestError(f"expected a langchain Document or str, got {type(doc).__name__}")
    block: dict[str, Any] = {"type": "text-plain", "mime_type": "text/plain", "text": doc.page_content}
    if doc.id is not None:
        block["id"] = str(doc.id)
    if title_key and doc.metadata.get(title_key):
        block["title"] = str(doc.metadata[title_key])
    if doc.metadata:
        block["extras"] = dict(doc.metadata)
    return block


def documents_to_messages(docs: Sequence[Document | str], question: str | None = None,
                          system: str | None = None, *, title_key: str | None = None) -> list[BaseMessage]:
    """Messages carrying ``docs`` as ``text-plain`` blocks: ``[SystemMessage(system)]``
    if given, then one ``HumanMessage`` whose content is the document blocks followed by
    the question (if given) as a ``text`` block. Feed them to ``ChatLazyLLM`` directly,
    or leave ``question`` out and place them with a ``MessagesPlaceholder``."""
    if isinstance(docs, (str, Document)):
        raise InvalidRequestError("docs must be a list of Documents, not a single one")
    blocks: list[Any] = [document_block(d, title_key=title_key) for d in docs]
    if question is not None:
        blocks.append({"type": "text", "text": question})
    msgs: list[BaseMessage] = [SystemMessage(system)] if system else []
    msgs.append(HumanMessage(content=blocks))
    return msgs


#: ``retriever | to_chunks`` turns retrieved ``Document``s into a one-message list for a
#: ``MessagesPlaceholder`` (see ``chunk_prompt``).
to_chunks = RunnableLambda(lambda docs: documents_to_messages(docs), name="to_chunks")


def chunk_prompt(system: str | None = None, question: str = "{question}",
                 documents_key: str = "documents") -> ChatPromptTemplate:
    """``ChatPromptTemplate``: optional system message, the documents placeholder
    (filled by ``to_chunks``), then the human question. ``system`` and ``question`` are
    templates (braces are variables)."""
    parts: list[Any] = [("system", system)] if system else []
    parts += [MessagesPlaceholder(documents_key), ("human", question)]
    return ChatPromptTemplate.from_messages(parts)


# -- messages -> (system, chunks, question) ------------------------------------------

_SKIPPED_BLOCKS = {"reasoning", "tool_call", "tool_call_chunk", "invalid_tool_call",
                   "server_tool_call", "server_tool_call_chunk", "server_tool_result", "non_standard"}


def _blocks(m: BaseMessage) -> list[dict]:
    if isinstance(m.content, str):
        return [{"type": "text", "text": m.content}] if m.content else []
    try:
        return list(m.content_blocks)
    except Exception:  # a block LangChain cannot translate: judge the raw list ourselves
        return [{"type": "text", "text": b} if isinstance(b, str) else b for b in m.content]


def block_to_chunk(block: dict) -> Chunk:
    """``lazyllm.Chunk`` of one ``text-plain`` block."""
    text = block.get("text")
    if text is None and block.get("base64"):
        try:
            text = base64.b64decode(block["base64"], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"text-plain block has invalid base64 text: {e}") from None
    if not isinstance(text, str):
        raise InvalidRequestError("a text-plain block needs `text` or `base64` (url and file_id are not fetched)")
    meta = dict(block.get("extras") or {})
    if "metadata" in block and isinstance(block["metadata"], dict):
        meta.update(block["metadata"])
    for k in ("title", "context"):
        if block.get(k):
            meta[k] = block[k]
    if block.get("title"):
        text = f"{block['title']}\n\n{text}"
    return Chunk(text, id=block.get("id"), metadata=meta)


def _role(m: BaseMessage) -> str:
    if isinstance(m, HumanMessage):
        return "user"
    if isinstance(m, AIMessage):
        return "assistant"
    if isinstance(m, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(m, SystemMessage):
        return "system"
    if isinstance(m, ChatMessage):
        return {"human": "user", "ai": "assistant"}.get(m.role, m.role)
    return m.type


def messages_to_request(messages: Sequence[BaseMessage]) -> RagRequest:
    """Split a LangChain conversation into ``(question, chunks, system)``.

    - every ``text-plain`` block, in any message, becomes a chunk, in order;
    - system messages' text joins (blank line between) into ``system``;
    - the text of the last human message that has text is the question; every other
      turn with text is folded into the question text as a transcript;
    - reasoning and tool-call blocks of assistant messages are left out; any other
      block type (images, audio, files) is refused.
    """
    return request_from_messages(map(message_parts, messages), user="human")


def message_parts(m: BaseMessage) -> tuple[str, str, list[Chunk]]:
    """``(role, text, chunks)`` of one message, for ``request_from_messages``."""
    texts, chunks = [], []
    for b in _blocks(m):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(b.get("text") or "")
        elif kind == "text-plain":
            chunks.append(block_to_chunk(b))
        elif kind not in _SKIPPED_BLOCKS:
            raise InvalidRequestError(
                f"lazyllm takes text and text-plain (document) content blocks; got {kind or type(b).__name__!r}")
    return _role(m), "".join(texts), chunks


# -- requests <-> tagged strings (for the string LLM) ------------------------------

def format_documents(docs: Sequence[Document | str], *, title_key: str | None = None) -> str:
    """Retrieved documents as tagged sections for a string prompt: ``LazyLLMText``
    lifts them out as chunks. Use it where a string chain would use ``format_docs``."""
    return "".join(format_chunk(block_to_chunk(document_block(d, title_key=title_key))) for d in docs)


__all__ = ["block_to_chunk", "chunk_prompt", "document_block", "documents_to_messages", "format_documents",
           "message_parts", "messages_to_request", "to_chunks"]
