"""The OpenAI-compatible server (lazyllm.integrations.server) over a tiny random model, on a
real uvicorn server on 127.0.0.1: the openai client and LangChain's ChatOpenAI unchanged,
documents reused across requests, bad input at every field, auth and limits, clients that
disconnect mid-stream, 64 concurrent streams without cross-talk."""
import asyncio
import json
import random
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from lazyllm import Chunk  # noqa: E402
from lazyllm.integrations.server import (  # noqa: E402
    APIError,
    ChatRequest,
    completion_response,
    create_app,
    parse_chat_request,
    validate_body,
)
from tests.server.conftest import KEY, MODEL  # noqa: E402

LIMIT = 64
DOCS = [f"Document {i}: the {w} sits next to the {v} in room {i * 7}." for i, (w, v) in enumerate(
    zip(["lamp", "chair", "table", "clock", "vase", "piano", "rug", "mirror"],
        ["door", "window", "shelf", "bed", "desk", "sofa", "stove", "sink"]))]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def app_options():
    return dict(max_request_bytes=256 << 10, max_new_tokens_limit=LIMIT, default_max_tokens=8)


def _idle(llm) -> bool:
    """No request holds pages: none pinned, and every page not held by a cached chunk is free."""
    s = llm.cache_stats()
    page_bytes = s["pool_bytes"] // s["pool_pages"]
    return s["pinned_entries"] == 0 and s["free_pages"] * page_bytes + s["resident_bytes"] == s["pool_bytes"]


def _wait_idle(llm, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while not _idle(llm):
        assert time.monotonic() < deadline, llm.cache_stats()
        time.sleep(0.02)


def _body(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Where is the lamp?"}], "max_tokens": 4}
    body.update(kw)
    return body


def _assert_error(r, status, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# -- translation helpers (no server) -------------------------------------------------------

def test_parse_chat_request_folds_messages_and_documents():
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "developer", "content": "Cite ids."},
                         {"role": "user", "content": "Earlier question"},
                         {"role": "assistant", "content": None, "tool_calls": []},
                         {"role": "assistant", "content": "Earlier answer"},
                         {"role": "user", "content": [{"type": "text", "text": "Where is "},
                                                      {"type": "text", "text": "the lamp?"}]}],
            "documents": ["plain doc", {"text": "doc two", "id": 7, "metadata": {"src": "x"}}],
            "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 1, "stop": "\n"}
    req = parse_chat_request(json.dumps(body).encode(), max_new_tokens_limit=LIMIT)
    assert isinstance(req, ChatRequest)
    question, chunks, system, sampling = req
    assert system == "Be brief.\n\nCite ids."
    assert question.startswith("Where is the lamp?") and "User: Earlier question" in question
    assert "Assistant: Earlier answer" in question
    assert chunks == [Chunk("plain doc"), Chunk("doc two", id="7")] and chunks[1].metadata == {"src": "x"}
    assert sampling == {"max_new_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 1, "stop": "\n"}
    plain = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, default_max_tokens=9)
    assert plain.chunks == [] and plain.system is None and plain.sampling["max_new_tokens"] == 9
    assert plain.sampling["temperature"] == 0.0


def test_completion_response_shape(llm):
    out = llm.generate("Where is the lamp?", DOCS[:2], max_new_tokens=3)
    resp = completion_response(out, model=MODEL, request_id="chatcmpl-x", created=1)
    assert resp["choices"][0]["message"] == {"role": "assistant", "content": out.text}
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == out.usage.cached_tokens
    assert resp["usage"]["total_tokens"] == out.usage.prompt_tokens + out.usage.completion_tokens
    with pytest.raises(APIError) as e:
        validate_body(b"{")
    assert e.value.status == 400


# -- the openai client and ChatOpenAI, unchanged ------------------------------------------------

def test_openai_client_reuses_documents_streaming_and_not(server, llm):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=30)
    docs = [DOCS[0], {"text": DOCS[1], "id": "d1", "metadata": {"room": 7}}, DOCS[2]]
    ask = dict(model=MODEL, messages=[{"role": "system", "content": "Answer from the documents."},
                                      {"role": "user", "content": "Where is the lamp?"}], max_tokens=6)
    cold = client.chat.completions.create(**ask, extra_body={"documents": docs})
    ref = llm.generate("Where is the lamp?", [DOCS[0], Chunk(DOCS[1], id="d1"), DOCS[2]],
                       "Answer from the documents.", max_new_tokens=6)
    assert cold.choices[0].message.content == ref.text
    assert cold.usage.prompt_tokens == ref.usage.prompt_tokens
    warm = client.chat.completions.create(**ask, extra_body={"documents": docs[::-1]})  # another order
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert warm.choices[0].finish_reason in ("stop", "length")

    stream = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True},
                                            extra_body={"documents": docs[1:] + docs[:1]})
    deltas, usage, finish = [], None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            deltas.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    assert usage.completion_tokens >= 1 and finish in ("stop", "length") and "".join(deltas)

    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 0 and plain.choices[0].message.content is not None
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=LIMIT + 1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    _wait_idle(llm)


def test_openai_async_client(server):
    openai = pytest.importorskip("openai")

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=30)
        r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Where?"}],
                                                 max_tokens=3, extra_body={"documents": DOCS[3:5]})
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Where?"}], max_tokens=3, stream=True,
            extra_body={"documents": DOCS[3:5]})]
        await client.close()
        return r, chunks

    r, chunks = asyncio.run(run())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_langchain_chat_openai_unchanged(server):
    lc_openai = pytest.importorskip("langchain_openai")
    docs = [{"text": DOCS[5], "id": "d5"}, DOCS[6]]
    chat = lc_openai.ChatOpenAI(base_url=f"{server}/v1", api_key=KEY, model=MODEL, max_tokens=5, temperature=0,
                                max_retries=0, timeout=30, extra_body={"documents": docs})
    first = chat.invoke([("system", "Answer from the documents."), ("human", "Where is the piano?")])
    assert isinstance(first.content, str) and first.usage_metadata["input_tokens"] > 0
    again = chat.invoke([("system", "Answer from the documents."), ("human", "Where is the rug?")])
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
    streamed = list(chat.stream([("human", "Where is the piano?")], stream_usage=True))
    text = "".join(c.content for c in streamed)
    assert text and sum(c.usage_metadata["input_token_details"].get("cache_read", 0)
                        for c in streamed if c.usage_metadata) > 0


# -- our adapters against a server ------------------------------------------------------------

def test_chat_lazyllm_and_llama_index_target_a_server(server, llm):
    from lazyllm.integrations.langchain import ChatLazyLLM, documents_to_messages

    chat = ChatLazyLLM(base_url=f"{server}/v1", api_key=KEY, max_tokens=5)
    msgs = documents_to_messages([DOCS[0], DOCS[7]], "Where is the lamp?", system="Be brief.")
    out = chat.invoke(msgs)
    ref = llm.generate("Where is the lamp?", [DOCS[0], DOCS[7]], "Be brief.", max_new_tokens=5)
    assert out.content == ref.text
    assert out.usage_metadata["input_token_details"]["cache_read"] > 0  # ref warmed the chunks just now
    assert "".join(c.content for c in chat.stream(msgs)) == ref.text
    assert asyncio.run(chat.ainvoke(msgs)).content == ref.text
    with pytest.raises(ValueError, match="max_tokens"):
        chat.invoke(msgs, max_tokens=LIMIT + 1)

    from lazyllm.integrations.llama_index import LlamaIndexLLM

    li = LlamaIndexLLM(base_url=f"{server}/v1", api_key=KEY, max_new_tokens=5)
    assert li.context_window == llm.model.spec.max_context
    resp = li.complete("Where is the lamp?", chunks=[DOCS[0], DOCS[7]], system="Be brief.", formatted=True)
    assert resp.text == ref.text and resp.additional_kwargs["cached_tokens"] > 0
    streamed = list(li.stream_complete("Where is the lamp?", chunks=[DOCS[0], DOCS[7]], system="Be brief.",
                                       formatted=True))
    assert streamed[-1].text == ref.text and streamed[-1].additional_kwargs["cached_tokens"] > 0


# -- bad input at every field -------------------------------------------------------------------

BAD = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "only a system prompt"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
    ({"model": 3}, "model"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": LIMIT + 1}, "max_tokens"),
    ({"max_completion_tokens": LIMIT + 1}, "max_completion_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a", 1]}, "stop[1]"),
    ({"n": 9}, "n"),
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream_options": 3}, "stream_options"),
    ({"documents": "one doc"}, "documents"),
    ({"documents": [5]}, "documents[0]"),
    ({"documents": [{"txt": "x"}]}, "documents[0].text"),
    ({"documents": [{"text": "x", "metadata": 3}]}, "documents[0].metadata"),
    ({"documents": [{"text": "x", "extra": 1}]}, "documents[0].extra"),
    ({"documents": [{"text": "a", "id": "same"}, {"text": "b", "id": "same"}]}, None),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"user": 5}, "user"),
]


def test_bad_input_at_every_field(http, llm):
    for fields, param in BAD:
        r = http.post("/v1/chat/completions", json=_body(**fields))
        err = _assert_error(r, 400, param)
        assert err["type"] == "invalid_request_error", (fields, err)
        r = http.post("/v1/chat/completions", json=_body(stream=True, **fields) if "stream" not in fields else
                      _body(**fields))
        _assert_error(r, 400)  # a stream is refused the same way, before any event
    for raw in (b"{", b"[1, 2]", b"null", b'"text"', b"\xff\xfe"):
        _assert_error(http.post("/v1/chat/completions", content=raw,
                                headers={"Content-Type": "application/json"}), 400)
    err = _assert_error(http.post("/v1/chat/completions", json=_body(
        documents=[" ".join(DOCS) * 40], max_tokens=LIMIT)), 400)
    assert err["code"] == "context_length_exceeded"
    err = _assert_error(http.post("/v1/chat/completions", json=_body(model="other")), 404, "model")
    assert err["code"] == "model_not_found"
    _assert_error(http.get("/v1/nothing"), 404)
    _assert_error(http.get("/v1/chat/completions"), 405)
    _assert_error(http.get("/v1/models/other"), 404)
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    # the server keeps serving, and nothing is left pinned
    assert http.post("/v1/chat/completions", json=_body()).status_code == 200
    _wait_idle(llm)


def test_auth_and_limits(server, http):
    url = f"{server}/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        r = httpx.post(url, json=_body(), headers=headers)
        err = _assert_error(r, 401)
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    _assert_error(httpx.get(f"{server}/v1/models"), 401)
    assert httpx.get(f"{server}/health").json()["status"] == "ok"  # probes and scrapes need no key
    assert "lazyllm_cache_hits_total" in httpx.get(f"{server}/metrics").text
    big = _body(documents=["x" * (300 << 10)])
    err = _assert_error(http.post("/v1/chat/completions", json=big), 413)
    assert err["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit holds on the bytes read
        yield json.dumps(big).encode()

    _assert_error(http.post("/v1/chat/completions", content=chunked(), headers={"Content-Type": "application/json"}),
                  413)


def test_create_app_refuses_bad_limits(llm):
    for kw in ({"max_request_bytes": 0}, {"max_new_tokens_limit": -1}, {"max_concurrency": 1.5},
               {"api_key": ""}):
        with pytest.raises(ValueError):
            create_app(llm, **kw)


def test_metrics(http, llm):
    http.post("/v1/chat/completions", json=_body(documents=DOCS[:2]))
    text = http.get("/metrics").text
    stats = llm.cache_stats()
    for name in ("lazyllm_cache_hits_total", "lazyllm_cache_misses_total", "lazyllm_cache_resident_bytes",
                 "lazyllm_ttft_seconds_bucket", "lazyllm_queue_seconds_bucket", "lazyllm_http_requests_total",
                 "lazyllm_requests_in_flight"):
        assert name in text, name
    line = next(x for x in text.splitlines() if x.startswith("lazyllm_cache_resident_bytes "))
    assert float(line.split()[1]) == stats["resident_bytes"]


# -- disconnects and load -------------------------------------------------------------------------

def _sse_deltas(lines):
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for c in obj["choices"]:
                if c["delta"].get("content"):
                    yield c["delta"]["content"]


def test_disconnect_mid_stream_cancels_and_releases_pages(server, llm):
    before = llm.engine.metrics["cancelled"]
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c, c.stream(
            "POST", "/v1/chat/completions", json=_body(stream=True, max_tokens=LIMIT, documents=DOCS[2:6])) as r:
        assert r.status_code == 200
        for got, _ in enumerate(_sse_deltas(r.iter_lines()), 1):
            if got == 2:
                break  # leave with the connection (the with-blocks close it)
    deadline = time.monotonic() + 20
    while llm.engine.metrics["cancelled"] == before:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.02)
    _wait_idle(llm)


def test_64_concurrent_streams_with_disconnects(server, llm):
    rng = random.Random(3)
    n, leave = 64, set(rng.sample(range(64), 7))  # ~10% leave mid-stream
    reqs = []
    for i in range(n):
        docs = rng.sample(DOCS, 3)  # shared documents, in many orders
        q = f"Where is item {i}?"
        reqs.append((q, docs, _body(stream=True, max_tokens=LIMIT if i in leave else 10, documents=docs,
                                    messages=[{"role": "user", "content": q}])))
    cancelled_before = llm.engine.metrics["cancelled"]

    async def one(client, i, body):
        text = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                for d in _sse_deltas([line]):
                    text.append(d)
                    if i in leave and len(text) == 2:
                        return None  # disconnect
        return "".join(text)

    async def run():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                                     limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i, r[2]) for i, r in enumerate(reqs))), 90)

    results = asyncio.run(run())
    _wait_idle(llm)
    assert llm.engine.metrics["cancelled"] > cancelled_before  # the leavers' requests were cancelled
    for i, ((q, docs, _), got) in enumerate(zip(reqs, results)):
        if i in leave:
            assert got is None
            continue
        alone = llm.generate(q, docs, max_new_tokens=10)
        assert got == alone.text, (i, got, alone.text)  # nobody got another request's tokens
    _wait_idle(llm)
