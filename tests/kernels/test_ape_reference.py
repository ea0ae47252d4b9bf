"""APE-style context calibration in the torch reference attention (off by default)."""
import torch

from lazyllm.kernels.reference import paged_attention_ref


def _inputs(seed=0, hq=4, hkv=2, d=8, ps=4, pages=4):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(pages, ps, hkv, d, generator=g)
    v = torch.randn(pages, ps, hkv, d, generator=g)
    q = torch.randn(3, hq, d, generator=g)
    q_pos = torch.tensor([13, 14, 15])
    table = torch.arange(pages, dtype=torch.int32)[None]
    pos = (torch.arange(pages) * ps)[None]
    delta = torch.zeros(1, pages, dtype=torch.long)
    blen = torch.full((1, pages), ps)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    return (q, q_pos, torch.tensor([0, 3]), k, v, table, pos, delta, blen, inv, d ** -0.5)


def test_off_by_default_and_identity_at_one():
    args = _inputs()
    base = paged_attention_ref(*args)
    same = paged_attention_ref(*args, ctx_range=torch.tensor([[4, 12]]), ctx_temperature=1.0, ctx_lse_scale=1.0)
    assert torch.equal(base, same)


def test_matches_the_two_part_formula():
    q, q_pos, cu, k, v, table, pos, delta, blen, inv, scale = args = _inputs(1)
    T, S = 0.8, 0.9
    out = paged_attention_ref(*args, ctx_range=torch.tensor([[4, 12]]), ctx_temperature=T, ctx_lse_scale=S)
    kk = k.reshape(-1, k.shape[2], k.shape[3]).repeat_interleave(2, 1)  # (16, hq, d), no rotation (delta 0)
    vv = v.reshape(-1, v.shape[2], v.shape[3]).repeat_interleave(2, 1)
    kpos = torch.arange(16)
    for i in range(3):
        z = torch.einsum("hd,khd->hk", q[i], kk) * scale
        vis = kpos <= q_pos[i]
        ctx = (kpos >= 4) & (kpos < 12) & vis
        oth = vis & ~ctx
        lc = torch.logsumexp(z[:, ctx] / T, -1)
        ln = torch.logsumexp(z[:, oth], -1)
        oc = torch.einsum("hk,khd->hd", torch.softmax(z[:, ctx] / T, -1), vv[ctx])
        on = torch.einsum("hk,khd->hd", torch.softmax(z[:, oth], -1), vv[oth])
        wc, wn = torch.exp(S * lc)[:, None], torch.exp(ln)[:, None]
        torch.testing.assert_close(out[i], (wc * oc + wn * on) / (wc + wn), rtol=1e-5, atol=1e-5)


def test_queries_inside_the_context_are_untouched():
    args = _inputs(2)
    base = paged_attention_ref(*args)
    # context ends after the queries' positions: nothing changes
    out = paged_attention_ref(*args, ctx_range=torch.tensor([[4, 16]]), ctx_temperature=0.5, ctx_lse_scale=0.5)
    assert torch.equal(base, out)
