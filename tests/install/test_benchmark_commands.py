"""Every benchmark command the documents print runs as printed, up to its arguments: the script
exists, and its argument parser accepts the flags and values the document gives (a shell
script: it exists, and ``gpu_run.sh``'s targets are ones it knows). ``[...]`` marks an
optional part and is read as given; ``# ...`` is a comment.

The commands are parsed in one interpreter: each script runs as ``__main__`` with its
``ArgumentParser.parse_args`` replaced by one that stops the script once the real parse
succeeds, so nothing is measured."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["BENCHMARKS.md", "README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# a command line: optional VAR=value words and a timer, then the interpreter and a benchmark
COMMAND = re.compile(r"^\s*(?:[A-Z_]+=\S+\s+)*(?:/usr/bin/time -v\s+)?(?:\.venv/bin/python|python3?|bash)\s+"
                     r"(benchmarks/\w+\.(?:py|sh))(.*)$")

CHECK = r'''
import argparse, json, os, runpy, sys

class Parsed(BaseException):
    pass

real = argparse.ArgumentParser.parse_args

def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
results = {}
for key, script, argv in json.loads(sys.argv[1]):
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
        results[key] = "ran past its argument parser"
    except Parsed:
        results[key] = "ok"
    except SystemExit as e:
        results[key] = f"exit {e.code}"
    finally:
        sys.path.pop(0)
print("RESULTS " + json.dumps(results))
'''


def commands() -> list[tuple[str, str, list[str]]]:
    """``(where, script, argv)`` of every benchmark command line in the documents."""
    out = []
    for doc in DOCS:
        lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            line, n = lines[i], i
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            m = COMMAND.match(line)
            if not m:
                continue
            rest = m.group(2)
            while True:  # a quoted argument may go on over the next lines
                try:
                    argv = shlex.split(rest.split(" #", 1)[0].replace("[", " ").replace("]", " "))
                    break
                except ValueError:
                    if i >= len(lines):
                        raise
                    rest, i = rest + " " + lines[i].strip(), i + 1
            out.append((f"{doc}:{n + 1}", m.group(1), argv))
    return out


def test_the_documents_print_benchmark_commands():
    scripts = {s for _, s, _ in commands()}
    assert len(commands()) >= 20 and {"benchmarks/engine.py", "benchmarks/ttft_matrix.py",
                                      "benchmarks/quality.py"} <= scripts, scripts


def test_every_printed_benchmark_command_names_a_script_and_its_flags_parse():
    cmds = commands()
    missing = [(w, s) for w, s, _ in cmds if not (ROOT / s).is_file()]
    assert not missing, f"commands name scripts that do not exist: {missing}"
    # the script's case patterns (`serving)`, `tests|tests=*)`), not the catch-all `*)`
    labels = re.findall(r"^\s+(\w[\w|=*-]*)\)", (ROOT / "benchmarks/gpu_run.sh").read_text(), re.M)
    targets = [t for label in labels for t in label.split("|")]
    assert {"tests", "tests=*", "serving"} <= set(targets), targets
    bad = [(w, a) for w, s, argv in cmds if s.endswith("gpu_run.sh") for a in argv
           if not any(fnmatchcase(a, t) for t in targets)]
    assert not bad, f"gpu_run.sh has no such target: {bad}"
    py = [(w, str(ROOT / s), argv) for w, s, argv in cmds if s.endswith(".py")]
    r = subprocess.run([sys.executable, "-c", CHECK, json.dumps(py)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line, r.stdout[-2000:] + r.stderr[-4000:]
    results = json.loads(line[len("RESULTS "):])
    failed = {w: f"{res}: {' '.join(argv)}" for w, _, argv in py for res in [results.get(w)] if res != "ok"}
    assert not failed, f"{failed}\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("doc", ["BENCHMARKS.md", "docs/fidelity.md"])
def test_a_removed_study_is_cited_with_the_commit_it_ran_at(doc):
    """A benchmark script a document names that no longer exists is named as "at commit SHA
    with `benchmarks/NAME.py ...`", and the file is in that commit (where git history is)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w./-])(benchmarks/\w+\.py)", text))
    gone = sorted(p for p in named if not (ROOT / p).exists())
    has_git = (ROOT / ".git").exists()
    for p in gone:
        shas = re.findall(rf"commit\s+([0-9a-f]{{7,40}})\s+with\s+`{re.escape(p)}", text)
        assert shas, f"{doc} names {p}, which does not exist, without 'at commit SHA with `{p}`'"
        if has_git:
            for sha in shas:
                r = subprocess.run(["git", "cat-file", "-e", f"{sha}:{p}"], cwd=ROOT, capture_output=True)
                assert r.returncode == 0, f"{p} is not in commit {sha}"
