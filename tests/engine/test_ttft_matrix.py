"""benchmarks/ttft_matrix.py on CPU with tiny shapes: every figure of the sampled cells is
measured, the comparison ranks cells by their ratio, and two sides take turns in order."""
import json
import math
import threading

from tests.conftest import load_benchmark

CELLS = "B;q8-n1-L128-cold-after-t4-default;q50-n4-L512-cached-alone-t1-default"


def test_tiny_matrix_measures_each_cell_and_compares(tmp_path):
    m = load_benchmark("ttft_matrix")
    out = tmp_path / "new.json"
    res = m.main(["--tiny", "--device", "cpu", "--cells", CELLS, "--reps", "1", "--json", str(out)])
    assert list(res["cells"]) == CELLS.split(";")
    b = res["cells"]["B"]["passes"][0]
    for k in ("engine_ms", "call_ms", "engine2_ms", "call2_ms", "cold_engine_ms", "cold_call_ms"):
        assert math.isfinite(b[k]) and b[k] > 0, k
    assert b["engine2_ms"] > b["engine_ms"] and b["call_ms"] >= b["engine_ms"]
    one = res["cells"]["q50-n4-L512-cached-alone-t1-default"]["passes"][0]
    assert "engine2_ms" not in one and one["engine_ms"] > 0  # one token: no second
    # the same file against a copy with one cell twice as slow: that cell first, ratio 2
    slow = json.loads(out.read_text())
    slow["cells"]["q8-n1-L128-cold-after-t4-default"]["passes"][0]["engine_ms"] *= 2
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    rows = m.main(["--compare", str(out), str(tmp_path / "slow.json")])
    assert rows[0]["cell"] == "q8-n1-L128-cold-after-t4-default" and rows[0]["engine_ms"][2] == 2.0
    assert all(r["engine_ms"][2] == 1.0 for r in rows[1:])


def test_sample_keeps_b_and_the_anchors():
    m = load_benchmark("ttft_matrix")
    names = m.choose("6", ["default"])
    assert names[0] == "B" and len(names) == 7 and len(set(names)) == 7
    assert all(f"{a}-default" in names for a in m.ANCHORS)
    assert all(m.Cell.parse(n).name == n for n in names[1:])
    assert len(m.grid(["default"])) == 3 * 4 * 3 * 2 * 2 * 3


def test_two_sides_take_turns(tmp_path):
    m = load_benchmark("ttft_matrix")
    log, items = [], 3

    def side(name):
        t = m.Turns(str(tmp_path), name, timeout_s=30)
        t.items = items
        t.ready()
        for item in range(2 * items):  # two passes
            s = t.slot(item)
            assert t.wait(s)
            log.append((item, name))
            t.done(s)

    threads = [threading.Thread(target=side, args=(s,)) for s in ("new", "old")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    first = ["old"] * items + ["new"] * items  # old first in the first pass, new in the second
    assert log == [x for i in range(2 * items) for x in ((i, first[i]), (i, "new" if first[i] == "old" else "old"))]
