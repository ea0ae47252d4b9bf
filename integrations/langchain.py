"""LangChain adapter: ``ChatLazyLLM`` (a chat model), ``LazyLLMText`` (a string LLM),
helpers that turn retrieved ``Document``s into chunk-carrying messages, and
``BundledMiniLMEmbeddings`` (the bundled offline embedding model, for ``langchain_chroma.Chroma``
or any LangChain vector store).

Documents reach the engine as chunks, never as one flattened string. In LangChain terms a
document is a v1 ``text-plain`` content block::

    {"type": "text-plain", "mime_type": "text/plain", "text": "...", "id": "doc-7",
     "title": "optional", "extras": {...document metadata...}}

``ChatLazyLLM`` turns each such block, in whatever message it sits, into a
``lazyllm.Chunk`` (block ``id`` -> chunk id, ``extras`` (+ ``title``/``context``) ->
chunk metadata, ``title`` prepended to the text as its first paragraph), the system
messages into the shared ``system`` prefix, and the text of the last human message into
the question. Earlier turns are appended to the question text as a transcript (see
``lazyllm.integrations._common``).

The LCEL idiom (``to_chunks`` replaces the usual ``format_docs``, and a
``MessagesPlaceholder`` replaces the ``{context}`` string)::

    from langchain_core.runnables import RunnablePassthrough
    from lazyllm.integrations.langchain import ChatLazyLLM, chunk_prompt, to_chunks

    llm = ChatLazyLLM(max_tokens=128)                     # default model, offline
    prompt = chunk_prompt(system="Answer from the documents only.")
    chain = {"documents": retriever | to_chunks, "question": RunnablePassthrough()} | prompt | llm
    chain.invoke("Who wrote it?").usage_metadata["input_token_details"]["cache_read"]

or, without a prompt template, ``llm.invoke(documents_to_messages(docs, question, system))``.

``LazyLLMText`` is the string-in, string-out variant (``BaseLLM``). LangChain's own
message-to-string conversion keeps only ``text`` blocks and silently drops documents, so
``LazyLLMText`` renders messages to a string in which each document is a tagged section
(``<lazyllm-document id="...">...</lazyllm-document>``, see ``encode_prompt``) and parses
the sections back into chunks before generating. In string-prompt chains, use
``format_documents`` where you would have written ``format_docs``: the tagged documents
can sit anywhere in a ``PromptTemplate``; they are lifted out as chunks and the rest of
the prompt becomes the question.
"""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("langchain", "langchain_core")

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, BaseLLM, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import (
    BaseMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.prompt_values import ChatPromptValue, PromptValue, StringPromptValue
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from lazyllm import GenerationOutput, InvalidRequestError, LazyLLM
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
    model_to_run,
    usage_dict,
)
from .chroma_langchain import ChromaRetriever
from .langchain_messages import (
    block_to_chunk,
    chunk_prompt,
    document_block,
    documents_to_messages,
    format_documents,
    message_parts,
    messages_to_request,
    to_chunks,
)
from .langchain_tools import (
    CallHold,
    ai_message,
    bind_tools,
    last_chunk_message,
    pop_structured,
    to_openai_messages,
    turn_kinds,
    with_structured_output,
)
from .minilm_langchain import BundledMiniLMEmbeddings
from .remote import RemoteLazyLLM
from .tagged import decode_prompt, encode_prompt

PROVIDER = "lazyllm"

# -- shared engine parameters --------------------------------------------------------

# the fields below that are LazyLLM arguments
_ENGINE_FIELDS = ("reuse", "chunk_context", "device", "dtype", "kv_cache_bytes")


class _EngineParams(BaseModel):
    """Fields shared by ``ChatLazyLLM`` and ``LazyLLMText``: the engine (a ``LazyLLM``,
    given or built from the same constructor arguments) and the sampling defaults."""

    # an argument these classes do not know is refused, never silently dropped (restated in each
    # subclass: pydantic lets the LangChain base listed after this one override its config)
    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, extra="forbid")

    llm: LazyLLM | RemoteLazyLLM | None = Field(default=None, exclude=True)
    """The engine. Built from the fields below when not given. Several models can share
    one engine (and so one chunk cache)."""
    base_url: str | None = None
    """A lazyllm server (``lazyllm serve``) at ``http://host:port/v1`` that runs the
    requests instead of an in-process engine; documents still travel as chunks (the
    server's ``documents`` field) and are cached there. ``model_name`` is then the
    ``model`` id sent (default: the server's model)."""
    api_key: SecretStr | None = None
    """The server's API key (``lazyllm serve --api-key``), sent as a Bearer token."""
    model_name: str | None = None
    """The model to run (also ``model=``, as ``ChatOpenAI``): a folder with a transformers
    checkpoint, a ``.gguf`` file or a hub id, loaded as ``LazyLLM``'s first argument (``None``:
    the embedded default model). A name that is given is loaded or raises ``ModelLoadError``,
    never replaced; with ``llm=`` it must be that engine's model. After construction it holds
    the model that runs, which traces and ``response_metadata`` report."""
    model: str | None = Field(default=None, exclude=True)
    model_name_or_path: str | None = None
    """Both the same as ``model_name`` (``ChatOpenAI``'s name for it, and ``LazyLLM``'s)."""
    reuse: str | None = None
    chunk_context: str | None = None
    device: str = "auto"
    dtype: Any = None
    kv_cache_bytes: int | None = None
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Any other ``LazyLLM`` argument (``quality``, ``page_size``...). Only the options set
    here or above reach ``LazyLLM``, so a ``quality`` preset runs as it does there; ``reuse``
    and ``chunk_context`` then hold the engine's values."""

    max_tokens: int = Field(default=256, alias="max_new_tokens")
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    timeout: float | None = None
    """Seconds before a request is cancelled (``RequestCancelled``)."""
    max_retries: int = 0
    """Accepted for LangChain's standard parameters; an in-process engine has no
    transient failures to retry, so it is not used."""
    streaming: bool = False
    """``invoke`` streams internally (callbacks get ``on_llm_new_token``)."""
    logprobs: bool | None = None
    """As ``ChatOpenAI``: the generated tokens' log-probabilities in
    ``response_metadata["logprobs"]`` (OpenAI's ``{"content": [...]}``)."""
    top_logprobs: int | None = None
    """With ``logprobs``: the most likely tokens at each place (0-20)."""

    @model_validator(mode="before")
    @classmethod
    def _name_over_alias(cls, data: Any) -> Any:
        """``max_tokens`` wins over its alias ``max_new_tokens`` when both are given (rather than
        the name being refused as an unknown argument)."""
        if isinstance(data, dict) and "max_tokens" in data:
            data = {k: v for k, v in data.items() if k != "max_new_tokens"}
        return data

    @model_validator(mode="after")
    def _build_engine(self):
        name = model_to_run(self.llm if self.base_url is None else None, self.model_name, self.model,
                            self.model_name_or_path)
        if self.base_url is not None:
            if self.llm is not None or self.model_name_or_path is not None:
                raise InvalidRequestError("give base_url= (a server) or llm=/model_name_or_path=, not both")
            key = self.api_key.get_secret_value() if self.api_key is not None else None
            self.llm = RemoteLazyLLM(self.base_url, key, name)
        elif self.llm is None:
            given = {k: getattr(self, k) for k in _ENGINE_FIELDS if k in self.model_fields_set}
            self.llm = build_engine(name, **engine_options(given, self.engine_kwargs))
        self.reuse, self.chunk_context = self.llm.reuse, self.llm.chunk_context
        if self.model_name is None or isinstance(self.llm, LazyLLM):
            self.model_name = str(self.llm.model_name)  # what runs, not a label
        return self

    @classmethod
    def from_model_id(cls, model_id: str | None = None, task: str | None = None, *, device: Any = None,
                      device_map: Any = None, model_kwargs: dict | None = None,
                      pipeline_kwargs: dict | None = None, **kwargs: Any):
        """Build from a model id or path, with the argument names of
        ``HuggingFacePipeline.from_model_id``, so swapping it for ours is one line.

        ``model_id`` ``None`` is the embedded default model. ``task`` must be
        ``"text-generation"`` (or left out). ``device`` takes transformers' ``-1``/``0``
        or a device string; ``model_kwargs`` takes ``trust_remote_code`` and
        ``dtype``/``torch_dtype``; ``pipeline_kwargs`` takes generation options
        (``max_new_tokens``, ``temperature``, ``do_sample``...). Other keyword arguments
        are fields of this class (``reuse``, ``max_tokens``...)."""
        if task not in (None, "text-generation"):
            raise InvalidRequestError(f"lazyllm only does text-generation, not {task!r}")
        engine, dtype = engine_kwargs_from_hf(model_kwargs, kwargs.pop("engine_kwargs", {}))
        if dtype is not None:
            kwargs.setdefault("dtype", dtype)
        dev = device_from_hf(device, device_map)
        if dev is not None:
            kwargs.setdefault("device", dev)
        gen = hf_generate_kwargs(pipeline_kwargs)
        if "max_new_tokens" in gen:
            kwargs.setdefault("max_tokens", gen.pop("max_new_tokens"))
        for k, v in gen.items():
            kwargs.setdefault(k, v)
        return cls(model_name_or_path=model_id, engine_kwargs=engine, **kwargs)

    # -- per-call options ------------------------------------------------------------
    def _ls_params(self, model_type: str, stop: list[str] | None, kwargs: dict[str, Any]) -> LangSmithParams:
        params = LangSmithParams(ls_provider=PROVIDER, ls_model_type=model_type,
                                 ls_model_name=kwargs.get("model") or self.model_name,
                                 ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        stop = stop if stop is not None else self.stop
        if stop:
            params["ls_stop"] = list(stop)
        return params

    def _sampling(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        # LangChain passes `stop` as its own argument (so never inside kwargs) and may
        # pass `model`, which an in-process engine can only check.
        options = dict(kwargs)
        model = options.pop("model", None)
        if stop is not None:
            options["stop"] = stop
        defaults = dict(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                        top_k=self.top_k, seed=self.seed, stop=self.stop, timeout=self.timeout)
        out = call_sampling(defaults, options, type(self).__name__)
        if model is not None and model != self.model_name:
            raise InvalidRequestError(
                f"this model serves {self.model_name!r} in process; it cannot switch to {model!r}")
        out["stop"] = list(out["stop"]) if out["stop"] else None
        return out

    def _engine_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "reuse": self.reuse, "chunk_context": self.chunk_context,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": self.stop}

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (LangChain's default one for a
        server)."""
        if isinstance(self.llm, RemoteLazyLLM):
            return super().get_token_ids(text)
        return self.llm.prompts.encode(text)


def _usage_metadata(out: GenerationOutput) -> UsageMetadata:
    u = out.usage
    return UsageMetadata(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                         total_tokens=u.prompt_tokens + u.completion_tokens,
                         input_token_details=InputTokenDetails(cache_read=u.cached_tokens))


def _response_metadata(model_name: str, out: GenerationOutput) -> dict[str, Any]:
    return {"model_name": model_name, "model_provider": PROVIDER, "finish_reason": out.finish_reason,
            "ttft_s": out.ttft_s, "total_s": out.total_s, "cached_tokens": out.usage.cached_tokens,
            "cached_chunk_tokens": out.usage.cached_chunk_tokens,
            "chunk_ids": list(out.chunk_ids),
            **({"logprobs": {"content": [t.to_openai() for t in out.logprobs]}} if out.logprobs is not None else {})}


# -- the chat model --------------------------------------------------------------


class ChatLazyLLM(_EngineParams, BaseChatModel):
    """LangChain chat model over an in-process ``LazyLLM``: retrieved documents
    (``text-plain`` blocks) become cached chunks, reused at any position by later calls.

    >>> chat = ChatLazyLLM(max_tokens=64)                    # embedded default model
    >>> chat = ChatLazyLLM(model="HuggingFaceTB/SmolLM2-360M-Instruct")  # loaded (or ModelLoadError)
    >>> chat = ChatLazyLLM(llm=LazyLLM("path/to/model"))     # share an engine
    >>> chat = ChatLazyLLM(base_url="http://127.0.0.1:8000/v1", api_key=KEY)  # a lazyllm serve server
    >>> chat = ChatLazyLLM.from_model_id("HuggingFaceTB/SmolLM2-360M-Instruct",
    ...                                  pipeline_kwargs={"max_new_tokens": 128})
    >>> msg = chat.invoke(documents_to_messages(docs, "Who?", system="Be brief."))
    >>> msg.usage_metadata["input_token_details"]["cache_read"]   # reused chunk tokens

    ``usage_metadata``: ``input_tokens``, ``output_tokens``, ``total_tokens`` and
    ``input_token_details.cache_read`` (prompt tokens whose KV was reused).
    ``response_metadata``: ``model_name``, ``finish_reason`` (``stop``/``length``/
    ``tool_calls``), ``ttft_s``, ``total_s``, ``cached_tokens``, ``chunk_ids``. Per-call
    options: ``stop``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
    ``timeout``. Tools: ``bind_tools`` (functions, Pydantic classes, ``@tool``s, dicts;
    ``tool_choice`` "auto" / "any" / "required" / "none" / a name), ``AIMessage.tool_calls``,
    ``ToolMessage`` results, streamed ``tool_call_chunks``; ``with_structured_output``
    (``json_schema``, ``function_calling``, ``json_mode``; ``include_raw``), all held to a
    grammar (``lazyllm.integrations.langchain_tools``). No images.
    """

    model_config = _EngineParams.model_config

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any):
        return bind_tools(self, tools, tool_choice, **kwargs)

    def with_structured_output(self, schema: Any = None, *, method: str = "json_schema", include_raw: bool = False,
                               **kwargs: Any):
        return with_structured_output(self, schema, method=method, include_raw=include_raw, **kwargs)

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        """``(RagRequest, options)`` of a call: where ``keeps_turns`` says so (tools, tool
        turns) the conversation goes as real turns (``messages=``) with its documents as
        chunks; otherwise it is folded into the question."""
        extra = pop_structured(kwargs)
        logprobs, top = kwargs.pop("logprobs", self.logprobs), kwargs.pop("top_logprobs", self.top_logprobs)
        if logprobs:  # only when asked: a remote engine without them is not sent the fields
            extra.update(logprobs=True, top_logprobs=top or 0)
        options = {**self._sampling(stop, kwargs), **extra}
        if not keeps_turns(turn_kinds(messages), extra.get("tools")):
            return messages_to_request(messages), options
        options["messages"] = to_openai_messages(messages, message_parts)
        return RagRequest(None), options

    @property
    def _llm_type(self) -> str:
        return "lazyllm-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._engine_params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params("chat", stop, kwargs)

    def _result(self, out: GenerationOutput) -> ChatResult:
        msg = ai_message(out, usage_metadata=_usage_metadata(out),
                         response_metadata=_response_metadata(self.model_name, out))
        gen = ChatGeneration(message=msg, generation_info={"finish_reason": out.finish_reason})
        return ChatResult(generations=[gen], llm_output={"model_name": self.model_name, "token_usage": usage_dict(out)})

    def _last_chunk(self, out: GenerationOutput, hold: CallHold) -> ChatGenerationChunk:
        msg = last_chunk_message(out, hold, usage_metadata=_usage_metadata(out),
                                 response_metadata=_response_metadata(self.model_name, out))
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": out.finish_reason})

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        req, options = self._request(messages, stop, kwargs)
        return self._result(self.llm.generate(req.question, req.chunks, req.system, **options))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        req, options = self._request(messages, stop, kwargs)
        return self._result(await self.llm.agenerate(req.question, req.chunks, req.system, **options))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        req, options = self._request(messages, stop, kwargs)
        stream, hold = GenerationStream(self.llm, req, **options), CallHold("tools" in options)
        for delta in stream:
            if (delta := hold.feed(delta)) is None:
                continue
            chunk = ChatGenerationChunk(message=hold.message(delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.output, hold)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        req, options = self._request(messages, stop, kwargs)
        stream, hold = GenerationStream(self.llm, req, **options), CallHold("tools" in options)
        async for delta in stream:
            if (delta := hold.feed(delta)) is None:
                continue
            chunk = ChatGenerationChunk(message=hold.message(delta))
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.output, hold)


# -- the string LLM ----------------------------------------------------------------


class LazyLLMText(_EngineParams, BaseLLM):
    """LangChain string LLM (``BaseLLM``) over an in-process ``LazyLLM`` that keeps the
    documents: messages are rendered with ``encode_prompt`` (documents as tagged
    sections) instead of LangChain's ``get_buffer_string``, which drops them, and tagged
    sections in any prompt string (from ``format_documents``) go to the engine as
    chunks. The drop-in for ``HuggingFacePipeline``::

        llm = LazyLLMText.from_model_id(model_id=None, task="text-generation",
                                        pipeline_kwargs={"max_new_tokens": 128})

    ``generation_info`` of each generation carries the usage (``cached_tokens``...),
    ``finish_reason`` and ``ttft_s``; ``llm_output["token_usage"]`` sums the batch.
    """

    model_config = _EngineParams.model_config

    @property
    def _llm_type(self) -> str:
        return "lazyllm"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._engine_params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params("llm", stop, kwargs)

    def _convert_input(self, model_input: Any) -> PromptValue:
        # Messages: render documents as tagged sections rather than dropping them.
        value = super()._convert_input(model_input)
        if isinstance(value, ChatPromptValue):
            return StringPromptValue(text=encode_prompt(messages_to_request(value.messages)))
        return value

    @staticmethod
    def _generation(out: GenerationOutput) -> Generation:
        return Generation(text=out.text, generation_info=usage_dict(out))

    def _llm_result(self, outs: list[GenerationOutput]) -> LLMResult:
        total = {k: sum(o_[k] for o_ in map(usage_dict, outs))
                 for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")}
        return LLMResult(generations=[[self._generation(o)] for o in outs],
                         llm_output={"model_name": self.model_name, "token_usage": total})

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        sampling = self._sampling(stop, kwargs)
        if self.streaming and len(prompts) == 1:
            text, last = "", None
            for g in self._stream(prompts[0], stop, run_manager, **kwargs):
                text += g.text
                last = g
            return LLMResult(generations=[[Generation(text=text, generation_info=last.generation_info)]],
                             llm_output={"model_name": self.model_name})
        reqs = [decode_prompt(p) for p in prompts]
        outs = self.llm.generate_batch(
            [{"question": r.question, "chunks": r.chunks, "system": r.system} for r in reqs], **sampling)
        return self._llm_result(outs)

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        import asyncio

        sampling = self._sampling(stop, kwargs)
        reqs = [decode_prompt(p) for p in prompts]
        outs = await asyncio.gather(*(self.llm.agenerate(r.question, r.chunks, r.system, **sampling) for r in reqs))
        return self._llm_result(list(outs))

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        stream = GenerationStream(self.llm, decode_prompt(prompt), **self._sampling(stop, kwargs))
        for delta in stream:
            chunk = GenerationChunk(text=delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=usage_dict(stream.output))

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        stream = GenerationStream(self.llm, decode_prompt(prompt), **self._sampling(stop, kwargs))
        async for delta in stream:
            chunk = GenerationChunk(text=delta)
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=usage_dict(stream.output))


__all__ = [
    "ChatLazyLLM", "LazyLLMText", "BundledMiniLMEmbeddings", "ChromaRetriever", "documents_to_messages",
    "document_block", "to_chunks", "chunk_prompt", "format_documents", "messages_to_request", "encode_prompt",
    "decode_prompt", "block_to_chunk",
]
