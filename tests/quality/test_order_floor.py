"""The order floor of the fidelity report: full attention in other orders of each case's
documents, the ratios to it, the KL to the order-mean, and the rule that chooses defaults
(tiny random model, CPU)."""
import math

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm import quality as q
from lazyllm.quality.floor import kl_from_mean, mean_log_probs, other_orders, ratios
from tests.conftest import make_tiny

DOCS = ["The lighthouse on the north cape was lit in 1887 and its lamp reaches 19 miles. " * 3,
        "Cobalt oxide colours the island's glass blue, and copper colours it green. " * 3,
        "The cog railway climbs to a station at 2,900 metres, open from June to September. " * 3]


def test_other_orders_are_distinct_and_never_the_case_order():
    assert other_orders(1, 4) == [] and other_orders(2, 4) == [(1, 0)]
    assert len(other_orders(3, 10)) == 5  # 3! - 1
    for n in (3, 4, 6):
        perms = other_orders(n, 4, seed=7)
        assert len(perms) == 4 and len(set(perms)) == 4 and tuple(range(n)) not in perms
        assert all(sorted(p) == list(range(n)) for p in perms)
        assert perms == other_orders(n, 4, seed=7) and perms[0] == tuple(reversed(range(n)))


def test_order_mean_is_a_distribution_and_kl_from_it():
    a, b = torch.randn(3, 50), torch.randn(3, 50)
    m = mean_log_probs([a, b])
    assert torch.allclose(m.exp().sum(-1), torch.ones(3), atol=1e-5)
    manual = ((a.softmax(-1) + b.softmax(-1)) / 2).log()
    assert torch.allclose(m, manual, atol=1e-5)
    assert max(kl_from_mean(mean_log_probs([a]), a)) < 1e-6 and min(kl_from_mean(m, a)) > 0


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return make_tiny("llama"), tokenizer


def test_floor_is_full_attention_in_other_orders(tiny):
    hf, tok = tiny
    cases = [dict(question="When was the lighthouse lit?", documents=DOCS),
             dict(question="What colours the glass green?", documents=DOCS[::-1])]
    rep = q.compare(LazyLLM(model=hf, tokenizer=tok, reuse="none", kv_cache_bytes=16 << 20, progress=False,
                            quality="isolated"), cases,
                    settings=["default"], progress=False, ttft_cases=0, answer_tokens=6, orders=2, workers=1)
    f = rep.floor
    assert f["pairs"] == 4 and f["orders"] == 2 and 0.0 <= f["top1"] <= 1.0 and f["kl"] > 0.0
    # the same measure taken by hand for the first case: its answer, then the two other orders
    full = LazyLLM(model=hf, tokenizer=tok, reuse="none", kv_cache_bytes=16 << 20, progress=False, quality="isolated")
    c = cases[0]
    ids = list(full.generate(c["question"], chunks=c["documents"], max_new_tokens=6).token_ids)
    ref = full.score(c["question"], chunks=c["documents"], continuation=ids, return_logits=True).logits
    kls, logits = [], [ref]
    for perm in other_orders(3, 2, seed=0):
        lg = full.score(c["question"], chunks=[c["documents"][j] for j in perm], continuation=ids,
                        return_logits=True).logits
        kl, _ = q.kl_and_agreement(ref, lg)
        kls.append(sum(kl) / len(kl))
        logits.append(lg)
    full.close()
    ref_case = [pc for pc in rep.cases if pc["setting"] == q.REFERENCE_NAME][0]
    assert math.isclose(ref_case["floor"]["kl"] / 2, sum(kls) / 2, rel_tol=1e-4)
    km = kl_from_mean(mean_log_probs(logits), ref)
    assert math.isclose(ref_case["kl_mean"], sum(km) / len(km), rel_tol=1e-4)
    d = rep.row("default")
    assert d["kl_mean"] is not None and d["kl_mean"] >= 0.0
    md = rep.floor_markdown()
    assert f"| default | {ratios(d, f)['top1']:.2f}x | {d['kl'] / f['kl']:.2f}x |" in md and "order floor" in md
    assert rep.full_markdown().endswith(md)


def test_floor_choice_is_the_cheapest_setting_inside_the_floor():
    floor = dict(setting="order floor", orders=4, pairs=8, top1=0.9, kl=0.1, same_answer=0.5, same_answer_n=4,
                 kl_mean=0.05)
    rows = [dict(setting=q.REFERENCE_NAME, top1=1.0, kl=0.0, same_answer=1.0, recomputed=1.0, ttft_ms=None),
            dict(setting="default", top1=0.85, kl=0.15, same_answer=0.4, recomputed=0.0, ttft_ms=None),
            dict(setting="fast", top1=0.88, kl=0.25, same_answer=0.6, recomputed=0.0, ttft_ms=None),
            dict(setting="balanced", top1=0.95, kl=0.05, same_answer=0.7, recomputed=0.15, ttft_ms=None)]
    rep = q.FidelityReport(rows=rows, target={}, floor=floor)
    assert rep.floor_choice() == "balanced"  # default misses same answer, fast is over 2x the KL
    assert rep.floor_choice(kl_factor=3.0) == "fast"
    rows[3]["same_answer"] = 0.3
    assert rep.floor_choice() == "exact"
    assert q.FidelityReport(rows=rows, target={}).floor_choice() is None


def test_a_slice_of_the_prose_suite_runs_through_the_report(tiny):
    """20 cases of the shipped test split through the report with its floor (a tiny random
    model: the plumbing at real lengths, not the default model's figures)."""
    from pathlib import Path

    hf, tok = tiny
    cases = q.load_cases(Path(__file__).parents[2] / "benchmarks" / "data" / "prose" / "test.jsonl")[:20]
    llm = LazyLLM(model=hf, tokenizer=tok, reuse="none", kv_cache_bytes=64 << 20, progress=False, quality="isolated")
    rep = q.compare(llm, cases, settings=["isolated", "balanced"], progress=False, ttft_cases=0, answer_tokens=4,
                    orders=1)
    llm.close()
    assert rep.n_cases == 20 and rep.floor["pairs"] == 20  # every case has at least two documents
    assert rep.row("isolated")["recomputed"] == 0.0 and 0.0 < rep.row("balanced")["recomputed"] < 0.5
    assert rep.floor["kl"] > 0.0 and rep.row("isolated")["kl_mean"] > 0.0  # reordering moves full attention too
