"""``LlamaIndexLLM`` as a ``FunctionCallingLLM``: ``chat_with_tools`` (forced and by name),
``get_tool_calls_from_response``, tool results back as messages, ``structured_predict``, and a
``FunctionAgent`` run, on a tiny random model held to the tools' grammar."""
import asyncio
import contextlib
from typing import Literal

import jsonschema
import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from lazyllm import LazyLLM
from lazyllm.integrations.llama_index import LlamaIndexLLM
from tests.conftest import make_tiny


def lookup(city: Literal["Paris", "Berlin"], year: Literal[2020, 2024]) -> str:
    """Population of a city in a year."""
    return "2.1 million"


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def li(tokenizer):
    llm = LazyLLM(model=make_tiny("llama", seed=5), tokenizer=tokenizer, kv_cache_bytes=32 << 20)
    yield LlamaIndexLLM(llm=llm, max_new_tokens=60)
    llm.close()


def test_chat_with_tools_round_trip(li):
    tool = FunctionTool.from_defaults(fn=lookup)
    assert li.metadata.is_function_calling_model
    resp = li.chat_with_tools([tool], user_msg="Paris population?", tool_required=True)
    [sel] = li.get_tool_calls_from_response(resp)
    assert sel.tool_name == "lookup" and sel.tool_id
    jsonschema.validate(sel.tool_kwargs, tool.metadata.get_parameters_dict())
    history = [ChatMessage(role=MessageRole.USER, content="Paris population?"), resp.message,
               ChatMessage(role=MessageRole.TOOL, content=str(tool(**sel.tool_kwargs)),
                           additional_kwargs={"tool_call_id": sel.tool_id})]
    final = li.chat_with_tools([tool], chat_history=history, tool_choice="none")
    assert li.get_tool_calls_from_response(final, error_on_no_tool_call=False) == []
    bad = history[:2] + [ChatMessage(role=MessageRole.TOOL, content="x", additional_kwargs={"tool_call_id": "nope"})]
    with pytest.raises(ValueError, match="unknown tool_call_id"):
        li.chat(bad, tools=[tool.metadata.to_openai_tool()])


def test_structured_predict(li):
    p = li.structured_predict(Person, PromptTemplate("Describe {who}."), who="someone")
    assert isinstance(p, Person)


def test_function_agent_run(li):
    from llama_index.core.agent.workflow import FunctionAgent

    forced = LlamaIndexLLM(llm=li.lazyllm, max_new_tokens=60, tool_choice="required")  # a tiny model does not plan
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=lookup)], llm=forced, system_prompt="Use the tools.")

    async def run():
        handler = agent.run("Paris population in 2024?", max_iterations=3)
        calls = []
        from llama_index.core.agent.workflow import ToolCallResult

        async for ev in handler.stream_events():
            if isinstance(ev, ToolCallResult):
                calls.append(ev)
        # forced to call, the agent calls until max_iterations, which it reports as an error
        with contextlib.suppress(Exception):
            await handler
        return calls

    calls = asyncio.run(run())
    assert calls and calls[0].tool_name == "lookup" and calls[0].tool_output.content == "2.1 million"


def test_as_structured_llm(li):
    sllm = li.as_structured_llm(Person)
    resp = sllm.chat([ChatMessage(role=MessageRole.USER, content="who?")])
    assert isinstance(resp.raw, Person)
