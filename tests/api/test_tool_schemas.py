"""Tool parameter schemas as users write them ($defs, $ref, recursion), what the grammar
cannot express refused in one line, a call cut off by the length limit, and JSON strings
bounded under constrained decoding. On a tiny random model: the output follows the schema
only because the grammar holds it there."""
from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from lazyllm import InvalidRequestError, LazyLLM
from lazyllm.structured.formats import DEFAULT_MAX_STRING_LENGTH, bounded
from tests.conftest import make_tiny
from tests.tool_models import Node, Person, tool

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def llm(tokenizer):
    m = LazyLLM(model=make_tiny("llama", seed=3), tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="isolated")
    yield m
    m.close()


@pytest.mark.parametrize("model", [Person, Node], ids=["nested", "recursive"])
def test_tool_with_defs_and_refs_gives_a_call_that_validates(llm, model):
    spec = tool("save", model)
    assert "$defs" in spec["function"]["parameters"]
    for seed in range(3):
        out = llm.generate("save it", tools=[spec], tool_choice="required", max_new_tokens=300,
                           temperature=1.0, seed=seed)
        assert out.finish_reason == "tool_calls", out.text
        (call,) = out.tool_calls
        jsonschema.validate(call.arguments, spec["function"]["parameters"])
        model.model_validate(call.arguments)


def test_two_tools_with_the_same_def_names_keep_their_own_schemas(llm):
    class Place(BaseModel):
        city: str = Field(max_length=6)

    class Trip(BaseModel):
        home: Place

    class Other(BaseModel):
        place: int = Field(ge=0, le=3)

    class Ask(BaseModel):
        home: Other

    # both name their definition after the field's class; "Place" appears in one only
    tools = [tool("trip", Trip), tool("ask", Ask)]
    for seed in range(4):
        out = llm.generate("go", tools=tools, tool_choice="required", max_new_tokens=120, temperature=1.0,
                           seed=seed)
        (call,) = out.tool_calls
        {"trip": Trip, "ask": Ask}[call.name].model_validate(call.arguments)


def test_ref_loop_is_one_clear_line(llm):
    params = {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "required": ["x"],
              "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}
    spec = {"type": "function", "function": {"name": "f", "parameters": params}}
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("q", tools=[spec], tool_choice="required")
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 200, msg
    assert "$ref loops" in msg and "#/$defs/A -> #/$defs/B -> #/$defs/A" in msg, msg
    loop = {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}
    with pytest.raises(InvalidRequestError, match=r"\$ref loops.*#/\$defs/A -> #/\$defs/A"):
        llm.generate("q", response_format=loop)


def test_schema_nested_too_deep_says_so(llm):
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    with pytest.raises(InvalidRequestError, match="nested too deeply") as e:
        llm.generate("q", response_format=schema)
    assert "\n" not in str(e.value) and len(str(e.value)) < 250
    assert llm.generate("still serving?", max_new_tokens=2).usage.completion_tokens >= 1


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_call_cut_by_length_keeps_the_partial_call(llm, stream):
    kw = dict(tools=[WEATHER], tool_choice="required", max_new_tokens=20, temperature=1.0, seed=0)
    if stream:
        s = llm.stream("weather?", **kw)
        text = "".join(s)
        out = s.output
        assert text == out.text
    else:
        out = llm.generate("weather?", **kw)
    assert out.finish_reason == "length"
    (call,) = out.tool_calls
    assert call.name == "get_weather" and call.partial is not None and call.arguments == {}
    head = '<tool_call>{"name": "get_weather", "arguments": '
    assert out.text == head + call.partial, out.text
    assert call.partial.startswith("{") and call.to_openai()["function"]["arguments"] == call.partial


def test_runaway_string_is_bounded(llm):
    # a random model never closes a string on its own: without the bound it writes until the limit
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"],
              "additionalProperties": False}
    for seed in range(2):
        out = llm.generate("talk", response_format=schema, max_new_tokens=DEFAULT_MAX_STRING_LENGTH + 40,
                           temperature=1.0, seed=seed)
        assert out.finish_reason == "stop", out.text
        assert len(out.parsed["s"]) <= DEFAULT_MAX_STRING_LENGTH


def test_bound_leaves_strings_that_say_their_own_shape():
    schema = {"type": "object", "properties": {
        "free": {"type": "string"}, "long": {"type": "string", "maxLength": 5000},
        "pat": {"type": "string", "pattern": "^a+$"}, "pick": {"type": "string", "enum": ["x"]},
        "maybe": {"type": ["string", "null"]}, "list": {"type": "array", "items": {"type": "string"}}},
        "$defs": {"D": {"type": "string"}}}
    out = bounded(schema, 100)
    p = out["properties"]
    assert p["free"]["maxLength"] == 100 and p["maybe"]["maxLength"] == 100
    assert p["list"]["items"]["maxLength"] == 100 and out["$defs"]["D"]["maxLength"] == 100
    assert p["long"]["maxLength"] == 5000 and "maxLength" not in p["pat"] and "maxLength" not in p["pick"]
    assert bounded(schema, None) is schema
    assert json.loads(json.dumps(out))  # still a JSON document


def test_string_bound_is_an_engine_option_and_the_schema_wins(tokenizer):
    from lazyllm.structured import prepare

    m = LazyLLM(model=make_tiny("llama", seed=3), tokenizer=tokenizer, kv_cache_bytes=16 << 20, max_string_length=12,
                quality="isolated")
    try:
        assert m.config.max_string_length == 12
        free = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"],
                "additionalProperties": False}
        for seed in range(2):
            out = m.generate("talk", response_format=free, max_new_tokens=60, temperature=1.0, seed=seed)
            assert out.finish_reason == "stop" and len(out.parsed["s"]) <= 12, out.text
        own = {**free, "properties": {"s": {"type": "string", "maxLength": 40}}}
        grammar = prepare(m.inputs.grammars, own).grammar
        assert '"maxLength": 40' in grammar and '"maxLength": 12' not in grammar
    finally:
        m.close()
    with pytest.raises(InvalidRequestError, match="max_string_length"):
        LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, max_string_length=0, quality="isolated")
