"""lazyllm.quality: the fidelity report users run on their own cases (CPU, default model)."""
import json
from pathlib import Path

import pytest

from lazyllm import LazyLLM
from lazyllm import quality as q
from lazyllm.config import EngineConfig

CASES = Path(__file__).parents[1] / "data" / "quality_cases.jsonl"


@pytest.fixture(scope="module")
def llm():
    m = LazyLLM(reuse="none", kv_cache_bytes=64 << 20, progress=False, quality="isolated")
    yield m
    m.close()


@pytest.fixture(scope="module")
def report(llm):
    return q.compare(llm, str(CASES), settings=["isolated", "fast", "balanced", "default"], progress=False,
                     ttft_cases=1, answer_tokens=10)


def test_report_rows_are_consistent(report):
    assert [r["setting"] for r in report.rows] == [q.REFERENCE_NAME, "isolated", "fast", "balanced", "default"]
    full = report.row(q.REFERENCE_NAME)
    assert full["top1"] == 1.0 and full["kl"] == 0.0 and full["same_answer"] == 1.0
    assert full["recomputed"] == 1.0  # full attention computes every chunk token
    for r in report.rows:
        assert r["cases"] == 3 and 0.0 <= r["top1"] <= 1.0 and r["kl"] >= 0.0
        assert r["ttft_ms"] > 0 and r["exact_match"] is not None and r["contains"] is not None
    assert report.row("isolated")["recomputed"] == 0.0 and report.row("fast")["recomputed"] == 0.0
    assert 0.0 < report.row("balanced")["recomputed"] < 0.5
    assert report.row("isolated")["kl"] > 0.0  # isolated chunks differ from full attention
    # LazyLLM()'s default is balanced's configuration: run once, reported under both names
    b, d = report.row("balanced"), report.row("default")
    assert (d["kl"], d["top1"], d["same_answer"], d["recomputed"]) == (b["kl"], b["top1"], b["same_answer"],
                                                                      b["recomputed"])
    assert d["kwargs"] == {} and b["kwargs"] == {"quality": "balanced"}
    assert sum(pc["setting"] == "default" for pc in report.cases) == 3


def test_report_outputs(report, tmp_path):
    md = report.to_markdown()
    assert "| balanced |" in md and "Recommended" in md
    assert report._repr_markdown_() == md
    d = json.loads(report.to_json(tmp_path / "r.json"))
    assert d["recommendation"] == report.recommend() and len(d["cases"]) == 15
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = report.plot(path=tmp_path / "r.png")
    assert fig is not None and (tmp_path / "r.png").stat().st_size > 0


def test_recommend_picks_the_cheapest_setting_that_meets_the_target(report):
    # no setting that reuses chunk KV matches full attention exactly: the fallback is the
    # preset that does, a name LazyLLM(quality=...) takes
    assert report.recommend("kl<=0") == "exact"
    EngineConfig.resolve(quality=report.recommend("kl<=0"))
    # without a quality target the cheapest (nothing recomputed, then fastest) wins
    assert report.recommend({"kl": 100.0}) in ("isolated", "fast")
    rows = [dict(setting="a", top1=0.99, kl=0.001, recomputed=0.3, ttft_ms=5.0),
            dict(setting="b", top1=0.98, kl=0.004, recomputed=0.1, ttft_ms=9.0),
            dict(setting="c", top1=0.90, kl=0.1, recomputed=0.0, ttft_ms=1.0)]
    rep = q.FidelityReport(rows=rows, target=q.parse_target("top1=0.97,kl<=0.01"))
    assert rep.recommend() == "b"
    assert rep.recommend("top1>=0.985") == "a"


def test_parse_target():
    assert q.parse_target(None) == q.DEFAULT_TARGET
    assert q.parse_target("top1>=0.95, kl<=0.02, same=0.8, em=0.5") == \
        {"top1": 0.95, "kl": 0.02, "same_answer": 0.8, "exact_match": 0.5}
    with pytest.raises(ValueError):
        q.parse_target("bogus>=1")


def test_answer_matching():
    assert q.exact_match("4821. It opens vault 17.", "4821")
    assert q.exact_match("The Eiffel Tower", "eiffel tower!")
    assert not q.exact_match("It is 4821", "4821")
    assert q.contains_answer("It is 4821.", "4821") and not q.contains_answer("48210", "4821")


def test_cli_writes_markdown_and_json(tmp_path, capsys):
    md, js = tmp_path / "out.md", tmp_path / "out.json"
    rep = q.main([str(CASES), "--settings", "fast", "--answer-tokens", "4", "--ttft-cases", "1", "--no-progress",
                  "--markdown", str(md), "--json", str(js), "--target", "top1>=0.5"])
    assert "| fast |" in md.read_text() and "| fast |" in capsys.readouterr().out
    assert json.loads(js.read_text())["rows"][1]["setting"] == "fast"
    assert rep.target == {"top1": 0.5}


def test_cases_from_langchain_and_llamaindex_sources():
    from langchain_core.callbacks import CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    class Fixed(BaseRetriever):
        def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun):
            return [Document(page_content=f"doc about {query}"), Document(page_content="other")]

    cases = q.cases_from_retriever(Fixed(), ["tides", "moons"], references=["a", None], system="S")
    assert [c.documents for c in cases] == [["doc about tides", "other"], ["doc about moons", "other"]]
    assert cases[0].reference == "a" and cases[1].system == "S"
    nodes = [NodeWithScore(node=TextNode(text="node one"), score=0.9), TextNode(text="node two")]
    [c] = q.cases.as_cases([{"question": "q?", "documents": nodes}], None, None)
    assert c.documents == ["node one", "node two"]
    # questions only, documents filled from the retriever
    [c] = q.cases.as_cases(["why?"], Fixed(), "sys")
    assert c.documents[0] == "doc about why?" and c.system == "sys"
    with pytest.raises(TypeError):
        q.document_text(object())


def test_load_cases(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('# comment\n{"question": "q", "documents": ["d", {"text": "e"}], "answer": "x"}\n\n')
    [c] = q.load_cases(p)
    assert c.documents == ["d", "e"] and c.reference == "x" and c.system is None
    p.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="documents"):
        q.load_cases(p)


def test_full_attention_is_timed_on_a_cold_prompt(tokenizer):
    """The scoring passes cache the very prompts the TTFT pass then sends: under full
    attention (identical-prefix reuse) each timed request must compute its prompt afresh,
    as a new question would; a chunk-caching setting keeps its documents cached."""
    import importlib

    from lazyllm import LazyLLM
    from lazyllm.quality.cases import Case
    from tests.conftest import make_tiny

    report = importlib.import_module("lazyllm.quality.report")
    case = Case(question="What is the code?", documents=["The code is 7. " * 10, "The door is red. " * 10])
    for quality, cold in (("exact", True), (None, False)):
        llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=16 << 20, quality=quality)
        try:
            llm.generate(case.question, chunks=case.documents, max_new_tokens=1)  # what scoring leaves behind
            before = llm.cache_stats()["hits"]
            report._ttft(llm, case)
            reused = llm.cache_stats()["hits"] - before
            assert (reused == 0) == cold, (quality, reused)
        finally:
            llm.close()
