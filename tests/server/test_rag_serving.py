"""The serving benchmark itself, run small on CPU with the default model: every system
answers, the figures are sane, and block's re-rotated copies cost cache capacity."""
import json
import math

import pytest

from tests.conftest import load_benchmark

rag_serving = load_benchmark("rag_serving")


def test_arrivals_offer_exactly_the_nominal_rate():
    a = rag_serving.arrivals(20, 4.0, "s")
    assert a == sorted(a) and a[0] > 0
    assert a[-1] == pytest.approx(20 / 4.0)
    assert a == rag_serving.arrivals(20, 4.0, "s")  # seeded


def test_finish_rate_is_the_completion_slope():
    assert rag_serving.finish_rate([1 + 0.25 * i for i in range(12)], 0.0) == pytest.approx(4.0)
    # slow first and last requests move it less than they move (n-1) / span; one completion: the fallback
    noisy = [0.5] + [1 + 0.25 * i for i in range(1, 11)] + [4.5]
    assert abs(rag_serving.finish_rate(noisy, 0.0) - 4) < abs(11 / (4.5 - 0.5) - 4)
    assert rag_serving.finish_rate([3.0], 7.0) == 7.0


def test_per_alpha_specs():
    assert rag_serving.per_alpha("1,2", [2.1, 0.0]) == {2.1: [1.0, 2.0], 0.0: [1.0, 2.0]}
    assert rag_serving.per_alpha("2.1=0,4;0=", [2.1, 0.0]) == {2.1: [0.0, 4.0], 0.0: []}
    assert rag_serving.per_alpha("2.1=0,4;0=1;2.1@0.12=0", [2.1, 0.0]) == {2.1: [0.0, 4.0], 0.0: [1.0],
                                                                           (2.1, 0.12): [0.0]}
    with pytest.raises(SystemExit):
        rag_serving.per_alpha("2.1=1", [2.1, 0.0])


def test_prefix_mode_chunk_hits_are_the_chunk_part_of_the_cached_prefix():
    segs = [("prefix", [1] * 10), ("chunk", [2] * 20), ("chunk", [3] * 20), ("suffix", [4] * 5)]
    assert rag_serving.chunk_tokens_of(segs) == 40
    assert rag_serving.cached_chunk_tokens_of_prefix(segs, 8) == 0
    assert rag_serving.cached_chunk_tokens_of_prefix(segs, 32) == 22
    assert rag_serving.cached_chunk_tokens_of_prefix(segs, 55) == 40


def _row(system, rate, p50, p95, finish, hit=0.5, failed=0, budget=0.33, alpha=2.1):
    return dict(system=system, rate=rate, alpha=alpha, budget=budget, ttft_p50_ms=p50, ttft_p95_ms=p95,
                finish_rate=finish, req_per_s=finish if rate == 0 else min(rate, finish), failed=failed,
                requests=10, chunk_tokens=1000, cached_chunk_tokens=int(1000 * hit), hit_rate=hit)


def test_sustained_and_summary():
    rows = [
        _row("block", 2, 100, 200, 2.0, hit=0.4), _row("block", 4, 300, 500, 3.8, hit=0.4),
        _row("block", 8, 2000, 5000, 5.0, hit=0.4),  # finish rate below 90% of 8, p95 exploded
        _row("block", 0, 900, 1500, 5.2, hit=0.4),
        _row("lazy", 2, 50, 90, 2.0, hit=0.8), _row("lazy", 4, 60, 110, 4.0, hit=0.8),
        _row("lazy", 8, 80, 200, 7.5, hit=0.8), _row("lazy", 0, 200, 400, 9.0, hit=0.8),
        _row("hf", 0, 5000, 9000, 0.5, budget=1.0),
    ]
    rag_serving.mark_sustained(rows, 3.0)
    assert [r["sustained"] for r in rows[:4]] == [True, True, False, None]
    assert [r["sustained"] for r in rows[4:8]] == [True, True, True, None]
    s, hf = rag_serving.summarize(rows)
    assert s["block_max_sustained_rate"] == 4 and s["lazy_max_sustained_rate"] == 8
    assert s["at_block_max"]["ttft_p50_ratio"] == pytest.approx(5.0)
    assert s["sustained_throughput_ratio"] == pytest.approx(7.5 / 3.8)
    assert s["closed_loop"]["throughput_ratio"] == pytest.approx(9.0 / 5.2)
    assert s["hit_rate_ratio"] == pytest.approx(2.0)
    assert hf["vs"] == "hf" and hf["throughput_ratio"] == pytest.approx(18.0)
    assert hf["ttft_p50_ratio"] == pytest.approx(25.0)
    # the highest sustained rate is the top of the sustained run from the lowest rate up
    rows[1]["sustained"] = False
    assert rag_serving.summarize(rows)[0]["block_max_sustained_rate"] == 2


@pytest.mark.slow
def test_block_copies_cost_cache_capacity(tmp_path):
    """One request at a time (deterministic), uniform popularity, a pool that holds every
    document and one request's private pages but not block's re-rotated copies as well:
    block's copies evict cached documents, so its chunk hit rate is lower."""
    rows, summary = rag_serving.main(["--docs", "6", "--doc-tokens", "48", "--k", "2", "--requests", "8",
                                      "--output-tokens", "2", "--concurrency", "1", "--warm-requests", "4",
                                      "--alphas", "0", "--budgets", "1.4", "--systems", "lazy,block", "--rates", "0"])
    by = {r["system"]: r for r in rows}
    assert by["lazy"]["failed"] == by["block"]["failed"] == 0
    assert by["block"]["copied_gib"] > 0 and by["lazy"]["copied_gib"] == 0
    assert by["block"]["evictions"] > by["lazy"]["evictions"]
    assert by["lazy"]["hit_rate"] >= 1.3 * by["block"]["hit_rate"] > 0
    assert by["block"]["prefill_tokens"] > by["lazy"]["prefill_tokens"]
    assert summary[0]["hit_rate_ratio"] == pytest.approx(by["lazy"]["hit_rate"] / by["block"]["hit_rate"])


@pytest.mark.slow
def test_rag_serving_ci_preset(tmp_path):
    """Closed loop and Poisson, Zipf and uniform, JSON and plots (block runs above)."""
    rows, summary = rag_serving.main([
        "--preset", "ci", "--systems", "lazy,none,hf", "--budgets", "1.0", "--requests", "3",
        "--alphas", "2.1,0", "--rates", "2.1=0,6;0=6", "--hf-rates", "2.1=0;0=",
        "--json", str(tmp_path / "r.json"), "--plots", str(tmp_path)])
    assert {(r["system"], r["alpha"], r["rate"]) for r in rows} == (
        {(s, a, r) for s in ("lazy", "none") for a, r in ((2.1, 0), (2.1, 6), (0.0, 6))} | {("hf", 2.1, 0)})
    for r in rows:
        assert r["requests"] == 3 and r["failed"] == 0, r
        assert r["ttft_p50_ms"] > 0 and r["req_per_s"] > 0 and r["out_tok_per_s"] > 0 and r["finish_rate"] > 0
        assert r["ttft_p95_ms"] >= r["ttft_p50_ms"]
        assert 0.0 <= r["hit_rate"] <= 1.0 and 0.0 <= r["prompt_hit_rate"] <= 1.0
        assert r["sustained"] is None if r["rate"] == 0 else r["sustained"] in (True, False)
    by = {(r["system"], r["alpha"], r["rate"]): r for r in rows}
    # chunk reuse prefills fewer tokens than recomputing everything, which equals transformers' work
    assert by["lazy", 2.1, 0]["prefill_tokens"] < by["none", 2.1, 0]["prefill_tokens"]
    assert by["none", 2.1, 0]["prefill_tokens"] == by["hf", 2.1, 0]["prefill_tokens"]
    assert by["lazy", 2.1, 0]["hit_rate"] > 0 and by["none", 2.1, 0]["hit_rate"] == 0
    assert by["lazy", 2.1, 0]["copied_gib"] == 0
    assert not math.isnan(by["lazy", 2.1, 0]["peak_kv_gib"]) and by["lazy", 2.1, 0]["peak_kv_gib"] > 0
    assert [(s["alpha"], s["vs"]) for s in summary] == [(2.1, "hf")]  # no block: no lazy/block summary
    for name in ("ttft_vs_rate.png", "throughput_vs_budget.png", "hit_rate_vs_budget.png"):
        assert (tmp_path / name).stat().st_size > 1000
    saved = json.loads((tmp_path / "r.json").read_text())
    assert len(saved["rows"]) == len(rows) and len(saved["summary"]) == len(summary)


@pytest.mark.slow
def test_deadline_skips_and_lists_points(tmp_path):
    rows, summary = rag_serving.main(["--preset", "ci", "--systems", "lazy,hf", "--budgets", "1.0", "--requests", "2",
                                      "--rates", "0,5", "--deadline-s", "0", "--json", str(tmp_path / "r.json")])
    assert rows == [] and summary == []
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["skipped"] == ["lazy alpha=2.1 budget=1.0 rate=0", "lazy alpha=2.1 budget=1.0 rate=5",
                                "hf alpha=2.1 rate=0", "hf alpha=2.1 rate=5"]
