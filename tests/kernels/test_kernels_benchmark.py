"""benchmarks/kernel_bench.py: the tables it derives (each row against the strongest baseline),
and the whole script on CPU (``--dry-run``: Triton's interpreter, tiny shapes)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _prefill_row(flash_graph, flash, cudnn_causal, ours=(0.10, 0.09), norope=(0.088, 0.089), nomask=0.07):
    """A prefill row as ``run_prefill`` records it (times in ms), for 512 new tokens over 4k keys."""
    return dict(kind="prefill", q=512, kv=4096, kernel="gluon", flops=4 * 32 * 128 * (512 * 3584 + 512 * 513 / 2),
                ms_rope=0.3, ms_norope=0.11, ms_rope_pretable=0.1, ms_sdpa=flash, ms_sdpa_graph=flash_graph,
                ms_cudnn=cudnn_causal, ms_cudnn_nomask=nomask, err_cudnn=3e-3, err_ref=3e-3, nan=False,
                ms_rope_graph=ours[0], ms_rope_graph2=ours[1], ms_norope_graph=norope[0], ms_norope_graph2=norope[1])


@pytest.mark.parametrize("times,name", [((0.11, 0.12, 0.13), "flash, graph"), ((0.12, 0.11, 0.13), "flash, do_bench"),
                                        ((0.13, 0.12, 0.11), "cuDNN causal")])
def test_a_prefill_row_names_its_strongest_causal_baseline(times, name):
    bk = load_benchmark("kernel_bench")
    r = bk.derived(_prefill_row(*times))
    assert r["best_causal_sdpa"] == name and r["ms_best_causal_sdpa"] == pytest.approx(0.11)
    assert r["ms_rope_graph_min"] == pytest.approx(0.09)  # the lower of the two readings
    assert r["vs_best_causal_sdpa"] == pytest.approx(0.11 / 0.09)
    # ours on the causal pairs against cuDNN unmasked on all pairs, both as FLOP rates
    ours_rate = r["flops"] / 0.09
    theirs = 4 * 32 * 128 * 512 * 4096 / 0.07
    assert r["rate_vs_cudnn_nomask"] == pytest.approx(ours_rate / theirs)
    assert r["rope_cost_graph"] == pytest.approx(0.09 / 0.088 - 1)
    md = bk.markdown(dict(device="H200", torch="2", triton="3", date="d", page_size=64, copy_tbs=4.2), [r])
    line = next(ln for ln in md.splitlines() if ln.startswith("| 512 | 4096 | Gluon |"))
    assert f"| {name} | 0.1100 |" in line and f"| {100 * ours_rate / theirs:.0f}% |" in line


def test_a_row_without_graph_timings_gets_no_baseline_comparison():
    bk = load_benchmark("kernel_bench")
    row = _prefill_row(0.11, 0.12, 0.13)
    for k in ("ms_rope_graph", "ms_rope_graph2", "ms_norope_graph", "ms_norope_graph2"):
        del row[k]
    r = bk.derived(row)
    assert "best_causal_sdpa" not in r and "rate_vs_cudnn_nomask" not in r
    md = bk.markdown(dict(device="H200", torch="2", triton="3", date="d", page_size=64, copy_tbs=4.2), [r])
    assert "Against the strongest baseline" not in md


def test_dry_run_checks_every_kernel_against_the_reference(tmp_path):
    """The GPU benchmark script end to end on CPU: every prefill and decode row agrees with the
    float32 reference, and the re-rotation copy with torch."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_bench.py"), "--dry-run", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("prefill") == 2 and kinds.count("decode") == 2 and kinds.count("rerotate") == 1
    for r in rows:
        assert "error" not in r, r
        if r["kind"] in ("prefill", "decode"):
            assert r["err_ref"] < 1e-2 and not r["nan"], r
        else:
            assert r["v_equal"] and r["err_k"] < 1e-2, r
    assert (tmp_path / "kernels.md").read_text().count("| 16 | 600 |") >= 1


@pytest.mark.parametrize("graph,do_bench", [(0.06, 0.07), (0.08, 0.07)])
def test_cudnn_unmasked_is_taken_at_its_faster_reading(graph, do_bench):
    """The FA3-class reference is cuDNN unmasked at the faster of its CUDA-graph and do_bench
    readings (a graph keeps K/V in L2 as ours does), and the same for cuDNN causal."""
    bk = load_benchmark("kernel_bench")
    row = dict(_prefill_row(0.2, 0.2, 0.2, nomask=do_bench), ms_cudnn_nomask_graph=graph, ms_cudnn_graph=0.15)
    r = bk.derived(row)
    best = min(graph, do_bench)
    assert r["ms_cudnn_nomask_best"] == pytest.approx(best)
    assert r["rate_vs_cudnn_nomask"] == pytest.approx((r["flops"] / 0.09) / (4 * 32 * 128 * 512 * 4096 / best))
    assert r["best_causal_sdpa"] == "cuDNN causal, graph" and r["ms_best_causal_sdpa"] == pytest.approx(0.15)
    md = bk.markdown(dict(device="H200", torch="2", triton="3", date="d", page_size=64, copy_tbs=4.2), [r])
    line = next(ln for ln in md.splitlines() if ln.startswith("| 512 | 4096 | Gluon |"))
    assert f"| {best:.4f} |" in line
