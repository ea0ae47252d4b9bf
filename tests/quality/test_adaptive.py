"""Adaptive recompute's replay (``lazyllm.quality.adaptive``) and the first-token margin it
orders requests by."""
import math
import random

import pytest
import torch

from lazyllm.quality.adaptive import curve_markdown, escalation_curve
from lazyllm.quality.floor import within_floor
from lazyllm.quality.metrics import first_token_margin


def test_margin_is_the_gap_between_the_two_likeliest_tokens():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=g) * 3
        p = torch.softmax(logits.double(), -1).sort(descending=True).values
        assert math.isclose(first_token_margin(logits), float(p[0] - p[1]), rel_tol=1e-9, abs_tol=1e-12)
    assert first_token_margin(torch.tensor([2.0, 2.0, -1.0])) == 0.0
    assert first_token_margin(torch.tensor([50.0, 0.0, 0.0])) > 0.999


def _cases(n, seed):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.randint(1, 16)
        out.append(dict(id=f"c{i}", setting="s", margin=rnd.random(), kl=rnd.random() * 0.3, top1=rnd.random(),
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


def test_curve_refuses_cases_it_cannot_replay():
    with pytest.raises(ValueError, match="no cases"):
        escalation_curve(_cases(3, 0), "missing", {})
    cases = _cases(3, 0)
    cases[0]["margin"] = None
    with pytest.raises(ValueError, match="margin"):
        escalation_curve(cases, "s", {})
