"""``EngineMetrics``: typed counters, read as a read-only mapping too, and every counter the code
reads or writes is a field."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from lazyllm.engine.metrics import EngineMetrics

_ROOT = Path(__file__).resolve().parents[2]


def test_the_mapping_view_reads_the_fields():
    m = EngineMetrics()
    m.prefill_s += 0.5
    m.requests += 2
    assert m["prefill_s"] == 0.5 and m["requests"] == 2
    assert dict(m)["requests"] == 2 and set(m) == {f.name for f in dataclasses.fields(m)}
    assert len(m) == len(dataclasses.fields(m)) and m.get("nope", 7) == 7 and "decode_s" in m
    with pytest.raises(KeyError):
        m["nope"]
    with pytest.raises(TypeError):
        m["requests"] = 3  # read-only: writers set fields


def test_snapshot_and_restore():
    m = EngineMetrics(requests=3, decode_s=1.0)
    saved = m.snapshot()
    m.requests, m.decode_s = 10, 2.0
    assert saved.requests == 3
    m.restore(saved)
    assert m.requests == 3 and m.decode_s == 1.0


def _keys_in_use() -> set[str]:
    """String keys read from an engine's ``metrics`` anywhere (``metrics["k"]``, ``m["k"]`` after
    ``m = ....metrics``, ``metrics.get("k")``) and attributes written on it."""
    keys = set()
    files = [p for d in ("lazyllm", "benchmarks", "integrations", "tests/engine", "tests/server", "tests/cache")
             for p in (_ROOT / d).rglob("*.py")]
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                base = ast.unparse(node.value)
                if base.endswith("engine.metrics") or base in ("self.metrics", "op.metrics", "s.metrics"):
                    keys.add(node.slice.value)
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("self.metrics",) and \
                    isinstance(node.ctx, ast.Store):
                keys.add(node.attr)
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute) and \
                    ast.unparse(node.target.value) in ("self.metrics", "m"):
                keys.add(node.target.attr)
    return {k for k in keys if isinstance(k, str)}


def test_every_counter_in_use_is_a_field():
    used = _keys_in_use()
    fields = {f.name for f in dataclasses.fields(EngineMetrics)}
    assert {"requests", "prefill_s", "decode_steps", "cancelled", "disk_hits"} <= used
    assert used <= fields, used - fields
