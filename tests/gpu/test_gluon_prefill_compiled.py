"""The warp-specialized Gluon prefill run on a Hopper GPU against the reference and the Triton
kernel, and the launcher's routing to it (the CPU checks of the module are in
``tests/kernels/test_gluon_prefill.py``, whose batch this uses)."""
from __future__ import annotations

import pytest
import torch

from lazyllm.kernels.options import KernelOptions
from lazyllm.kernels.reference import paged_attention_ref
from tests.kernels.test_gluon_prefill import _batch, gp
from tests.kernels.test_kernels_triton import _relerr

_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                             reason="needs a Hopper GPU (sm_90)")



@pytest.mark.gpu
@_hopper
@pytest.mark.parametrize("config", [None, (128, 4, 2, 64), (128, 4, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [64, 128])
def test_gpu_matches_reference(dtype, config, page_size):
    """Prefill of a varlen batch with RoPE on (deltas up to ~1e5) and off, against the
    float32 reference and against the Triton kernel; every output row written."""
    from lazyllm.kernels.triton import paged_attention_triton, rope_table

    b, nq = _batch(dtype, page_size=page_size)
    b = {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}
    for rope in (True, False):
        bb = b if rope else dict(b, block_delta=torch.zeros_like(b["block_delta"]))
        up = dict(bb, q=bb["q"].float(), k_cache=bb["k_cache"].float(), v_cache=bb["v_cache"].float())
        ref = paged_attention_ref(**up)
        out = torch.full_like(bb["q"], float("nan"))
        got = gp.paged_prefill_gluon(**bb, out=out, max_seqlen_q=nq, padding_finite=True, use_rope=rope,
                                     config=config)
        assert got is out and not torch.isnan(got).any()
        assert _relerr(got, ref) < 1e-2
        tri = paged_attention_triton(**bb, max_seqlen_q=nq, use_rope=rope)
        assert _relerr(got, tri) < 1e-2
    # the runs table built once per step is accepted, and gives the same result
    runs = rope_table(b["block_delta"], b["inv_freq"].cuda())[2]
    again = gp.paged_prefill_gluon(**b, max_seqlen_q=nq, padding_finite=True, runs=runs, config=config)
    first = gp.paged_prefill_gluon(**b, max_seqlen_q=nq, padding_finite=True, config=config)
    assert torch.equal(again, first)



@pytest.mark.gpu
@_hopper
def test_gpu_triton_launcher_routes_prefill_to_gluon(monkeypatch):
    """``paged_attention_triton`` sends prefill to the Gluon kernel exactly when the caller
    passes ``padding_finite=True`` and nothing asks for the Triton kernel (a config, a loop,
    batch invariance, key splits, ``prefill_kernel="triton"``, ``gluon_prefill=False``) and
    the key ranges are long enough (``_GLUON_MIN_KEYS``); decode never goes there. Routed
    calls return the Gluon kernel's own bits."""
    from lazyllm.kernels.loader import triton_kernels

    ta = triton_kernels()

    b, nq = _batch(torch.bfloat16)
    b = {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}
    calls = []
    real = gp.paged_prefill_gluon
    monkeypatch.setattr(gp, "paged_prefill_gluon", lambda *a, **k: calls.append(1) or real(*a, **k))
    direct = real(**b, max_seqlen_q=nq, padding_finite=True)
    # this batch's key ranges are short (about 1.2k slots): left to the Triton kernel, which
    # is the faster there, unless the threshold is lowered
    hit = len(calls)
    ta.paged_attention_triton(**b, max_seqlen_q=nq, options=KernelOptions(num_splits=1), padding_finite=True)
    assert len(calls) == hit
    monkeypatch.setattr(ta.launcher, "_GLUON_MIN_KEYS", 0)

    def routed(**kw):  # one key split: this small grid would take split-K by occupancy otherwise
        n = len(calls)
        opts = {k: kw.pop(k) for k in list(kw) if k not in ("padding_finite", "batch_invariant", "rope")}
        out = ta.paged_attention_triton(**b, max_seqlen_q=nq, options=KernelOptions(**dict(dict(num_splits=1), **opts)),
                                        **kw)
        return len(calls) > n, out

    hit, out = routed(padding_finite=True)
    assert hit and torch.equal(out, direct)
    hit, out = routed(padding_finite=True, rope=ta.rope_table(b["block_delta"], b["inv_freq"]))
    assert hit and torch.equal(out, direct)
    for kw in (dict(), dict(padding_finite=True, prefill_kernel="triton"), dict(padding_finite=True, loop="halves"),
               dict(padding_finite=True, gluon_prefill=False),
               dict(padding_finite=True, batch_invariant=True), dict(padding_finite=True, config=(64, 64, 4, 2)),
               dict(padding_finite=True, num_splits=2)):
        hit, out = routed(**kw)
        assert not hit, kw
        assert _relerr(out, direct) < 1e-2, kw
    hit, _ = routed(padding_finite=True, prefill_kernel="gluon")
    assert hit
    with pytest.raises(ValueError, match="padding_finite"):
        routed(prefill_kernel="gluon")
    # decode: one query per sequence
    one = dict(b, q=b["q"][b["cu_seqlens_q"][1:] - 1], q_pos=b["q_pos"][b["cu_seqlens_q"][1:] - 1],
               cu_seqlens_q=torch.arange(4, dtype=torch.int32, device="cuda"))
    n = len(calls)
    ta.paged_attention_triton(**one, max_seqlen_q=1, padding_finite=True)
    assert len(calls) == n
    # the rotary-halves short path with one key split: still the Triton kernel
    got = ta.paged_attention_triton(**one, max_seqlen_q=1, padding_finite=True,
                                    options=KernelOptions(short_halves="auto", num_splits=1))
    assert len(calls) == n
    up = dict(one, q=one["q"].float(), k_cache=one["k_cache"].float(), v_cache=one["v_cache"].float())
    assert _relerr(got, paged_attention_ref(**up)) < 1e-2

