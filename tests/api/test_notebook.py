"""The example notebook runs top to bottom (nbclient, CPU, offline: HTTP(S) goes nowhere).

The kernel is this interpreter (the ``kernel_name`` fixture of tests/conftest.py).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"

pytestmark = pytest.mark.slow


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
