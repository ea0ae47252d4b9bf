"""The serving benchmark itself, run small on CPU with the default model: every system
answers and the figures are sane."""
import math

import pytest


@pytest.mark.slow
def test_rag_serving_ci_preset(tmp_path):
    import sys

    sys.path.insert(0, "benchmarks")
    import rag_serving

    rows = rag_serving.main(["--preset", "ci", "--systems", "lazy,block,none,hf", "--budgets", "1.0",
                             "--requests", "4", "--json", str(tmp_path / "r.json"), "--plots", str(tmp_path)])
    by = {r["system"]: r for r in rows}
    assert set(by) == {"lazy", "block", "none", "hf"}
    for r in rows:
        assert r["requests"] == 4 and r["failed"] == 0, r
        assert r["ttft_p50_ms"] > 0 and r["req_per_s"] > 0 and r["out_tok_per_s"] > 0
        assert r["ttft_p95_ms"] >= r["ttft_p50_ms"]
        assert 0.0 <= r["hit_rate"] <= 1.0
    # chunk reuse prefills fewer tokens than recomputing everything, which equals transformers' work
    assert by["lazy"]["prefill_tokens"] < by["none"]["prefill_tokens"]
    assert by["none"]["prefill_tokens"] == by["hf"]["prefill_tokens"]
    assert by["lazy"]["hit_rate"] > 0 and by["none"]["hit_rate"] == 0
    assert not math.isnan(by["lazy"]["peak_kv_gib"]) and by["lazy"]["peak_kv_gib"] > 0
    for name in ("ttft_vs_rate.png", "throughput_vs_budget.png", "hit_rate_vs_budget.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "r.json").exists()
