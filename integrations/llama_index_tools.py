"""Tool calling for ``LlamaIndexLLM`` (a LlamaIndex ``FunctionCallingLLM``): the chat with
tools as OpenAI-shaped messages for ``LazyLLM.generate(messages=...)``, calls back as
``ToolSelection``s. Calls live in the assistant message's ``additional_kwargs["tool_calls"]``
(OpenAI's shape), results in ``tool`` messages with ``additional_kwargs["tool_call_id"]``."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.llms.llm import ToolSelection

from lazyllm import GenerationOutput, InvalidRequestError

TOOL_KWARGS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


def prepare_chat_with_tools(tools: Sequence[Any], user_msg: Any = None, chat_history: list | None = None,
                            allow_parallel_tool_calls: bool = False, **kwargs: Any) -> dict[str, Any]:
    """``FunctionCallingLLM._prepare_chat_with_tools``: the chat arguments."""
    messages = list(chat_history or [])
    if user_msg is not None:
        messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                        else user_msg)
    specs = [t.metadata.to_openai_tool(skip_length_check=True) for t in tools]
    return {"messages": messages, "tools": specs or None, "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}


def openai_messages(messages: Sequence[ChatMessage], system: str | None) -> list[dict]:
    """OpenAI-shaped dicts of a LlamaIndex chat (text content)."""
    out = [{"role": "system", "content": system}] if system else []
    for m in messages:
        role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
        d: dict[str, Any] = {"role": {"model": "assistant", "chatbot": "assistant"}.get(role, role),
                             "content": m.content or ""}
        if d["role"] == "tool":
            d["tool_call_id"] = m.additional_kwargs.get("tool_call_id")
        if m.additional_kwargs.get("tool_calls"):
            d["tool_calls"] = m.additional_kwargs["tool_calls"]
        if d["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"unsupported chat role {role!r} with tools")
        out.append(d)
    return out


def chat_message(out: GenerationOutput) -> ChatMessage:
    """The assistant message of a result (calls in ``additional_kwargs["tool_calls"]``)."""
    if out.tool_calls:
        return ChatMessage(role=MessageRole.ASSISTANT, content="",
                           additional_kwargs={"tool_calls": [c.to_openai() for c in out.tool_calls]})
    return ChatMessage(role=MessageRole.ASSISTANT, content=out.text)


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool = True) -> list[ToolSelection]:
    """``FunctionCallingLLM.get_tool_calls_from_response``."""
    import json

    calls = response.message.additional_kwargs.get("tool_calls") or []
    if not calls and error_on_no_tool_call:
        raise ValueError(f"expected at least one tool call, got {len(calls)}")
    return [ToolSelection(tool_id=c["id"], tool_name=c["function"]["name"],
                          tool_kwargs=json.loads(c["function"]["arguments"])) for c in calls]
