"""The server's protocol edges and its event loop, over a tiny random model on a real
uvicorn server: OpenAI's answers to unknown fields and a missing model, every status
counted in the metrics, Retry-After on 429, the event loop free while a near-limit body
is parsed and refused, and a non-streaming client that leaves cancelling its request."""
import asyncio
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from lazyllm import GenerationOutput, Usage  # noqa: E402
from lazyllm.integrations.server import create_app  # noqa: E402
from tests.conftest import loopback_server  # noqa: E402
from tests.server.conftest import KEY, MODEL  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def app_options():
    # the default body limit (8 MiB), so a near-limit body is a real one
    return dict(max_new_tokens_limit=2000, default_max_tokens=4)


def _body(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Where is the lamp?"}], "max_tokens": 2}
    body.update(kw)
    return body


def _count(text: str, status: str) -> float:
    """``lazyllm_http_requests_total`` for ``status``, summed over the modes."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("lazyllm_http_requests_total{") and f'status="{status}"' in line:
            total += float(line.split()[-1])
    return total


def _wait_idle(llm, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = llm.cache_stats()
        page_bytes = s["pool_bytes"] // s["pool_pages"]
        if s["pinned_entries"] == 0 and s["free_pages"] * page_bytes + s["resident_bytes"] == s["pool_bytes"]:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def test_unknown_fields_and_a_missing_model_are_refused_as_openai_does(http):
    r = http.post("/v1/chat/completions", json=_body(frobnicate=1))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "frobnicate" and "Unrecognized request argument" in err["message"]
    body = _body()
    del body["model"]
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    # what OpenAI clients send and does not change the answer is accepted
    ok = http.post("/v1/chat/completions", json=_body(user="u", metadata={"a": "b"}, store=False,
                                                       parallel_tool_calls=False))
    assert ok.status_code == 200, ok.text
    # a per-request preset other than the server's is refused, not ignored
    r = http.post("/v1/chat/completions", json=_body(quality="exact"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "quality", r.text
    assert http.post("/v1/chat/completions", json=_body(quality=None)).status_code == 200


def test_every_status_is_counted(server, http):
    before = http.get("/metrics").text
    assert httpx.post(f"{server}/v1/chat/completions", json=_body()).status_code == 401
    assert http.post("/v1/chat/completions", json=_body(model="other")).status_code == 404
    assert http.post("/v1/chat/completions", json=_body(messages=[])).status_code == 400
    assert http.post("/v1/chat/completions", content=b"x" * (9 << 20),
                     headers={"Content-Type": "application/json"}).status_code == 413
    after = http.get("/metrics").text
    for status, n in (("401", 1), ("404", 1), ("400", 1), ("413", 1)):
        assert _count(after, status) - _count(before, status) == n, (status, after)


class _HeldStream:
    """A backend stream that yields one delta, then waits until released."""

    def __init__(self, release: threading.Event):
        self.release, self.output = release, None

    async def __aiter__(self):
        yield "a"
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        self.output = GenerationOutput(text="a", token_ids=[1], prompt_segments=[], finish_reason="stop",
                                       usage=Usage(prompt_tokens=1, completion_tokens=1), ttft_s=0.0, total_s=0.0)

    def cancel(self):
        self.release.set()


class _HeldBackend:
    model_name = MODEL

    def __init__(self):
        self.release = threading.Event()

    def stream(self, question, chunks, system, **sampling):
        return _HeldStream(self.release)

    async def model_info(self):
        return {"max_context": 100}

    def cache_stats(self):
        return {}


def test_429_carries_retry_after():
    backend = _HeldBackend()
    app = create_app(backend, max_concurrency=1)
    with loopback_server(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # the first request is being served
            r = c.post("/v1/chat/completions", json=_body())
            backend.release.set()
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        # the limit and what fills it, not "serving 0 requests, its limit"
        assert "its limit of 1 requests at once (1 running" in r.json()["error"]["message"], r.text


def test_health_answers_while_a_near_limit_body_is_refused(server, http):
    """A 7.9 MiB body (under the 8 MiB limit) is refused as too long without tokenizing it,
    and the event loop keeps answering meanwhile (parsing runs on a worker thread)."""
    doc = "word " * ((79 << 20) // 50)  # 7.9 MiB of text
    body = json.dumps(_body(documents=[doc])).encode()
    assert (7 << 20) < len(body) < (8 << 20)
    waits, stop = [], threading.Event()

    def probe():
        with httpx.Client(base_url=server, timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                waits.append(time.perf_counter() - t)
                time.sleep(0.01)

    th = threading.Thread(target=probe)
    th.start()
    try:
        while not waits:  # the probe is running before the body is sent
            assert th.is_alive()
            time.sleep(0.01)
        t = time.perf_counter()
        r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        took = time.perf_counter() - t
    finally:
        stop.set()
        th.join()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # before: 6.3 s to refuse it, /health waiting 5.1 s; a loaded CI machine gets slack
    assert took < 4.0, took
    assert waits and max(waits) < 2.0, max(waits)


def test_a_non_streaming_client_that_leaves_cancels_its_request(server, llm, http):
    cancelled = llm.engine.metrics["cancelled"]
    before = http.get("/metrics").text
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0) as c, \
            pytest.raises(httpx.ReadTimeout):
        # 2000 tokens take the tiny model far longer than the client's 1 s before it gives up
        c.post("/v1/chat/completions", json=_body(max_tokens=2000, documents=["A document to pin."]))
    deadline = time.monotonic() + 5
    while llm.engine.metrics["cancelled"] == cancelled:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.02)
    _wait_idle(llm)
    after = http.get("/metrics").text
    assert _count(after, "499") - _count(before, "499") == 1
    assert _count(after, "200") == _count(before, "200")

    def disconnects(text):
        return float(next(x for x in text.splitlines() if x.startswith("lazyllm_client_disconnects_total ")).split()[1])

    assert disconnects(after) - disconnects(before) == 1


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400_before_compute(server, http, llm):
    """A prompt that fits the context alone but not with its ``max_tokens`` gets OpenAI's 400
    ``context_length_exceeded``, streamed or not, before any token is computed; the same
    prompt asking for what fits is served."""
    context = llm.model.spec.max_context
    doc = "word " * (context - 1000)  # fits alone, not with 2000 new tokens
    before = llm.cache_stats()
    for stream in (False, True):
        t0 = time.perf_counter()
        r = http.post("/v1/chat/completions", json=_body(documents=[doc], max_tokens=2000, stream=stream))
        took = time.perf_counter() - t0
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and str(context) in err["message"], err
        assert took < 2.0, took
    after = llm.cache_stats()
    assert (after["misses"], after["hits"]) == (before["misses"], before["hits"])  # nothing was planned
    r = http.post("/v1/chat/completions", json=_body(documents=[doc], max_tokens=2))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
