"""The fused layer kernels (``kernels/fused.py``) against the torch code they replace.

Run in Triton's interpreter on CPU (a private copy of the module, as in
``test_kernels_triton.py``), on random inputs, float32 and float16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lazyllm.kernels.reference import apply_rope, rope_cos_sin, write_kv_ref
from lazyllm.model.llama import _rms_norm
from tests._triton_load import load_kernel_module

pytest.importorskip("triton", reason="triton is not installed")

fk = load_kernel_module("fused.py", interpret=True)
DTYPES = [torch.float32, torch.float16]


def _tol(dtype):
    # one unit in the last place of the dtype: RMSNorm's sum runs in another order
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hidden", [(1, 64), (5, 96), (3, 576)])
def test_rms_norm_and_add(dtype, n, hidden):
    g = torch.Generator().manual_seed(n * hidden)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    y = torch.randn(n, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    torch.testing.assert_close(fk.rms_norm(h, w, 1e-5), _rms_norm(h, w, 1e-5), **_tol(dtype))
    hs, x = fk.add_rms_norm(h, y, w, 1e-6)
    assert torch.equal(hs, h + y)  # the residual stream: exact
    torch.testing.assert_close(x, _rms_norm(h + y, w, 1e-6), **_tol(dtype))
    h0 = h.clone()
    fk.add_rms_norm(h, y, w, 1e-6)
    assert torch.equal(h, h0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(1)
    gu = (3 * torch.randn(4, 2 * 1500, generator=g)).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fk.silu_mul(gu), F.silu(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,rd,ps", [(4, 2, 64, 64, 16), (6, 2, 32, 16, 8), (3, 3, 64, 48, 4)])
def test_rope_qkv_write(dtype, hq, hkv, d, rd, ps):
    g = torch.Generator().manual_seed(hq * d + rd)
    n, pages = 7, 6
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (n,), generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    cos, sin = rope_cos_sin(pos, inv, 1.3)
    slots = torch.randperm(pages * ps, generator=g)[:n]
    kc = torch.full((pages, ps, hkv, d), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    kr, vr = kc.clone(), vc.clone()
    q = fk.rope_qkv_write(qkv, cos, sin, kc, vc, slots, hq, hkv)
    qs = qkv[:, : hq * d].view(n, hq, d)
    ks = qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d)
    vs = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
    torch.testing.assert_close(q, apply_rope(qs, cos, sin), **_tol(dtype))
    write_kv_ref(kr, vr, slots, apply_rope(ks, cos, sin), vs)
    torch.testing.assert_close(kc, kr, equal_nan=True, **_tol(dtype))
    assert torch.equal(vc.nan_to_num(), vr.nan_to_num())  # V is copied, untouched
    assert torch.isnan(kc).sum() == torch.isnan(kr).sum()  # nothing written outside the slots


def test_model_forward_with_fused_kernels():
    """The model's fused forward (kernels/fused.py in the interpreter) gives the logits and
    K/V of the plain forward, on a varlen batch over pages."""
    from lazyllm.model.llama import AttentionMetadata, LlamaFamilyModel
    from tests.conftest import make_tiny

    hf = make_tiny("llama", seed=3)
    plain = LlamaFamilyModel(hf, fuse=True, fused_kernels=False)
    fused = LlamaFamilyModel(hf, fuse=True, fused_kernels=fk)
    assert fused.fused is fk and plain.fused is None
    s = plain.spec
    ps, n_pages = 8, 12
    shape = (s.num_layers, n_pages, ps, s.num_kv_heads, s.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]
    lens = [11, 6]
    ids = torch.randint(0, 1000, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens]).to(torch.int32)
    slots = torch.cat([torch.arange(n) for n in lens])
    slots[lens[0]:] += 4 * ps  # the second sequence on pages 4..
    meta = AttentionMetadata(
        positions=pos, cu_seqlens_q=torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32), slot_mapping=slots,
        block_table=torch.tensor([[0, 1], [4, 0]], dtype=torch.int32),
        block_pos=torch.tensor([[0, ps], [0, 0]], dtype=torch.int32),
        block_delta=torch.zeros((2, 2), dtype=torch.int32),
        block_len=torch.tensor([[ps, lens[0] - ps], [lens[1], 0]], dtype=torch.int32), max_seqlen_q=max(lens))
    rows = torch.tensor([lens[0] - 1, sum(lens) - 1])
    a = plain.forward(ids, meta, *caches[0], logits_index=rows)
    b = fused.forward(ids, meta, *caches[1], logits_index=rows)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1][0], caches[0][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[1][1], caches[0][1]) or torch.allclose(caches[1][1], caches[0][1], atol=1e-5)
