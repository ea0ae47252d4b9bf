"""``ChatLazyLLM`` tool calling and structured output: ``bind_tools`` from every tool shape,
``tool_choice``, ``ToolMessage`` round trips, streamed ``tool_call_chunks``,
``with_structured_output`` (three methods, ``include_raw``), and an agent loop over a
retriever tool whose documents travel as chunks and are reused at the next step. On a tiny
random model: whatever it writes, the grammar keeps calls and answers valid."""
import json
from typing import Literal

import jsonschema
import pytest
from langchain_core.documents import Document
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from pydantic.v1 import BaseModel as BaseModelV1
from pydantic.v1 import Field as FieldV1

from lazyllm import LazyLLM
from lazyllm.integrations.langchain import ChatLazyLLM, documents_to_messages
from tests import tool_models
from tests.conftest import make_tiny

DOCS = [Document("Paris is the capital of France and has 2.1 million inhabitants.", id="d1"),
        Document("Berlin is the capital of Germany and has 3.7 million inhabitants.", id="d2")]


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool(response_format="content_and_artifact")
def retrieve(query: Literal["capitals", "population"]) -> tuple[str, list[Document]]:
    """Search the document store."""
    return "\n\n".join(d.page_content for d in DOCS), DOCS


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


def get_time(city: Literal["Paris", "Berlin"], utc: bool) -> str:
    """The time in a city."""
    return "12:00"


WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def chat(tokenizer):
    llm = LazyLLM(model=make_tiny("llama", seed=5), tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="isolated")
    yield ChatLazyLLM(llm=llm, max_tokens=80)
    llm.close()


def _args_valid(call, schema):
    assert call["id"] and call["type"] == "tool_call"
    jsonschema.validate(call["args"], schema)


@pytest.mark.parametrize("shape", ["tool", "function", "pydantic", "dict"])
def test_bind_tools_every_shape_forced(chat, shape):
    t = {"tool": multiply, "function": get_time, "pydantic": Person, "dict": WEATHER}[shape]
    from langchain_core.utils.function_calling import convert_to_openai_tool

    spec = convert_to_openai_tool(t)["function"]
    msg = chat.bind_tools([t], tool_choice="any").invoke("go")
    assert msg.response_metadata["finish_reason"] == "tool_calls" and msg.content == ""
    assert [c["name"] for c in msg.tool_calls] == [spec["name"]]
    _args_valid(msg.tool_calls[0], spec["parameters"])


@pytest.mark.parametrize("model", [tool_models.Person, tool_models.Node], ids=["nested", "recursive"])
def test_bind_tools_nested_and_recursive_pydantic(chat, model):
    """Pydantic puts the nested model in ``$defs`` (and the recursive one refers to itself):
    the call still follows the whole schema."""
    for seed in range(2):
        msg = chat.bind_tools([model], tool_choice="any").invoke("save it", max_tokens=300, seed=seed,
                                                                 temperature=1.0)
        assert msg.response_metadata["finish_reason"] == "tool_calls" and msg.content == ""
        [call] = msg.tool_calls
        assert call["name"] == model.__name__
        model.model_validate(call["args"])


def test_tool_choice_by_name_and_stream_chunks(chat):
    bound = chat.bind_tools([multiply, WEATHER], tool_choice="weather")
    full = None
    for chunk in bound.stream("weather?"):
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessage) and full.content == ""
    assert [c["name"] for c in full.tool_calls] == ["weather"]
    [tc] = full.tool_call_chunks
    assert json.loads(tc["args"]) == full.tool_calls[0]["args"] and tc["id"] == full.tool_calls[0]["id"]


def test_stream_gives_the_call_as_it_is_decoded(chat):
    chunks = list(chat.bind_tools([WEATHER], tool_choice="weather").stream("weather?"))
    named = [c for c in chunks if any(t["name"] for t in c.tool_call_chunks)]
    pieces = [t["args"] for c in chunks for t in c.tool_call_chunks if t["args"]]
    assert len(named) == 1 and chunks.index(named[0]) < len(chunks) - 1  # the name before the end
    assert len(pieces) > 1 and all(c.content == "" for c in chunks)  # the arguments in pieces, no markup
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert json.loads("".join(pieces)) == full.tool_calls[0]["args"]


def test_call_cut_by_max_tokens_is_an_invalid_tool_call(chat):
    msg = chat.bind_tools([WEATHER], tool_choice="weather").invoke("weather?", max_tokens=16)
    assert msg.response_metadata["finish_reason"] == "length" and msg.content == "" and msg.tool_calls == []
    [bad] = msg.invalid_tool_calls
    assert bad["name"] == "weather" and bad["args"].startswith("{")


def test_tool_message_round_trip(chat):
    bound = chat.bind_tools([multiply], tool_choice="any")
    first = bound.invoke([HumanMessage("3 times 4?")])
    call = first.tool_calls[0]
    result = multiply.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    second = chat.bind_tools([multiply], tool_choice="none").invoke([HumanMessage("3 times 4?"), first, result])
    assert second.tool_calls == [] and isinstance(second.content, str)
    with pytest.raises(ValueError, match="unknown tool_call_id"):
        chat.invoke([HumanMessage("3 times 4?"), ToolMessage("12", tool_call_id="call_nobody")])


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output(chat, method):
    if method == "json_mode":  # any JSON object: only include_raw shows what came back
        out = chat.with_structured_output(None, method=method, include_raw=True).invoke("json")
        raw = out["raw"]
        if raw.response_metadata["finish_reason"] == "stop":
            assert isinstance(out["parsed"], dict) and out["parsing_error"] is None
        return
    p = chat.with_structured_output(Person, method=method).invoke("who?")
    assert isinstance(p, Person)
    d = chat.with_structured_output(Person.model_json_schema(), method=method, include_raw=True).invoke("who?")
    assert d["parsing_error"] is None and isinstance(d["raw"], AIMessage)
    jsonschema.validate(d["parsed"], Person.model_json_schema())


class Tagged(BaseModel):
    """A note with tags."""

    title: str = Field(max_length=10)
    tags: list[str] = []


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@pytest.mark.parametrize("schema", [Tagged, Tagged.model_json_schema()], ids=["pydantic", "dict"])
def test_cut_answer_is_never_parsed(chat, method, schema):
    """An answer the length limit cut is never parsed as complete (LangChain's JSON parsers
    would close the cut array): ``parsed`` None, ``parsing_error`` saying so, the raw message's
    ``finish_reason`` length; without ``include_raw``, the error is raised."""
    short = chat.model_copy(update={"max_tokens": 12})
    out = short.with_structured_output(schema, method=method, include_raw=True).invoke("tag it")
    assert out["raw"].response_metadata["finish_reason"] == "length"
    assert out["parsed"] is None and "length limit" in str(out["parsing_error"]), out
    with pytest.raises(OutputParserException, match="length limit"):
        short.with_structured_output(schema, method=method).invoke("tag it")


class PersonV1(BaseModelV1):
    """A person (a pydantic.v1 model)."""

    name: str = FieldV1(max_length=10)
    age: int = FieldV1(ge=0, le=120)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_pydantic_v1(chat, method):
    """LangChain still takes pydantic.v1 models; the answer is an instance of that class."""
    p = chat.with_structured_output(PersonV1, method=method).invoke("who?")
    assert isinstance(p, PersonV1) and 0 <= p.age <= 120
    assert all(isinstance(c, PersonV1) for c in chat.with_structured_output(PersonV1, method=method).stream("who?"))


def test_agent_loop_over_retriever_reuses_chunks(chat):
    """retrieve -> multiply -> answer: the documents come back as the retriever's artifact,
    travel as chunks, and the step after the one that computed them reads them from cache."""
    bound = {c: chat.bind_tools([retrieve, multiply], tool_choice=c) for c in ("retrieve", "multiply", "none")}
    msgs = [HumanMessage("How many inhabitants do Paris and Berlin have together, times two?")]
    steps = []
    for choice in ("retrieve", "multiply", "none"):
        ai = bound[choice].invoke(msgs)
        steps.append(ai.response_metadata)
        msgs.append(ai)
        for call in ai.tool_calls:
            msgs.append({"retrieve": retrieve, "multiply": multiply}[call["name"]].invoke(call))
    assert steps[0]["chunk_ids"] == []
    assert steps[1]["chunk_ids"] == ["d1", "d2"] and steps[1]["cached_chunk_tokens"] == 0
    assert steps[2]["chunk_ids"] == ["d1", "d2"] and steps[2]["cached_chunk_tokens"] > 0
    assert steps[2]["cached_tokens"] > steps[1]["cached_tokens"]


def test_documents_in_conversation_reused_at_second_step(chat):
    bound = chat.bind_tools([multiply], tool_choice="any")
    msgs = documents_to_messages(DOCS, "Paris inhabitants times two?")
    first = bound.invoke(msgs)
    msgs += [first, multiply.invoke(first.tool_calls[0])]
    second = chat.bind_tools([multiply], tool_choice="none").invoke(msgs)
    assert second.response_metadata["cached_chunk_tokens"] > 0
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0


def test_logprobs_as_chat_openai_gives_them(chat):
    """``logprobs=True`` (a field or per call, as ``ChatOpenAI``): ``response_metadata
    ["logprobs"]["content"]`` in OpenAI's shape, one per generated token (the end of sequence
    left out); streamed, the chunks add up to the same."""
    msg = chat.invoke("hello", logprobs=True, top_logprobs=2, max_tokens=6)
    content = msg.response_metadata["logprobs"]["content"]
    assert len(content) == msg.usage_metadata["output_tokens"] - (msg.response_metadata["finish_reason"] == "stop")
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
               for e in content)
    full = None
    for chunk in chat.model_copy(update={"logprobs": True}).stream("hello", max_tokens=6):
        full = chunk if full is None else full + chunk
    assert [(e["token"], e["logprob"]) for e in full.response_metadata["logprobs"]["content"]] == [
        (e["token"], e["logprob"]) for e in content]
    assert "logprobs" not in chat.invoke("hello", max_tokens=2).response_metadata
