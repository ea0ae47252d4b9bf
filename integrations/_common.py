"""Framework-neutral glue shared by the LangChain, LlamaIndex and chromadb adapters.

Everything here speaks ``lazyllm`` types only (``LazyLLM``, ``Chunk``,
``GenerationOutput``); the framework modules translate their own message and document
types into a :class:`RagRequest` and back.

Conversation history
--------------------
Whether earlier turns stay chat-template turns or are folded into the question text is one
rule, ``lazyllm.inputs.conversation.keeps_turns`` (turns with tools or tool turns, folded
otherwise, as ``fold_history`` writes them); every adapter and the server decide with it.
Documents are never folded into the text: they always travel as chunks, whichever message
carried them.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lazyllm import Chunk, GenerationOutput, InvalidRequestError, LazyLLM
from lazyllm.inputs.conversation import fold_turns
from lazyllm.presets import QUALITY_OPTIONS
from lazyllm.stream import TextStream

from .remote_tools import RemoteAsk, StreamedCalls, request_fields


@dataclass
class RagRequest:
    """What one call to the engine needs: the question, the documents as chunks (in
    retrieval order) and the shared system prompt."""

    question: str
    chunks: list[Chunk] = field(default_factory=list)
    system: str | None = None


def request_from_messages(messages: Iterable[tuple[str, str, list[Chunk]]], system_parts: list[str] | None = None,
                          user: str = "user") -> RagRequest:
    """The request a chat transcript asks, each message given as ``(role, text, chunks)``
    (the framework adapters read their own message types into that): every message's
    chunks, in order; ``system`` messages' text after ``system_parts``; the other messages
    with text as turns (``request_from_turns``). ``user`` names the user role in errors."""
    system_parts = list(system_parts or [])
    chunks: list[Chunk] = []
    turns: list[tuple[str, str]] = []
    for role, text, docs in messages:
        chunks.extend(docs)
        if role == "system":
            system_parts.append(text)
        elif text.strip():
            turns.append((role, text))
    return request_from_turns(turns, chunks, system_parts, user=user)


def request_from_turns(turns: list[tuple[str, str]], chunks: list[Chunk], system_parts: list[str],
                       user: str = "user") -> RagRequest:
    """The request a chat transcript asks: the last ``user`` turn is the question, the
    other turns are folded into it (``fold_history``), system texts are joined."""
    return RagRequest(fold_turns(turns, user), chunks, join_system(system_parts))


def join_system(parts: list[str]) -> str | None:
    parts = [p.strip() for p in parts if p and p.strip()]
    return "\n\n".join(parts) if parts else None


# -- sampling options --------------------------------------------------------------

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "timeout")


def sampling_kwargs(**kw: Any) -> dict[str, Any]:
    """The ``LazyLLM.generate`` keyword arguments among ``kw``, ``None`` values dropped."""
    return {k: v for k, v in kw.items() if k in SAMPLING_KEYS and v is not None}


def call_sampling(defaults: dict[str, Any], options: dict[str, Any], owner: str) -> dict[str, Any]:
    """The sampling options of one call: the model's ``defaults`` (a value for each of
    ``SAMPLING_KEYS``) overridden by the per-call ``options``. ``max_tokens`` (the
    LangChain and OpenAI name) stands for ``max_new_tokens`` and wins over it; any other
    option raises ``InvalidRequestError`` naming ``owner``, rather than being ignored.
    Values are kept as given (``None`` included): the adapters differ there."""
    opts = dict(options)
    if "max_tokens" in opts:
        opts["max_new_tokens"] = opts.pop("max_tokens")
    unknown = set(opts) - set(SAMPLING_KEYS)
    if unknown:
        raise InvalidRequestError(f"unsupported options for {owner}: {sorted(unknown)}")
    return {**defaults, **opts}


def hf_generate_kwargs(kw: dict[str, Any] | None) -> dict[str, Any]:
    """Map transformers-style generation options (``pipeline_kwargs`` of
    ``HuggingFacePipeline``, ``generate_kwargs`` of ``HuggingFaceLLM``) to ours, so that
    swapping those classes for ours keeps working. ``do_sample=False`` means greedy;
    options with no counterpart (``repetition_penalty``...) raise, rather than being
    silently ignored."""
    out: dict[str, Any] = {}
    kw = dict(kw or {})
    do_sample = kw.pop("do_sample", None)
    for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed"):
        if k in kw:
            out[k] = kw.pop(k)
    if "stop_strings" in kw:
        out["stop"] = list(kw.pop("stop_strings"))
    kw.pop("return_full_text", None)  # we never echo the prompt
    if kw:
        raise InvalidRequestError(f"unsupported generation options for lazyllm: {sorted(kw)}")
    if do_sample is False:
        out["temperature"] = 0.0
    elif do_sample and not out.get("temperature"):
        out["temperature"] = 1.0
    return out


def device_from_hf(device: Any, device_map: Any = None) -> str | None:
    """transformers pipelines take ``device=-1`` for CPU and ``device=0`` for cuda:0;
    a ``device_map`` string (``"cuda"``, ``"cpu"``) counts when ``device`` is not given,
    a dict one (a multi-device placement) does not."""
    if device is None:
        dev = None
    elif isinstance(device, int):
        dev = "cpu" if device < 0 else f"cuda:{device}"
    else:
        dev = str(device)
    return dev or (device_map if isinstance(device_map, str) else None)


def engine_kwargs_from_hf(model_kwargs: dict[str, Any] | None,
                          engine_kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
    """``(LazyLLM keyword arguments, dtype)`` from transformers' ``model_kwargs``
    (``trust_remote_code``, ``dtype``/``torch_dtype``) added to ``engine_kwargs``; any
    other model option raises, rather than being silently ignored."""
    ek = dict(engine_kwargs or {})
    mk = dict(model_kwargs or {})
    if "trust_remote_code" in mk:
        ek["trust_remote_code"] = mk.pop("trust_remote_code")
    dtype = mk.pop("dtype", mk.pop("torch_dtype", None))
    if mk:
        raise InvalidRequestError(f"unsupported model_kwargs for lazyllm: {sorted(mk)}")
    return ek, dtype


# -- the engine ----------------------------------------------------------------------

def engine_options(given: dict[str, Any], engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The ``LazyLLM`` keyword arguments of an adapter: the options its caller set, as named
    arguments (``given``) or in ``engine_kwargs``, and nothing else, so that the engine's
    defaults and a ``quality`` preset apply as they do to ``LazyLLM`` itself."""
    ek = dict(engine_kwargs or {})
    both = sorted(k for k in set(given) & set(ek) if given[k] != ek[k])
    if both:
        raise InvalidRequestError(f"{', '.join(both)} given twice, as an argument and in engine_kwargs")
    return {**ek, **given}


def build_engine(*args: Any, **kwargs: Any) -> LazyLLM:
    """``LazyLLM(*args, **kwargs)`` for an adapter that builds its own engine (the core
    stops every engine at interpreter exit)."""
    return LazyLLM(*args, **kwargs)


def resolve_lazyllm(obj: Any) -> LazyLLM:
    """The ``LazyLLM`` behind ``obj``: a ``LazyLLM`` itself or any of our adapters."""
    if isinstance(obj, LazyLLM):
        return obj
    for attr in ("llm", "lazyllm"):
        inner = getattr(obj, attr, None)
        if isinstance(inner, LazyLLM):
            return inner
    raise InvalidRequestError(
        f"expected a LazyLLM or a lazyllm integration model, got {type(obj).__name__}")


def GenerationStream(llm: LazyLLM, request: RagRequest, **sampling: Any) -> TextStream:
    """Text deltas of one request (``for`` or ``async for``), with the full
    ``GenerationOutput`` (usage, TTFT, finish reason) in ``.output`` once the iteration
    ends: ``LazyLLM.stream``, taking a ``RagRequest``."""
    return llm.stream(request.question, request.chunks, request.system, **sampling)


def usage_dict(out: GenerationOutput) -> dict[str, Any]:
    """Flat, JSON-friendly summary of one result (for framework metadata fields)."""
    return {
        "prompt_tokens": out.usage.prompt_tokens,
        "cached_tokens": out.usage.cached_tokens,
        "cached_chunk_tokens": out.usage.cached_chunk_tokens,
        "completion_tokens": out.usage.completion_tokens,
        "total_tokens": out.usage.total_tokens,
        "finish_reason": out.finish_reason,
        "ttft_s": out.ttft_s,
        "total_s": out.total_s,
        "chunk_ids": list(out.chunk_ids),
    }


# -- a lazyllm server instead of an in-process engine -------------------------------------

def engine_settings(llm: Any) -> dict[str, Any]:
    """The engine options a served ``LazyLLM`` runs with (the ``/v1/models`` card and the
    ``lazyllm_engine_info`` metric): the quality preset and the options it resolves to."""
    out: dict[str, Any] = {"quality": getattr(llm, "quality", None)}
    for name in QUALITY_OPTIONS:
        if hasattr(llm, name):
            out[name] = getattr(llm, name)
    return out


class RemoteLazyLLM:
    """The part of ``LazyLLM`` the adapters call (``generate``, ``agenerate``, ``stream``,
    ``astream``, ``generate_batch``), served by a ``lazyllm serve`` server (or anything
    speaking its OpenAI dialect) at ``base_url`` (``http://host:port/v1``).

    Documents travel as the server's ``documents`` extension, so they are cached as chunks
    there exactly as in process; the system prompt and the (already folded) question go as
    a system and a user message. ``messages``, ``tools``, ``tool_choice``,
    ``response_format`` (JSON kinds) and ``parallel_tool_calls`` go as the OpenAI fields, and
    the answer comes back as in process: ``tool_calls``, ``parsed``, a stream's deltas with
    the calls as the model wrote them (``integrations.remote_tools``). Results are ``GenerationOutput``s with the usage
    (``cached_tokens``...), finish reason and the server's TTFT, queue and total times;
    ``token_ids`` and ``prompt_segments`` stay empty (the server does not send them).
    ``model``: the ``model`` id to send (``None``: the server's one, asked at the first request). Errors: a 400 raises
    ``InvalidRequestError`` (``ContextLengthError`` for a prompt too long), anything else
    ``LazyLLMError``, both with the server's message.
    """

    reuse = "remote"
    chunk_context = "remote"

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, *,
                 timeout: float = 600.0, headers: dict[str, str] | None = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"base_url must be an http(s) URL, got {base_url!r}")
        base_url = base_url.rstrip("/")
        self.base_url = base_url if base_url.endswith("/v1") else base_url + "/v1"
        self.model = model
        self.model_name = model or "lazyllm-server"
        self.timeout = timeout
        self.headers = dict(headers or {})
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._client = None

    def __repr__(self) -> str:
        return f"RemoteLazyLLM(base_url={self.base_url!r}, model={self.model!r})"

    # -- plumbing --------------------------------------------------------------------
    def _sync(self):
        import httpx

        if self._client is None:
            self._client = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=self.timeout)
        return self._client

    def _async(self):
        import httpx

        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout)

    def _model_id(self) -> str:
        """``model``, or the server's own id (asked once: a request must name its model)."""
        if self.model is None:
            self.model = self.models()[0]["id"]
        return self.model

    def payload(self, question: str | None, chunks: Any = None, system: str | None = None, *, stream: bool = False,
                **sampling: Any) -> dict[str, Any]:
        """The chat completion body of one request."""
        return self._request(question, chunks, system, stream, sampling)[0]

    def _request(self, question, chunks, system, stream, sampling) -> tuple[dict[str, Any], RemoteAsk]:
        """The body of one request and what its answer is read with (tools, the format)."""
        from lazyllm.types import as_chunk

        if isinstance(chunks, (str, Chunk)):
            raise InvalidRequestError("chunks must be a list of str or Chunk, not a single one")
        messages, carried, fields, ask = request_fields(question, system, sampling)
        if carried and chunks:
            raise InvalidRequestError("give chunks either as the argument or in one message, not both")
        docs = []
        for i, c in enumerate(chunks or carried):
            c = as_chunk(c, i)
            d: dict[str, Any] = {"text": c.text}
            if c.id is not None:
                d["id"] = c.id
            if c.metadata:
                d["metadata"] = c.metadata
            docs.append(d)
        body: dict[str, Any] = {"messages": messages, "documents": docs, "stream": stream, **fields}
        body["model"] = self._model_id()
        unknown = set(sampling) - set(SAMPLING_KEYS)
        if unknown:
            raise InvalidRequestError(f"unsupported options: {sorted(unknown)}")
        for ours, theirs in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k"), ("seed", "seed"), ("stop", "stop")):
            if sampling.get(ours) is not None:
                body[theirs] = list(sampling[ours]) if ours == "stop" and not isinstance(
                    sampling[ours], str) else sampling[ours]
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body, ask

    @staticmethod
    def raise_for(status: int, body: Any) -> None:
        """Raise the lazyllm error for an HTTP error answer."""
        from lazyllm.errors import ContextLengthError, LazyLLMError

        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else str(body)[:500]
        if status == 400:
            if isinstance(err, dict) and err.get("code") == "context_length_exceeded":
                raise ContextLengthError(msg)
            raise InvalidRequestError(msg)
        raise LazyLLMError(f"lazyllm server answered {status}: {msg}")

    @staticmethod
    def output(text: str, finish_reason: str | None, usage: dict | None, extra: dict | None) -> GenerationOutput:
        """A ``GenerationOutput`` from the server's answer."""
        from lazyllm.types import Usage

        usage, extra = usage or {}, extra or {}
        details = usage.get("prompt_tokens_details") or {}
        u = Usage(prompt_tokens=usage.get("prompt_tokens", 0), cached_tokens=details.get("cached_tokens", 0) or 0,
                  completion_tokens=usage.get("completion_tokens", 0),
                  cached_chunk_tokens=extra.get("cached_chunk_tokens", 0))
        return GenerationOutput(text=text, token_ids=[], prompt_segments=[], usage=u,
                                finish_reason=finish_reason or "stop", ttft_s=extra.get("ttft_s", 0.0),
                                total_s=extra.get("total_s", 0.0), queue_s=extra.get("queue_s", 0.0),
                                chunk_ids=list(extra.get("chunk_ids", [])))

    @classmethod
    def _from_json(cls, status: int, body: Any, ask: RemoteAsk) -> GenerationOutput:
        if status != 200:
            cls.raise_for(status, body)
        choice = body["choices"][0]
        out = cls.output(choice["message"].get("content") or "", choice.get("finish_reason"), body.get("usage"),
                         body.get("lazyllm"))
        return ask.finish(out, choice["message"].get("tool_calls"))

    @staticmethod
    def _json(resp) -> Any:
        try:
            return resp.json()
        except ValueError:
            return resp.text

    # -- the LazyLLM calls -------------------------------------------------------------
    def generate(self, question: str, chunks: Any = None, system: str | None = None, **sampling: Any
                 ) -> GenerationOutput:
        timeout = sampling.pop("timeout", None) or self.timeout
        body, ask = self._request(question, chunks, system, False, sampling)
        r = self._sync().post("/chat/completions", json=body, timeout=timeout)
        return self._from_json(r.status_code, self._json(r), ask)

    __call__ = generate

    async def agenerate(self, question: str, chunks: Any = None, system: str | None = None, **sampling: Any
                        ) -> GenerationOutput:
        timeout = sampling.pop("timeout", None) or self.timeout
        body, ask = self._request(question, chunks, system, False, sampling)
        async with self._async() as client:
            r = await client.post("/chat/completions", json=body, timeout=timeout)
            return self._from_json(r.status_code, self._json(r), ask)

    def stream(self, question: str, chunks: Any = None, system: str | None = None, **sampling: Any
               ) -> RemoteStream:
        timeout = sampling.pop("timeout", None) or self.timeout
        return RemoteStream(self, *self._request(question, chunks, system, True, sampling), timeout)

    astream = stream

    def generate_batch(self, requests: Any, **common: Any) -> list[GenerationOutput]:
        """The requests sent at once (the server batches them)."""
        from concurrent.futures import ThreadPoolExecutor

        items = []
        for item in requests:
            args = dict(common)
            args.update({"question": item} if isinstance(item, str) else item)
            items.append(args)
        bodies = [(a.pop("question", None), a.pop("chunks", None), a.pop("system", None), a) for a in items]
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(bodies)))) as ex:
            return list(ex.map(lambda b: self.generate(b[0], b[1], b[2], **b[3]), bodies))

    def models(self) -> list[dict[str, Any]]:
        """The server's ``/v1/models`` entries (``id``, ``max_model_len``...)."""
        r = self._sync().get("/models")
        body = self._json(r)
        if r.status_code != 200:
            self.raise_for(r.status_code, body)
        return body["data"]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class RemoteStream:
    """Text deltas of one request to a server, for ``for`` or ``async for``; ``output``
    holds the ``GenerationOutput`` once the iteration ends. Stopping early closes the
    connection, which cancels the request on the server."""

    def __init__(self, remote: RemoteLazyLLM, body: dict[str, Any], ask: RemoteAsk, timeout: float):
        self.remote, self.body, self.ask, self.timeout = remote, body, ask, timeout
        self.output: GenerationOutput | None = None
        self._calls = StreamedCalls()  # delta.tool_calls, written back as the text the model wrote
        self._text: list[str] = []
        self._finish: str | None = None
        self._sync_iter = None

    def _event(self, line: str) -> str | None:
        """The delta of one SSE line (``None`` for none); sets ``output`` at the end."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            return None
        obj = json.loads(data)
        if "error" in obj:
            RemoteLazyLLM.raise_for(500 if obj["error"].get("type") == "server_error" else 400, obj)
        if obj.get("usage") is not None:
            self.output = self.ask.finish(RemoteLazyLLM.output("".join(self._text), self._finish, obj["usage"],
                                                               obj.get("lazyllm")), self._calls.calls)
        for choice in obj.get("choices") or []:
            self._finish = choice.get("finish_reason") or self._finish
            d = choice.get("delta") or {}
            delta = (d.get("content") or "") + self._calls.text(d.get("tool_calls") or [])
            delta += self._calls.close(choice.get("finish_reason"))
            if delta:
                self._text.append(delta)
                return delta
        return None

    def _finish_output(self) -> None:
        if self.output is None:
            self.output = self.ask.finish(RemoteLazyLLM.output("".join(self._text), self._finish, None, None),
                                          self._calls.calls)

    def _iterate(self):
        with self.remote._sync().stream("POST", "/chat/completions", json=self.body, timeout=self.timeout) as r:
            if r.status_code != 200:
                r.read()
                RemoteLazyLLM.raise_for(r.status_code, RemoteLazyLLM._json(r))
            for line in r.iter_lines():
                delta = self._event(line)
                if delta:
                    yield delta
        self._finish_output()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self._sync_iter is None:
            self._sync_iter = self._iterate()
        return next(self._sync_iter)

    async def __aiter__(self):
        async with self.remote._async() as client, client.stream(
                "POST", "/chat/completions", json=self.body, timeout=self.timeout) as r:
            if r.status_code != 200:
                await r.aread()
                RemoteLazyLLM.raise_for(r.status_code, RemoteLazyLLM._json(r))
            async for line in r.aiter_lines():
                delta = self._event(line)
                if delta:
                    yield delta
        self._finish_output()

    def close(self) -> None:
        if self._sync_iter is not None:
            self._sync_iter.close()
