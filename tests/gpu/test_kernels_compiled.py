"""The Triton kernels compiled on CUDA against their torch twins (the interpreted runs of the
same kernels are in ``tests/kernels/test_kernels_triton.py``, whose batch builders these use)."""
from __future__ import annotations

import random

import pytest
import torch

from lazyllm.kernels.options import LOOPS, KernelOptions
from lazyllm.kernels.reference import paged_attention_ref
from tests.kernels.test_kernels_triton import (
    _chunks,
    _invariant_batches,
    _load_kernels,
    _make_batch,
    _relerr,
    _window_seqs,
)


def _check_compiled(mod, seqs, dtype, launch=None, **batch_kw):
    """Compiled kernels on CUDA against the float32 reference: the prefill of ``seqs`` and a
    decode step of one query per sequence over the same tables (``launch``: extra launcher
    arguments for both)."""
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    launch = launch or {}
    batch = _make_batch(seqs, hkv=2, dtype=dtype, **batch_kw)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    up = dict(batch, q=batch["q"].float(), k_cache=batch["k_cache"].float(), v_cache=batch["v_cache"].float())
    got = mod.paged_attention_triton(**batch, **launch)
    assert not torch.isnan(got).any()
    assert _relerr(got, paged_attention_ref(**up)) < tol
    dec = dict(batch, q=batch["q"][: len(seqs)].contiguous(), q_pos=batch["q_pos"][: len(seqs)],
               cu_seqlens_q=torch.arange(len(seqs) + 1, device="cuda", dtype=torch.int32))
    up = dict(dec, q=dec["q"].float(), k_cache=up["k_cache"], v_cache=up["v_cache"])
    got = mod.paged_attention_triton(**dec, max_seqlen_q=1, **launch)
    assert _relerr(got, paged_attention_ref(**up)) < tol



def _gpu_seqs(seed, shapes, lo, hi):
    gen = random.Random(seed)
    seqs = []
    for nc, nq in shapes:
        chunks, pos = _chunks(gen, nc, 0, lo=lo, hi=hi)
        seqs.append((chunks + [(pos, nq + 5, 0)], nq))
    return seqs



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_compiled_matches_reference(dtype):
    """The key-rotating kernels (pages of 16) compiled, for head dims 64, 128 and 256."""
    mod = _load_kernels(interpret=False)
    seqs = _gpu_seqs(19, ((6, 70), (3, 1), (9, 130)), 30, 300)
    for g, d, rd in ((4, 128, None), (3, 64, 32), (8, 256, None)):
        _check_compiled(mod, seqs, dtype, page_size=16, group=g, d=d, rotary_dim=rd, seed=10)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_gpu_compiled_query_rotation(dtype, d):
    """The query-rotating path (pages of 64 and 128, the default tiles) compiled for each
    head dim, prefill and decode, against the reference; no fallback taken."""
    mod = _load_kernels(interpret=False)
    seqs = _gpu_seqs(23, ((5, 70), (2, 1), (1, 9)), 20, 200)
    for ps in (64, 128):
        _check_compiled(mod, seqs, dtype, page_size=ps, group=4, d=d, seed=24)
    assert not mod.launcher._QROT_FAILED, f"fell back to the key-rotating kernel for {mod.launcher._QROT_FAILED}"



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
@pytest.mark.parametrize("loop", ["per_run", "flat_runs", "halves"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_compiled_run_loops(loop, dtype):
    """The three forms of the query-rotating loop (a loop per run, one flat loop, one loop
    on rotary halves) compiled, head_dim 128, pages of 64, split and unsplit."""
    mod = _load_kernels(interpret=False)
    seqs = _gpu_seqs(29, ((7, 90), (3, 1), (2, 17)), 40, 300)
    for splits in (None, 1, 3):
        _check_compiled(mod, seqs, dtype, launch=dict(options=KernelOptions(loop=loop, num_splits=splits)),
                        page_size=64, group=4, d=128, seed=30)
    assert not mod.launcher._QROT_FAILED
    # the rotary-halves loop rotated on 16-bit pairs (inline PTX) in what was checked above
    packed = {c.get("PACKED_ROT") for c, _ in mod.compiled_kernels(mod.prefill._paged_attn_fwd)
              if c.get("QROT") == LOOPS[loop]}
    assert packed == {loop == "halves"}



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_compiled_short_halves(dtype):
    """The short path on rotary halves (``KernelOptions(short_halves="auto")``; decode, and 9
    queries per sequence) compiled: 64-key tiles for few programs and, with the SM count
    taken as 2, 32-key tiles; head_dim 128, pages of 64, against the reference."""
    mod = _load_kernels(interpret=False)
    seqs = _gpu_seqs(31, ((6, 9), (3, 1), (2, 5)), 40, 300)
    dev = torch.cuda.current_device()
    sms = mod.launcher._num_sms(torch.device("cuda", dev))
    try:
        for n_sms, bn in ((sms, 64), (2, 32)):
            mod.launcher._NUM_SMS[dev] = n_sms
            _check_compiled(mod, seqs, dtype, launch=dict(options=KernelOptions(short_halves="auto")), page_size=64,
                            group=4, d=128, seed=32)
            got = {(c.get("QROT"), c.get("BLOCK_N"), c.get("PACKED_ROT")) for c, _ in
                   mod.compiled_kernels(mod.prefill._paged_attn_fwd)}
            assert (3, bn, True) in got, got
    finally:
        mod.launcher._NUM_SMS[dev] = sms
    assert not mod.launcher._QROT_FAILED



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
@pytest.mark.parametrize("loop", ["flat_runs", "halves"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_run_coefficients_from_delta(loop, dtype):
    """Compiled run loops computing cos/sin from the delta (``cos.approx``/``sin.approx``
    after the range reduction), with and without the run-ahead load, at deltas up to ~1e5
    positions: the reference's result, prefill and decode, split and unsplit."""
    mod = _load_kernels(interpret=False)
    gen = random.Random(52)
    seqs = []
    for start, nc, nq in ((9, 3, 17), (40000, 4, 5), (97000, 2, 1), (120000, 6, 70)):
        chunks, pos = _chunks(gen, nc, start, lo=30, hi=200)
        seqs.append(([(0, 9, 0)] + chunks + [(pos, nq + 7, 0)], nq))
    for look in (False, True):
        for splits in (None, 3):
            _check_compiled(mod, seqs, dtype, launch=dict(options=KernelOptions(
                                loop=loop, num_splits=splits, coef_from_delta=True, coef_lookahead=look)),
                            page_size=64, group=4, d=128, seed=53)
    from_delta = {c.get("FROM_DELTA") for c, _ in mod.compiled_kernels(mod.prefill._paged_attn_fwd)
                  if c.get("QROT") == LOOPS[loop]}
    assert from_delta == {True}



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,page_size", [(128, 64), (64, 16), (16, 64)])
def test_gpu_batch_invariant_bitwise(dtype, d, page_size):
    """Compiled, ``batch_invariant=True``: a query's output is bit-for-bit the same decoded
    alone, decoded in a batch, and as the last row of a prefill batch."""
    mod = _load_kernels(interpret=False)
    b, dec, last = _invariant_batches(dtype, "cuda", d=d, page_size=page_size)
    pre = mod.paged_attention_triton(**b, max_seqlen_q=12, batch_invariant=True)
    batched = mod.paged_attention_triton(**dec, max_seqlen_q=1, batch_invariant=True)
    for i in range(len(last)):
        one = {k: (v[i:i + 1] if k in ("q", "q_pos", "block_table", "block_pos", "block_delta", "block_len")
                   else v) for k, v in dec.items()}
        one["cu_seqlens_q"] = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
        alone = mod.paged_attention_triton(**one, max_seqlen_q=1, batch_invariant=True)
        assert torch.equal(alone[0], batched[i])
        assert torch.equal(alone[0], pre[last[i]])



def _check_window_compiled(mod, seqs, dtype, window, launch=None, **batch_kw):
    """Compiled kernels with a sliding window against the float32 reference with it: the
    prefill of ``seqs`` and a decode step of one query per sequence."""
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    launch = launch or {}
    batch = _make_batch(seqs, hkv=2, dtype=dtype, **batch_kw)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    up = dict(batch, q=batch["q"].float(), k_cache=batch["k_cache"].float(), v_cache=batch["v_cache"].float())
    got = mod.paged_attention_triton(**batch, window=window, **launch)
    assert not torch.isnan(got).any()
    assert _relerr(got, paged_attention_ref(**up, window=window)) < tol
    n = len(seqs)
    last = batch["cu_seqlens_q"][1:].long() - 1
    dec = dict(batch, q=batch["q"][last].contiguous(), q_pos=batch["q_pos"][last],
               cu_seqlens_q=torch.arange(n + 1, device="cuda", dtype=torch.int32))
    up = dict(dec, q=dec["q"].float(), k_cache=up["k_cache"], v_cache=up["v_cache"])
    got = mod.paged_attention_triton(**dec, max_seqlen_q=1, window=window, **launch)
    assert not torch.isnan(got).any()
    assert _relerr(got, paged_attention_ref(**up, window=window)) < tol



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d,ps,group", [(128, 64, 4), (256, 64, 2), (256, 16, 2), (64, 16, 4)])
def test_gpu_window_compiled(dtype, d, ps, group):
    """Sliding windows compiled, default launches (Gemma 3 4B's head dim 256 and 2 query
    heads per KV head among them): chunks shorter than, equal to and longer than the window,
    prefills whose queries cross its edge, decode; pages outside every window NaN-poisoned."""
    mod = _load_kernels(interpret=False)
    window = 100
    seqs = _window_seqs(random.Random(d + ps), window, 90)
    _check_window_compiled(mod, seqs, dtype, window, page_size=ps, group=group, d=d, seed=d)
    for splits in (1, 5):
        _check_window_compiled(mod, seqs, dtype, window, launch=dict(options=KernelOptions(num_splits=splits)),
                               page_size=ps, group=group, d=d, seed=d)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
@pytest.mark.parametrize("loop", ["per_run", "flat_runs", "halves", "per_tile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_window_run_loops(loop, dtype):
    """Every key-tile loop compiled with a window (head dim 128, pages of 64)."""
    mod = _load_kernels(interpret=False)
    seqs = _window_seqs(random.Random(3), 150, 120)
    _check_window_compiled(mod, seqs, dtype, 150, launch=dict(options=KernelOptions(loop=loop)), page_size=64,
                           group=4, d=128, seed=4)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels run only on a GPU)")
def test_gpu_window_long_prefill_stays_off_gluon(monkeypatch):
    """A long windowed prefill that the Gluon prefill would serve without a window (16-bit,
    head dim 128, pages of 64, finite padding, thousands of keys) runs the Triton kernel and
    matches the reference; the same call without the window may take Gluon."""
    mod = _load_kernels(interpret=False)
    plans = []
    real = mod.launcher.plan_launch
    monkeypatch.setattr(mod.launcher, "plan_launch", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    gen = random.Random(8)
    chunks, pos = _chunks(gen, 8, 0, lo=480, hi=520)
    batch = _make_batch([(chunks + [(pos, 300, 0)], 256)], page_size=64, hkv=2, group=4, d=128,
                        dtype=torch.bfloat16, seed=8, pad_extra=0)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    up = dict(batch, q=batch["q"].float(), k_cache=batch["k_cache"].float(), v_cache=batch["v_cache"].float())
    got = mod.paged_attention_triton(**batch, window=1024, padding_finite=True)
    assert not plans[-1].gluon and plans[-1].window == 1024
    assert _relerr(got, paged_attention_ref(**up, window=1024)) < 1e-2
    mod.paged_attention_triton(**batch, padding_finite=True)
    assert plans[-1].window == 0

