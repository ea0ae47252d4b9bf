"""The quality benchmark's --quick slice: sanity of its measurements, and the configured
default setting against the benchmark's quality targets (``quality.THRESHOLDS``).

Runs the real default model on CPU (marked slow)."""
import math

import pytest

from tests.conftest import load_benchmark

pytestmark = pytest.mark.slow

quality = load_benchmark("quality")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "quick.json"
    res = quality.main(["--quick", "--quiet", "--json", str(out)])
    assert "error" not in res, res.get("error")
    assert out.exists()
    return res


def _rows(result):
    return {r["setting"]: r for r in result["results"]}


def test_full_attention_against_itself_is_exact(result):
    self_check = [r for r in result["results"] if r["is_reference"]]
    assert len(self_check) == 1
    r = self_check[0]
    assert r["top1"] == 1.0
    assert abs(r["kl"]) <= 1e-6 and r["kl_max"] <= 1e-6
    assert r["recompute_frac"] == 0.0


def test_every_setting_is_in_range(result):
    assert result["results"], "no setting was measured"
    for r in result["results"]:
        assert 0.0 <= r["top1"] <= 1.0, r["setting"]
        assert r["kl"] >= 0.0 and math.isfinite(r["kl"]), r["setting"]
        assert 0.0 <= r["greedy_match"] <= 1.0, r["setting"]
        assert r["needle_acc"] is None or 0.0 <= r["needle_acc"] <= 1.0, r["setting"]
        assert r["recompute_frac"] >= 0.0, r["setting"]
        assert r["tokens"] > 0 and r["ttft_ms"] > 0, r["setting"]
        # warmed chunks: without recovery nothing but the question and answer is prefilled
        if r["recovery"] == "none":
            assert r["uncached_prompts"] == 0, r["setting"]


def test_isolated_chunks_without_recovery_differ_from_full_attention(result):
    r = _rows(result)["lazy/isolated/none"]
    assert r["kl"] > 0.0
    assert r["top1"] < 1.0 or r["kl"] > 1e-4


def test_one_setting_is_the_default(result):
    assert [r["is_default"] for r in result["results"]].count(True) == 1, [r["setting"] for r in result["results"]]


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="no reusable setting meets the quality targets on the default model within the "
                          "recompute budget (BENCHMARKS.md, Quality)")
def test_default_setting_meets_quality_targets(result):
    """The setting ``LazyLLM()`` runs with against the quality targets on this slice (top-1
    agreement and KL against full attention, needles, within the recompute budget). It falls
    short today (BENCHMARKS.md, "Quality"): strict, so a default that meets them fails this
    test until the mark is removed."""
    d = next(r for r in result["results"] if r["is_default"])
    t = result["thresholds"]
    assert d["top1"] >= t["top1"], f"{d['setting']}: top-1 {d['top1']:.3f} < {t['top1']}"
    assert d["kl"] <= t["kl"], f"{d['setting']}: KL {d['kl']:.4f} > {t['kl']}"
    assert d["recompute_frac"] <= d["recompute_max"], \
        f"{d['setting']}: recomputes {d['recompute_frac']:.3f} of chunk tokens > {d['recompute_max']}"
    if d["needle_rel"] is not None:
        assert d["needle_rel"] >= t["needle_rel"], f"{d['setting']}: needle {d['needle_rel']:.3f} of full's"


def test_unsupported_model_is_reported(tmp_path, tokenizer):
    """A model lazyllm cannot run gives a clear 'not supported' result, not a traceback."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=512,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "r.json"
    res = quality.main(["--quick", "--quiet", "--model", str(tmp_path / "gpt2"), "--json", str(out)])
    assert res["unsupported"] is True
    assert "not supported" in res["error"] and "gpt2" in res["error"]
    assert out.exists()
