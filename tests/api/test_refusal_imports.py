"""Bad flags of the ``lazyllm`` commands refused before any heavy import: each command runs
in a fresh interpreter, and at its exit no torch, transformers, engine or ``LazyLLM`` module
has been imported, the status is 2 and stderr ends with one line naming the problem. The
time from the call to the refusal is asserted under 2 s; the import check is the guard that
does not depend on the machine's load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "lazyllm.api", "lazyllm.engine", "lazyllm.model", "lazyllm.quality.report",
         "lazyllm.integrations.server.app")
# runs ``lazyllm.cli.main(argv)`` and reports, at exit, the heavy modules imported and the time taken
RUNNER = """
import json, sys, time
t0 = time.perf_counter()
code = None
try:
    from lazyllm.cli import main
    code = main(json.loads(sys.argv[1]))
except SystemExit as e:
    code = e.code
elapsed = time.perf_counter() - t0
heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print("REPORT " + json.dumps({"code": code, "elapsed": elapsed, "heavy": heavy}))
"""


def run_cli(argv: list[str]) -> tuple[dict, str, float]:
    """``(report, stderr, wall seconds)`` of ``lazyllm <argv>`` in a fresh interpreter."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(argv), json.dumps(HEAVY)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    line = [x for x in p.stdout.splitlines() if x.startswith("REPORT ")]
    assert line, (p.stdout, p.stderr)
    return json.loads(line[-1][7:]), p.stderr, wall


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A model folder as far as the checks read it (the default model's shape: 9 heads, 3 KV
    heads; no weights), documents for ``adapt`` and cases for the fidelity report."""
    d = tmp_path_factory.mktemp("refusals")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192)))
    (d / "docs.txt").write_text("\n\n".join(f"Document {i} says the code is {i * 7}." for i in range(8)))
    (d / "cases.jsonl").write_text(json.dumps({"question": "What is the code?", "documents": ["It is 7."]}) + "\n")
    return d


CASES = [
    ("serve-packets", lambda d: ["serve", "--packets", str(d / "missing.safetensors")], "no such packet file"),
    ("serve-kv-bytes", lambda d: ["serve", str(d / "model"), "--kv-cache-bytes", "10"], "smaller than one KV page"),
    ("serve-tensor-parallel", lambda d: ["serve", str(d / "model"), "--tensor-parallel", "2"],
     "--tensor-parallel 2: tensor_parallel=2 does not divide"),
    ("serve-default-max-tokens", lambda d: ["serve", "--default-max-tokens", "10000"],
     "--default-max-tokens 10000 is above --max-tokens-limit 4096"),
    ("serve-recompute-ratio", lambda d: ["serve", "--recompute-ratio", "2"], "recompute_ratio must be in [0, 1]"),
    ("adapt-k-header", lambda d: ["adapt", str(d / "docs.txt"), "--out", str(d / "p.safetensors"),
                                  "--k-header", "-1"], "k_header must be an int >= 0, got -1"),
    ("adapt-steps", lambda d: ["adapt", str(d / "docs.txt"), "--out", str(d / "p.safetensors"), "--steps", "0"],
     "steps must be an int >= 1, got 0"),
    ("quality-recompute-ratio", lambda d: ["quality", str(d / "cases.jsonl"), "--settings",
                                           'mine={"recompute_ratio": 2}'],
     "setting 'mine': recompute_ratio must be in [0, 1], got 2"),
]


@pytest.mark.parametrize("name,argv,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_flag_refused_before_heavy_imports(files, name, argv, needle):
    report, err, wall = run_cli(argv(files))
    print(f"{name}: refused in {report['elapsed']:.3f} s in process, {wall:.2f} s as a subprocess")
    assert report["code"] == 2, (report, err)
    assert report["heavy"] == [], f"imported before refusing: {report['heavy']}"
    last = err.strip().splitlines()[-1]
    assert needle in last and "Traceback" not in err, err
    assert report["elapsed"] < 2.0, report


def test_no_command_is_a_usage_error_and_version_works():
    report, err, _ = run_cli([])
    assert report["code"] == 2 and report["heavy"] == [] and "usage: lazyllm" in err
    p = subprocess.run([sys.executable, "-m", "lazyllm.cli", "--version"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("lazyllm "), p


def test_python_m_lazyllm_quality_refuses_before_heavy_imports(files):
    """The fidelity report's own entry point, ``python -m lazyllm.quality``, checks first too."""
    code = ("import runpy, sys, json\n"
            "try:\n    runpy.run_module('lazyllm.quality', run_name='__main__')\n"
            "except SystemExit as e:\n"
            f"    print('REPORT', e.code, json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))\n")
    p = subprocess.run([sys.executable, "-c", code, str(files / "cases.jsonl"), "--settings",
                        'mine={"recompute_ratio": 2}'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "REPORT 2 []" in p.stdout, (p.stdout, p.stderr)
    assert "recompute_ratio must be in [0, 1], got 2" in p.stderr


def test_adapt_defaults_are_the_functions():
    """``lazyllm adapt`` shows the defaults of ``adapt`` (kept in the light checks module)."""
    import inspect

    from lazyllm.quality.adapt import adapt
    from lazyllm.quality.checks import ADAPT_DEFAULTS

    params = inspect.signature(adapt).parameters
    assert {k: params[k].default for k in ADAPT_DEFAULTS} == ADAPT_DEFAULTS
