"""APE-style context calibration (``ctx_range``, ``ctx_temperature``, ``ctx_lse_scale``) in the
Triton attention kernels, run in Triton's interpreter, against ``paged_attention_ref``.

Covers the prefill kernel's loops (key-rotating, per run, flat, rotary halves), the decode
kernel (pages smaller than the key tile) and the short path, forced key splits (the context
log-sum-exp must be merged over all splits before it is scaled), GQA, pages of 16 and 32,
sequences with different context ranges (an empty one, one that no query is past), table
orders other than by position, and that the calibration off is exactly the launch without it.
"""
from __future__ import annotations

import pytest
import torch

from lazyllm.kernels.options import KernelOptions
from lazyllm.kernels.reference import paged_attention_ref
from tests._triton_load import load_kernel_module
from tests.conftest import PAD_ENTRY, paged_batch

pytest.importorskip("triton", reason="triton is not installed")

ta = load_kernel_module("triton", interpret=True)


def _batch(seqs, *, page_size=16, hkv=2, group=2, d=32, dtype=torch.float32, seed=0, shuffle=False,
           pad_last=False):
    """``paged_batch`` with one padding entry per table (at a random place, or last with
    ``pad_last``); ``shuffle``: the entries in random order."""
    def place(gen, entries):
        entries.insert(len(entries) if pad_last else gen.randint(0, len(entries)), PAD_ENTRY)
        if shuffle:
            gen.shuffle(entries)

    return paged_batch(seqs, page_size=page_size, hkv=hkv, group=group, d=d, dtype=dtype, seed=seed,
                       place_padding=place)


# A RAG-like batch: a prefix, retrieved documents (cached chunks at nonzero deltas: the
# context), then the question. (segments, n_queries, ctx_range) per sequence.
_SEQS = [
    # queries from inside the last document to the end: some before the context end, most past it
    ([(0, 7, 0), (7, 37, 900), (44, 29, 3000), (73, 19, 0)], 30, (7, 73)),
    # no context (an empty range)
    ([(0, 20, 0), (20, 26, 0)], 12, (20, 20)),
    # the context from position 0, and a range that does not start or end on a page boundary
    ([(0, 40, 77), (40, 30, 5), (70, 12, 0)], 9, (3, 62)),
    # every query before the context's end: unchanged
    ([(0, 10, 0), (10, 45, 400)], 8, (10, 60)),
]


def _make(seqs=_SEQS, nq=None, **kw):
    """``_batch`` of ``seqs`` (``nq``: that many queries per sequence instead) and its
    ``(batch, 2)`` context ranges."""
    batch = _batch([(segs, nq or n) for segs, n, _ in seqs], **kw)
    return batch, torch.tensor([c for _, _, c in seqs])


def _tol(dtype):
    return dict(atol=3e-3, rtol=3e-3) if dtype == torch.float16 else dict(atol=3e-5, rtol=3e-5)


def _check(batch, ctx, T, S, *, window=None, batch_invariant=False, **opts):
    ref = paged_attention_ref(**batch, window=window, ctx_range=ctx, ctx_temperature=T, ctx_lse_scale=S)
    out = torch.full_like(batch["q"], float("nan"))  # poisoned: every element must be written
    got = ta.paged_attention_triton(**batch, out=out, window=window, ctx_range=ctx, ctx_temperature=T,
                                    ctx_lse_scale=S, batch_invariant=batch_invariant, options=KernelOptions(**opts))
    assert got is out
    assert not torch.isnan(got).any(), "unwritten or NaN output"
    torch.testing.assert_close(got.float(), ref.float(), **_tol(batch["q"].dtype))
    # the calibration changed something where a query is past a nonempty context
    base = paged_attention_ref(**batch, window=window)
    assert (ref.float() - base.float()).abs().max() > 1e-2
    return got, ref


# (dtype, page_size, group, options): the prefill kernel's loops, key splits forced
PREFILL = [
    (torch.float32, 16, 2, dict()),  # key-rotating loop (pages smaller than the key tile)
    (torch.float16, 16, 4, dict(num_splits=3, config=(16, 32, 4, 1))),
    (torch.float32, 32, 2, dict(loop="per_run", config=(16, 32, 4, 1), num_splits=2)),
    (torch.float16, 32, 1, dict(loop="flat_runs", config=(32, 16, 4, 1))),
    (torch.float32, 32, 4, dict(loop="halves", config=(16, 32, 4, 1), num_splits=4, coef_from_delta=True)),
]
_TS = [(0.7, 1.4), (1.0, 0.6), (1.5, 1.0)]  # both, the scale alone, the temperature alone


@pytest.mark.parametrize("case", range(len(PREFILL)))
def test_prefill_matches_reference(case):
    dtype, ps, group, opts = PREFILL[case]
    batch, ctx = _make(page_size=ps, group=group, dtype=dtype, seed=case)
    T, S = _TS[case % len(_TS)]
    _check(batch, ctx, T, S, **opts)


# (dtype, page_size, group, options): the decode kernel (pages of 16 under a 32-key tile:
# each tile spans two pages), and the prefill kernel's short path (pages of 32)
DECODE = [
    (torch.float32, 16, 2, dict()),
    (torch.float16, 16, 4, dict(num_splits=3)),
    (torch.float32, 32, 2, dict(num_splits=2)),
    (torch.float16, 32, 4, dict(loop="halves", config=(0, 32, 4, 1), num_splits=3)),
]


@pytest.mark.parametrize("case", range(len(DECODE)))
def test_decode_matches_reference(case):
    dtype, ps, group, opts = DECODE[case]
    batch, ctx = _make(nq=1, page_size=ps, group=group, dtype=dtype, seed=10 + case)
    T, S = _TS[case % len(_TS)]
    _check(batch, ctx, T, S, **opts)


def test_decode_kernel_serves_decode():
    """The decode cases of pages of 16 run the per-page decode kernel (its own APE code)."""
    batch, ctx = _make(nq=1, page_size=16)
    plan = ta.launcher.plan_launch(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"],
                                   batch["inv_freq"], 4, 1, True, False, False, KernelOptions(), 0, True)
    assert plan.decode_kernel and plan.ppt > 1 and not plan.gluon


@pytest.mark.parametrize("ps,opts", [(16, dict(num_splits=2)), (32, dict(loop="flat_runs", config=(16, 32, 4, 1)))])
def test_tables_out_of_position_order(ps, opts):
    """Entries in random order: the context tiles and the skipped block are found exactly."""
    for nq, seed in ((None, 20), (1, 21)):
        batch, ctx = _make(nq=nq, page_size=ps, seed=seed, shuffle=True)
        _check(batch, ctx, 0.8, 1.3, **opts)


def test_long_context_block_is_skipped_exactly():
    """A long block of context pages (the other keys' programs skip its tiles when every row
    is past it), with split boundaries falling inside and around it; the loops that rotate
    the query once per run of equal deltas jump from the prefix's run over the documents'
    runs to the question's."""
    seqs = [([(0, 5, 0), (5, 150, 60), (155, 40, 900), (195, 6, 0)], 6, (5, 195)),
            ([(0, 100, 11), (100, 3, 0)], 3, (0, 100))]
    for ps, nq, opts in ((16, 1, dict(num_splits=3)),
                         (32, None, dict(loop="per_run", config=(16, 32, 4, 1), num_splits=5)),
                         (32, None, dict(loop="halves", config=(16, 16, 4, 1), num_splits=1, coef_from_delta=True)),
                         (32, 1, dict(loop="flat_runs", config=(0, 16, 4, 1), num_splits=1, coef_from_delta=True))):
        batch, ctx = _make(seqs, nq=nq, page_size=ps, seed=30 + ps, pad_last=True)
        _check(batch, ctx, 0.9, 0.5, **opts)


def test_window_and_batch_invariant():
    """A sliding window (some queries' windows reach part of the context or none of it) and the
    batch-invariant launch: both served, and batch-invariant decode equals its prefill row."""
    batch, ctx = _make(page_size=16, seed=40)
    _check(batch, ctx, 0.7, 1.4, window=24)
    dec, _ = _make(nq=1, page_size=16, seed=41)
    _check(dec, ctx, 0.7, 1.4, window=40, num_splits=2)
    got, _ = _check(batch, ctx, 0.7, 1.4, batch_invariant=True)
    last = batch["cu_seqlens_q"][1:] - 1  # each sequence's last query, decoded alone
    one = dict(batch, q=batch["q"][last], q_pos=batch["q_pos"][last],
               cu_seqlens_q=torch.arange(len(last) + 1, dtype=torch.int32))
    alone = ta.paged_attention_triton(**one, ctx_range=ctx, ctx_temperature=0.7, ctx_lse_scale=1.4,
                                      batch_invariant=True)
    torch.testing.assert_close(alone, got[last], atol=1e-6, rtol=1e-6)


def test_off_is_the_launch_without_the_arguments():
    batch, ctx = _make(page_size=16, dtype=torch.float16, seed=50)
    base = ta.paged_attention_triton(**batch, options=KernelOptions(num_splits=2))
    for kw in (dict(ctx_range=None, ctx_temperature=0.5, ctx_lse_scale=2.0), dict(ctx_range=ctx),
               dict(ctx_range=ctx, ctx_temperature=1.0, ctx_lse_scale=1.0)):
        assert torch.equal(ta.paged_attention_triton(**batch, options=KernelOptions(num_splits=2), **kw), base)
    # on, but no query past a nonempty context: the reference's values
    none = torch.tensor([[c1, c1] for _, c1 in ctx.tolist()])
    got = ta.paged_attention_triton(**batch, ctx_range=none, ctx_temperature=0.5, ctx_lse_scale=2.0)
    torch.testing.assert_close(got.float(), paged_attention_ref(**batch).float(), **_tol(torch.float16))


def test_bad_arguments():
    batch, ctx = _make(page_size=16, seed=60)
    with pytest.raises(ValueError, match="ctx_temperature"):
        ta.paged_attention_triton(**batch, ctx_range=ctx, ctx_temperature=0.0)
    with pytest.raises(ValueError, match="ctx_range"):
        ta.paged_attention_triton(**batch, ctx_range=ctx[:2], ctx_temperature=0.5)
    with pytest.raises(ValueError, match="Gluon"):
        ta.paged_attention_triton(**batch, ctx_range=ctx, ctx_lse_scale=0.5, padding_finite=True,
                                  options=KernelOptions(prefill_kernel="gluon"))
