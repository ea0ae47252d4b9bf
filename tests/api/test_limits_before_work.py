"""Every limit checked before the work: a request that cannot fit the context, ``adapt`` and
fidelity-report arguments that cannot train or measure, refused in well under 2 s with one
clear line, before any model loads, case is built or token is computed. Also the ``lazyllm``
command's usage and version, ``adapt --help``, ``warm()`` under full attention and the mode
of a packet file."""
from __future__ import annotations

import os
import re
import stat
import time

import pytest
import torch

import lazyllm
from lazyllm import ContextLengthError, InvalidRequestError, LazyLLM
from tests.conftest import make_tiny

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def llm(tokenizer):
    m = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=64 << 20, quality="isolated")
    yield m
    m.close()


def test_prompt_plus_max_tokens_beyond_the_context_is_refused_before_compute(llm):
    context = llm.model.spec.max_context
    doc = "word " * (context - 1000)  # fits alone, not with 2000 new tokens
    before = llm.cache_stats()
    t0 = time.perf_counter()
    with pytest.raises(ContextLengthError, match="max_new_tokens") as e:
        llm.generate("q?", chunks=[doc], max_new_tokens=2000)
    assert time.perf_counter() - t0 < 2.0
    assert "\n" not in str(e.value) and str(context) in str(e.value)
    after = llm.cache_stats()
    assert (after["misses"], after["hits"]) == (before["misses"], before["hits"])  # nothing was planned
    out = llm.generate("q?", chunks=[doc], max_new_tokens=2)  # the same prompt, asking what fits
    assert out.usage.completion_tokens == 2


def test_warm_under_full_attention_says_why_it_does_nothing(tokenizer):
    m = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=16 << 20, quality="exact")
    try:
        with pytest.warns(UserWarning, match=r"warm\(\) does nothing with reuse='prefix' \(quality='exact'\)"):
            assert m.warm(["a document"])["computed_tokens"] == 0
    finally:
        m.close()


def _no_model(monkeypatch):
    """Any model load fails the test: the checks must come first."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    import importlib

    # the package exports functions of the same names: the modules themselves
    adapt_mod = importlib.import_module("lazyllm.quality.adapt")
    report_mod = importlib.import_module("lazyllm.quality.report")

    monkeypatch.setattr(adapt_mod, "_teacher_llm", refuse)
    monkeypatch.setattr(report_mod, "LazyLLM", refuse)
    monkeypatch.setattr(lazyllm, "LazyLLM", refuse)


DOCS = [f"Document {i} says the code is {i * 7}." for i in range(8)]


@pytest.mark.parametrize("kw,match", [
    ({"k_header": -1}, "k_header"), ({"steps": 0}, "steps"), ({"k_header": 0, "k_trailer": 0}, "trains nothing"),
    ({"heldout": 1.5}, "heldout"), ({"lr": 0}, "lr"), ({"out": "/no/such/folder/p.safetensors"}, "does not exist"),
])
def test_adapt_arguments_refused_before_training(monkeypatch, kw, match):
    from lazyllm.quality import adapt

    _no_model(monkeypatch)
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=match):
        adapt(None, DOCS, **kw)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("argv,match", [
    (["--k-header", "-1"], "k_header"), (["--steps", "0"], "steps"), (["--heldout", "0"], "heldout"),
])
def test_adapt_command_refuses_before_the_model_loads(monkeypatch, capsys, tmp_path, argv, match):
    from lazyllm.cli import main

    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(DOCS))
    _no_model(monkeypatch)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        main(["adapt", str(docs), "--out", str(tmp_path / "p.safetensors"), *argv])
    assert e.value.code == 2 and time.perf_counter() - t0 < 2.0
    assert match in capsys.readouterr().err


def test_fidelity_report_setting_refused_before_measuring(monkeypatch):
    from lazyllm.quality import compare

    _no_model(monkeypatch)
    cases = [{"question": "What is the code?", "documents": DOCS[:2]}]
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=r"setting 'mine': recompute_ratio must be in \[0, 1\], got 2"):
        compare(None, cases, settings={"mine": {"recompute_ratio": 2}})
    assert time.perf_counter() - t0 < 2.0


def test_lazyllm_command_usage_and_version(capsys):
    from lazyllm.cli import main

    assert main([]) == 2
    assert "usage: lazyllm" in capsys.readouterr().err
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("lazyllm ")


def test_adapt_help_describes_every_flag(capsys):
    from lazyllm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["adapt", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:")[1]
    entries, cur = [], None
    for line in options.splitlines():
        if line.startswith("  -"):
            cur = [line]
            entries.append(cur)
        elif cur is not None and line.strip():
            cur.append(line)
    flags = [e[0].split()[0].rstrip(",") for e in entries]
    assert "--device" in flags and "--questions" in flags and "--seed" in flags
    for e in entries:
        first = re.split(r"\s{2,}", e[0].strip())  # flag (and metavar), then its help after 2+ spaces
        assert first[1:] + e[1:], f"{first[0]} has no help"


def test_packet_file_has_the_usual_permissions(tmp_path):
    from lazyllm.model.packets import Packets

    old = os.umask(0o022)
    try:
        path = Packets(torch.zeros(2, 4), torch.zeros(1, 4), model="m").save(tmp_path / "p.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
