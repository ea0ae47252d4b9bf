"""Adaptive recompute's replay (``lazyllm.quality.adaptive``) and the first-token margin it
orders requests by."""
import math
import random

import pytest
import torch

from lazyllm.quality.adaptive import curve_markdown, escalation_curve, escalation_signal
from lazyllm.quality.floor import within_floor
from lazyllm.quality.metrics import answer_margins


def test_margin_is_the_gap_between_the_two_likeliest_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 50, generator=g) * 3
    got = answer_margins(logits)
    for row, m in zip(logits, got):
        p = torch.softmax(row.double(), -1).sort(descending=True).values
        assert math.isclose(m, float(p[0] - p[1]), rel_tol=1e-5, abs_tol=1e-6)
    assert answer_margins(torch.tensor([[2.0, 2.0, -1.0], [50.0, 0.0, 0.0]]))[0] == 0.0
    assert answer_margins(torch.tensor([[50.0, 0.0, 0.0]]))[0] > 0.999


def test_the_window_signal_stops_where_the_answer_leaves_full_attentions():
    c = dict(margin=0.9, margins=[0.9, 0.8, 0.05, 0.01, 0.7], first_miss=5)
    assert [escalation_signal(c, w) for w in (1, 2, 3, 4, 8)] == [0.9, 0.8, 0.05, 0.01, 0.01]
    # the answer leaves full attention's at its second token: later margins are not its own
    c = dict(c, first_miss=1)
    assert [escalation_signal(c, w) for w in (1, 2, 3, 8)] == [0.9, 0.8, 0.8, 0.8]


def _cases(n, seed):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.randint(1, 16)
        margins = [rnd.random() for _ in range(k)]
        out.append(dict(id=f"c{i}", setting="s", margin=margins[0], margins=margins,
                        first_miss=rnd.randint(0, k), kl=rnd.random() * 0.3, top1=rnd.random(),
                        same_answer=rnd.random() < 0.5, recomputed=rnd.randint(0, 50),
                        chunk_tokens=rnd.randint(200, 600), ids=list(range(k))))
        out.append(dict(out[-1], setting="other", margin=0.0))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_curve_replays_full_attention_for_the_lowest_margins(seed):
    cases = _cases(40, seed)
    mine = [c for c in cases if c["setting"] == "s"]
    floor = dict(pairs=10, top1=0.9, kl=0.05, same_answer=0.5)
    pts = escalation_curve(cases, "s", floor, fractions=(0.0, 0.25, 1.0))
    # nothing escalated: the setting's own token-weighted means
    tok = sum(len(c["ids"]) for c in mine)
    assert math.isclose(pts[0]["kl"], sum(c["kl"] * len(c["ids"]) for c in mine) / tok)
    assert pts[0]["same_answer_n"] == sum(c["same_answer"] for c in mine)
    assert pts[0]["recomputed"] == sum(c["recomputed"] for c in mine) / sum(c["chunk_tokens"] for c in mine)
    # a quarter escalated: exactly the ten lowest margins answer as full attention does
    low = sorted(mine, key=lambda c: c["margin"])[:10]
    ids = {c["id"] for c in low}
    kept = [c for c in mine if c["id"] not in ids]
    assert pts[1]["escalated_n"] == 10 and pts[1]["threshold"] == low[-1]["margin"]
    assert math.isclose(pts[1]["kl"], sum(c["kl"] * len(c["ids"]) for c in kept) / tok)
    assert pts[1]["same_answer_n"] == 10 + sum(c["same_answer"] for c in kept)
    rec = sum(c["chunk_tokens"] for c in low) + sum(c["recomputed"] for c in kept)
    assert math.isclose(pts[1]["recomputed"], rec / sum(c["chunk_tokens"] for c in mine))
    # all escalated: full attention's own figures, inside the floor
    assert (pts[2]["kl"], pts[2]["top1"], pts[2]["same_answer"], pts[2]["recomputed"]) == (0.0, 1.0, 1.0, 1.0)
    assert pts[2]["inside"] == within_floor(pts[2], floor) is True
    table = curve_markdown(pts)
    assert table.count("\n") == 4 and "25% (10)" in table


@pytest.mark.parametrize("window", [2, 4, 16])
def test_a_window_orders_cases_by_their_window_signal(window):
    cases = _cases(40, window)
    mine = [c for c in cases if c["setting"] == "s"]
    pts = escalation_curve(cases, "s", {}, fractions=(0.0, 0.25), window=window)
    low = sorted(mine, key=lambda c: escalation_signal(c, window))[:10]
    assert pts[1]["threshold"] == escalation_signal(low[-1], window) and pts[1]["window"] == window
    assert pts[1]["same_answer_n"] == 10 + sum(c["same_answer"] for c in mine if c not in low)
    del mine[0]["margins"]
    with pytest.raises(ValueError, match="margins"):
        escalation_curve(cases, "s", {}, window=window)


def test_curve_refuses_cases_it_cannot_replay():
    with pytest.raises(ValueError, match="no cases"):
        escalation_curve(_cases(3, 0), "missing", {})
    cases = _cases(3, 0)
    cases[0]["margin"] = None
    with pytest.raises(ValueError, match="margin"):
        escalation_curve(cases, "s", {})
