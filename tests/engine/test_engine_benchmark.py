"""benchmarks/engine.py run whole on CPU (``--dry-run``: a tiny random model, small batches):
every row it prints is measured, the sampled batch row included, through the public API."""
import math

from tests.conftest import load_benchmark


def test_dry_run_measures_every_row(tmp_path):
    res = load_benchmark("engine").main(["--dry-run", "--json", str(tmp_path / "engine.json")])
    assert (tmp_path / "engine.json").exists()
    for key in ("warm_ttft_ms", "cold_ttft_ms", "decode_b1_step_ms", "decode_b4_step_ms",
                "decode_b4_distinct_step_ms", "decode_b4_sampled_step_ms", "decode_b4_sampled_ms"):
        assert math.isfinite(res[key]) and res[key] > 0, key
    # steps with all four sampled requests decoding were timed, and the seeds gave the
    # requests different continuations
    assert res["decode_b4_sampled_steps"] > 0
    assert res["decode_b4_sampled_distinct_outputs"] > 1
    assert res["cached_tokens"] > 0 and res["suffix_tokens"] > 0
