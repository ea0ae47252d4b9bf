"""Tools and structured output over HTTP as users write them: Pydantic models with nested and
recursive $defs through the openai client, and the remote LangChain and LlamaIndex clients
(``base_url=``) with the same powers as in process, against a live loopback server over a tiny
random model (whatever it picks, the grammar holds calls and JSON to their schemas). Also a
call cut off by max_tokens, streamed and not, and the OpenAI refusals."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.server.conftest import KEY, MODEL  # noqa: E402
from tests.tool_models import SAVED, Node, Person, save  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def app_options():
    return dict(max_new_tokens_limit=512, default_max_tokens=300)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Save it."}]


@pytest.mark.parametrize("model", [Person, Node], ids=["nested", "recursive"])
def test_pydantic_function_tool_over_http(client, model):
    tool = openai.pydantic_function_tool(model, name="save")
    assert "$defs" in tool["function"]["parameters"]
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        model.model_validate_json(choice.message.tool_calls[0].function.arguments)
    # the SDK's own parsing validates the arguments against the model
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool], tool_choice="required",
                                           max_tokens=300)
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, model)


@pytest.fixture(scope="module")
def remote_chat(server):
    pytest.importorskip("langchain_core")
    from lazyllm.integrations.langchain import ChatLazyLLM

    return ChatLazyLLM(base_url=f"{server}/v1", api_key=KEY, model_name=MODEL, max_tokens=300, temperature=1.0)


@pytest.mark.parametrize("model", [Person, Node], ids=["nested", "recursive"])
def test_remote_langchain_bind_tools_nested_and_recursive(remote_chat, model):
    bound = remote_chat.bind_tools([model], tool_choice="any")
    for seed in range(2):
        msg = bound.invoke("save it", seed=seed)
        assert msg.response_metadata["finish_reason"] == "tool_calls" and msg.content == ""
        [call] = msg.tool_calls
        assert call["name"] == model.__name__ and call["id"].startswith("call_")
        model.model_validate(call["args"])


def test_remote_langchain_stream_gives_incremental_tool_call_chunks(remote_chat):
    bound = remote_chat.bind_tools([Person], tool_choice="Person")
    chunks = list(bound.stream("save it", seed=1))
    with_args = [c for c in chunks if any(t["args"] for t in c.tool_call_chunks)]
    assert len(with_args) > 1  # the arguments arrive in pieces, as decoded
    assert all(c.content == "" for c in chunks)
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    [call] = full.tool_calls
    Person.model_validate(call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_remote_langchain_with_structured_output(remote_chat, method):
    schema = None if method == "json_mode" else Person
    structured = remote_chat.with_structured_output(schema, method=method, include_raw=True)
    out = structured.invoke("Describe someone.")
    if method == "json_mode":  # any object: it may run past the limit, and a cut answer is never parsed
        if out["raw"].response_metadata["finish_reason"] == "length":
            assert out["parsed"] is None and "length limit" in str(out["parsing_error"]), out
        else:
            assert out["parsing_error"] is None and isinstance(out["parsed"], dict), out
    else:
        assert out["parsing_error"] is None, out
        assert isinstance(out["parsed"], Person)


def test_remote_llama_index_function_tool_with_a_model_argument(server):
    pytest.importorskip("llama_index.core")
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool

    from lazyllm.integrations.llama_index import LlamaIndexLLM

    tool = FunctionTool.from_defaults(fn=save)
    assert "$defs" in tool.metadata.to_openai_tool()["function"]["parameters"]
    llm = LlamaIndexLLM(base_url=f"{server}/v1", api_key=KEY, model_name=MODEL, max_new_tokens=300)
    resp = llm.chat_with_tools([tool], user_msg="Save Ann.", tool_required=True)
    [sel] = llm.get_tool_calls_from_response(resp)
    assert sel.tool_name == "save"
    Person.model_validate(sel.tool_kwargs["person"])
    assert tool.call(**sel.tool_kwargs).content == "saved" and isinstance(SAVED[-1], Person)
    p = llm.structured_predict(Person, PromptTemplate("Describe {who}."), who="someone")
    assert isinstance(p, Person)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}


def test_call_cut_by_max_tokens_over_http(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=20, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut off: as far as generated
    finish, name, args, content = None, None, "", ""
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                name = name or t.function.name
                args += t.function.arguments or ""
    assert finish == "length" and content == "" and name == "get_weather"
    assert args == call.function.arguments  # greedy: the same call, streamed as far as generated


@pytest.mark.parametrize("body,param", [
    ({"tools": []}, "tools"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": "get_weather"}, "tool_choice"),
])
def test_server_refuses_what_openai_refuses(server, body, param):
    r = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_schema_nested_100_deep_is_named_as_such(server):
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    r = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": ASK, "response_format": {
                       "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "too deeply" in msg and "not valid JSON" not in msg, msg


def test_ref_loop_over_http_is_one_line(client):
    params = {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "required": ["x"],
              "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "f", "parameters": params}}])
    msg = e.value.body["message"]
    assert "#/$defs/A -> #/$defs/B -> #/$defs/A" in msg and len(msg) < 200, msg
