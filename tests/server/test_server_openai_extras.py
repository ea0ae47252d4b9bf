"""OpenAI's endpoints and fields beyond plain chat, through the server on a real loopback
server over a tiny random model: ``logprobs`` / ``top_logprobs`` (equal to ``LazyLLM.score``
for the same tokens), streamed too."""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.server.conftest import KEY, MODEL  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SYSTEM, QUESTION = "Be brief.", "When was the lighthouse lit?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _in_process(llm, n_tokens: int):
    """The greedy answer's tokens and ``score``'s log-probabilities of them."""
    out = llm.generate(QUESTION, None, SYSTEM, max_new_tokens=n_tokens)
    ids = [t for t in out.token_ids if t not in (llm.tokenizer.eos_token_id,)]
    return ids, llm.score(QUESTION, None, SYSTEM, continuation=ids, return_logits=True)


def test_logprobs_equal_score(client, llm):
    """``logprobs`` over HTTP equal ``score()``'s for the same prompt and tokens (1e-4, CPU
    float32), with ``top_logprobs`` the most likely tokens first (the chosen one among them
    when greedy), and streamed: the chunks' entries join to the same list."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ids, scored = _in_process(llm, 8)
    assert len(content) == len(ids) == len(scored.logprobs) > 0
    for entry, i, lp, logits in zip(content, ids, scored.logprobs, scored.logits):
        assert entry.token == llm.tokenizer.decode([i]) and bytes(entry.bytes) == entry.token.encode()
        assert math.isclose(entry.logprob, lp, abs_tol=1e-4), (entry.logprob, lp)
        top = logits.log_softmax(-1).topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
    assert "".join(e.token for e in content) == r.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [(e.token, e.logprob, []) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logprobs_refusals_are_400(server):
    for body, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                 "top_logprobs")):
        r = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "messages": MESSAGES, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert json.loads(r.text)["error"]["message"]


def test_embeddings_equal_the_bundled_embedder(client, server):
    """``/v1/embeddings`` serves the bundled MiniLM: the OpenAI client's vectors (it asks for
    base64) and plain float lists equal ``minilm.embed``'s to 1e-5, in input order."""
    np = pytest.importorskip("numpy")
    from lazyllm.integrations.minilm import MODEL_NAME, embed

    texts = ["The lighthouse was lit in 1887.", "Sorna glass is blue.", "x"]
    want = embed(texts)
    r = client.embeddings.create(model=MODEL_NAME, input=texts)
    got = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5
    assert r.usage.prompt_tokens > len(texts) and r.model == MODEL_NAME
    one = client.embeddings.create(model=MODEL_NAME, input=texts[0], encoding_format="float")
    assert np.abs(np.array(one.data[0].embedding) - want[0]).max() < 1e-5


@pytest.mark.parametrize("body,status,param", [
    ({"input": ["a"]}, 400, "model"),
    ({"model": "other", "input": ["a"]}, 404, "model"),
    ({"input": []}, 400, "input"),
    ({"input": [""]}, 400, "input"),
    ({"input": [[1, 2]]}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": ["a"], "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": ["a"], "dimensions": 3}, 400, "dimensions"),
    ({"input": ["a"], "extra": 1}, 400, "extra"),
])
def test_embeddings_bad_input_is_4xx(server, body, status, param):
    from lazyllm.integrations.minilm import MODEL_NAME

    body = {"model": MODEL_NAME, **body} if "model" not in body and param != "model" else body
    r = httpx.post(f"{server}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert httpx.post(f"{server}/v1/embeddings", json=body, timeout=60).status_code == 401


def test_embeddings_from_any_embedder_or_none(llm):
    """The server embeds with the model it is given (here a callable), and without one says so."""
    from starlette.testclient import TestClient

    from lazyllm.integrations.server import create_app
    from lazyllm.integrations.server.embeddings import Embedder

    def lengths(texts):
        return [[float(len(t)), 1.0] for t in texts]

    app = create_app(llm, model_name=MODEL, warmup=False, embedder=Embedder(lengths, name="len"))
    with TestClient(app) as c:
        r = c.post("/v1/embeddings", json={"model": "len", "input": ["ab", "abcd"]})
        assert [d["embedding"] for d in r.json()["data"]] == [[2.0, 1.0], [4.0, 1.0]]
    with TestClient(create_app(llm, model_name=MODEL, warmup=False, embedder=None)) as c:
        r = c.post("/v1/embeddings", json={"model": "len", "input": ["ab"]})
        assert r.status_code == 404 and "no embedding model" in r.json()["error"]["message"]


def test_quality_refusal_names_what_the_server_runs(server):
    """Found by the schema fuzzer: a server started without a preset refused ``quality`` with
    "this server runs the preset None"; it says it runs no preset."""
    r = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": MESSAGES, "quality": "fast"}, timeout=60)
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "runs no preset" in msg and "None" not in msg, msg


def test_legacy_completions_complete_the_prompt_as_written(client, server, llm):
    """``/v1/completions`` completes the prompt as written (no chat template), equal to
    ``generate(prompt, raw=True)``, streamed or not, with the legacy ``logprobs`` object equal
    to ``score``'s; ``documents`` come before the prompt as cached chunks."""
    prompt = "The lighthouse was lit in"
    want = llm.generate(prompt, raw=True, max_new_tokens=6)
    assert want.prompt_segments[-1][1] == llm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    ch = r.choices[0]
    assert r.object == "text_completion" and ch.text == want.text and ch.finish_reason == want.finish_reason
    ids = [t for t in want.token_ids if t != llm.tokenizer.eos_token_id]
    scored = llm.score(prompt, continuation=ids).logprobs  # the chat prompt: differs from the raw one
    raw_scored = [t.logprob for t in llm.generate(prompt, raw=True, max_new_tokens=6, logprobs=True).logprobs]
    assert ch.logprobs.token_logprobs == pytest.approx(raw_scored, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(raw_scored, scored)) > 1e-3  # the prompt as written, not templated
    assert all(len(top) <= 2 for top in ch.logprobs.top_logprobs) and ch.logprobs.text_offset[0] == 0
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True))
    assert text == want.text
    docs = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                     extra_body={"documents": ["Sorna glass is blue."]})
    again = client.completions.create(model=MODEL, prompt=prompt + " 18", max_tokens=3, temperature=0,
                                      extra_body={"documents": ["Sorna glass is blue."]})
    assert docs.usage.prompt_tokens > r.usage.prompt_tokens and again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("body,param", [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "a", "n": 2}, "n"), ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "suffix": "z"}, "suffix"), ({"prompt": "a", "logprobs": 6}, "logprobs"),
    ({"prompt": "a", "max_tokens": 10 ** 6}, "max_tokens"), ({"prompt": ""}, None), ({}, "prompt"),
])
def test_legacy_completions_bad_input_is_400(server, body, param):
    r = httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert param is None or r.json()["error"]["param"] == param, r.text


def test_n_choices_share_the_prompt_and_draw_their_own_seeds(client, llm):
    """``n`` choices: choice ``i`` is the seeded request with ``seed + i`` (so they differ and
    each is reproducible), the prompt counted once in ``usage``, the documents' chunk computed
    once for all of them; streamed, each chunk carries its choice's index."""
    doc = ["The Halvorsen lighthouse was lit in 1887 and guards the northern reef."]
    before = llm.cache_stats()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=5, temperature=1.0, seed=11,
                                       extra_body={"documents": doc})
    after = llm.cache_stats()
    assert [c.index for c in r.choices] == [0, 1, 2]
    outs = [llm.generate(QUESTION, doc, SYSTEM, max_new_tokens=5, temperature=1.0, seed=11 + i) for i in range(3)]
    want = [o.text for o in outs]
    assert [c.message.content for c in r.choices] == want and len(set(want)) > 1
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=11,
                                            extra_body={"documents": doc})
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(o.usage.completion_tokens for o in outs)
    assert 1 <= after["misses"] - before["misses"] <= 2, (before, after)  # the chunk (and prefix) once, not 3 times
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=5, temperature=1.0,
                                                seed=11, stream=True, extra_body={"documents": doc}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: want[0], 1: want[1]}


def test_remote_chat_lazyllm_passes_logprobs_through(server, llm):
    """``ChatLazyLLM(base_url=..., logprobs=True)`` gives ``response_metadata["logprobs"]``
    as in process (the server's values), streamed or not."""
    pytest.importorskip("langchain_core")
    from lazyllm.integrations.langchain import ChatLazyLLM

    remote = ChatLazyLLM(base_url=f"{server}/v1", api_key=KEY, model_name=MODEL, max_tokens=5, logprobs=True,
                         top_logprobs=2)
    local = ChatLazyLLM(llm=llm, max_tokens=5, logprobs=True, top_logprobs=2)
    got = remote.invoke(QUESTION).response_metadata["logprobs"]["content"]
    want = local.invoke(QUESTION).response_metadata["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in want]
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
    assert all(len(e["top_logprobs"]) == 2 for e in got) and got
    full = None
    for chunk in remote.stream(QUESTION):
        full = chunk if full is None else full + chunk
    assert [e["token"] for e in full.response_metadata["logprobs"]["content"]] == [e["token"] for e in got]
