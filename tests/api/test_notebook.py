"""The example notebook runs top to bottom (nbclient, CPU, offline: HTTP(S) goes nowhere).

The kernel is this interpreter, whatever kernelspecs the machine has: the test writes a
kernelspec pointing at ``sys.executable`` into a temporary Jupyter path, so it works in a
fresh virtual environment with only ``ipykernel`` installed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"
KERNEL = "lazyllm-test-python"

pytestmark = pytest.mark.slow


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lazyllm tests", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # offline: any HTTP(S) request (a model download, telemetry) goes to a closed local port
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.setenv("no_proxy", "")
    return KERNEL


def test_notebook_runs(kernel_name):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, kernel_name=kernel_name, timeout=600,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "cold:" in text and "warm:" in text and "pre-warmed:" in text
    assert "warming chunks" in text  # the warm-up progress bar
    assert "Warning" not in text  # no deprecated API, no library warnings
    # retrieval through langchain-chroma's vector store, embedded with the bundled MiniLM
    code = "".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "from langchain_chroma import Chroma" in code and "BundledMiniLMEmbeddings()" in code
    assert "ChromaRetriever" not in code
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the TTFT plot
    assert any("| query |" in o.get("data", {}).get("text/markdown", "") for o in outputs)  # results table
    # the warm query reused chunks: parse the printed cached count
    warm = text.split("warm:", 1)[1]
    cached = int(warm.split("cached ", 1)[1].split(",", 1)[0])
    assert cached > 0
