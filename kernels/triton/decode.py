"""The decode kernel for pages smaller than the key tile, and the split-K merge.

``_paged_decode_fwd`` rotates the query per page: a key tile spans ``PPT`` pages with their
own deltas, so the program holds ``PPT`` copies of the query group, ``R(-delta_p) q``, as
extra rows of the (anyway padded to 16) MMA, and row group ``p`` sees only its page's keys.

Decode and short prefills split the key range of each sequence over ``num_splits``
programs (flash-decoding); ``_merge_splits`` merges the partial outputs (and decode's
page-slot row groups) by log-sum-exp.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import _M_INIT, _ctx_mask, _ctx_split, _max, _min, _sum


@triton.jit
def _load_qcs(Cos_row, Sin_row, t, max_blocks, row_ok, row_page, cs_col, in_rot,
              HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PPT: tl.constexpr):
    """Per query row ``(p, g)``: cos/sin ``(BLOCK_M, HEAD_DIM)`` of the ``p``-th page of key
    tile ``t``, laid out as ``[c, c, 1]`` / ``[s, s, 0]`` over the head dims."""
    e_row = (t * BLOCK_N) // PAGE_SIZE + row_page
    cm = (row_ok & (e_row < max_blocks))[:, None] & in_rot
    cs_off = e_row[:, None] * HALF + cs_col[None, :]
    c = tl.load(Cos_row + cs_off, mask=cm, other=1.0)
    s = tl.load(Sin_row + cs_off, mask=cm, other=0.0)
    return c, s


@triton.jit
def _paged_decode_fwd(
    Q, QPos, CuQ, K, V, BT, BPos, BLen, Cos, Sin, Out, PartO, PartLse,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_btb, stride_bpb, stride_blb,
    max_blocks, num_splits,
    NUM_Q_HEADS: tl.constexpr, G: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_OUT: tl.constexpr, USE_ROPE: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr,
    PREFETCH: tl.constexpr, WINDOW: tl.constexpr = 0,
    APE: tl.constexpr = False, CtxRange=None, ctx_inv_t=None,
):
    """Decode: one query per sequence, the delta applied to the *query*.

    Grid ``(num_kv_heads * num_splits, batch)``. A key tile spans ``PPT`` pages, each with
    its own delta, so the program keeps ``PPT`` copies of the query group as rows
    ``p * G + g``: row group ``p`` holds ``R(-delta) q`` for the tile's ``p``-th page and
    sees only that page's keys. Rotating ``PPT * G`` query rows costs a quarter of
    rotating the ``BLOCK_N`` keys (G=4, pages of 16), and K goes from shared memory to
    the tensor cores untouched. Row group ``p`` is a partial softmax over the pages
    ``p, p + PPT, ...``; all are written as partials ``split * PPT + p`` for
    ``_merge_splits`` (``SPLIT_OUT``), or straight to ``Out`` when there is one.

    ``WINDOW`` (``0``: none): a sliding window, the query at ``p`` sees keys at
    ``p - WINDOW < pos <= p``. A scan of the table row finds the entries the window can
    reach, and the key range (and its splits) covers only their tiles; keys inside it but
    outside the window are masked, so any table order is served exactly.

    ``APE``: APE-style context calibration, as ``prefill._paged_attn_fwd`` computes it (the
    splits ``[0, num_splits / 2)`` the keys but the context, the others the context keys with
    their logits scaled by ``ctx_inv_t``; ``SPLIT_OUT``). The other-keys class skips the
    tiles of a block of entries holding only context keys (``_ctx_split``): its loop walks
    virtual tiles. Needs ``PREFETCH`` off.
    """
    pid_hs = tl.program_id(0)
    b = tl.program_id(1)
    kvh = pid_hs // num_splits
    split = pid_hs % num_splits
    q_start = tl.load(CuQ + b).to(tl.int32)
    if tl.load(CuQ + b + 1).to(tl.int32) == q_start:
        return

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < PPT * G
    row_page = rows // G
    head = kvh * G + rows % G
    qpos = tl.load(QPos + q_start + rows * 0).to(tl.int32)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_row = Q + q_start.to(tl.int64) * stride_qt + head * stride_qh
    # q and its rotate-half partner stay in the cache dtype (exact: q is stored in it) until
    # each tile's rotation, to keep registers for occupancy
    q = tl.load(q_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(K.dtype.element_ty)
    if USE_ROPE:
        # q' = R(-delta) q = q * [c, c, 1] + [q2, -q1, 0] * [s, s, 0]
        is_lo = offs_d < HALF
        sw_col = tl.where(is_lo, offs_d + HALF, offs_d - HALF)
        sw_mask = row_ok[:, None] & (offs_d < ROT)[None, :]
        qsw = tl.load(q_row[:, None] + sw_col[None, :], mask=sw_mask, other=0.0).to(K.dtype.element_ty)
        qsw = tl.where(is_lo[None, :], qsw, -qsw)
        cs_col = offs_d % HALF
        in_rot = (offs_d < ROT)[None, :]
    else:
        qsw = q
        cs_col = offs_d
        in_rot = (offs_d < 0)[None, :]

    BT_row = BT + b.to(tl.int64) * stride_btb
    BPos_row = BPos + b.to(tl.int64) * stride_bpb
    BLen_row = BLen + b.to(tl.int64) * stride_blb
    Cos_row = Cos + b.to(tl.int64) * max_blocks * HALF
    Sin_row = Sin + b.to(tl.int64) * max_blocks * HALF
    Kh = K + kvh * stride_kh
    Vh = V + kvh * stride_vh

    if WINDOW > 0:
        qp = tl.load(QPos + q_start).to(tl.int32)
        lo_e = max_blocks
        hi_e = 0
        for e0 in range(0, max_blocks, 256):
            e = e0 + tl.arange(0, 256)
            em = e < max_blocks
            ln = tl.load(BLen_row + e, mask=em, other=0).to(tl.int32)
            bp = tl.load(BPos_row + e, mask=em, other=0).to(tl.int32)
            reach = (ln > 0) & (bp <= qp) & (bp + ln - 1 > qp - WINDOW)
            lo_e = tl.minimum(lo_e, _min(tl.where(reach, e, max_blocks), 0))
            hi_e = tl.maximum(hi_e, _max(tl.where(reach, e + 1, 0), 0))
        t_hi = (hi_e * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
        t_lo = tl.minimum((lo_e * PAGE_SIZE) // BLOCK_N, t_hi)
        per_split = (t_hi - t_lo + num_splits - 1) // num_splits
        s_start = t_lo + split * per_split
        s_end = tl.minimum(s_start + per_split, t_hi)
    else:
        t_hi = (max_blocks * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
        per_split = (t_hi + num_splits - 1) // num_splits
        s_start = split * per_split
        s_end = tl.minimum(s_start + per_split, t_hi)

    if APE:
        n_cls = num_splits // 2
        ape_ctx = (split >= n_cls).to(tl.int32)
        ctx_c0 = tl.load(CtxRange + b * 2).to(tl.int32)
        ctx_c1 = tl.load(CtxRange + b * 2 + 1).to(tl.int32)
        after = tl.load(QPos + q_start).to(tl.int32) >= ctx_c1
        s_start, s_end, h0, hole = _ctx_split(BLen_row, BPos_row, ctx_c0, ctx_c1, max_blocks, t_lo if WINDOW > 0 else 0,
                                              t_hi, split % n_cls, n_cls, ape_ctx, after.to(tl.int32),
                                              after.to(tl.int32), PAGE_SIZE, BLOCK_N, 256)
        qk_scale = tl.where(ape_ctx != 0, qk_scale * ctx_inv_t, qk_scale)

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    c_n, s_n = _load_qcs(Cos_row, Sin_row, s_start, max_blocks * (USE_ROPE and PREFETCH), row_ok, row_page,
                         cs_col, in_rot, HALF, PAGE_SIZE, BLOCK_N, PPT)
    for t in range(s_start, s_end):
        if APE:  # a virtual tile: past the hole
            t = tl.where(t >= h0, t + hole, t)
        idx = t * BLOCK_N + offs_n
        ent = idx // PAGE_SIZE
        slot = idx % PAGE_SIZE
        ln = tl.load(BLen_row + ent, mask=ent < max_blocks, other=0)
        kvalid = slot < ln
        page = tl.load(BT_row + ent, mask=kvalid, other=0)
        page = page.to(tl.int64) if IDX64 else page.to(tl.int32)  # int32 offsets: fewer registers
        k = tl.load((Kh + page * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :],
                    mask=kvalid[:, None], other=0.0)
        if USE_ROPE:
            if PREFETCH:
                c, s = c_n, s_n
                c_n, s_n = _load_qcs(Cos_row, Sin_row, t + 1, max_blocks, row_ok, row_page, cs_col, in_rot,
                                     HALF, PAGE_SIZE, BLOCK_N, PPT)
            else:
                c, s = _load_qcs(Cos_row, Sin_row, t, max_blocks, row_ok, row_page, cs_col, in_rot,
                                 HALF, PAGE_SIZE, BLOCK_N, PPT)
            qr = (q.to(tl.float32) * c + qsw.to(tl.float32) * s).to(K.dtype.element_ty)
        else:
            qr = q.to(K.dtype.element_ty)
        qk = tl.dot(qr, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        kpos = tl.load(BPos_row + ent, mask=kvalid, other=0).to(tl.int32) + slot
        seen = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        if WINDOW > 0:
            seen = seen & (qpos[:, None] - kpos[None, :] < WINDOW)
        if PPT > 1:
            seen = seen & ((ent % PPT)[None, :] == row_page[:, None])
        if APE:
            seen = _ctx_mask(seen, kpos, qpos, ctx_c0, ctx_c1, ape_ctx)
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, _max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + _sum(p, 1)
        v = tl.load((Vh + page * stride_vp + slot * stride_vs)[:, None] + offs_d[None, :],
                    mask=kvalid[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(V.dtype.element_ty), v, acc, input_precision=DOT_PREC)
        m_i = m_new

    seen_any = l_i > 0.0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    if SPLIT_OUT:
        part = (q_start.to(tl.int64) * NUM_Q_HEADS + head) * (num_splits * PPT) + split * PPT + row_page
        tl.store(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(seen_any, m_i + tl.math.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + part, lse, mask=row_ok)
    else:
        o_ptr = Out + q_start.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(o_ptr[:, None] + offs_d[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits(
    PartO, PartLse, Out, stride_ot, stride_oh, num_splits,
    NUM_Q_HEADS: tl.constexpr, SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, APE: tl.constexpr = False, ctx_lse_scale=None,
):
    """Log-sum-exp merge of ``num_splits`` partial outputs; grid ``(total_q * heads,)``.

    ``APE``: the upper half of the partials are the context keys' (APE-style calibration);
    with ``L_C`` their merged log-sum-exp, each of them is weighted as if its log-sum-exp
    were ``+ (ctx_lse_scale - 1) * L_C``, so the context as a whole weighs
    ``e^{ctx_lse_scale * L_C}`` against the other keys' ``e^{L_N}``."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid // NUM_Q_HEADS
    h = pid % NUM_Q_HEADS
    s = tl.arange(0, SPLITS_P)
    sm = s < num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(PartLse + pid * num_splits + s, mask=sm, other=float("-inf"))
    if APE:
        is_ctx = sm & (s >= num_splits // 2)
        lse_c = tl.where(is_ctx, lse, float("-inf"))
        mc = _max(lse_c, 0)
        mc = tl.where(mc == float("-inf"), 0.0, mc)
        sc = _sum(tl.math.exp2(lse_c - mc), 0)  # 0: no context key
        lc = mc + tl.math.log2(tl.where(sc > 0.0, sc, 1.0))
        adj = tl.where(sc > 0.0, (ctx_lse_scale - 1.0) * lc, 0.0)
        lse = tl.where(is_ctx, lse + adj, lse)
    m = _max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0
    w = tl.math.exp2(lse - m)
    den = _sum(w, 0)
    o = tl.load(PartO + (pid * num_splits + s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=sm[:, None], other=0.0)
    res = _sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d, res.to(Out.dtype.element_ty))

