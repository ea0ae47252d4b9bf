"""Bad requests answered with a message that names the real cause, as OpenAI's API does: a lone
UTF-16 surrogate escape, a number that is NaN or infinite, ``stream_options`` without
``stream``, and a JSON Schema ``$ref`` to a definition the schema does not have."""
import json

import pytest

from lazyllm import InvalidRequestError, LazyLLM
from tests.conftest import make_tiny

pytest.importorskip("fastapi")

from lazyllm.integrations.server.errors import APIError  # noqa: E402
from lazyllm.integrations.server.protocol import validate_body  # noqa: E402


def _body(**fields) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields})


def _refused(raw: str) -> APIError:
    with pytest.raises(APIError) as e:
        validate_body(raw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("escape", [r"\ud800", r"a\ud800b", r"\udc00", r"\ud800\ud800"])
def test_a_lone_surrogate_is_named(escape):
    err = _refused('{"messages": [{"role": "user", "content": "' + escape + '"}]}')
    assert "half of a UTF-16 surrogate pair" in err.message and "hex escape" not in err.message, err.message
    assert err.code == "invalid_json"


def test_a_surrogate_pair_is_a_character():
    body = validate_body(r'{"messages": [{"role": "user", "content": "smile \ud83d\ude00"}]}')
    assert body.messages[0].content == "smile \U0001f600"


@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
                                         ("presence_penalty", "-Infinity")])
def test_nan_and_infinity_are_not_numbers(field, value):
    raw = _body()[:-1] + f', "{field}": {value}}}'
    err = _refused(raw)
    assert err.param == field and "finite number" in err.message, err.message


def test_stream_options_needs_stream():
    err = _refused(_body(stream_options={"include_usage": True}))
    assert err.param == "stream_options" and "stream" in err.message
    assert validate_body(_body(stream=True, stream_options={"include_usage": True})).stream_options.include_usage
    assert validate_body(_body(stream_options=None)).stream_options is None


def test_a_ref_to_a_missing_definition_is_named(tokenizer):
    llm = LazyLLM(model=make_tiny("llama", seed=4), tokenizer=tokenizer, kv_cache_bytes=8 << 20, quality="isolated")
    try:
        schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "$defs": {"B": {}}}
        with pytest.raises(InvalidRequestError) as e:
            llm.generate("q", response_format=schema, max_new_tokens=2)
        msg = str(e.value)
        assert "'#/$defs/Missing'" in msg and "#/properties/a" in msg and "no definition" in msg, msg
        assert "\n" not in msg and len(msg) < 200, msg
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        with pytest.raises(InvalidRequestError, match="no definition"):
            llm.generate("q", tools=[tool], tool_choice="required", max_new_tokens=2)
        assert llm.generate("q", max_new_tokens=2).usage.completion_tokens == 2  # still serves
    finally:
        llm.close()
