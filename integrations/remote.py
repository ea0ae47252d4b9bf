"""The remote client: ``RemoteLazyLLM``, the part of ``LazyLLM`` the LangChain and
LlamaIndex adapters call, served by a ``lazyllm serve`` server over HTTP (``base_url``), and
``RemoteStream``, a streamed answer read from the server's server-sent events.

Tools and structured output travel as the OpenAI request fields the server takes: the
``LazyLLM.generate`` arguments (``messages``, ``tools``, ``tool_choice``, ``response_format``,
``parallel_tool_calls``) become those fields (``request_fields``), and the answer is read back
into a ``GenerationOutput`` as an in-process engine fills it (``tool_calls``, ``parsed``:
``RemoteAsk``).

A streamed answer's ``delta.tool_calls`` are turned back into the text the model wrote
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the format the grammar fixes:
``StreamedCalls``), so a stream over HTTP yields the same deltas as one in process and the
adapters read calls out of either the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lazyllm import Chunk, GenerationOutput, InvalidRequestError
from lazyllm.structured.formats import ResponseFormat, normalize_response_format
from lazyllm.structured.tools import CALL_CLOSE, CALL_OPEN, normalize_tool_choice, normalize_tools
from lazyllm.types import TokenLogprob, ToolCall

from ._common import SAMPLING_KEYS

__all__ = ["STRUCTURED_OPTIONS", "RemoteAsk", "RemoteLazyLLM", "RemoteStream", "StreamedCalls", "request_fields"]

STRUCTURED_OPTIONS = ("messages", "tools", "tool_choice", "response_format", "parallel_tool_calls")


@dataclass
class RemoteAsk:
    """What a request asked that its answer is read with: the response format (parses the
    content) and whether calls may come."""

    fmt: ResponseFormat | None = None
    tools: bool = False
    logprobs: list | None = None  # asked for: the answer's ``logprobs.content`` items as they come

    def take_logprobs(self, lp: dict | None) -> None:
        """Keep the items of one answer's (or one chunk's) OpenAI ``logprobs``."""
        if self.logprobs is not None and isinstance(lp, dict):
            self.logprobs += [_token_logprob(t) for t in lp.get("content") or []]

    def finish(self, out: GenerationOutput, calls: list[dict] | None) -> GenerationOutput:
        """``out`` with the server's ``tool_calls`` (OpenAI items), the parsed answer and the
        log-probabilities (when asked)."""
        out.tool_calls = [_tool_call(c) for c in calls or []]
        out.logprobs = None if self.logprobs is None else list(self.logprobs)
        if self.fmt is not None and not out.tool_calls and out.finish_reason == "stop":
            try:
                out.parsed = self.fmt.parse(out.text)
            except ValueError:  # a stop string cut the answer short: nothing complete to parse
                out.parsed = None
        return out


def _token_logprob(item: dict) -> TokenLogprob:
    return TokenLogprob(-1, item.get("token", ""), float(item.get("logprob", 0.0)),  # the server sends no ids
                        tuple(_token_logprob(t) for t in item.get("top_logprobs") or []))


def _tool_call(item: dict) -> ToolCall:
    fn = item.get("function") or {}
    text = fn.get("arguments") or ""
    try:
        args = json.loads(text)
    except ValueError:  # cut off by the length limit: the arguments as far as generated
        return ToolCall(item.get("id") or "", fn.get("name") or "", {}, partial=text)
    return ToolCall(item.get("id") or "", fn.get("name") or "", args)


def _message(i: int, m: Any) -> tuple[dict, list[Chunk]]:
    """An OpenAI message of the server's request (tool call arguments as JSON strings), and the
    documents the message carries in ``"chunks"``."""
    if not isinstance(m, dict):
        raise InvalidRequestError(f"messages[{i}] must be a dict")
    out = {k: v for k, v in m.items() if k != "chunks"}
    chunks = [c if isinstance(c, Chunk) else Chunk(str(c)) for c in m.get("chunks") or []]
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            if isinstance(c, ToolCall):
                c = c.to_openai()
            fn = c.get("function", c) if isinstance(c, dict) else None
            if not isinstance(fn, dict):
                raise InvalidRequestError(f"messages[{i}].tool_calls: each needs a function name and arguments")
            args = fn.get("arguments", {})
            calls.append({"id": c.get("id") or "", "type": "function", "function": {
                "name": fn.get("name"), "arguments": args if isinstance(args, str) else json.dumps(args)}})
        out["tool_calls"] = calls
    return out, chunks


def _response_format(rf: Any) -> tuple[dict | None, ResponseFormat | None]:
    fmt = normalize_response_format(rf)
    if fmt is None:
        return None, None
    if fmt.kind == "json_object":
        return {"type": "json_object"}, fmt
    if fmt.kind != "json_schema":
        raise InvalidRequestError("through a server, response_format must be a JSON Schema, a Pydantic model or "
                                  f"json_object ({fmt.kind} formats need an in-process engine)")
    name = rf.__name__ if isinstance(rf, type) else (rf.get("json_schema") or {}).get("name") \
        if isinstance(rf, dict) and rf.get("type") == "json_schema" else None
    # strict only where the caller asked it: strict closes every object (a Pydantic model's
    # schema is closed already, and a dict-typed field is an object that must stay open)
    strict = isinstance(rf, dict) and rf.get("type") == "json_schema" and rf["json_schema"].get("strict") is True
    return {"type": "json_schema", "json_schema": {"name": name or "response", "schema": fmt.schema,
                                                   "strict": strict}}, fmt


def request_fields(question: str | None, system: str | None, options: dict[str, Any]
                   ) -> tuple[list[dict], list[Chunk], dict[str, Any], RemoteAsk]:
    """``(messages, documents the messages carry, other request fields, RemoteAsk)`` for a
    call with ``options`` (the structured ones, popped from it)."""
    opts = {k: options.pop(k) for k in STRUCTURED_OPTIONS if k in options}
    messages: list[dict] = []
    carried: list[Chunk] = []
    if opts.get("messages") is not None:
        if not isinstance(opts["messages"], (list, tuple)):
            raise InvalidRequestError("messages must be a list of message dicts")
        for i, m in enumerate(opts["messages"]):
            msg, chunks = _message(i, m)
            carried += chunks
            messages.append(msg)
    if system:
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{system}\n\n{messages[0].get('content') or ''}"}
        else:
            messages.insert(0, {"role": "system", "content": system})
    if question is not None:
        if not isinstance(question, str):
            raise InvalidRequestError(f"question must be a str, got {type(question).__name__}")
        messages.append({"role": "user", "content": question})
    if not messages:
        raise InvalidRequestError("a request needs a question or messages")
    fields: dict[str, Any] = {}
    tools = normalize_tools(opts.get("tools"))
    if tools:
        fields["tools"] = [t.to_openai() for t in tools]
        fields["parallel_tool_calls"] = bool(opts.get("parallel_tool_calls"))
    if opts.get("tool_choice") is not None:
        choice = normalize_tool_choice(opts["tool_choice"], tools)
        fields["tool_choice"] = choice if choice in ("auto", "required", "none") else {
            "type": "function", "function": {"name": choice}}
    rf, fmt = _response_format(opts.get("response_format"))
    if rf is not None:
        fields["response_format"] = rf
    return messages, carried, fields, RemoteAsk(fmt, bool(tools) and fields.get("tool_choice") != "none")


class StreamedCalls:
    """A stream's ``delta.tool_calls`` items joined into calls, and written back as the text
    the model generated (``text(items)``; ``close()`` ends the last call when the answer
    finished with its calls)."""

    def __init__(self):
        self.calls: list[dict] = []

    def text(self, items: list[dict]) -> str:
        out = []
        for item in items:
            fn = item.get("function") or {}
            if "id" in item or item.get("index", 0) >= len(self.calls):
                if self.calls:
                    out.append("}" + CALL_CLOSE + "\n")
                self.calls.append({"id": item.get("id") or "", "type": "function",
                                   "function": {"name": fn.get("name") or "", "arguments": ""}})
                out.append(CALL_OPEN + '{"name": ' + json.dumps(fn.get("name") or "") + ', "arguments": ')
            frag = fn.get("arguments") or ""
            if frag:
                self.calls[-1]["function"]["arguments"] += frag
                out.append(frag)
        return "".join(out)

    def close(self, finish_reason: str | None) -> str:
        return "}" + CALL_CLOSE if self.calls and finish_reason == "tool_calls" else ""


class RemoteLazyLLM:
    """The part of ``LazyLLM`` the adapters call (``generate``, ``agenerate``, ``stream``,
    ``astream``, ``generate_batch``), served by a ``lazyllm serve`` server (or anything
    speaking its OpenAI dialect) at ``base_url`` (``http://host:port/v1``).

    Documents travel as the server's ``documents`` extension, so they are cached as chunks
    there exactly as in process; the system prompt and the (already folded) question go as
    a system and a user message. ``messages``, ``tools``, ``tool_choice``,
    ``response_format`` (JSON kinds) and ``parallel_tool_calls`` go as the OpenAI fields, and
    the answer comes back as in process: ``tool_calls``, ``parsed``, a stream's deltas with
    the calls as the model wrote them (``StreamedCalls``). Results are ``GenerationOutput``s with the usage
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
        if sampling.pop("logprobs", False):  # OpenAI's fields; the answer's logprobs become TokenLogprobs
            body["logprobs"], ask.logprobs = True, []
            if sampling.get("top_logprobs"):
                body["top_logprobs"] = sampling["top_logprobs"]
        sampling.pop("top_logprobs", None)
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
        ask.take_logprobs(choice.get("logprobs"))
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
            self.ask.take_logprobs(choice.get("logprobs"))
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
