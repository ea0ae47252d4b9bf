"""Every way a user starts lazyllm works from the repository's root and from ``tests/``: a
one-line ``generate``, ``python -m lazyllm.quality`` (its help, then a run), ``python -m
lazyllm.serve --help`` and every benchmark script's ``--help``, each in its own interpreter.

The commands run in a few parallel interpreters once per module; each test reads its result.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"root": ROOT, "tests": ROOT / "tests"}
GENERATE = ("from lazyllm import LazyLLM; "
            "out = LazyLLM(progress=False).generate('Q?', chunks=['A doc.'], max_new_tokens=2); "
            "print('tokens', out.usage.completion_tokens)")


def _scripts() -> list[str]:
    """The benchmark scripts (a file with a ``__main__`` block); ``_*.py`` and the modules other
    scripts import are not commands."""
    return sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")
                  if not p.name.startswith("_") and "__main__" in p.read_text(encoding="utf-8"))


def _cases(tmp: Path) -> Path:
    path = tmp / "cases.jsonl"
    path.write_text(json.dumps({"question": "What colour is Sorna glass?",
                                "documents": ["Sorna glass is blue.", "The Halvorsen lighthouse was lit in 1887."]})
                    + "\n")
    return path


def _commands(tmp: Path) -> dict[tuple[str, str], list[str]]:
    cmds = {}
    for where, cwd in FOLDERS.items():
        bench = os.path.relpath(ROOT / "benchmarks", cwd)
        cmds[(where, "generate")] = ["-c", GENERATE]
        cmds[(where, "quality --help")] = ["-m", "lazyllm.quality", "--help"]
        cmds[(where, "serve --help")] = ["-m", "lazyllm.serve", "--help"]
        for script in _scripts():
            cmds[(where, script)] = [os.path.join(bench, script), "--help"]
    cmds[("root", "quality run")] = ["-m", "lazyllm.quality", str(_cases(tmp)), "--settings", "fast",
                                     "--answer-tokens", "2", "--ttft-cases", "0", "--no-progress"]
    return cmds


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("entry_points")
    env = dict(os.environ, PYTHONPATH="", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")

    def run(item):
        (where, _), argv = item
        return item[0], subprocess.run([sys.executable, *argv], cwd=FOLDERS[where], env=env, capture_output=True,
                                       text=True, timeout=900)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(run, _commands(tmp).items()))


def _ok(results, key):
    out = results[key]
    assert out.returncode == 0, f"{key}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.parametrize("where", list(FOLDERS))
def test_generate_runs(results, where):
    assert "tokens 2" in _ok(results, (where, "generate"))


@pytest.mark.parametrize("where", list(FOLDERS))
def test_module_commands_print_their_help(results, where):
    assert "usage:" in _ok(results, (where, "quality --help"))
    assert "usage:" in _ok(results, (where, "serve --help"))


def test_the_quality_report_runs(results):
    out = _ok(results, ("root", "quality run"))
    assert "| full attention | 100.0% |" in out and "| fast |" in out, out


@pytest.mark.parametrize("where", list(FOLDERS))
@pytest.mark.parametrize("script", _scripts())
def test_benchmark_script_prints_its_help(results, where, script):
    assert "usage:" in _ok(results, (where, script)).lower()
