"""Property tests of constrained decoding: for random JSON Schemas (from a strategy of the
schema features lazyllm's grammar library implements), random regexes and random choice
lists, every output a sampling tiny random model produces under the constraint parses and
validates; and the grammar admits the schema's own valid instances (drawn by ``instances``,
checked by jsonschema), so the constraint does not forbid what the schema allows.
(hypothesis-jsonschema 0.23's ``from_schema`` fails on object schemas under hypothesis 6.170:
it calls ``many.more``, which hypothesis removed; hence our own instance strategy.)"""
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lazyllm
from lazyllm import LazyLLM
from tests.conftest import make_tiny

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                      HealthCheck.data_too_large], derandomize=True)
KEYS = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
SCALARS = st.one_of(st.integers(-50, 50), st.booleans(), st.none(), st.text(alphabet="xyz ", max_size=4))


@st.composite
def _bounded_int(draw):
    lo = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": lo, "maximum": lo + draw(st.integers(0, 500))}


@st.composite
def _string(draw):
    s = {"type": "string", "maxLength": draw(st.integers(0, 8))}
    if draw(st.booleans()):
        s["minLength"] = draw(st.integers(0, s["maxLength"]))
    if draw(st.integers(0, 4)) == 0:
        s = {"type": "string", "pattern": draw(st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}-[A-Z]$", "^(ab|cd)+$"]))}
        s["pattern"] = s["pattern"].replace("+", "{1,3}")
    return s


LEAVES = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}), _bounded_int(), _string(),
    st.builds(lambda v: {"enum": v}, st.lists(SCALARS, min_size=1, max_size=4, unique_by=json.dumps)),
    st.builds(lambda v: {"const": v}, SCALARS),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-100, 100)),
)


def _containers(children):
    @st.composite
    def obj(draw):
        props = draw(st.dictionaries(KEYS, children, min_size=0, max_size=3))
        req = [k for k in props if draw(st.booleans())]
        return {"type": "object", "properties": props, "required": req, "additionalProperties": False}

    arrays = st.builds(lambda it, lo, extra: {"type": "array", "items": it, "minItems": lo, "maxItems": lo + extra},
                       children, st.integers(0, 1), st.integers(0, 2))
    any_of = st.builds(lambda a, b: {"anyOf": [a, b]}, children, children)
    return st.one_of(obj(), arrays, any_of)


SCHEMAS = st.recursive(LEAVES, _containers, max_leaves=6)


@pytest.fixture(scope="module")
def llm(tokenizer):
    m = LazyLLM(model=make_tiny("llama", seed=11), tokenizer=tokenizer, kv_cache_bytes=64 << 20, quality="isolated")
    yield m
    m.close()


@pytest.fixture(scope="module")
def lengths():
    """How many outputs of each kind the length limit cut short (reported, and bounded)."""
    box = {"json": [0, 0], "regex": [0, 0], "choice": [0, 0]}
    yield box
    for kind, (cut, total) in box.items():
        assert cut <= max(2, total // 10), f"{kind}: {cut} of {total} outputs ran into the length limit"


def _run(llm, seed, max_new_tokens=160, **kw):
    return llm.generate("Answer.", max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, **kw)


@settings(max_examples=200, **SETTINGS)
@given(schema=SCHEMAS, seed=st.integers(0, 2**31 - 1))
def test_random_schemas_outputs_validate(llm, lengths, schema, seed):
    out = _run(llm, seed, response_format=schema)
    lengths["json"][1] += 1
    if out.finish_reason == "length":
        lengths["json"][0] += 1
        return
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert out.parsed == value


def instances(schema: dict) -> st.SearchStrategy:
    """Values valid against a schema drawn from ``SCHEMAS``."""
    if "anyOf" in schema:
        return st.one_of(*[instances(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    t = schema["type"]
    if t in ("boolean", "null"):
        return st.booleans() if t == "boolean" else st.none()
    if t == "integer":
        return st.integers(schema["minimum"], schema["maximum"])
    if t == "number":
        return st.floats(schema["minimum"], schema["maximum"], allow_nan=False).map(lambda x: round(x, 3))
    if t == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(alphabet="abc xyz\"'\\é", min_size=schema.get("minLength", 0), max_size=schema["maxLength"])
    if t == "array":
        return st.lists(instances(schema["items"]), min_size=schema["minItems"], max_size=schema["maxItems"])
    # keys in the schema's order: the grammar writes (and admits) properties in that order
    props, missing = schema["properties"], object()
    parts = [instances(v) if k in schema["required"] else st.one_of(st.just(missing), instances(v))
             for k, v in props.items()]
    return st.tuples(*parts).map(lambda vals: {k: v for k, v in zip(props, vals) if v is not missing})


@settings(max_examples=100, **SETTINGS)
@given(data=st.data(), schema=SCHEMAS)
def test_random_schemas_admit_their_instances(llm, data, schema):
    from lazyllm.structured import normalize_response_format

    value = data.draw(instances(schema))
    jsonschema.validate(value, schema)  # the strategy's own check
    text = json.dumps(value, separators=(", ", ": "), ensure_ascii=False)
    c = llm.inputs.grammars.constraint(normalize_response_format(schema).grammar)
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert all(c.accept(t) for t in ids), (text, c.error)
    assert c.is_accepting(), text


@st.composite
def _regex(draw):
    atoms = st.one_of(st.sampled_from(["[a-z]", "[0-9]", "[A-F]", "x", "-", "\\.", "(ab|c)", "[a-c0-2]"]))
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        a = draw(atoms)
        lo = draw(st.integers(0, 2))
        q = draw(st.sampled_from(["", "?", f"{{{lo},{lo + draw(st.integers(0, 3))}}}"]))
        parts.append(a + q)
    return "".join(parts)


@settings(max_examples=100, **SETTINGS)
@given(pattern=_regex(), seed=st.integers(0, 2**31 - 1))
def test_random_regexes_full_match(llm, lengths, pattern, seed):
    out = _run(llm, seed, response_format=lazyllm.Regex(pattern), max_new_tokens=40)
    lengths["regex"][1] += 1
    if out.finish_reason == "length":
        lengths["regex"][0] += 1
        return
    assert re.fullmatch(pattern, out.text), (pattern, out.text)


@settings(max_examples=100, **SETTINGS)
@given(choices=st.lists(st.text(alphabet="abc xyz.!\"\\é-", min_size=1, max_size=10), min_size=1, max_size=6,
                        unique=True),
       seed=st.integers(0, 2**31 - 1))
def test_random_choices_pick_one(llm, lengths, choices, seed):
    out = _run(llm, seed, response_format=choices, max_new_tokens=40)
    lengths["choice"][1] += 1
    assert out.finish_reason == "stop"
    assert out.text in choices and out.parsed == out.text
