"""One rule for when a conversation's earlier turns are chat-template turns
(``lazyllm.inputs.conversation.keeps_turns``): with tools or tool turns they are, otherwise
they are folded into the question. ``LazyLLM.generate(messages=...)`` (the front door), the
LangChain and LlamaIndex adapters and the server follow it, so one conversation becomes the
same prompt whichever entry point it came through."""
from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402

from lazyllm.inputs import InputProcessor, PromptBuilder  # noqa: E402
from lazyllm.inputs.conversation import HISTORY_HEADER, keeps_turns  # noqa: E402
from lazyllm.integrations.langchain import ChatLazyLLM  # noqa: E402
from lazyllm.integrations.llama_index import LlamaIndexLLM  # noqa: E402
from lazyllm.integrations.remote import RemoteLazyLLM  # noqa: E402
from lazyllm.integrations.server.protocol import parse_chat_request  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                         "parameters": SCHEMA}}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."},
                {"role": "assistant", "content": "Hi, how can I help?"},
                {"role": "user", "content": "Which city is the capital of France?"}]


@pytest.fixture(scope="module")
def door(tokenizer):
    return InputProcessor(tokenizer, PromptBuilder(tokenizer), max_context=4096, vocab_size=len(tokenizer))


def _remote():
    return RemoteLazyLLM("http://127.0.0.1:9/v1", None, "m")  # never called: only the requests are read


def _entry_points(extra: dict):
    """``(name, (question, chunks, system, options))`` of ``CONVERSATION`` with ``extra``
    (response_format, tools) as each entry point hands it to ``LazyLLM.generate``."""
    chat = ChatLazyLLM(llm=_remote())
    lc = [SystemMessage(CONVERSATION[0]["content"]), HumanMessage(CONVERSATION[1]["content"]),
          AIMessage(CONVERSATION[2]["content"]), HumanMessage(CONVERSATION[3]["content"])]
    req, opts = chat._request(lc, None, dict(extra))
    yield "langchain", (req.question, req.chunks, req.system, opts)
    li = LlamaIndexLLM(llm=_remote(), context_window=4096)
    roles = {"system": MessageRole.SYSTEM, "user": MessageRole.USER, "assistant": MessageRole.ASSISTANT}
    req, opts = li._chat_request([ChatMessage(role=roles[m["role"]], content=m["content"]) for m in CONVERSATION],
                                 dict(extra))
    yield "llama_index", (req.question, req.chunks, req.system, opts)
    sr = parse_chat_request({"model": "m", "messages": CONVERSATION, **extra})
    yield "server", (sr.question, sr.chunks, sr.system, sr.sampling)


def _render(door, question, chunks, system, options):
    keep = {k: options[k] for k in ("messages", "tools", "response_format") if options.get(k) is not None}
    return [(s.kind, s.ids) for s in door.generation(question, chunks, system, **keep).segments]


def test_keeps_turns_is_tools_or_tool_turns():
    assert not keeps_turns(CONVERSATION, None) and not keeps_turns(CONVERSATION, [])
    assert keeps_turns(CONVERSATION, [TOOL])
    assert keeps_turns([{"role": "tool", "content": "x"}], None)
    assert keeps_turns([{"role": "assistant", "tool_calls": [{"id": "1"}]}], None)


@pytest.mark.parametrize("extra", [{}, {"response_format": FORMAT}], ids=["plain", "response_format"])
def test_a_conversation_without_tools_is_folded_by_every_entry_point(door, extra):
    api = [(s.kind, s.ids) for s in door.generation(None, messages=CONVERSATION, **extra).segments]
    suffix = door.tokenizer.decode(api[-1][1])
    assert HISTORY_HEADER in suffix and "Hi, how can I help?" in suffix  # folded into the question
    for name, (question, chunks, system, options) in _entry_points(extra):
        assert "messages" not in options and HISTORY_HEADER in question, name
        assert _render(door, question, chunks, system, options) == api, name


def test_a_conversation_with_tools_keeps_its_turns_at_every_entry_point(door):
    api = [(s.kind, s.ids) for s in door.generation(None, messages=CONVERSATION, tools=[TOOL]).segments]
    assert HISTORY_HEADER not in door.tokenizer.decode(api[0][1] + api[-1][1])
    for name, (question, chunks, system, options) in _entry_points({"tools": [TOOL]}):
        assert question is None and options["messages"], name
        assert _render(door, question, chunks, system, options) == api, name
