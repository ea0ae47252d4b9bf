"""The front door (``lazyllm.inputs``): the one place a ``Request`` is made, and made complete."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lazyllm import Chunk, ContextLengthError, InvalidRequestError
from lazyllm.engine.detokenizer import Detokenizer
from lazyllm.inputs import InputProcessor, PromptBuilder

_ROOT = Path(__file__).resolve().parents[2]
_SOURCES = sorted(p for d in ("lazyllm", "kernels", "integrations", "benchmarks") for p in (_ROOT / d).rglob("*.py"))
_FRONT_DOOR = "lazyllm/inputs/processor.py"


def _request_constructions(tree: ast.AST) -> list[int]:
    """Lines that call ``Request(...)`` (by name or as an attribute) or ``Request.__new__``."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name == "Request" or (name == "__new__" and isinstance(f.value, ast.Name) and f.value.id == "Request"):
            lines.append(node.lineno)
    return lines


def test_only_the_front_door_constructs_a_request():
    assert len(_SOURCES) > 40
    found = {}
    for path in _SOURCES:
        rel = path.relative_to(_ROOT).as_posix()
        lines = _request_constructions(ast.parse(path.read_text(), filename=rel))
        if lines:
            found[rel] = lines
    assert list(found) == [_FRONT_DOOR], found
    assert len(found[_FRONT_DOOR]) == 1  # one constructor call: every kind of request goes through it


def test_the_scan_sees_a_construction():
    src = "from lazyllm.engine import request\nr = request.Request(segments=[], params=None, events=None)\n"
    assert _request_constructions(ast.parse(src)) == [2]


@pytest.fixture(scope="module")
def door(tokenizer):
    return InputProcessor(tokenizer, PromptBuilder(tokenizer), max_context=2048, vocab_size=len(tokenizer))


def test_a_generation_request_is_complete_when_made(door):
    r = door.generation("Which city?", ["Paris is in France."], "Be brief.", temperature=0.7, stop=["\n"],
                        timeout=5.0, streaming=False)
    assert [s.kind for s in r.segments] == ["prefix", "chunk", "suffix"]
    assert isinstance(r.detok, Detokenizer) and list(r.detok.stop) == ["\n"]
    assert isinstance(r.seed, int) and r.deadline is not None and r.deadline > r.submit_time
    assert r.score is None and r.logit_rows == 1 and not r.streaming and r.finalize is None
    other = door.generation("Which city?", ["Paris is in France."], temperature=0.7)
    assert other.seed != r.seed  # unseeded requests draw their own seed, each once
    assert door.generation("Which city?", seed=7).seed == 7


def test_warming_and_scoring_requests(door):
    w = door.warming([Chunk("Paris is in France.")], None)
    assert w.warm_only and w.segments[-1].ids == [] and w.detok is not None
    plain = door.generation("Which city?", ["Paris is in France."])
    s = door.scoring("Which city?", ["Paris is in France."], None, [5, 6, 7], return_logits=True)
    assert s.score.ids == [5, 6, 7] and s.logit_rows == 3 and s.score.return_logits
    assert [g.ids for g in s.score.prompt] == [g.ids for g in plain.segments]
    assert s.segments[-1].ids == plain.segments[-1].ids + [5, 6]  # the continuation but its last token
    with pytest.raises(InvalidRequestError, match="continuation"):
        door.scoring("Which city?", None, None, [])
    with pytest.raises(ContextLengthError):
        door.scoring("Which city?", None, None, [5] * 2048)


def test_structured_requests_carry_their_constraint_and_finalize(door):
    r = door.generation("Pick one.", response_format=["yes", "no"])
    assert r.constraint is not None and r.finalize is not None


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_a_chunk_has_one_cache_key_whatever_renders_the_request(tokenizer):
    """A chunk's segment, and so its cache key, is the same in a plain request, a conversation
    and a tool request, and equals what a router's ``ChunkKeyer`` computes: packet ids included
    (here the shipped packet of the default model)."""
    from lazyllm.cache.store import segment_keys
    from lazyllm.inputs import ChunkKeyer
    from lazyllm.model.packets import SHIPPED_DIR, load_packets

    packet = next(p for p in map(load_packets, sorted(SHIPPED_DIR.glob("*.safetensors"))) if p.info.get("default"))
    ids = packet.ids(len(tokenizer))
    assert ids[0] or ids[1]  # the shipped packet puts virtual ids around each chunk
    door = InputProcessor(tokenizer, PromptBuilder(tokenizer, ids), max_context=2048, vocab_size=len(tokenizer))
    doc = Chunk("Paris is the capital of France.")
    requests = {
        "plain": door.generation("Which city?", [doc]),
        "conversation": door.generation(None, [doc], messages=[
            {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Which city?"}]),
        "tools": door.generation("Which city?", [doc], tools=[WEATHER]),
        "response_format": door.generation(None, [doc], messages=[{"role": "user", "content": "Which city?"}],
                                           response_format=["Paris", "Rome"]),
    }
    router = ChunkKeyer(tokenizer, "fp", "isolated", packet_ids=ids).keys([doc])[0]
    for how, r in requests.items():
        (seg,) = [s for s in r.segments if s.kind == "chunk"]
        assert seg.ids[:len(ids[0])] == ids[0] and seg.ids[len(seg.ids) - len(ids[1]):] == ids[1], how
        assert segment_keys("fp", "isolated", [], [seg.ids])[1][0] == router[0], how
