"""The README is a newcomer's page: short, and its snippets run exactly as printed, in a Jupyter
kernel started at the repository's root (where a notebook user starts one). BENCHMARKS.md holds
current figures only, and every command in it names a file that exists."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
# a path in the tree as a command or a link names it
TREE_PATH = re.compile(r"(?<![\w./-])((?:benchmarks|examples|scripts|tests|lazyllm|kernels|integrations|docs)"
                       r"/[\w./-]*\.(?:py|sh|md|jsonl|ipynb|json|png))")


def snippets(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def test_readme_and_benchmarks_stay_small():
    assert len(README.read_bytes()) <= 12 * 1024
    assert len(BENCHMARKS.read_bytes()) <= 40 * 1024


@pytest.mark.parametrize("doc", ["BENCHMARKS.md", "README.md", "docs/guide.md"])
def test_every_file_a_document_names_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    named = set(TREE_PATH.findall(text))
    assert named, "no path found: the pattern no longer matches the document"
    # a removed study's figures cite it as "at commit SHA with `benchmarks/NAME.py`"
    # (tests/install/test_benchmark_commands.py checks that commit)
    missing = sorted(p for p in named if not (ROOT / p).exists() and not (ROOT / doc).parent.joinpath(p).exists()
                     and not re.search(rf"commit\s+[0-9a-f]{{7,40}}\s+with\s+`{re.escape(p)}", text))
    assert not missing, f"{doc} names files that do not exist: {missing}"


@pytest.mark.slow
def test_readme_snippets_run_as_printed_in_a_kernel_at_the_root(kernel_name):
    code = snippets(README)
    assert len(code) >= 2
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in code])
    NotebookClient(nb, kernel_name=kernel_name, timeout=600, resources={"metadata": {"path": str(ROOT)}}).execute()
    errors = [o for c in nb.cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for c in nb.cells for o in c.outputs if o.output_type == "stream")
    assert "ms to the first token" in text and "'hit_rate'" in text
    # the second request reused both documents: cache_stats counts the hits
    stats = text.split("{'hits': ", 1)[1]
    assert int(stats.split(",", 1)[0]) >= 2
