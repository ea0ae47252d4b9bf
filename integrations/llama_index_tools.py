"""Tool calling for ``LlamaIndexLLM`` (a LlamaIndex ``FunctionCallingLLM``): the chat with
tools as OpenAI-shaped messages for ``LazyLLM.generate(messages=...)``, calls back as
``ToolSelection``s. Calls live in the assistant message's ``additional_kwargs["tool_calls"]``
(OpenAI's shape), results in ``tool`` messages with ``additional_kwargs["tool_call_id"]``.

Documents in the conversation travel as chunks: a text ``DocumentBlock`` or a
``CitableBlock`` (what ``ChunkRetrieverTool`` returns, one per retrieved node) in any message.
The first message that carries documents keeps them as the request's chunks, so their KV is
reused at every later step of an agent; documents of later messages are written into that
message's text (a request has one run of chunks). ``chat_to_request`` turns a chat without
tools into a RAG request.
"""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("llama-index", "llama_index.core")

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CitableBlock,
    CompletionResponse,
    DocumentBlock,
    MessageRole,
    TextBlock,
)
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.schema import MetadataMode, NodeWithScore
from llama_index.core.tools import RetrieverTool, ToolOutput

from lazyllm import Chunk, GenerationOutput, InvalidRequestError
from lazyllm.structured.tools import CALL_OPEN

from ._common import RagRequest, request_from_messages, usage_dict

# passed to the engine as they are (with the tools: the log-probabilities, OpenAI's names)
TOOL_KWARGS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "logprobs", "top_logprobs")

_UNTITLED = "input_document"  # the title DocumentBlock fills in when none is given


def block_chunk(block: Any) -> Chunk | None:
    """The chunk of a document block (a text ``DocumentBlock``, or a ``CitableBlock``
    whose ``source`` becomes the chunk id); None for any other block."""
    if isinstance(block, CitableBlock):
        if not all(isinstance(b, TextBlock) for b in block.content):
            raise InvalidRequestError("lazyllm reads CitableBlocks of text only")
        text = "\n".join(b.text for b in block.content)
        return Chunk(text, id=block.source or None, metadata={"title": block.title})
    if not isinstance(block, DocumentBlock):
        return None
    if block.document_mimetype not in (None, "text/plain", "text/markdown"):
        raise InvalidRequestError(f"lazyllm reads text documents only, not {block.document_mimetype}")
    try:
        text = block.resolve_document().read().decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("a DocumentBlock's data is not UTF-8 text") from None
    title = block.title if block.title != _UNTITLED else None
    meta = {"title": title} if title else {}
    return Chunk(f"{title}\n\n{text}" if title else text, metadata=meta)


class ChunkRetrieverTool(RetrieverTool):
    """A ``RetrieverTool`` whose result is one ``CitableBlock`` per retrieved node (node id as
    ``source``, node content as text) instead of one string of all of them, so that an agent
    on ``LlamaIndexLLM`` hands the nodes to the engine as chunks: their KV is computed once
    and read from the cache at the agent's later steps (and shared with ``ChunkSynthesizer``
    queries over the same nodes, which convert them the same way).

    >>> tool = ChunkRetrieverTool.from_defaults(index.as_retriever(), name="search",
    ...                                         description="Search the documents.")
    >>> FunctionAgent(tools=[tool], llm=LlamaIndexLLM())

    ``metadata_mode``: the node content the model reads, as for ``ChunkSynthesizer``.
    """

    def __init__(self, retriever: Any, metadata: Any, node_postprocessors: list | None = None,
                 metadata_mode: MetadataMode = MetadataMode.NONE):
        super().__init__(retriever=retriever, metadata=metadata, node_postprocessors=node_postprocessors)
        self._metadata_mode = metadata_mode

    def _as_blocks(self, out: ToolOutput) -> ToolOutput:
        nodes: list[NodeWithScore] = list(out.raw_output or [])
        blocks = [CitableBlock(title=str(n.node.metadata.get("title") or n.node.node_id), source=n.node.node_id,
                               content=n.node.get_content(metadata_mode=self._metadata_mode)) for n in nodes]
        return ToolOutput(tool_name=out.tool_name, blocks=blocks or [TextBlock(text="No documents found.")],
                          raw_input=out.raw_input, raw_output=nodes)

    def call(self, *args: Any, **kwargs: Any) -> ToolOutput:
        return self._as_blocks(super().call(*args, **kwargs))

    async def acall(self, *args: Any, **kwargs: Any) -> ToolOutput:
        return self._as_blocks(await super().acall(*args, **kwargs))


def prepare_chat_with_tools(tools: Sequence[Any], user_msg: Any = None, chat_history: list | None = None,
                            allow_parallel_tool_calls: bool = False, **kwargs: Any) -> dict[str, Any]:
    """``FunctionCallingLLM._prepare_chat_with_tools``: the chat arguments."""
    messages = list(chat_history or [])
    if user_msg is not None:
        messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                        else user_msg)
    specs = [t.metadata.to_openai_tool(skip_length_check=True) for t in tools]
    return {"messages": messages, "tools": specs or None, "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}


def text_and_chunks(m: ChatMessage, role: str) -> tuple[str, list[Chunk]]:
    """The text of a message's text blocks and the chunks of its document blocks; any other
    block is refused with a clear error, except an assistant's thinking and tool-call blocks
    (their content travels in ``additional_kwargs``)."""
    texts, chunks = [], []
    for b in m.blocks:
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif (c := block_chunk(b)) is not None:
            chunks.append(c)
        elif not (role == "assistant" and getattr(b, "block_type", None) in ("thinking", "tool_call")):
            raise InvalidRequestError(
                f"lazyllm takes text and text document blocks; got {getattr(b, 'block_type', type(b).__name__)!r}")
    return "\n".join(texts), chunks


def openai_messages(messages: Sequence[ChatMessage], system: str | None) -> list[dict]:
    """OpenAI-shaped dicts of a LlamaIndex chat: text content, and the documents of the first
    message that has any as its ``"chunks"`` (later documents inline)."""
    out = [{"role": "system", "content": system}] if system else []
    carried = False
    for m in messages:
        role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
        role = {"model": "assistant", "chatbot": "assistant"}.get(role, role)
        text, chunks = text_and_chunks(m, role)
        d: dict[str, Any] = {"role": role, "content": text}
        if chunks and not carried:
            d["chunks"], carried = chunks, True
        elif chunks:  # a request has one run of chunks
            d["content"] = "\n\n".join([c.text for c in chunks] + ([text] if text else []))
        if d["role"] == "tool":
            d["tool_call_id"] = m.additional_kwargs.get("tool_call_id")
        if m.additional_kwargs.get("tool_calls"):
            d["tool_calls"] = m.additional_kwargs["tool_calls"]
        if d["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"unsupported chat role {role!r} with tools")
        out.append(d)
    return out


def turn_kinds(messages: Sequence[ChatMessage]) -> list[dict]:
    """Each message's role and tool calls, OpenAI-shaped, for ``keeps_turns``."""
    return [{"role": m.role.value if isinstance(m.role, MessageRole) else str(m.role),
             "tool_calls": m.additional_kwargs.get("tool_calls")} for m in messages]


def chat_message(out: GenerationOutput) -> ChatMessage:
    """The assistant message of a result (calls in ``additional_kwargs["tool_calls"]``)."""
    # calls (maybe cut off, even before one was named): never markup as content
    if out.tool_calls or out.answer_is_calls or out.text.startswith(CALL_OPEN):
        # a call the length limit cut off can be neither run nor answered, so it stays out of the
        # message an agent keeps in its memory (it is in ``raw.tool_calls``, with its partial arguments)
        return ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={
            "tool_calls": [c.to_openai() for c in out.tool_calls if c.partial is None]})
    return ChatMessage(role=MessageRole.ASSISTANT, content=out.text)


def chat_response(out: GenerationOutput) -> ChatResponse:
    """``LlamaIndexLLM.chat``'s answer: the assistant message, usage, log-probabilities, ``raw``."""
    return ChatResponse(message=chat_message(out), raw=out, additional_kwargs=usage_dict(out),
                        logprobs=li_logprobs(out))


def completion_response(out: GenerationOutput) -> CompletionResponse:
    """``LlamaIndexLLM.complete``'s answer: the text, usage, log-probabilities, ``raw``."""
    return CompletionResponse(text=out.text, raw=out, additional_kwargs=usage_dict(out), logprobs=li_logprobs(out))


def _arguments(call: dict) -> dict | None:
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool = True) -> list[ToolSelection]:
    """``FunctionCallingLLM.get_tool_calls_from_response``; a call the length limit cut off
    (its arguments not yet JSON) is no call to run."""
    calls = [(c, args) for c in response.message.additional_kwargs.get("tool_calls") or []
             if (args := _arguments(c)) is not None]
    if not calls and error_on_no_tool_call:
        raise ValueError(f"expected at least one tool call, got {len(calls)}")
    return [ToolSelection(tool_id=c["id"], tool_name=c["function"]["name"], tool_kwargs=args) for c, args in calls]


_ROLES = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system", MessageRole.USER: "user",
          MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
          MessageRole.TOOL: "tool", MessageRole.FUNCTION: "tool"}


def chat_to_request(messages: Sequence[ChatMessage], system_prompt: str | None = None) -> RagRequest:
    """Split LlamaIndex chat messages into ``(question, chunks, system)``: system and
    developer messages (after ``system_prompt``) form ``system``; text ``DocumentBlock``s
    and ``CitableBlock``s become chunks; the last user message with text is the question; other turns are
    folded into the question text."""
    return request_from_messages(map(_message_parts, messages), [system_prompt] if system_prompt else [])


def _message_parts(m: ChatMessage) -> tuple[str, str, list[Chunk]]:
    """``(role, text, chunks)`` of one message, for ``request_from_messages``."""
    role = _ROLES.get(m.role, str(m.role.value if hasattr(m.role, "value") else m.role))
    return (role, *text_and_chunks(m, role))


def li_logprobs(out: GenerationOutput) -> list | None:
    """``ChatResponse.logprobs`` as LlamaIndex's OpenAI LLM fills it: per generated token, its
    most likely tokens (``top_logprobs``; the token itself when none were asked), as
    ``LogProb``s; None when the call asked for none."""
    if out.logprobs is None:
        return None
    from llama_index.core.base.llms.types import LogProb

    def lp(t) -> LogProb:
        return LogProb(token=t.token, logprob=t.logprob, bytes=list(t.token.encode("utf-8")))

    return [[lp(x) for x in t.top_logprobs] or [lp(t)] for t in out.logprobs]
