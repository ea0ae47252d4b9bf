"""The fused layer kernels (``kernels/fused.py``) against the torch code they replace.

Run in Triton's interpreter on CPU (a private copy of the module, as in
``test_kernels_triton.py``), on random inputs, float32 and float16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lazyllm.kernels.reference import apply_rope, rope_cos_sin, write_kv_ref
from lazyllm.model.llama import _gemma_norm, rms_norm
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
    torch.testing.assert_close(fk.rms_norm(h, w, 1e-5), rms_norm(h, w, 1e-5), **_tol(dtype))
    hs, x = fk.add_rms_norm(h, y, w, 1e-6)
    assert torch.equal(hs, h + y)  # the residual stream: exact
    torch.testing.assert_close(x, rms_norm(h + y, w, 1e-6), **_tol(dtype))
    h0 = h.clone()
    fk.add_rms_norm(h, y, w, 1e-6)
    assert torch.equal(h, h0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hidden", [(1, 64), (3, 96)])
def test_gemma_norms(dtype, n, hidden):
    """Gemma's ``(1 + w)`` RMSNorm, alone, after the residual add, and the sandwich (the
    projection normalised before the add), against ``llama._gemma_norm``."""
    g = torch.Generator().manual_seed(7 * n + hidden)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    y = (4 * torch.randn(n, hidden, generator=g)).to(dtype)
    w = (0.3 * torch.randn(hidden, generator=g)).to(dtype)
    wy = (0.3 * torch.randn(hidden, generator=g)).to(dtype)
    torch.testing.assert_close(fk.rms_norm(h, w, 1e-6, gemma=True), _gemma_norm(h, w, 1e-6), **_tol(dtype))
    hs, x = fk.add_rms_norm(h, y, w, 1e-6, gemma=True)
    assert torch.equal(hs, h + y)
    torch.testing.assert_close(x, _gemma_norm(h + y, w, 1e-6), **_tol(dtype))
    hs, x = fk.add_rms_norm(h, y, w, 1e-6, gemma=True, y_weight=wy)
    ref_h = h + _gemma_norm(y, wy, 1e-6)
    torch.testing.assert_close(hs, ref_h, **_tol(dtype))
    torch.testing.assert_close(x, _gemma_norm(ref_h, w, 1e-6), **_tol(dtype))
    with pytest.raises(ValueError):
        fk.add_rms_norm(h, y, w, 1e-6, y_weight=wy)  # the sandwich norm is Gemma's only


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul(dtype):
    g = torch.Generator().manual_seed(2)
    gu = (3 * torch.randn(3, 2 * 1100, generator=g)).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fk.silu_mul(gu, gelu_tanh=True), F.gelu(gate, approximate="tanh") * up,
                               **_tol(dtype))


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,rd", [(4, 2, 32, 32), (3, 1, 16, 8)])
def test_rope_qkv_write_with_qk_norm(gemma, dtype, hq, hkv, d, rd):
    """Per-head q/k RMSNorm (Qwen3; Gemma 3 with ``gemma``) then RoPE, then the K/V write:
    what the model's ``qkv_proj`` computes."""
    g = torch.Generator().manual_seed(hq * d + rd + gemma)
    n, pages, ps = 5, 3, 4
    qkv = (3 * torch.randn(n, (hq + 2 * hkv) * d, generator=g)).to(dtype)
    qn = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    kn = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    pos = torch.randint(0, 3000, (n,), generator=g)
    cos, sin = rope_cos_sin(pos, 1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    slots = torch.randperm(pages * ps, generator=g)[:n]
    kc = torch.full((pages, ps, hkv, d), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    kr, vr = kc.clone(), vc.clone()
    q = fk.rope_qkv_write(qkv, cos, sin, kc, vc, slots, hq, hkv, q_norm=qn, k_norm=kn, eps=1e-6, gemma=gemma)
    norm = _gemma_norm if gemma else rms_norm
    qs = norm(qkv[:, : hq * d].view(n, hq, d), qn, 1e-6)
    ks = norm(qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d), kn, 1e-6)
    vs = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
    torch.testing.assert_close(q, apply_rope(qs, cos, sin), **_tol(dtype))
    write_kv_ref(kr, vr, slots, apply_rope(ks, cos, sin), vs)
    torch.testing.assert_close(kc, kr, equal_nan=True, **_tol(dtype))
    assert torch.equal(vc.nan_to_num(), vr.nan_to_num())
    with pytest.raises(ValueError):
        fk.rope_qkv_write(qkv, cos, sin, kc, vc, slots, hq, hkv, q_norm=qn)


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


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_model_forward_with_fused_kernels(family):
    """The model's fused forward (kernels/fused.py in the interpreter) gives the logits and
    K/V of the plain forward, on a varlen batch over pages: the Llama layer, Qwen3's q/k
    norms, Gemma 3's (1 + w) and sandwich norms, q/k norms and gelu-tanh."""
    from lazyllm.model.attention import AttentionMetadata
    from lazyllm.model.llama import LlamaFamilyModel
    from tests.conftest import make_tiny

    hf = make_tiny(family, seed=3)
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


def _sum_parts(parts: torch.Tensor, dtype) -> torch.Tensor:
    """The partial sums added in split order in float32, rounded to ``dtype`` (what the
    kernels that take ``gemv_parts`` compute)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc.to(dtype)


@pytest.mark.parametrize("n_out,k,config", [(96, 64, (32, 32, 4)), (50, 200, (16, 64, 4)), (7, 33, (8, 16, 2))])
def test_gemv_parts_is_the_projection(n_out, k, config):
    """Split-K partial sums of one row: their sum is ``F.linear`` (float16 storage, float32
    sums), for shapes that are not multiples of the blocks."""
    g = torch.Generator().manual_seed(n_out + k)
    x = torch.randn(1, k, generator=g).to(torch.float16)
    w = (0.2 * torch.randn(n_out, k, generator=g)).to(torch.float16)
    parts = fk.gemv_parts(x, w, config)
    assert parts.shape == (-(-k // config[1]), 1, n_out) and parts.dtype == torch.float32
    ref = x.float() @ w.float().t()
    torch.testing.assert_close(parts.sum(0), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        fk.gemv_parts(torch.randn(2, k).to(torch.float16), w, config)


def test_kernels_take_partial_sums():
    """Each fused kernel given float32 partial sums computes exactly what it computes given
    their sum rounded to the dtype (the one rounding ``F.linear`` does)."""
    g = torch.Generator().manual_seed(5)
    dt = torch.float16
    hidden, inter, hq, hkv, d, ps = 96, 160, 4, 2, 32, 8
    h = torch.randn(1, hidden, generator=g).to(dt)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dt)
    parts = torch.randn(3, 1, hidden, generator=g)
    hs_p, x_p = fk.add_rms_norm(h, parts, w, 1e-6)
    hs, x = fk.add_rms_norm(h, _sum_parts(parts, dt), w, 1e-6)
    assert torch.equal(hs_p, hs) and torch.equal(x_p, x)

    gu = 3 * torch.randn(4, 1, 2 * inter, generator=g)
    assert torch.equal(fk.silu_mul(gu, dt), fk.silu_mul(_sum_parts(gu, dt)))

    qkv = torch.randn(2, 1, (hq + 2 * hkv) * d, generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    cos, sin = rope_cos_sin(torch.tensor([37]), inv, 1.0)
    slots = torch.tensor([13])
    caches = [(torch.zeros(3, ps, hkv, d, dtype=dt), torch.zeros(3, ps, hkv, d, dtype=dt)) for _ in range(2)]
    q_p = fk.rope_qkv_write(qkv, cos, sin, *caches[0], slots, hq, hkv)
    q = fk.rope_qkv_write(_sum_parts(qkv, dt), cos, sin, *caches[1], slots, hq, hkv)
    assert q_p.dtype == dt and torch.equal(q_p, q)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert caches[0][0].abs().sum() > 0
    with pytest.raises(ValueError):
        fk.add_rms_norm(h, parts.to(dt), w, 1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_model_decode_one_token_with_gemv(family):
    """A single-token step of the fused forward in float16 runs its projections as split-K
    GEMVs (Qwen3 and Gemma 3 too: the single-token projection path); its logits and K/V
    match the plain forward's to float16 accuracy; under ``batch_invariant`` it keeps the
    row-blocked GEMMs (no GEMV call)."""
    from lazyllm.model.attention import AttentionMetadata
    from lazyllm.model.llama import LlamaFamilyModel
    from tests.conftest import forward_pair, make_tiny

    hf = make_tiny(family, seed=4).to(torch.float16)
    plain = LlamaFamilyModel(hf, fuse=True, fused_kernels=False)
    fused = LlamaFamilyModel(hf, fuse=True, fused_kernels=fk)
    s = plain.spec
    ps = 8
    shape = (s.num_layers, 4, ps, s.num_kv_heads, s.head_dim)
    g = torch.Generator().manual_seed(1)
    base_k = (0.5 * torch.randn(shape, generator=g)).to(torch.float16)
    base_v = (0.5 * torch.randn(shape, generator=g)).to(torch.float16)
    meta = AttentionMetadata(
        positions=torch.tensor([5], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        slot_mapping=torch.tensor([ps + 5]), block_table=torch.tensor([[1]], dtype=torch.int32),
        block_pos=torch.tensor([[0]], dtype=torch.int32), block_delta=torch.zeros((1, 1), dtype=torch.int32),
        block_len=torch.tensor([[6]], dtype=torch.int32), max_seqlen_q=1)
    ids = torch.tensor([17])
    (a, b), kv, calls = forward_pair(fk, (plain, fused), ids, meta, base_k, base_v)
    assert len(calls) == 4 * s.num_layers  # q/k/v, output, gate/up and down of every layer
    torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kv[1][0], kv[0][0], atol=2e-3, rtol=2e-3)

    inv = [LlamaFamilyModel(hf, fuse=True, fused_kernels=f, batch_invariant=True) for f in (False, fk)]
    (c, d), _, calls = forward_pair(fk, inv, ids, meta, base_k, base_v)
    assert not calls
    torch.testing.assert_close(d, c, atol=2e-2, rtol=2e-2)


def test_fallback_warnings(caplog):
    """Every supported family, on the Triton attention backend with the fused kernels, runs
    no layer on a slow fallback and logs nothing; a model that does logs one warning naming
    the reason: q/k/v projections left unfused."""
    import logging

    from lazyllm.model.attention import make_backend
    from lazyllm.model.llama import LlamaFamilyModel
    from tests.conftest import FAMILIES, make_tiny

    triton_cpu = make_backend("triton", torch.device("cpu"))
    models = {f: make_tiny(f, seed=1) for f in FAMILIES}
    with caplog.at_level(logging.WARNING, logger="lazyllm"):
        for f, hf in models.items():
            m = LlamaFamilyModel(hf, attention=triton_cpu, fuse=True, fused_kernels=fk)
            assert m.fused is fk and m.graph_capturable, f
    assert not [r for r in caplog.records if r.name == "lazyllm"], caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lazyllm"):
        LlamaFamilyModel(models["qwen3"], fuse=False, fused_kernels=fk)
    assert len(caplog.records) == 1 and "unfused q/k/v" in caplog.records[0].getMessage()
