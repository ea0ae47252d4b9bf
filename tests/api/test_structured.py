"""Structured output and tool calling through ``LazyLLM.generate``: every format's output
parses and follows its grammar, tools are called with arguments that validate, tool results
come back as messages, bad input is a clear ``InvalidRequestError`` and nothing leaks. On a
tiny random model, so the output follows the grammar only because the grammar holds it."""
import asyncio
import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, Field

import lazyllm
from lazyllm import InvalidRequestError, LazyLLM
from tests.conftest import make_tiny

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
              "required": ["lat"], "additionalProperties": False},
    "ok": {"type": "boolean"}}, "required": ["name", "tags", "where", "ok"], "additionalProperties": False}


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def llm(tokenizer):
    m = LazyLLM(model=make_tiny("llama", seed=3), tokenizer=tokenizer, kv_cache_bytes=32 << 20, quality="isolated")
    yield m
    m.close()


def _no_pins(llm):
    assert llm.cache_stats()["pinned_entries"] == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(llm, temperature):
    for rf in (SCHEMA, {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}):
        out = llm.generate("describe", response_format=rf, max_new_tokens=200, temperature=temperature, seed=1)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.parsed == json.loads(out.text)


def test_pydantic_json_object_regex_choices_grammar(llm):
    out = llm.generate("who?", response_format=Person, max_new_tokens=100)
    assert isinstance(out.parsed, Person) and out.parsed == Person.model_validate_json(out.text)
    out = llm.generate("json", response_format={"type": "json_object"}, max_new_tokens=300, temperature=1.0, seed=5)
    if out.finish_reason == "stop":  # free-form JSON may run past the limit on a random model
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and out.parsed is None and out.text.startswith("{")
    pattern = r"[A-Z][a-z]{1,5}-[0-9]{2,4}"
    out = llm.generate("code?", response_format=lazyllm.Regex(pattern), max_new_tokens=30, temperature=1.0, seed=2)
    assert re.fullmatch(pattern, out.text) and out.parsed == out.text
    choices = ["yes", "no", "maybe not"]
    out = llm.generate("ok?", response_format=choices, temperature=1.0, seed=3)
    assert out.text in choices and out.finish_reason == "stop"
    ebnf = 'root ::= expr\nexpr ::= num (("+" | "*") num){0,3}\nnum ::= [1-9] [0-9]{0,2}\n'
    out = llm.generate("sum?", response_format=lazyllm.Grammar(ebnf), max_new_tokens=30, temperature=1.0, seed=4)
    assert re.fullmatch(r"[1-9][0-9]{0,2}([+*][1-9][0-9]{0,2}){0,3}", out.text), out.text


def _check_calls(out, names):
    assert out.finish_reason == "tool_calls", out.text
    assert out.tool_calls and len({c.id for c in out.tool_calls}) == len(out.tool_calls)
    for c in out.tool_calls:
        assert c.name in names
        jsonschema.validate(c.arguments, PARAMS[c.name])


def test_tool_choice_required_named_auto_none(llm):
    out = llm.generate("weather in Paris?", tools=[WEATHER, ADD], tool_choice="required", max_new_tokens=60)
    _check_calls(out, {"get_weather", "add"})
    for name in ("add", {"type": "function", "function": {"name": "get_weather"}}):
        out = llm.generate("go", tools=[WEATHER, ADD], tool_choice=name, max_new_tokens=60, temperature=1.0, seed=9)
        _check_calls(out, {name if isinstance(name, str) else "get_weather"})
    out = llm.generate("go", tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=True,
                       max_new_tokens=200, temperature=1.0, seed=1)
    assert out.finish_reason in ("tool_calls", "length")
    if out.finish_reason == "tool_calls":
        _check_calls(out, {"get_weather", "add"})
    for seed in range(4):  # auto: a call, or a text answer that does not open one
        out = llm.generate("hi", tools=[WEATHER], max_new_tokens=20, temperature=1.0, seed=seed)
        if out.tool_calls:
            _check_calls(out, {"get_weather"})
        else:
            assert not out.text.startswith("<tool_call>")
    out = llm.generate("hi", tools=[WEATHER], tool_choice="none", max_new_tokens=8)
    assert out.tool_calls == [] and out.finish_reason in ("stop", "length")


def test_tool_results_round_trip_and_chunks_reused(llm):
    docs = ["Paris is the capital of France.", "Berlin is the capital of Germany."]
    msgs = [{"role": "user", "content": "weather where the capital of France is?"}]
    first = llm.generate(None, docs, messages=msgs, tools=[WEATHER], tool_choice="required", max_new_tokens=60)
    _check_calls(first, {"get_weather"})
    call = first.tool_calls[0]
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = llm.generate(None, docs, messages=msgs, tools=[WEATHER], max_new_tokens=20)
    assert second.usage.cached_chunk_tokens > 0  # the documents' KV from the first step
    kinds = [k for k, _ in second.prompt_segments]
    assert kinds == ["prefix", "chunk", "chunk", "suffix"]
    # the first step's prefix (system, tools, up to the documents) is the second step's
    assert first.prompt_segments[0] == second.prompt_segments[0]
    bad = msgs + [{"role": "tool", "tool_call_id": "call_nobody", "content": "x"}]
    with pytest.raises(InvalidRequestError, match="unknown tool_call_id"):
        llm.generate(None, docs, messages=bad, tools=[WEATHER])
    _no_pins(llm)


def test_stream_batch_async(llm):
    s = llm.stream("who?", response_format=Person, max_new_tokens=100)
    text = "".join(s)
    assert text == s.output.text and isinstance(s.output.parsed, Person)
    outs = llm.generate_batch([{"question": "a", "response_format": ["x", "y"]},
                               {"question": "b", "max_new_tokens": 5},
                               {"question": "c", "tools": [ADD], "tool_choice": "add", "max_new_tokens": 60}])
    assert outs[0].parsed in ("x", "y") and outs[1].parsed is None
    _check_calls(outs[2], {"add"})
    out = asyncio.run(llm.agenerate("who?", response_format=Person, max_new_tokens=100))
    assert isinstance(out.parsed, Person)


def test_length_mid_json_gives_partial_text_and_frees_pages(llm):
    llm.generate("warm the prefix", response_format=SCHEMA, max_new_tokens=2)
    free = llm.cache_stats()["free_pages"]
    out = llm.generate("warm the prefix", response_format=SCHEMA, max_new_tokens=4)
    assert out.finish_reason == "length" and out.parsed is None and out.text.startswith('{"name": ')
    out = llm.generate("q", tools=[WEATHER], tool_choice="required", max_new_tokens=5)
    # one tool: the call is that tool's, cut before its name was written
    assert out.finish_reason == "length" and out.text.startswith("<tool_call>") and out.answer_is_calls
    assert [(c.name, c.partial) for c in out.tool_calls] == [("get_weather", "")]
    _no_pins(llm)
    llm.generate("warm the prefix", response_format=SCHEMA, max_new_tokens=4)
    assert llm.cache_stats()["free_pages"] == free


BAD = [
    ("invalid schema type", {"response_format": {"type": "objectx"}}, "grammar"),
    ("unsupported keyword", {"response_format": {"not": {"type": "string"}}}, "not"),
    ("look-around regex", {"response_format": lazyllm.Regex("(?=a)b")}, "look"),
    ("empty choices", {"response_format": []}, "non-empty"),
    ("bad GBNF", {"response_format": lazyllm.Grammar("root ::= (")}, "grammar"),
    ("unknown format object", {"response_format": 3.5}, "response_format"),
    ("json_schema without schema", {"response_format": {"type": "json_schema", "json_schema": 3}}, "json_schema"),
    ("tool parameters not an object", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "parameters"),
    ("tool parameters invalid", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]}, "grammar"),
    ("tool without name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "name"),
    ("duplicate tools", {"tools": [ADD, ADD]}, "unique"),
    ("tools not a list", {"tools": ADD}, "list"),
    ("unknown tool_choice", {"tools": [ADD], "tool_choice": "mul"}, "not among"),
    ("tool_choice without tools", {"tool_choice": "required"}, "needs tools"),
    ("bad message role", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ("tool args not JSON", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]}, "not JSON"),
]


@pytest.mark.parametrize("name,kw,match", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_a_clear_error(llm, name, kw, match):
    q = None if "messages" in kw else "q"
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(q, **kw)
    _no_pins(llm)
    assert llm.generate("still serving?", max_new_tokens=2).usage.completion_tokens >= 1


def test_compiled_grammar_cached_per_schema(llm):
    before = dict(llm.inputs.grammars.stats)
    for _ in range(3):
        llm.generate("x", response_format={"type": "object", "properties": {"k": {"enum": [1, 2, 3]}},
                                           "required": ["k"], "additionalProperties": False})
    assert llm.inputs.grammars.stats["compiled"] == before["compiled"] + 1
    assert llm.inputs.grammars.stats["hits"] >= before["hits"] + 2


def test_batched_mask_fill_equals_row_by_row(llm):
    """``GrammarConstraint.fill_bitmasks`` (llguidance's threads, what the sampler calls for a
    batch) writes the same rows as one ``fill_bitmask`` per row."""
    import torch

    from lazyllm.engine.running.sampler import bitmask_words
    from lazyllm.structured import GrammarConstraint, normalize_response_format

    grammars = [normalize_response_format(f).grammar for f in (SCHEMA, ["yes", "no"], lazyllm.Regex("[0-9]{3}"))]
    cons = [llm.inputs.grammars.constraint(g) for g in grammars]
    for c, prefix in zip(cons, ('{"name": "', "y", "1")):
        for t in llm.tokenizer(prefix, add_special_tokens=False)["input_ids"]:
            assert c.accept(t)
    words = bitmask_words(llm.model.spec.vocab_size)
    one, many = torch.zeros((3, words), dtype=torch.int32), torch.zeros((3, words), dtype=torch.int32)
    for i, c in enumerate(cons):
        c.fill_bitmask(one, i)
    GrammarConstraint.fill_bitmasks([(c, i) for i, c in enumerate(cons)], many)
    assert torch.equal(one, many) and all(one[i].any() for i in range(3))


@pytest.mark.parametrize("max_tokens", [1, 3, 5, 8, 12, 16])
def test_call_cut_at_any_length_is_never_content(llm, max_tokens):
    """A call cut by the length limit is a call, whatever its length: with two tools, named
    once the written part fits one of them (never an empty list of calls from a named call);
    with one tool, named from the first token. The adapters never show its markup."""
    from lazyllm.integrations.langchain_tools import ai_message
    from lazyllm.integrations.llama_index_tools import chat_message

    for tools, choice in (([WEATHER, ADD], "required"), ([WEATHER, ADD], "add")):
        out = llm.generate("q", tools=tools, tool_choice=choice, max_new_tokens=max_tokens)
        assert out.finish_reason == "length" and out.answer_is_calls and out.text.startswith("<"), out.text
        fits = [n for n in ("get_weather", "add") if choice in ("required", n)
                and f'<tool_call>{{"name": "{n}"'.startswith(out.text[:len(f'<tool_call>{{"name": "{n}"')])]
        if len(fits) == 1:  # the written part names one tool: the cut call is that tool's
            [call] = out.tool_calls
            assert call.name == fits[0] and call.partial is not None and call.arguments == {}
        else:
            assert out.tool_calls == []
        assert ai_message(out).content == "" and chat_message(out).content == ""


def test_auto_text_answer_holds_no_call_markup(llm):
    """Under ``tool_choice="auto"`` a text answer may hold ``<`` but never a call's markup
    (a model echoing the prompt's call format would hand the caller a call as content)."""
    from lazyllm.structured import prepare

    req = prepare(llm.inputs.grammars, tools=[WEATHER], tool_choice="auto")

    def accepts(text):
        c = llm.inputs.grammars.constraint(req.grammar)
        return all(c.accept(t) for t in llm.tokenizer(text, add_special_tokens=False)["input_ids"])

    assert accepts("Sure, <b>bold</b> and 3 < 4.")
    assert not accepts('Sure: <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert not accepts("done </tool_call>")
    assert not accepts("<b>text may not start like a call</b>")


CITY = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "where": {"type": "object", "properties": {"lat": {"type": "integer"}}, "required": ["lat"]}},
    "required": ["name", "where"]}


def _accepts(llm, grammar: str, text: str) -> bool:
    """Whether ``grammar`` admits ``text`` as a complete answer, token by token."""
    c = llm.inputs.grammars.constraint(grammar)
    return all(c.accept(t) for t in llm.tokenizer(text, add_special_tokens=False)["input_ids"]) and c.is_accepting()


def test_strict_closes_every_object(llm):
    """``strict: true`` admits no key outside ``properties``, at any depth (OpenAI's strict
    mode); without it the schema is followed as written (objects open)."""
    from lazyllm.structured import prepare

    def rf(strict, schema=CITY):
        return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": strict}}

    ok, extra = '{"name": "Paris", "where": {"lat": 48}}', '{"name": "Paris", "where": {"lat": 48}, "type": "json"}'
    deep = '{"name": "Paris", "where": {"lat": 48, "lon": 2}}'
    strict, loose = (prepare(llm.inputs.grammars, response_format=rf(s)).grammar for s in (True, False))
    assert _accepts(llm, strict, ok) and not _accepts(llm, strict, extra) and not _accepts(llm, strict, deep)
    assert _accepts(llm, loose, extra) and _accepts(llm, loose, deep)
    out = llm.generate("a city", response_format=rf(True), max_new_tokens=80)
    assert out.finish_reason == "stop" and set(out.parsed) == {"name", "where"} and set(out.parsed["where"]) == {"lat"}
    opened = {**CITY, "properties": {**CITY["properties"], "tags": {"type": "object", "additionalProperties": True}}}
    with pytest.raises(InvalidRequestError, match=r"schema\.properties\.tags: strict mode closes every object"):
        llm.generate("a city", response_format=rf(True, opened))
    tool = {"type": "function", "function": {"name": "save", "strict": True, "parameters": opened}}
    with pytest.raises(InvalidRequestError, match=r"tools\[0\]\.function\.parameters\.properties\.tags"):
        llm.generate("a city", tools=[tool])
    assert llm.generate("a city", tools=[{**tool, "function": {**tool["function"], "strict": False}}],
                        tool_choice="required", max_new_tokens=4).finish_reason == "length"


def test_arrays_and_free_values_are_bounded(llm):
    """Where a schema sets no ``maxItems`` an array holds at most ``max_array_length`` items
    (the schema's own ``maxItems`` wins); a value the schema leaves free (``json_object``, ``{}``,
    an object's other keys) nests at most ``max_json_depth`` levels; a user sets both (the
    defaults: 32 items, 8 levels), in response formats and tool arguments alike."""
    from lazyllm.config import EngineConfig
    from lazyllm.structured import JsonBounds, prepare

    def nested(levels):  # an object `levels` deep, top level counted
        return '{"a": ' * levels + "1" + "}" * levels

    def items(n):
        return "[" + ", ".join(["1"] * n) + "]"

    obj = {"type": "json_object"}
    g = prepare(llm.inputs.grammars, response_format=obj).grammar  # the engine's defaults
    assert _accepts(llm, g, nested(8)) and not _accepts(llm, g, nested(9))
    assert _accepts(llm, g, '{"a": ' + items(32) + "}") and not _accepts(llm, g, '{"a": ' + items(33) + "}")
    small = JsonBounds(max_array_length=3, max_json_depth=2)
    g = prepare(None, response_format=obj, bounds=small).grammar
    assert _accepts(llm, g, nested(2)) and not _accepts(llm, g, nested(3))
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                             "more": {"type": "array", "maxItems": 5}, "free": {}},
            "required": ["tags", "more", "free"]}
    g = prepare(None, response_format=tags, bounds=small).grammar
    assert _accepts(llm, g, '{"tags": ["a", "b", "c"], "more": ' + items(5) + ', "free": {"k": 1}}')
    assert not _accepts(llm, g, '{"tags": ["a", "b", "c", "d"], "more": [], "free": 1}')
    assert not _accepts(llm, g, '{"tags": [], "more": [], "free": {"k": {"j": 1}}}')  # three levels
    tool = {"type": "function", "function": {"name": "tag", "parameters": tags}}
    g = prepare(None, tools=[tool], tool_choice="required", bounds=small).grammar
    call = '<tool_call>{"name": "tag", "arguments": {"tags": %s, "more": [], "free": 1}}</tool_call>'
    assert _accepts(llm, g, call % '["a", "b", "c"]') and not _accepts(llm, g, call % '["a", "b", "c", "d"]')
    unbounded = JsonBounds(max_array_length=None, max_json_depth=None)
    assert _accepts(llm, prepare(None, response_format=obj, bounds=unbounded).grammar, nested(12))
    for bad in ({"max_array_length": 0}, {"max_json_depth": "3"}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            EngineConfig(**bad)
