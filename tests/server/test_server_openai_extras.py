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
