"""The warp-specialized Gluon prefill (``lazyllm.kernels.gluon_prefill``) against the reference.

Gluon has no interpreter, so the kernel itself runs only in the tests marked ``gpu`` (on
the H200); on CPU this checks that the module imports and refuses what it cannot serve.
"""
from __future__ import annotations

import random

import pytest
import torch

from lazyllm.kernels.reference import paged_attention_ref
from tests.test_kernels_triton import _chunks, _make_batch, _relerr

gp = pytest.importorskip("lazyllm.kernels.gluon_prefill", reason="this triton has no Gluon (triton.experimental.gluon)")


def _batch(dtype, seed=70, page_size=64, pad_extra=2):
    """Three sequences: a prefix, chunks at deltas up to ~1e5 positions (two neighbours
    sharing one delta), then the queries' own pages; padding entries in the tables. Every
    slot of the pool finite (large where never written, so a leak would show)."""
    gen = random.Random(seed)
    seqs = []
    for start, nc, nq in ((9, 6, 90), (40000, 4, 300), (97000, 2, 17)):
        chunks, pos = _chunks(gen, nc, start, lo=40, hi=300)
        if len(chunks) > 2:
            chunks[2] = (chunks[2][0], chunks[2][1], chunks[1][2])
        seqs.append(([(0, 9, 0)] + chunks + [(pos, nq + 7, 0)], nq))
    b = _make_batch(seqs, page_size=page_size, hkv=2, group=4, d=128, dtype=dtype, seed=seed + 1, pad_extra=pad_extra)
    b["k_cache"] = torch.nan_to_num(b["k_cache"], nan=300.0)
    b["v_cache"] = torch.nan_to_num(b["v_cache"], nan=300.0)
    return b, max(nq for _, nq in seqs)


def test_refuses_what_it_cannot_serve():
    """Clear errors, before any device work: no padding promise, shapes and dtypes the
    kernel does not cover, tables that do not match, and any device but a Hopper GPU."""
    b, nq = _batch(torch.float16)
    ok = dict(max_seqlen_q=nq, padding_finite=True)
    with pytest.raises(ValueError, match="padding_finite"):
        gp.paged_prefill_gluon(**b, max_seqlen_q=nq, padding_finite=False)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gp.paged_prefill_gluon(**dict(b, k_cache=b["k_cache"].float(), v_cache=b["v_cache"].float()), **ok)
    with pytest.raises(ValueError, match="fully rotary"):
        gp.paged_prefill_gluon(**dict(b, inv_freq=b["inv_freq"][:32]), **ok)
    with pytest.raises(ValueError, match="config"):
        gp.paged_prefill_gluon(**b, **ok, config=(128, 4, 2))
    with pytest.raises(ValueError, match="int32 block_table"):
        gp.paged_prefill_gluon(**dict(b, block_table=b["block_table"].long()), **ok)
    with pytest.raises(ValueError, match="block tables of shapes"):
        gp.paged_prefill_gluon(**dict(b, block_len=b["block_len"][:, :-1]), **ok)
    with pytest.raises(ValueError, match="runs table"):
        gp.paged_prefill_gluon(**b, **ok, runs=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        gp.paged_prefill_gluon(**b, max_seqlen_q=0, padding_finite=True)
    with pytest.raises(RuntimeError, match="Hopper"):  # CPU tensors (or a GPU other than sm_90)
        gp.paged_prefill_gluon(**b, **ok)


_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                             reason="needs a Hopper GPU (sm_90)")


@pytest.mark.gpu
@_hopper
@pytest.mark.parametrize("config", [None, (64, 4, 2), (128, 8, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [64, 128])
def test_gpu_matches_reference(dtype, config, page_size):
    """Prefill of a varlen batch with RoPE on (deltas up to ~1e5) and off, against the
    float32 reference and against the Triton kernel; every output row written."""
    from lazyllm.kernels.triton_attention import paged_attention_triton, rope_table

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
