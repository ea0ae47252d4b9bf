"""LlamaIndex adapter: ``LlamaIndexLLM`` (a ``FunctionCallingLLM``), ``ChunkSynthesizer`` (a
response synthesizer that hands each retrieved node to the engine as its own chunk) and
``BundledMiniLMEmbedding`` (the bundled offline embedding model).

The default ``compact`` synthesizer joins the retrieved texts into one string and
re-splits it to fit the context window, so no two requests ever share a document's KV.
``ChunkSynthesizer`` instead passes each node as a ``lazyllm.Chunk`` (node id as chunk id,
node metadata as chunk metadata), so a document's KV is computed once and reused by any
later query that retrieves it, in any order::

    from llama_index.core import VectorStoreIndex
    from lazyllm.integrations.llama_index import BundledMiniLMEmbedding, ChunkSynthesizer, LlamaIndexLLM

    llm = LlamaIndexLLM(max_new_tokens=128)                       # default model, offline
    index = VectorStoreIndex.from_documents(docs, embed_model=BundledMiniLMEmbedding())
    engine = index.as_query_engine(llm=llm, response_synthesizer=ChunkSynthesizer(llm))
    response = engine.query("Who wrote it?")
    response.metadata["lazyllm"]["cached_tokens"]                # reused chunk tokens

Chunk text is the node content with ``metadata_mode=MetadataMode.NONE`` by default: the
document text exactly as stored, so the same document shares KV with LangChain chains
and with ``lazyllm.integrations.chroma.ingest(..., llm=...)`` warm-ups. Pass
``metadata_mode=MetadataMode.LLM`` to show LlamaIndex's metadata header to the model
(and warm with ``ChunkSynthesizer.warm(nodes)``, which uses the same conversion).

With ``output_cls=`` (a Pydantic model) the synthesizer's answers are held to its schema
and come back validated in a ``PydanticResponse``. For agents, ``ChunkRetrieverTool`` is a
retriever tool whose nodes reach the engine as chunks (``FunctionAgent`` over
``LlamaIndexLLM``: tool calls, ``structured_predict`` and ``as_structured_llm`` are held to
their schemas by the grammar).

``LlamaIndexLLM.chat`` takes documents too: a ``DocumentBlock`` with text data in any
message becomes a chunk, and ``complete``/``chat`` accept ``chunks=[...]`` and
``system=...`` keyword arguments. Conversation history is folded into the question text
as described in ``lazyllm.integrations._common``.
"""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("llama-index", "llama_index.core")

from collections.abc import Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    PydanticResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.bridge.pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from llama_index.core.callbacks import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle
from llama_index.core.types import RESPONSE_TEXT_TYPE

from lazyllm import Chunk, GenerationOutput, InvalidRequestError, LazyLLM
from lazyllm.inputs.conversation import keeps_turns

from ._common import (
    GenerationStream,
    RagRequest,
    build_engine,
    call_sampling,
    device_from_hf,
    engine_kwargs_from_hf,
    engine_options,
    hf_generate_kwargs,
    join_system,
    model_to_run,
    sampling_kwargs,
    usage_dict,
)
from .llama_index_tools import (
    TOOL_KWARGS,
    ChunkRetrieverTool,
    chat_message,
    chat_response,
    chat_to_request,
    completion_response,
    openai_messages,
    prepare_chat_with_tools,
    tool_selections,
    turn_kinds,
)
from .minilm_llama_index import BundledMiniLMEmbedding, MiniLMEmbedding
from .remote import RemoteLazyLLM

dispatcher = instrument.get_dispatcher(__name__)

class LlamaIndexLLM(FunctionCallingLLM):
    """LlamaIndex LLM over an in-process ``LazyLLM``. Argument names follow
    ``HuggingFaceLLM`` (``model_name``, ``context_window``, ``max_new_tokens``,
    ``generate_kwargs``, ``device_map``, ``model_kwargs``, ``system_prompt``), so
    swapping it for ours is one line.

    >>> llm = LlamaIndexLLM()                                  # embedded default model
    >>> llm = LlamaIndexLLM(llm=engine)                        # share a LazyLLM
    >>> llm = LlamaIndexLLM(base_url="http://127.0.0.1:8000/v1", api_key=KEY)  # a lazyllm serve server
    >>> llm.complete("Who?", chunks=["doc one", "doc two"]).additional_kwargs["cached_tokens"]

    Responses carry the usage (``prompt_tokens``, ``cached_tokens``,
    ``completion_tokens``), ``finish_reason`` and ``ttft_s`` in ``additional_kwargs``,
    and the full ``lazyllm.GenerationOutput`` in ``raw``.
    """

    model_name: str = Field(default="", description="The model that runs (given as model_name= or model=: loaded).")
    context_window: int = Field(default=0, description="Context length in tokens (default: the model's).")
    max_new_tokens: int = Field(default=256, description="Tokens to generate at most.")
    temperature: float = Field(default=0.0, description="0 is greedy.")
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    timeout: float | None = Field(default=None, description="Seconds before a request is cancelled.")
    is_chat_model: bool = Field(default=True, description="Use chat() (the model's chat template).")
    reuse: str = Field(default="", description="The engine's reuse mode (set from the engine).")
    chunk_context: str = Field(default="", description="The engine's chunk context (set from the engine).")
    tool_choice: str | None = Field(default=None, description=(
        "tool_choice when tools are given and the caller does not require a call: None is 'auto'; "
        "'required' makes every step of an agent call a tool"))

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")  # no argument silently dropped
    _engine: LazyLLM = PrivateAttr()

    def __init__(self, llm: LazyLLM | None = None, model_name: str | None = None, *, model: str | None = None,
                 generate_kwargs: dict | None = None, device_map: Any = None, device: Any = None,
                 model_kwargs: dict | None = None, tokenizer_name: str | None = None,
                 reuse: str | None = None, chunk_context: str | None = None, engine_kwargs: dict | None = None,
                 base_url: str | None = None, api_key: str | None = None, **kwargs: Any):
        for k, v in hf_generate_kwargs(generate_kwargs).items():
            kwargs.setdefault(k, v)
        model_name = model_to_run(None if base_url else llm, model_name, model)  # loaded, or an error
        if tokenizer_name not in (None, model_name):
            raise InvalidRequestError("lazyllm uses the model's own tokenizer; tokenizer_name must match model_name")
        if base_url is not None:  # a lazyllm server (lazyllm serve); model_name: the model id to send
            if llm is not None:
                raise InvalidRequestError("give base_url= (a server) or llm=, not both")
            llm = RemoteLazyLLM(base_url, api_key, model_name or None)
            if "context_window" not in kwargs:
                try:
                    kwargs["context_window"] = int(llm.models()[0]["max_model_len"])
                except Exception as e:
                    raise InvalidRequestError(f"could not read the context window from {llm.base_url}/models "
                                              f"({e}); pass context_window=") from None
        elif llm is None:
            # only what the caller set reaches LazyLLM, so a ``quality`` preset runs as it does there
            ek, dtype = engine_kwargs_from_hf(model_kwargs, engine_kwargs)
            given = {"reuse": reuse, "chunk_context": chunk_context, "device": device_from_hf(device, device_map),
                     "dtype": dtype}
            llm = build_engine(model_name or None, **engine_options(
                {k: v for k, v in given.items() if v is not None}, ek))
        if "context_window" not in kwargs:
            kwargs["context_window"] = llm.model.spec.max_context
        super().__init__(model_name=str(llm.model_name), reuse=llm.reuse, chunk_context=llm.chunk_context,
                         **kwargs)
        self._engine = llm

    @classmethod
    def class_name(cls) -> str:
        return "LazyLLM"

    @property
    def lazyllm(self) -> LazyLLM:
        """The engine (``cache_stats()``, ``warm()``...)."""
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window, num_output=self.max_new_tokens,
                           is_chat_model=self.is_chat_model, is_function_calling_model=True,
                           model_name=self.model_name)

    # -- helpers -------------------------------------------------------------------
    def _sampling(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        defaults = dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                        top_k=self.top_k, seed=self.seed, stop=self.stop, timeout=self.timeout)
        return sampling_kwargs(**call_sampling(defaults, kwargs, type(self).__name__))

    def _completion_request(self, prompt: str, formatted: bool, kwargs: dict) -> tuple[RagRequest, dict]:
        chunks = list(kwargs.pop("chunks", None) or [])
        system = kwargs.pop("system", None)
        fmt = kwargs.pop("response_format", None)  # the answer held to it; parsed in raw.parsed
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        system = join_system([p for p in (self.system_prompt, system) if p])
        sampling = self._sampling(kwargs)
        if fmt is not None:
            sampling["response_format"] = fmt
        return RagRequest(prompt, chunks, system), sampling

    # -- tools (FunctionCallingLLM): chat_with_tools, structured_predict, FunctionAgent --
    def _prepare_chat_with_tools(self, tools, user_msg=None, chat_history=None, verbose=False,
                                 allow_parallel_tool_calls=False, tool_required=False, **kwargs: Any) -> dict:
        kwargs.setdefault("tool_choice", "required" if tool_required else (self.tool_choice or "auto"))
        return prepare_chat_with_tools(tools, user_msg, chat_history, allow_parallel_tool_calls, **kwargs)

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list:
        return tool_selections(response, error_on_no_tool_call)

    def structured_predict(self, output_cls: type, prompt: Any, llm_kwargs: dict | None = None, **prompt_args: Any):
        """An ``output_cls`` instance from the answer held to its JSON Schema (also what
        ``as_structured_llm`` calls)."""
        messages = prompt.format_messages(llm=self, **prompt_args)
        resp = self.chat(messages, response_format=output_cls, **(llm_kwargs or {}))
        return output_cls.model_validate_json(resp.message.content)

    async def astructured_predict(self, output_cls: type, prompt: Any, llm_kwargs: dict | None = None,
                                  **prompt_args: Any):
        messages = prompt.format_messages(llm=self, **prompt_args)
        resp = await self.achat(messages, response_format=output_cls, **(llm_kwargs or {}))
        return output_cls.model_validate_json(resp.message.content)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict) -> tuple[RagRequest, dict]:
        extra = list(kwargs.pop("chunks", None) or [])
        system = kwargs.pop("system", None)
        tools = {k: kwargs.pop(k) for k in TOOL_KWARGS if k in kwargs}
        sys_text = join_system([p for p in (self.system_prompt, system) if p])
        if keeps_turns(turn_kinds(messages), tools.get("tools")):  # tools or tool turns: real turns
            turns = openai_messages(messages, sys_text)
            return RagRequest(None, extra), {**self._sampling(kwargs), **tools, "messages": turns}
        req = chat_to_request(messages, sys_text)
        req.chunks = extra + req.chunks
        return req, {**self._sampling(kwargs), **tools}

    def _generate(self, req: RagRequest, sampling: dict) -> GenerationOutput:
        return self._engine.generate(req.question, req.chunks, req.system, **sampling)

    async def _agenerate(self, req: RagRequest, sampling: dict) -> GenerationOutput:
        return await self._engine.agenerate(req.question, req.chunks, req.system, **sampling)

    # -- completion ----------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return completion_response(self._generate(*self._completion_request(prompt, formatted, kwargs)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        req, sampling = self._completion_request(prompt, formatted, kwargs)
        stream = GenerationStream(self._engine, req, **sampling)

        def gen() -> CompletionResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            yield CompletionResponse(text=text, delta="", raw=stream.output,
                                     additional_kwargs=usage_dict(stream.output))

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return completion_response(await self._agenerate(*self._completion_request(prompt, formatted, kwargs)))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        req, sampling = self._completion_request(prompt, formatted, kwargs)
        stream = GenerationStream(self._engine, req, **sampling)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            yield CompletionResponse(text=text, delta="", raw=stream.output,
                                     additional_kwargs=usage_dict(stream.output))

        return gen()

    # -- chat ----------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return chat_response(self._generate(*self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req, sampling = self._chat_request(messages, kwargs)
        stream = GenerationStream(self._engine, req, **sampling)

        def gen() -> ChatResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            out = stream.output  # its calls, if any, in the last message
            msg = chat_message(out) if out.tool_calls else ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=msg, delta="", raw=out, additional_kwargs=usage_dict(out))

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return chat_response(await self._agenerate(*self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        req, sampling = self._chat_request(messages, kwargs)
        stream = GenerationStream(self._engine, req, **sampling)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            out = stream.output  # its calls, if any, in the last message
            msg = chat_message(out) if out.tool_calls else ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=msg, delta="", raw=out, additional_kwargs=usage_dict(out))

        return gen()


class ChunkSynthesizer(BaseSynthesizer):
    """Response synthesizer that hands each retrieved node to the engine as its own
    chunk, in retrieval order, instead of packing them into one prompt string.

    ``llm`` must be a ``LlamaIndexLLM``. ``system`` is the shared system prompt (default:
    the LLM's ``system_prompt``); ``metadata_mode`` picks the node content the model
    reads (see the module docstring); other keyword arguments are generation options
    (``max_new_tokens``, ``temperature``...). With ``streaming=True`` queries return a
    ``StreamingResponse``. ``response.metadata["lazyllm"]`` holds the usage (for a
    streaming response, once the stream is exhausted).

    ``output_cls`` (a Pydantic model): the answer is held to its JSON Schema and queries
    return a ``PydanticResponse`` whose ``response`` is the validated instance (None when
    ``max_new_tokens`` cut it off; ``metadata["lazyllm"]["finish_reason"]`` is then
    ``"length"``). Pass it here: ``as_query_engine(output_cls=...)`` only hands it to the
    synthesizer it builds itself, which packs the documents into the prompt text.
    """

    def __init__(self, llm: LlamaIndexLLM, *, streaming: bool = False, system: str | None = None,
                 metadata_mode: MetadataMode = MetadataMode.NONE, output_cls: type[BaseModel] | None = None,
                 callback_manager: CallbackManager | None = None, **generate_kwargs: Any):
        if not isinstance(llm, LlamaIndexLLM):
            raise InvalidRequestError(
                f"ChunkSynthesizer needs a lazyllm LlamaIndexLLM, got {type(llm).__name__}")
        if output_cls is not None and streaming:
            raise InvalidRequestError("ChunkSynthesizer: output_cls answers are not streamed; pass streaming=False")
        if output_cls is not None and not (isinstance(output_cls, type) and issubclass(output_cls, BaseModel)):
            raise InvalidRequestError(f"output_cls must be a Pydantic model class, got {output_cls!r}")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._output_cls = output_cls
        self._system = system
        self._metadata_mode = metadata_mode
        self._generate_kwargs = dict(generate_kwargs)
        llm._sampling(self._generate_kwargs)  # reject bad options now, not at the first query

    def _get_prompts(self) -> dict:
        return {}

    def _update_prompts(self, prompts: dict) -> None:
        return None

    def node_to_chunk(self, node: BaseNode) -> Chunk:
        """The chunk a node becomes: its content, its id, its metadata."""
        return Chunk(node.get_content(metadata_mode=self._metadata_mode), id=node.node_id,
                     metadata=dict(node.metadata or {}))

    def warm(self, nodes: Sequence[BaseNode | NodeWithScore], *, progress: bool | None = None) -> dict:
        """Precompute the chunk KV of ``nodes`` exactly as queries will use it."""
        chunks = [self.node_to_chunk(n.node if isinstance(n, NodeWithScore) else n) for n in nodes]
        return self._llm.lazyllm.warm(chunks, system=self._system, progress=progress)

    def _kwargs(self, chunks: list[Chunk], extra: dict) -> dict:
        kw = {**self._generate_kwargs, **extra, "chunks": chunks}
        if self._output_cls is not None:
            kw["response_format"] = self._output_cls
        if self._system is not None:
            kw["system"] = self._system
        return kw

    # The abstract text-only entry points: chunks without ids (used only when called
    # directly; synthesize() below keeps the node ids).
    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        kw = self._kwargs([Chunk(t) for t in text_chunks], response_kwargs)
        if self._streaming:
            return (r.delta for r in self._llm.stream_complete(query_str, **kw) if r.delta)
        return self._llm.complete(query_str, **kw).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str],
                            **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        kw = self._kwargs([Chunk(t) for t in text_chunks], response_kwargs)
        if self._streaming:
            gen = await self._llm.astream_complete(query_str, **kw)
            return (r.delta async for r in gen if r.delta)
        return (await self._llm.acomplete(query_str, **kw)).text

    def _empty(self, query) -> RESPONSE_TYPE:
        resp = (StreamingResponse(response_gen=self._empty_response_generator()) if self._streaming
                else PydanticResponse(None) if self._output_cls is not None else Response(self._empty_response))
        dispatcher.event(SynthesizeEndEvent(query=query, response=resp))
        return resp

    def _prepare(self, query: Any, nodes: list[NodeWithScore], additional_source_nodes, response_kwargs):
        """Query bundle, source nodes, response metadata and engine arguments (one chunk per
        node), shared by ``synthesize`` and ``asynthesize``."""
        if isinstance(query, str):
            query = QueryBundle(query_str=query)
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        meta: dict[str, Any] = self._get_metadata_for_response([n.node for n in source_nodes]) or {}
        kw = self._kwargs([self.node_to_chunk(n.node) for n in nodes], response_kwargs)
        return query, source_nodes, meta, kw

    def _answer(self, r: CompletionResponse, source_nodes: list[NodeWithScore], meta: dict) -> RESPONSE_TYPE:
        meta["lazyllm"] = dict(r.additional_kwargs)
        if self._output_cls is not None:
            return PydanticResponse(r.raw.parsed, source_nodes=source_nodes, metadata=meta)
        return Response(r.text, source_nodes=source_nodes, metadata=meta)

    def synthesize(self, query: Any, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None,
                   **response_kwargs: Any) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        if not nodes:
            return self._empty(query)
        query, source_nodes, meta, kw = self._prepare(query, nodes, additional_source_nodes, response_kwargs)
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: query.query_str}) as event:
            if self._streaming:
                stream = self._llm.stream_complete(query.query_str, **kw)

                def deltas():
                    for r in stream:
                        if r.delta:
                            yield r.delta
                        if r.raw is not None:
                            meta["lazyllm"] = dict(r.additional_kwargs)

                response: RESPONSE_TYPE = StreamingResponse(response_gen=deltas(), source_nodes=source_nodes,
                                                            metadata=meta)
            else:
                r = self._llm.complete(query.query_str, **kw)
                response = self._answer(r, source_nodes, meta)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    async def asynthesize(self, query: Any, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None,
                          **response_kwargs: Any) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        if not nodes:
            if self._streaming:
                resp = AsyncStreamingResponse(response_gen=self._empty_response_agenerator())
                dispatcher.event(SynthesizeEndEvent(query=query, response=resp))
                return resp
            return self._empty(query)
        query, source_nodes, meta, kw = self._prepare(query, nodes, additional_source_nodes, response_kwargs)
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: query.query_str}) as event:
            if self._streaming:
                stream = await self._llm.astream_complete(query.query_str, **kw)

                async def deltas():
                    async for r in stream:
                        if r.delta:
                            yield r.delta
                        if r.raw is not None:
                            meta["lazyllm"] = dict(r.additional_kwargs)

                response: RESPONSE_TYPE = AsyncStreamingResponse(response_gen=deltas(), source_nodes=source_nodes,
                                                                 metadata=meta)
            else:
                r = await self._llm.acomplete(query.query_str, **kw)
                response = self._answer(r, source_nodes, meta)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response


__all__ = ["LlamaIndexLLM", "ChunkSynthesizer", "ChunkRetrieverTool", "BundledMiniLMEmbedding", "MiniLMEmbedding",
           "chat_to_request"]
