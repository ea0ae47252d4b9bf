"""Shared-chunk attention: the work-item planner, its plain-torch twin and the Triton kernel.

Random steps of requests that hold chunk pages (shared by several requests, each at its own
position and in its own order), private pages (question, generated tokens, a partial last
page) and padding columns. The grouped reference must equal ``paged_attention_ref`` over
the same tables, and the kernel (Triton's interpreter on CPU) the reference.
"""
from __future__ import annotations

import random

import pytest
import torch

from lazyllm.kernels.grouping import plan_groups
from lazyllm.kernels.reference import grouped_attention_ref, paged_attention_ref
from tests._triton_load import load_kernel_module

triton = pytest.importorskip("triton", reason="triton is not installed")
ta = load_kernel_module("triton", interpret=True)


def _step(seed, *, n_req=5, n_chunks=4, chunk_pages=3, page_size=16, hkv=2, group=2, d=32, rot=None,
          dtype=torch.float32, twice=False, queries_per_row=1, extend=0):
    """A random step: page pool, per-row tables (page, pos, delta, len), queries."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    # chunks: stored at their own positions 0.. (the chunk's frame), the last page partial
    chunks, n_pages = [], 0
    for _ in range(n_chunks):
        ln = chunk_pages * page_size - rng.randrange(page_size)
        pages = list(range(n_pages, n_pages + chunk_pages))
        n_pages += chunk_pages
        chunks.append((pages, ln, rng.randrange(0, 200)))  # stored from position c0
    rows, q_pos, q_rows = [], [], []
    for b in range(n_req):
        picks = rng.sample(range(n_chunks), rng.randint(0, n_chunks))
        if b < 2 and 0 not in picks:  # at least one chunk held twice, at two positions
            picks.insert(rng.randint(0, len(picks)), 0)
        if twice and picks:
            picks.append(picks[0])
        entries, pos = [], rng.randrange(0, 30)  # a system prefix's worth of offset
        for ci in picks:
            pages, ln, c0 = chunks[ci]
            for i, p in enumerate(pages):
                entries.append((p, pos + i * page_size, pos - c0, min(page_size, ln - i * page_size)))
            pos += ln
        own = rng.randint(1, 3)  # question and generated tokens, in the request's frame
        for i in range(own):
            ln = page_size if i < own - 1 else rng.randint(1, page_size)
            entries.append((n_pages, pos, 0, ln))
            n_pages += 1
            pos += ln
        rows.append(entries)
        for t in range(queries_per_row):
            q_rows.append(b)
            q_pos.append(pos - 1 - (queries_per_row - 1 - t))
    width = max(len(r) for r in rows) + extend + rng.randint(0, 2)
    tab = torch.zeros((4, n_req, width), dtype=torch.int32)
    for b, r in enumerate(rows):
        for c, e in enumerate(r):
            tab[:, b, c] = torch.tensor(e, dtype=torch.int32)
    hq = hkv * group
    rot = d if rot is None else rot
    k = torch.randn(n_pages, page_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(n_pages, page_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(q_rows), hq, d, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    queries = [[i for i, r in enumerate(q_rows) if r == b] for b in range(n_req)]
    return dict(k=k, v=v, q=q, q_pos=torch.tensor(q_pos, dtype=torch.int32), tab=tab, rows=rows, queries=queries,
                inv_freq=inv_freq, sm_scale=d ** -0.5)


def _plan(s, **kw):
    return plan_groups(s["rows"], queries=s["queries"], width=s["tab"].shape[2], **kw)


def _full_ref(s):
    """``paged_attention_ref`` over the step's tables, one sequence per query (decode rows
    or the rows' queries in order)."""
    tab = s["tab"]
    out = torch.empty_like(s["q"])
    for b, qs in enumerate(s["queries"]):
        if not qs:
            continue
        sub = s["q"][qs]
        cu = torch.tensor([0, len(qs)], dtype=torch.int32)
        out[qs] = paged_attention_ref(sub, s["q_pos"][qs], cu, s["k"], s["v"], tab[0, b:b + 1], tab[1, b:b + 1],
                                      tab[2, b:b + 1], tab[3, b:b + 1], s["inv_freq"], s["sm_scale"])
    return out


def _grouped(fn, s, plan, **kw):
    tab = s["tab"]
    return fn(s["q"], s["q_pos"], s["k"], s["v"], tab[0], tab[1], tab[2], tab[3], s["inv_freq"], s["sm_scale"],
              plan.tensors(), **kw)


def _check_cover(s, plan):
    """Each query reads each of its row's pages exactly once over its items, shared items
    place a page where the row's table does, and each query's slots are contiguous."""
    seen = {}
    for m_off, m_n, p_off, n_p in plan.items.tolist():
        for qi, b, _, delta in plan.members[m_off:m_off + m_n].tolist():
            for page, spos, ln in plan.pages[p_off:p_off + n_p].tolist():
                cols = [c for c, e in enumerate(s["rows"][b]) if e[0] == page and e[1] == spos + delta]
                assert len(cols) == 1 and s["rows"][b][cols[0]][3] == ln
                seen[(qi, cols[0])] = seen.get((qi, cols[0]), 0) + 1
    for qi, (b, c_off, n_c) in enumerate(plan.own.tolist()):
        assert qi in s["queries"][b]
        for c in plan.cols[c_off:c_off + n_c].tolist():
            if c < len(s["rows"][b]):
                seen[(qi, c)] = seen.get((qi, c), 0) + 1
    for b, qs in enumerate(s["queries"]):
        for qi in qs:
            for c in range(len(s["rows"][b])):
                assert seen.get((qi, c)) == 1, (qi, c)
    assert sorted(plan.members[:, 2].tolist()) == list(range(plan.n_slots))
    for qi, (f, n) in enumerate(plan.parts.tolist()):
        own = sorted(int(m[2]) for m in plan.members if m[0] == qi)
        assert own == list(range(f, f + n))


def _rows(pages_by_row):
    """Entries at consecutive positions, deltas 0: page lists as tables."""
    return [[(p, 16 * c, 0, 16) for c, p in enumerate(r)] for r in pages_by_row]


def test_nothing_shared_gives_no_plan():
    assert plan_groups(_rows([[0, 1], [2, 3], [4]])) is None
    assert plan_groups(_rows([[0, 1], [1]])) is not None
    # one row reading the same page at two places is a share too (two queries' worth of reads)
    plan = plan_groups([[(0, 0, 0, 16), (1, 16, 0, 16), (0, 32, 32, 16)]])
    assert plan is not None and plan.members[:, 3].tolist() == [0, 32] and plan.own[0, 2] == 1


def test_planner_rejects_bad_settings():
    with pytest.raises(ValueError):
        plan_groups(_rows([[0], [0]]), members_per_item=0)
    with pytest.raises(ValueError):
        plan_groups(_rows([[0], [0]]), queries=[[0]])


def test_planner_reads_a_shared_page_once_per_member_tile():
    # 6 requests over the same 2 chunks (pages 0-1 and 2-3, stored at 0 and 32) in two
    # orders after a 16-token prefix, each with its own page
    def row(b):
        order = [(0, 1, 0), (2, 3, 32)] if b % 2 else [(2, 3, 32), (0, 1, 0)]
        ents, pos = [], 16
        for p0, p1, stored in order:
            ents += [(p0, pos, pos - stored, 16), (p1, pos + 16, pos - stored, 16)]
            pos += 32
        return ents + [(10 + b, pos, 0, 5)]

    plan = plan_groups([row(b) for b in range(6)], members_per_item=4, pages_per_item=4)
    # a chunk's pages share one delta per member, the two chunks do not: a run per chunk,
    # members in tiles of 4 and 2, so each page is read twice for six requests
    assert sorted(it[1] for it in plan.items.tolist()) == [2, 2, 4, 4]
    assert all(it[3] == 2 for it in plan.items.tolist()) and plan.shared_pages == 4
    assert plan.own[:, 2].tolist() == [1] * 6 and plan.parts[:, 1].tolist() == [2] * 6
    assert plan.saved_reads == 6 * 4 - 4 * 2  # 24 reads of shared pages, 8 by the four items
    assert plan.pages[:, 1].tolist() in ([32, 48, 0, 16], [0, 16, 32, 48])  # stored positions


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mt,ppi", [(1, 1), (2, 2), (3, 8)])
def test_grouped_reference_equals_paged_reference(seed, mt, ppi):
    s = _step(seed, n_req=2 + seed, twice=seed % 3 == 0, group=1 + seed % 3, rot=16 if seed % 2 else None,
              extend=seed % 2)
    plan = _plan(s, members_per_item=mt, pages_per_item=ppi, extend=seed % 2 + 2)
    if plan is None:
        pytest.fail("the random step was expected to share a page")
    _check_cover(s, plan)
    got = _grouped(grouped_attention_ref, s, plan)
    torch.testing.assert_close(got, _full_ref(s), rtol=1e-5, atol=1e-5)


def _run_triton(s, plan, mt):
    return _grouped(ta.grouped_attention_triton, s, plan, members_per_item=mt)


@pytest.mark.parametrize("seed,mt,ppi,group", [(0, 4, 2, 1), (1, 2, 3, 2), (2, 4, 8, 4), (3, 1, 1, 2),
                                               (4, 8, 2, 4)])
def test_grouped_triton_equals_reference(seed, mt, ppi, group):
    s = _step(100 + seed, n_req=3 + seed, group=group, twice=seed == 2, rot=16 if seed == 3 else None,
              extend=seed % 2)
    plan = _plan(s, members_per_item=mt, pages_per_item=ppi, extend=seed % 2)
    assert plan is not None
    got = _run_triton(s, plan, mt)
    torch.testing.assert_close(got, _grouped(grouped_attention_ref, s, plan), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(got, _full_ref(s), rtol=2e-4, atol=2e-4)


def test_grouped_triton_half_precision_and_many_queries_per_row():
    # fp16 cache (interpreter-exact dtype), 3 queries per row (a short prefill over chunks)
    s = _step(7, n_req=4, group=2, dtype=torch.float16, queries_per_row=3)
    plan = _plan(s, members_per_item=4, pages_per_item=2)
    got = _run_triton(s, plan, 4)
    want = _full_ref(s)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_grouped_triton_fixed_size_plan_buffer():
    """Padding items (no member) are skipped and a plan laid in larger zeroed buffers gives
    the same output: what a CUDA graph over fixed-size buffers needs."""
    s = _step(11, n_req=5, group=2)
    plan = _plan(s, members_per_item=2, pages_per_item=2)
    t = plan.tensors()

    def pad(x, n):
        y = torch.zeros((x.shape[0] + n, *x.shape[1:]), dtype=torch.int32)
        y[:x.shape[0]] = x
        return y

    t = t._replace(items=pad(t.items, 5), pages=pad(t.pages, 4), members=pad(t.members, 3))
    tab = s["tab"]
    got = ta.grouped_attention_triton(s["q"], s["q_pos"], s["k"], s["v"], tab[0], tab[1], tab[2], tab[3],
                                      s["inv_freq"], s["sm_scale"], t, members_per_item=2)
    torch.testing.assert_close(got, _full_ref(s), rtol=2e-4, atol=2e-4)


def test_grouped_triton_rejects_bad_plans():
    s = _step(3, n_req=3)
    t = _plan(s).tensors()
    tab = s["tab"]
    with pytest.raises(ValueError, match="int32"):
        ta.grouped_attention_triton(s["q"], s["q_pos"], s["k"], s["v"], tab[0], tab[1], tab[2], tab[3],
                                    s["inv_freq"], s["sm_scale"], t._replace(items=t.items.long()),
                                    members_per_item=16)
