"""The torch reference (the specification) against attention computed from scratch."""
import pytest
import torch

from lazyllm.kernels.reference import (
    apply_rope,
    paged_attention_mass_ref,
    paged_attention_ref,
    rerotate_copy_ref,
    rope_cos_sin,
    rotate_by_delta,
    write_kv_ref,
)


def _inv_freq(rotary_dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def test_rotation_composes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 32, generator=g)
    inv = _inv_freq(24)  # partial rotary: 8 dims pass through
    a = torch.randint(-100, 100, (50,), generator=g)
    b = torch.randint(-100, 100, (50,), generator=g)
    once = rotate_by_delta(x, a + b, inv)
    twice = rotate_by_delta(rotate_by_delta(x, a, inv), b, inv)
    torch.testing.assert_close(once, twice, atol=2e-5, rtol=1e-5)
    assert torch.equal(once[..., 24:], x[..., 24:])


@pytest.mark.parametrize("hq,hkv,d,rot", [(4, 4, 32, 32), (6, 2, 32, 16), (8, 1, 64, 64)])
def test_paged_attention_matches_dense(hq, hkv, d, rot):
    """Build sequences of chunks placed at logical offsets, store keys at local positions in
    shuffled pages, and compare with dense attention over keys rotated at logical positions."""
    g = torch.Generator().manual_seed(hq * 100 + d)
    ps, inv, scale = 8, _inv_freq(rot), d ** -0.5
    n_pages = 64
    k_cache = torch.randn(n_pages, ps, hkv, d, generator=g)
    v_cache = torch.randn(n_pages, ps, hkv, d, generator=g)
    free = torch.randperm(n_pages, generator=g).tolist()
    seqs = []
    for _ in range(3):
        # segments: (logical start, stored start, length); the last one is the query segment
        lens = [int(x) for x in torch.randint(1, 20, (3,), generator=g)]
        nq = int(torch.randint(1, 6, (1,), generator=g))
        pos, segs = 0, []
        for L in lens:
            segs.append((pos, int(torch.randint(0, 5, (1,), generator=g)), L))
            pos += L
        segs.append((pos, pos, nq))  # own tokens, computed in the request's frame
        seqs.append(segs)
    q_list, qpos_list, cu, tables = [], [], [0], []
    ref_out = []
    for segs in seqs:
        raw_k, raw_v, kpos, table = [], [], [], []
        for (lpos, spos, L) in segs:
            kr = torch.randn(L, hkv, d, generator=g)
            vr = torch.randn(L, hkv, d, generator=g)
            stored = apply_rope(kr, *rope_cos_sin(torch.arange(spos, spos + L), inv))
            for i0 in range(0, L, ps):
                p = free.pop()
                n = min(ps, L - i0)
                k_cache[p, :n] = stored[i0:i0 + n]
                v_cache[p, :n] = vr[i0:i0 + n]
                table.append((p, lpos + i0, lpos - spos, n))
            raw_k.append(kr)
            raw_v.append(vr)
            kpos.append(torch.arange(lpos, lpos + L))
        kr, vr, kp = torch.cat(raw_k), torch.cat(raw_v), torch.cat(kpos)
        qstart, _, nq = segs[-1]
        qpos = torch.arange(qstart, qstart + nq)
        qr = torch.randn(nq, hq, d, generator=g)
        q = apply_rope(qr, *rope_cos_sin(qpos, inv))
        kd = apply_rope(kr, *rope_cos_sin(kp, inv)).repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, kd) * scale
        s = s.masked_fill(~(kp[None, None, :] <= qpos[None, :, None]), float("-inf"))
        ref_out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vr.repeat_interleave(hq // hkv, 1)))
        q_list.append(q)
        qpos_list.append(qpos)
        cu.append(cu[-1] + nq)
        table.append((0, 0, 0, 0))  # a padding entry must be ignored
        tables.append(table)
    width = max(len(t) for t in tables)
    T = {f: torch.zeros(len(tables), width, dtype=torch.int32) for f in "tpdl"}
    for b, t in enumerate(tables):
        for j, (p, lp, dl, n) in enumerate(t):
            T["t"][b, j], T["p"][b, j], T["d"][b, j], T["l"][b, j] = p, lp, dl, n
    out = paged_attention_ref(torch.cat(q_list), torch.cat(qpos_list), torch.tensor(cu), k_cache, v_cache,
                              T["t"], T["p"], T["d"], T["l"], inv, scale)
    torch.testing.assert_close(out, torch.cat(ref_out), atol=1e-4, rtol=1e-4)


def test_query_with_no_visible_key_is_zero():
    k = torch.randn(2, 4, 1, 8)
    out = paged_attention_ref(torch.randn(1, 1, 8), torch.tensor([0]), torch.tensor([0, 1]), k, k,
                              torch.tensor([[1]], dtype=torch.int32), torch.tensor([[5]], dtype=torch.int32),
                              torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[4]], dtype=torch.int32),
                              _inv_freq(8), 1.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_rerotate_copy_and_write_kv():
    g = torch.Generator().manual_seed(3)
    L, P, ps, h, d = 2, 6, 4, 2, 16
    k = torch.randn(L, P, ps, h, d, generator=g)
    v = torch.randn(L, P, ps, h, d, generator=g)
    inv = _inv_freq(16)
    k0, v0 = k.clone(), v.clone()
    rerotate_copy_ref(k, v, torch.tensor([0, 1]), torch.tensor([4, 5]), torch.tensor([7, -3]), inv)
    for src, dst, dl in ((0, 4, 7), (1, 5, -3)):
        for layer in range(L):
            torch.testing.assert_close(k[layer, dst], rotate_by_delta(k0[layer, src], torch.full((ps,), dl), inv))
            assert torch.equal(v[layer, dst], v0[layer, src])
    assert torch.equal(k[:, :4], k0[:, :4])
    kn, vn = torch.randn(3, h, d, generator=g), torch.randn(3, h, d, generator=g)
    write_kv_ref(k[0], v[0], torch.tensor([1, 6, 23]), kn, vn)
    assert torch.equal(k[0, 0, 1], kn[0]) and torch.equal(k[0, 1, 2], kn[1]) and torch.equal(v[0, 5, 3], vn[2])


@pytest.mark.parametrize("hq,hkv,window", [(4, 2, None), (3, 3, 5)])
def test_attention_mass_is_the_reference_softmax(hq, hkv, window):
    """Mass per slot = the probabilities paged_attention_ref applies to it: with one-hot
    values (one dimension per slot), the reference output summed over heads and queries is
    exactly the mass."""
    g = torch.Generator().manual_seed(hq + hkv)
    ps, d, inv = 4, 64, _inv_freq(16)
    n_pages = 12
    k_cache = torch.randn(n_pages, ps, hkv, d, generator=g)
    v_cache = torch.zeros(n_pages, ps, hkv, d)
    for p in range(n_pages):
        for s in range(ps):
            v_cache[p, s, :, p * ps + s] = 1.0  # slot id as a one-hot value
    # two sequences: pages with shifted rotations, partial last pages, padding
    table = torch.tensor([[3, 7, 1, 0], [5, 9, 11, 2]], dtype=torch.int32)
    pos = torch.tensor([[0, 4, 8, 0], [0, 2, 6, 10]], dtype=torch.int32)
    delta = torch.tensor([[0, 9, -3, 0], [0, 5, 0, 2]], dtype=torch.int32)
    blen = torch.tensor([[4, 4, 3, 0], [2, 4, 4, 3]], dtype=torch.int32)
    q_pos = torch.tensor([9, 10, 11, 13, 14], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    q = torch.randn(5, hq, d, generator=g)
    args = (q, q_pos, cu, k_cache, v_cache, table, pos, delta, blen, inv, d ** -0.5)
    out = paged_attention_ref(*args, window=window)
    mass = paged_attention_mass_ref(*args, window=window)
    for b in range(2):
        summed = out[cu[b]:cu[b + 1]].sum(dim=(0, 1))  # (d,): mass per slot id
        for j in range(table.shape[1]):
            for s in range(ps):
                want = float(summed[int(table[b, j]) * ps + s]) if s < int(blen[b, j]) else 0.0
                assert abs(float(mass[b, j, s]) - want) < 1e-4, (b, j, s)
        # every query's probabilities sum to 1 over the slots it sees
        assert abs(float(mass[b].sum()) - hq * int(cu[b + 1] - cu[b])) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_is_batch_invariant(dtype):
    """``linear_rows`` (the ``batch_invariant`` projections): a row's output is bit-for-bit
    the same whatever rows share the call, and equals ``F.linear`` up to rounding."""
    from lazyllm.model.linear import linear_rows

    torch.manual_seed(0)
    w = torch.randn(96, 64).to(dtype)
    bias = torch.randn(96).to(dtype)
    x = torch.randn(300, 64).to(dtype)
    full = linear_rows(x, w, bias, rows=32)
    assert full.shape == (300, 96) and full.dtype == dtype
    for lo, hi in ((0, 1), (5, 6), (7, 40), (31, 33), (250, 300)):
        assert torch.equal(linear_rows(x[lo:hi], w, bias, rows=32), full[lo:hi])
        assert torch.equal(linear_rows(torch.cat([x[lo:hi], -x[:3]]), w, bias, rows=32)[: hi - lo], full[lo:hi])
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, bias), **tol)
    assert linear_rows(x[:0], w, None, rows=32).shape == (0, 96)


@pytest.mark.parametrize("seed", range(6))
def test_causal_fast_path_equals_the_masked_softmax(seed):
    """``_sdpa`` takes ``is_causal`` where the mask is causal over keys that end with the
    queries' own; every pattern, taken that way or not, equals softmax with the mask."""
    from lazyllm.kernels.reference import _sdpa

    g = torch.Generator().manual_seed(seed)
    nq = int(torch.randint(1, 40, (1,), generator=g))
    group = [1, 2, 3][seed % 3]
    for nk, window in ((nq, None), (nq + nq // 2, None), (nq + 5 * nq + 3, None), (nq + 3, 4)):
        hkv, d = 2, 16
        q = torch.randn(hkv * group, nq, d, generator=g)
        k, v = torch.randn(hkv, nk, d, generator=g), torch.randn(hkv, nk, d, generator=g)
        qpos = torch.arange(nk - nq, nk)
        allowed = torch.arange(nk)[None, :] <= qpos[:, None]
        if window is not None:
            allowed &= qpos[:, None] - torch.arange(nk)[None, :] < window
        kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        z = (q @ kk.transpose(1, 2)) * 0.25
        want = torch.softmax(z.masked_fill(~allowed[None], float("-inf")), -1) @ vv
        torch.testing.assert_close(_sdpa(q, k, v, allowed, 0.25, group), want, atol=2e-5, rtol=1e-5)
