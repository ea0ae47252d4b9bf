"""Adding an engine option is one edit: a field declared with ``lazyllm.option_spec.opt`` (here
on a subclass of ``EngineConfig``, made at test time) is in ``LazyLLM``'s signature, validated
with an error naming it, documented in the docstring and the guide's table, and a flag of
``lazyllm serve``, with nothing else written."""
import argparse
import dataclasses
import inspect
from dataclasses import dataclass

import pytest

from lazyllm import LazyLLM, api
from lazyllm.config import QUALITY_OPTIONS, EngineConfig
from lazyllm.errors import InvalidRequestError
from lazyllm.option_spec import opt, options_docstring, options_markdown


@dataclass(frozen=True)
class WithBeams(EngineConfig):
    beam_width: int = opt(1, "beams searched per request", bounds="[1, 8]")
    beam_note: str | None = opt(None, "a note on the beams", doc="a note kept with the beams, ``None``: none",
                                choices=(None, "wide", "narrow"))


def test_lazyllm_signature_is_made_from_the_declarations():
    params = inspect.signature(LazyLLM.__init__).parameters
    assert inspect.signature(LazyLLM.__init__) == api._signature(EngineConfig)
    assert list(params)[4:] == [f.name for f in dataclasses.fields(EngineConfig)]
    new = api._signature(WithBeams).parameters
    assert list(new)[:-2] == list(params)
    p = new["beam_width"]
    assert (p.kind, p.default, p.annotation) == (inspect.Parameter.KEYWORD_ONLY, 1, "int")
    assert new["beam_note"].default is None
    # an option a preset sets defaults to None ("not given") in the signature
    assert all(params[name].default is None for name in QUALITY_OPTIONS)


def test_a_new_option_is_validated_by_its_declaration():
    assert WithBeams().beam_width == 1 and WithBeams.resolve("fast", beam_width=4).beam_width == 4
    with pytest.raises(InvalidRequestError, match=r"beam_width must be an int in \[1, 8\], got 9"):
        WithBeams(beam_width=9)
    with pytest.raises(InvalidRequestError, match="beam_width must be an int in"):
        WithBeams.resolve(beam_width=True)
    with pytest.raises(InvalidRequestError, match=r"beam_note must be one of \(None, 'wide', 'narrow'\)"):
        WithBeams(beam_note="tall")
    # every bad option in one error, the declared ones and the new one alike
    with pytest.raises(InvalidRequestError, match="recompute_ratio.*; beam_width"):
        WithBeams(recompute_ratio=2.0, beam_width=0)


def test_a_new_option_is_documented():
    assert "    beam_width : beams searched per request\n" in options_docstring(WithBeams)
    table = options_markdown(WithBeams)
    assert "| `beam_width` | `1` | beams searched per request |" in table
    assert "| `beam_note` | `None` | a note kept with the beams, `None`: none |" in table


def test_a_new_option_is_a_flag():
    pytest.importorskip("fastapi")
    from lazyllm.integrations.server.cli import add_engine_flags

    parser = argparse.ArgumentParser(prog="serve", exit_on_error=False)
    add_engine_flags(parser, WithBeams)
    assert "--beam-width" in parser.format_help() and "beams searched per request" in parser.format_help()
    args = parser.parse_args(["--beam-width", "3", "--beam-note", "wide"])
    assert (args.beam_width, args.beam_note) == (3, "wide")
    assert not hasattr(parser.parse_args([]), "beam_width")  # not given: the declaration's default applies
    with pytest.raises(argparse.ArgumentError, match="integer"):
        parser.parse_args(["--beam-width", "x"])
    with pytest.raises(InvalidRequestError, match="beam_width"):  # the value checked as in process
        WithBeams.resolve(**vars(parser.parse_args(["--beam-width", "9"])))


def test_lazyllm_takes_the_new_option_with_nothing_else_written(monkeypatch):
    """``LazyLLM.__init__`` reads nothing but the declarations: with the configuration class
    and the signature made from it swapped, the new keyword is taken and checked (a bad value
    refused before any model loads), and a misspelt one is a TypeError as for any function."""
    monkeypatch.setattr(api, "EngineConfig", WithBeams)
    monkeypatch.setattr(LazyLLM.__init__, "__signature__", api._signature(WithBeams))
    with pytest.raises(InvalidRequestError, match="beam_width"):
        LazyLLM(beam_width=9)
    with pytest.raises(TypeError, match="beam_widht"):
        LazyLLM(beam_widht=2)
