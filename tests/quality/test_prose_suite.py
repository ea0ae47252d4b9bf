"""The shipped real-prose fidelity suite (benchmarks/data/prose/): split by source, nothing
of the examples' corpus or the hand-written held-out cases in its training split, and the
shape the issue of defaults asks of it (cases, documents a case, tokens a document)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lazyllm.quality import load_cases

ROOT = Path(__file__).parents[2]
SUITE = ROOT / "benchmarks" / "data" / "prose"
SPLITS = ("train", "dev", "test")


def _cases(split):
    return [json.loads(x) for x in (SUITE / f"{split}.jsonl").read_text(encoding="utf-8").splitlines() if x]


@pytest.fixture(scope="module")
def suite():
    return {s: _cases(s) for s in SPLITS}


def test_no_source_and_no_document_in_two_splits(suite):
    meta = json.loads((SUITE / "sources.json").read_text())
    where: dict[str, set] = {}
    docs: dict[str, set] = {}
    for split, cases in suite.items():
        for c in cases:
            assert c["split"] == split
            for src in [c["source"], *c["doc_sources"]]:
                where.setdefault(src, set()).add(split)
                assert meta["sources"][src]["split"] == split, src  # the recorded split is the one used
                assert meta["sources"][src]["licence"]
            for d in c["documents"]:
                docs.setdefault(d, set()).add(split)
    assert len(where) > 100
    assert all(len(s) == 1 for s in where.values()), {k: v for k, v in where.items() if len(v) > 1}
    assert all(len(s) == 1 for s in docs.values())


def _heldout_texts():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from corpus import DOCS
    finally:
        sys.path.pop(0)
    held = load_cases(ROOT / "tests" / "data" / "quality_heldout.jsonl")
    assert len(held) == 16 and len(DOCS) == 6
    return list(DOCS.values()) + [d for c in held for d in c.documents] + [c.question for c in held]


def test_examples_corpus_and_heldout_cases_are_in_no_training_split(suite):
    texts = _heldout_texts()
    train = [t for c in suite["train"] for t in [c["question"], *c["documents"]]]
    for t in texts:
        probe = t[:60]  # any shared sentence start would show up here
        assert not any(probe in x or x[:60] in t for x in train), t[:80]


def test_suite_shape(suite):
    from transformers import AutoTokenizer

    from lazyllm.model.loader import default_model_dir

    assert sum(map(len, suite.values())) >= 400 and len(suite["test"]) >= 150
    tok = AutoTokenizer.from_pretrained(str(default_model_dir(progress=False)))
    kinds = set()
    for split, cases in suite.items():
        assert len({c["question"] for c in cases}) == len(cases)  # de-duplicated
        for c in cases:
            kinds.add(c["kind"])
            assert 2 <= len(c["documents"]) <= 10
            assert (c["kind"] == "unanswerable") == (c["answer_in"] == [])
        lens = [len(tok.encode(d, add_special_tokens=False)) for c in cases[:40] for d in c["documents"]]
        assert min(lens) >= 80 and max(lens) <= 1000, split
    assert kinds == {"fact", "fact-same-topic", "compare", "unanswerable"}
    assert len(load_cases(SUITE / "test.jsonl")) == len(suite["test"])  # the report reads the format


@pytest.mark.skipif(not list(Path("/usr/share/doc").glob("python3.*/html/_sources/library/json.rst.txt")),
                    reason="python3-doc is not installed")
def test_the_build_is_deterministic():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality.py"), "prose-suite", "--check"], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    meta = json.loads((SUITE / "sources.json").read_text())
    installed = subprocess.run(["dpkg-query", "-W", "-f=${Version}", meta["package"].split("=")[0]],
                               capture_output=True, text=True).stdout.strip()
    if installed != meta["package"].split("=")[1]:
        pytest.skip(f"another python3-doc ({installed}) than the suite's ({meta['package']})")
    assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr


def test_report_workers_each_take_a_slice_once(tmp_path):
    """``quality.py prose --jobs N``: a slice goes to the first worker that claims it, and
    to no other; a lone process takes every slice."""
    from benchmarks.fidelity import report as pf
    out = str(tmp_path / "slice-000.json")
    assert pf._claim(out, 0) is True
    assert pf._claim(out, 1) is False and pf._claim(out, 0) is False
    assert pf._claim(str(tmp_path / "slice-001.json"), 1) is True
    assert pf._claim(out, None) is True
