"""``LlamaIndexLLM`` as a ``FunctionCallingLLM``: ``chat_with_tools`` (forced and by name),
``get_tool_calls_from_response``, tool results back as messages, ``structured_predict``, a
``FunctionAgent`` run over a retriever tool whose nodes travel as chunks and are reused at the
next step, and query engines with an output class, on a tiny random model held to the
grammar: whatever it writes, calls and answers are valid."""
import asyncio
import contextlib
import json
from typing import Literal

import jsonschema
import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, CitableBlock, DocumentBlock, MessageRole
from llama_index.core.base.response.schema import PydanticResponse
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool, ToolMetadata
from pydantic import BaseModel, Field

from lazyllm import LazyLLM
from lazyllm.integrations.llama_index import (
    BundledMiniLMEmbedding,
    ChunkRetrieverTool,
    ChunkSynthesizer,
    LlamaIndexLLM,
)
from tests import tool_models
from tests.conftest import make_tiny


def lookup(city: Literal["Paris", "Berlin"], year: Literal[2020, 2024]) -> str:
    """Population of a city in a year."""
    return "2.1 million"


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


class City(BaseModel):
    name: str = Field(max_length=10)
    population_millions: int = Field(ge=0, le=40)


class SearchArgs(BaseModel):
    input: Literal["capitals", "population"]  # short calls: a random model writes any allowed value


DOCS = [Document(text="Paris is the capital of France and has 2.1 million inhabitants.", id_="d1"),
        Document(text="Berlin is the capital of Germany and has 3.7 million inhabitants.", id_="d2")]


@pytest.fixture(scope="module")
def index():
    return VectorStoreIndex.from_documents(DOCS, embed_model=BundledMiniLMEmbedding())


@pytest.fixture(scope="module")
def li(tokenizer):
    llm = LazyLLM(model=make_tiny("llama", seed=5), tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="isolated")
    yield LlamaIndexLLM(llm=llm, max_new_tokens=60)
    llm.close()


def test_function_tool_with_a_model_argument(tokenizer):
    """A ``FunctionTool`` taking a Pydantic argument (its schema has ``$defs``) gives a call
    that validates and runs."""
    tool = FunctionTool.from_defaults(fn=tool_models.save)
    assert "$defs" in tool.metadata.to_openai_tool()["function"]["parameters"]
    llm = LazyLLM(model=make_tiny("llama", seed=5), tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="isolated")
    try:
        li = LlamaIndexLLM(llm=llm, max_new_tokens=300)
        resp = li.chat_with_tools([tool], user_msg="Save Ann.", tool_required=True)
        [sel] = li.get_tool_calls_from_response(resp)
        assert sel.tool_name == "save"
        tool_models.Person.model_validate(sel.tool_kwargs["person"])
        assert tool.call(**sel.tool_kwargs).content == "saved"
        assert isinstance(tool_models.SAVED[-1], tool_models.Person)
    finally:
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


def _agent_run(agent, question: str, max_iterations: int):
    """Run ``agent``; its tool call results and the raw ``GenerationOutput`` of each LLM step."""
    async def run():
        handler = agent.run(question, max_iterations=max_iterations)
        calls, steps = [], []
        async for ev in handler.stream_events():
            if isinstance(ev, ToolCallResult):
                calls.append(ev)
            elif isinstance(ev, AgentOutput):
                steps.append(ev.raw)
        # forced to call, the agent calls until max_iterations, which it reports as an error
        with contextlib.suppress(Exception):
            await handler
        return calls, steps

    return asyncio.run(run())


@pytest.fixture
def fresh(tokenizer):
    """An LLM over an engine of its own: an empty chunk cache."""
    llm = LazyLLM(model=make_tiny("llama", seed=5), tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="isolated")
    yield LlamaIndexLLM(llm=llm, max_new_tokens=60)
    llm.close()


def _search_tool(index) -> ChunkRetrieverTool:
    return ChunkRetrieverTool(index.as_retriever(similarity_top_k=2), ToolMetadata(
        name="search", description="Search the documents.", fn_schema=SearchArgs))


def test_function_agent_run(li):
    forced = LlamaIndexLLM(llm=li.lazyllm, max_new_tokens=60, tool_choice="required")  # a tiny model does not plan
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=lookup)], llm=forced, system_prompt="Use the tools.")
    calls, _ = _agent_run(agent, "Paris population in 2024?", 3)
    assert calls and calls[0].tool_name == "lookup" and calls[0].tool_output.content == "2.1 million"


def test_function_agent_over_retriever_reuses_chunks(fresh, index):
    """search -> search -> search (forced): the nodes come back as one CitableBlock each,
    travel as chunks from the step after the retrieval on, and the step after that reads
    their KV from the cache."""
    forced = LlamaIndexLLM(llm=fresh.lazyllm, max_new_tokens=60, tool_choice="required")
    agent = FunctionAgent(tools=[_search_tool(index)], llm=forced, system_prompt="Use the tools.")
    calls, steps = _agent_run(agent, "How many inhabitants do Paris and Berlin have together?", 3)
    assert [c.tool_name for c in calls[:2]] == ["search", "search"]
    blocks = calls[0].tool_output.blocks
    nodes = [n.node for n in calls[0].tool_output.raw_output]
    assert {n.ref_doc_id for n in nodes} == {"d1", "d2"}
    assert all(isinstance(b, CitableBlock) for b in blocks) and [b.source for b in blocks] == [n.node_id for n in nodes]
    assert len(steps) == 3
    ids = [b.source for b in blocks]
    assert steps[0].chunk_ids == []
    assert steps[1].chunk_ids == ids and steps[1].usage.cached_chunk_tokens == 0
    assert steps[2].chunk_ids == ids and steps[2].usage.cached_chunk_tokens > 0
    assert steps[2].usage.cached_tokens > steps[1].usage.cached_tokens


def test_agent_reads_the_nodes_a_query_engine_cached(fresh, index):
    """Nodes a ChunkSynthesizer query computed are read from the cache at the agent's first
    step that carries them (the step after the retrieval): same text, any position."""
    engine = index.as_query_engine(llm=fresh, similarity_top_k=2, response_synthesizer=ChunkSynthesizer(fresh))
    assert engine.query("Which city is the capital of France?").metadata["lazyllm"]["cached_chunk_tokens"] == 0
    forced = LlamaIndexLLM(llm=fresh.lazyllm, max_new_tokens=60, tool_choice="required")
    agent = FunctionAgent(tools=[_search_tool(index)], llm=forced, system_prompt="Use the tools.")
    _, steps = _agent_run(agent, "How many inhabitants do Paris and Berlin have together?", 2)
    assert len(steps) == 2 and len(steps[1].chunk_ids) == 2
    assert steps[1].usage.cached_chunk_tokens > 0


def test_documents_in_chat_with_tools_are_chunks(fresh):
    """A DocumentBlock in the user message is the request's chunk run; a document in a later
    message is written into its text (a request has one run of chunks)."""
    li = fresh
    tool = FunctionTool.from_defaults(fn=lookup)
    doc = DocumentBlock(data=b"Paris has 2.1 million inhabitants.", title="paris")
    user = ChatMessage(role=MessageRole.USER, blocks=[doc, *ChatMessage(content="Paris population?").blocks])
    first = li.chat_with_tools([tool], chat_history=[user], tool_required=True)
    assert len(first.raw.chunk_ids) == 1 and first.raw.usage.cached_chunk_tokens == 0
    [sel] = li.get_tool_calls_from_response(first)
    later = ChatMessage(role=MessageRole.TOOL, blocks=[CitableBlock(title="b", source="b", content="Berlin 3.7M")],
                        additional_kwargs={"tool_call_id": sel.tool_id})
    second = li.chat_with_tools([tool], chat_history=[user, first.message, later], tool_choice="none")
    assert second.raw.chunk_ids == first.raw.chunk_ids and second.raw.usage.cached_chunk_tokens > 0
    assert second.additional_kwargs["cached_chunk_tokens"] == second.raw.usage.cached_chunk_tokens


def test_query_engine_output_cls_over_chunks(fresh, index):
    """A query engine with an output class whose documents travel as chunks: a validated
    City, the nodes as the request's chunks, their KV reused by the next query."""
    li = fresh
    engine = index.as_query_engine(llm=li, similarity_top_k=2,
                                   response_synthesizer=ChunkSynthesizer(li, output_cls=City))
    first = engine.query("Which city is the capital of France?")
    second = engine.query("Which city is the capital of Germany?")
    for r in (first, second):
        assert isinstance(r, PydanticResponse) and isinstance(r.response, City)
        City.model_validate(r.response.model_dump())
        meta = r.metadata["lazyllm"]
        assert meta["finish_reason"] == "stop"
        assert meta["chunk_ids"] == [n.node.node_id for n in r.source_nodes]
        assert sorted(n.node.ref_doc_id for n in r.source_nodes) == ["d1", "d2"]
    assert first.metadata["lazyllm"]["cached_chunk_tokens"] == 0
    assert second.metadata["lazyllm"]["cached_chunk_tokens"] > 0


def test_query_engine_output_cls_stock_synthesizer(li, index):
    """``as_query_engine(output_cls=...)`` with LlamaIndex's own synthesizer (documents in the
    prompt text) goes through ``structured_predict``: a validated instance too."""
    r = index.as_query_engine(llm=li, output_cls=City, similarity_top_k=2).query("Capital of France?")
    assert isinstance(r, PydanticResponse) and isinstance(r.response, City)


def test_chunk_synthesizer_output_cls_bad_input(li):
    with pytest.raises(ValueError, match="Pydantic model"):
        ChunkSynthesizer(li, output_cls=dict)
    with pytest.raises(ValueError, match="not streamed"):
        ChunkSynthesizer(li, output_cls=City, streaming=True)


def test_as_structured_llm(li):
    sllm = li.as_structured_llm(Person)
    resp = sllm.chat([ChatMessage(role=MessageRole.USER, content="who?")])
    assert isinstance(resp.raw, Person)


def test_chat_and_complete_take_response_format(li):
    """``chat`` and ``complete`` hold the answer to a ``response_format`` (any of lazyllm's);
    the parsed answer is in ``raw.parsed``."""
    r = li.chat([ChatMessage(role=MessageRole.USER, content="json?")], response_format={"type": "json_object"})
    if r.raw.finish_reason == "stop":
        assert isinstance(r.raw.parsed, dict) and json.loads(r.message.content) == r.raw.parsed
    else:  # a JSON object may run to the length limit: then nothing parsed
        assert r.raw.finish_reason == "length" and r.raw.parsed is None
    c = li.complete("Yes or no?", chunks=["Paris is in France."], response_format=["yes", "no"])
    assert c.text in ("yes", "no") and c.raw.parsed == c.text and c.additional_kwargs["finish_reason"] == "stop"
    p = li.complete("Who?", response_format=Person)
    assert isinstance(p.raw.parsed, Person) if p.raw.finish_reason == "stop" else p.raw.parsed is None


def test_chat_reads_citable_blocks_as_chunks(li):
    """Without tools too, a CitableBlock is a chunk (its source the chunk id); a CitableBlock
    of anything but text is refused."""
    cite = CitableBlock(title="paris", source="doc-paris", content="Paris has 2.1 million inhabitants.")
    msg = ChatMessage(role=MessageRole.USER, blocks=[cite, *ChatMessage(content="How many?").blocks])
    r = li.chat([msg], max_new_tokens=4)
    assert r.raw.chunk_ids == ["doc-paris"]
    pdf = DocumentBlock(data=b"%PDF", document_mimetype="application/pdf")
    bad = CitableBlock(title="x", source="x", content=[pdf])
    with pytest.raises(ValueError, match="text only"):
        li.chat([ChatMessage(role=MessageRole.USER, blocks=[bad, *ChatMessage(content="?").blocks])])


def test_chat_with_tools_refuses_blocks_it_cannot_read(li):
    """An image in a tool conversation is refused with a clear error, as in a plain chat,
    not dropped from the prompt."""
    from llama_index.core.base.llms.types import ImageBlock

    from lazyllm import InvalidRequestError

    tool = FunctionTool.from_defaults(fn=lookup)
    img = ImageBlock(image=b"\x89PNG\r\n", image_mimetype="image/png")
    msg = ChatMessage(role=MessageRole.USER, blocks=[img, *ChatMessage(content="What is this?").blocks])
    for call in (lambda: li.chat([msg]), lambda: li.chat_with_tools([tool], chat_history=[msg])):
        with pytest.raises(InvalidRequestError, match="text and text document blocks"):
            call()
    assert li.chat([ChatMessage(content="Still serving?")], max_new_tokens=2).message.content is not None


def test_call_cut_by_the_length_limit_stays_out_of_the_agent_memory(li):
    tool = FunctionTool.from_defaults(fn=lookup)
    resp = li.chat_with_tools([tool], user_msg="Paris population?", tool_required=True, max_new_tokens=16)
    assert resp.raw.finish_reason == "length" and resp.raw.tool_calls[-1].partial is not None
    assert resp.message.content == "" and resp.message.additional_kwargs["tool_calls"] == []
    assert li.get_tool_calls_from_response(resp, error_on_no_tool_call=False) == []
    # the next step of an agent sends the message back: it must not carry the unparsable call
    history = [ChatMessage(role=MessageRole.USER, content="Paris population?"), resp.message]
    assert li.chat([*history, ChatMessage(role=MessageRole.USER, content="Again.")], max_new_tokens=2).raw


def test_chat_logprobs_as_llama_index_openai_gives_them(li):
    """``chat(..., logprobs=True, top_logprobs=k)``: ``ChatResponse.logprobs`` holds, per
    generated token, its ``k`` most likely tokens as ``LogProb``s (``score``'s values); without
    them, None."""
    from llama_index.core.base.llms.types import ChatMessage

    resp = li.chat([ChatMessage(role="user", content="hello")], logprobs=True, top_logprobs=2, max_new_tokens=5)
    out = resp.raw
    assert resp.logprobs is not None and len(resp.logprobs) == len(out.logprobs) > 0
    for tops, t in zip(resp.logprobs, out.logprobs):
        assert [(p.token, p.logprob) for p in tops] == [(x.token, x.logprob) for x in t.top_logprobs]
        assert len(tops) == 2 and tops[0].logprob >= t.logprob - 1e-6
    assert li.chat([ChatMessage(role="user", content="hello")], max_new_tokens=2).logprobs is None
