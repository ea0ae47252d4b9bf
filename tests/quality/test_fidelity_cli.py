"""The fidelity report's command line and outputs as a user meets them: arguments checked
before the model loads, targets that can be met, a recommendation LazyLLM takes, and
reference counts next to the answer-match rates. No model is loaded here."""
import sys
from pathlib import Path

import pytest

import lazyllm
from lazyllm import quality as q
from lazyllm.config import EngineConfig
from lazyllm.quality import cli

CASES = Path(__file__).parents[1] / "data" / "quality_cases.jsonl"
GUIDE = Path(__file__).parents[2] / "docs" / "guide.md"  # where the fidelity CLI is documented


@pytest.fixture()
def no_model(monkeypatch):
    """Loading a model fails the test: every check must come first."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(lazyllm, "LazyLLM", refuse)  # the command imports it after its checks


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    return err


def test_plot_without_matplotlib_is_refused_before_loading(no_model, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = _usage_error([str(CASES), "--plot", str(tmp_path / "p.png")], capsys)
    assert '".[bench]"' in err


@pytest.mark.parametrize("content,needle", [("{not json\n", "not JSON"), ('{"documents": []}\n', "question"),
                                            ("", "no cases")])
def test_bad_case_files_are_usage_errors_before_loading(no_model, tmp_path, capsys, content, needle):
    path = tmp_path / "cases.jsonl"
    path.write_text(content)
    assert needle in _usage_error([str(path)], capsys)
    assert "No such file" in _usage_error([str(tmp_path / "missing.jsonl")], capsys)


def test_unreachable_targets_are_refused(no_model, capsys):
    with pytest.raises(ValueError, match="0.97"):
        q.parse_target("top1=97")
    for bad in ("same>=1.5", "kl<=-0.1", "recomputed<=2"):
        with pytest.raises(ValueError, match="never be met"):
            q.parse_target(bad)
    assert "never be met" in _usage_error([str(CASES), "--target", "top1=97"], capsys)
    assert "unknown setting" in _usage_error([str(CASES), "--settings", "turbo"], capsys)
    assert "--orders must be >= 0" in _usage_error([str(CASES), "--orders", "-1"], capsys)


def test_the_guide_and_help_target_syntax_agree():
    help_text = cli.build_parser().format_help()
    assert "top1>=0.97,kl<=0.01,same>=0.9" in help_text
    lines = [x for x in GUIDE.read_text().splitlines() if "python -m lazyllm.quality" in x and "--target" in x]
    assert lines
    for line in lines:
        target = line.split("--target", 1)[1].split()[0].strip("'\"")  # quoted: > and < are shell redirections
        assert (">=" in target or "<=" in target) and "'" in line, line  # --help's form, quoted for a shell
        q.parse_target(target)


def _rows():
    base = dict(kl=0.02, same_answer=0.5, same_answer_n=1, cases=2, recomputed=0.0, ttft_ms=3.0,
                contains=0.5, exact_match=0.0, references=2, meets_target=False)
    return [dict(base, setting=q.REFERENCE_NAME, top1=1.0, kl=0.0, recomputed=1.0),
            dict(base, setting="fast", top1=0.9)]


def test_recommend_returns_a_preset_lazyllm_takes():
    rep = q.FidelityReport(rows=_rows(), target=q.parse_target("top1>=0.95"), n_cases=2)
    rec = rep.recommend()
    assert rec == "exact"
    assert EngineConfig.resolve(quality=rec).quality == "exact"


def test_markdown_says_how_many_cases_had_a_reference_and_print_shows_it():
    rows = _rows()
    rep = q.FidelityReport(rows=rows, target=q.parse_target("top1>=0.95"), n_cases=3)
    md = rep.to_markdown()
    assert "0.0% (0/2)" in md and "50.0% (1/2)" in md and "2 cases with a reference" in md
    assert str(rep) == md
    rows[1]["references"] = 0
    rows[0]["references"] = 0
    assert "| - | - |" in q.FidelityReport(rows=rows, target={}, n_cases=3).to_markdown()


def test_packets_flag_adds_a_setting_per_file(monkeypatch, tmp_path, capsys):
    """``--packets FILE`` measures the default options with that packet next to the other
    settings (named after the file); a missing file is a usage error before the model loads."""
    from lazyllm.quality import report

    assert "no such packet file" in _usage_error([str(CASES), "--packets", str(tmp_path / "none.pt")], capsys)
    seen = {}

    class Engine:
        def __init__(self, *a, **k):
            pass

        def close(self):
            pass

    class Report:  # the CLI prints the whole report: the table, then the order floor's
        def full_markdown(self):
            return "table"

    def compare(llm, cases, settings, target, **kw):
        seen["settings"] = settings
        return Report()

    monkeypatch.setattr(lazyllm, "LazyLLM", Engine)
    monkeypatch.setattr(report, "compare", compare)
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"")
    cli.main([str(CASES), "--settings", "default,fast", "--packets", str(mine)])
    assert seen["settings"] == ["default", "fast", ("mine", {"packets": str(mine)})]
