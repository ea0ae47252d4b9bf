"""Tool calling and structured output through the OpenAI-compatible server, over a tiny
random model on a real loopback server: whatever the random weights pick, the grammar holds
the answer to the request's tools and schema, so calls and JSON must parse and validate."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from lazyllm.integrations.server import ToolCallDeltas  # noqa: E402
from tests.server.conftest import KEY, MODEL  # noqa: E402

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                           "parameters": ZONE}}]
PARAMS = {"get_weather": WEATHER, "get_time": ZONE}
ANSWER = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def app_options():
    return dict(max_new_tokens_limit=256, default_max_tokens=160)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(server, **body):
    return httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                      json={"model": MODEL, "messages": ASK, **body})


def _check_call(name: str, arguments: str, expected: str | None = None) -> dict:
    assert name in PARAMS and (expected is None or name == expected), name
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMS[name])
    return args


def test_required_tool_call_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)


def test_named_tool_call_streaming(client):
    # sampled, so the arguments differ from greedy ones; the grammar still forces get_time
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0, seed=3, stream=True))
    calls: dict[int, dict] = {}
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        assert not d.content, d  # only calls, no text
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call names it
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None, tc
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0], (finish, calls)
    args = _check_call(calls[0]["name"], calls[0]["arguments"], expected="get_time")
    assert args["zone"] in ("utc", "cet", "pst")


def test_parallel_calls_stream_matches_non_streaming(server):
    body = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=True, temperature=0)
    whole = _post(server, **body).json()["choices"][0]
    assert whole["finish_reason"] in ("tool_calls", "length"), whole
    with httpx.stream("POST", f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": ASK, "stream": True, **body}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed: dict[int, dict] = {}
    for e in events:
        for tc in e["choices"][0]["delta"].get("tool_calls", []):
            c = streamed.setdefault(tc["index"], {"name": tc["function"].get("name"), "arguments": ""})
            c["arguments"] += tc["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    complete = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"].get(
        "tool_calls") or []]
    assert complete, whole
    # greedy: the same calls, in the same order (a call cut by the length limit is not complete)
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())][:len(complete)]
    assert got == complete
    for name, args in complete:
        jsonschema.validate(args, PARAMS[name])


def test_json_schema_and_json_object(client):
    for strict in (True, False):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], temperature=0.7,
            seed=int(strict),
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": ANSWER,
                                                                    "strict": strict}})
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=256, temperature=0)
    if r.choices[0].finish_reason == "stop":  # any object: it may run past the limit
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "text"}, max_tokens=4)
    assert r.choices[0].message.content is not None


def test_tool_result_round_trip(client, server, llm):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    convo = ASK + [msg.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    second = client.chat.completions.create(model=MODEL, messages=convo, tools=TOOLS, tool_choice="none",
                                            max_tokens=6, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content is not None
    # the tool result reaches the prompt: a different result is a different prompt
    other = [*convo[:-1], {**convo[-1], "content": '{"forecast": "heavy rain and wind all week"}'}]
    third = client.chat.completions.create(model=MODEL, messages=other, tools=TOOLS, tool_choice="none",
                                           max_tokens=6, temperature=0)
    assert third.usage.prompt_tokens > second.usage.prompt_tokens
    # without tools too (a conversation that carries calls and results)
    r = _post(server, messages=convo, max_tokens=4)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, None),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "get_nothing"}, None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_unknown", "content": "x"}]}, None),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": {"id": "a"}}]}, "messages[1].tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
        "name": "get_time", "arguments": "{not json"}}]}]}, None),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "object", "additionalProperties": True}}}}}}, None),
])
def test_bad_structured_input_is_400(server, llm, body, param):
    for stream in (False, True):
        r = _post(server, **body, stream=stream)
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
        if param is not None:
            assert err["param"] == param, err
    assert _post(server, max_tokens=2).status_code == 200  # still serving


def test_tool_call_deltas_join_to_the_calls():
    text = ('<tool_call>{"name": "f", "arguments": {"s": "x}</tool_call>y", "n": {"m": 1}}}</tool_call>\n'
            '<tool_call>{"name": "g.h", "arguments": {}}</tool_call>')
    for step in (1, 3, 7, len(text)):
        d = ToolCallDeltas()
        items = []
        for i in range(0, len(text), step):
            content, got = d.feed(text[i:i + step])
            assert content is None
            items += got
        heads = [it for it in items if "id" in it]
        assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "f"), (1, "g.h")]
        assert len({h["id"] for h in heads}) == 2
        args = ["".join(it["function"]["arguments"] for it in items if it["index"] == k) for k in (0, 1)]
        assert json.loads(args[0]) == {"s": "x}</tool_call>y", "n": {"m": 1}} and json.loads(args[1]) == {}
    d = ToolCallDeltas()
    assert d.feed("Hello") == ("Hello", []) and d.feed(" <b>") == (" <b>", [])


def test_ray_requests_carry_the_same_fields():
    from lazyllm.integrations.ray_serve import RayBackend
    from lazyllm.integrations.server import parse_chat_request

    convo = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    req = parse_chat_request({"model": MODEL, "messages": convo, "tools": TOOLS, "tool_choice": "auto",
                              "documents": ["doc one"], "response_format": {"type": "json_object"}})
    assert req.question is None and [c.text for c in req.chunks] == ["doc one"]
    sr = RayBackend._request(req.question, req.chunks, req.system, req.sampling)
    assert sr.sampling["tools"] == TOOLS and sr.sampling["tool_choice"] == "auto"
    assert sr.sampling["response_format"] == {"type": "json_object"} and sr.sampling["parallel_tool_calls"] is False
    assert [m["role"] for m in sr.sampling["messages"]] == ["user", "assistant", "tool"]
    assert sr.sampling["messages"][2]["tool_call_id"] == "call_1" and "doc one" in sr.prompt


def _streamed(server, body) -> tuple[dict[int, dict], str, str]:
    with httpx.stream("POST", f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": ASK, "stream": True, **body}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for e in events:
        ch = e["choices"][0]
        content += ch["delta"].get("content") or ""
        finish = ch["finish_reason"] or finish
        for tc in ch["delta"].get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": tc["function"].get("name"), "arguments": ""})
            c["arguments"] += tc["function"]["arguments"]
    return calls, content, finish


@pytest.mark.parametrize("max_tokens", [1, 3, 8, 12])
def test_cut_call_is_never_markup_nor_an_empty_list(server, max_tokens):
    """Cut by ``max_tokens`` at any point: ``content`` null (never ``"<"`` or ``"<tool_"``),
    ``finish_reason`` length, and a ``tool_calls`` list only when it holds the cut call
    (named: a named tool is known from the first token); streamed the same."""
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = dict(tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, temperature=0)
        r = _post(server, **body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "length" and ch["message"]["content"] is None, ch
        assert ch["message"].get("tool_calls", None) != [], ch
        calls, content, finish = _streamed(server, body)
        assert content == "" and finish == "length", (content, finish)
        whole = [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"].get("tool_calls", [])]
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == whole
        if isinstance(choice, dict):
            assert [n for n, _ in whole] == ["get_time"]
