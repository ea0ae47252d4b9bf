"""Shared-chunk attention: one pass over a page's K/V for every query that holds it.

``_shared_fwd`` runs the shared work items of a ``lazyllm.kernels.grouping.GroupPlan``: a
program takes one item and one KV head, loads its members' queries (members times the ``G``
query heads of the KV head: the rows of the MMA tile), rotates each into the item's pages'
stored frame, ``R(-delta) q`` with the member's own delta, and walks the pages, so one tile
of K and V serves queries that place the pages at different positions. Each row writes a
partial softmax state (normalized output and log-sum-exp) to its member's slot.
``_own_merge`` then attends each query to its own pages (question, generated tokens) and
merges its shared slots into the same online softmax. The same function as ``paged_attention_triton``
over the tables (and ``reference.grouped_attention_ref``, the plain-torch twin).
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl
from lazyllm.intmath import next_pow2

from ._common import _LOG2E, _M_INIT, _cos_sin_of, _interpreting, _max, _sum
from .launcher import _validate

__all__ = ["grouped_attention_triton"]


@triton.jit
def _rotate(q, qsw, delta, inv, in_rot, dtype, APPROX: tl.constexpr):
    """``R(-delta) q`` per row: ``q * [c, c, 1] + [q2, -q1, 0] * [s, s, 0]``, in ``dtype``."""
    c, s = _cos_sin_of(delta.to(tl.float32)[:, None] * inv[None, :], APPROX)
    c = tl.where(in_rot[None, :], c, 1.0)
    s = tl.where(in_rot[None, :], s, 0.0)
    return (q * c + qsw * s).to(dtype)


@triton.jit
def _load_q(Q, q_row, row_ok, offs_d, HALF: tl.constexpr, ROT: tl.constexpr, USE_ROPE: tl.constexpr):
    """The query rows (float32) and their rotate-half partners ``[q2, -q1, 0]``."""
    q = tl.load(q_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    if USE_ROPE:
        is_lo = offs_d < HALF
        sw_col = tl.where(is_lo, offs_d + HALF, offs_d - HALF)
        qsw = tl.load(q_row[:, None] + sw_col[None, :], mask=row_ok[:, None] & (offs_d < ROT)[None, :],
                      other=0.0).to(tl.float32)
        qsw = tl.where(is_lo[None, :], qsw, -qsw)
    else:
        qsw = q
    return q, qsw


@triton.jit
def _page_step(qr, K, V, kvh, page, ln, kpos0, qpos, m_i, l_i, acc, qk_scale,
               stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
               offs_n, offs_d, DOT_PREC: tl.constexpr):
    """One page of keys into the online softmax of the rows ``qr`` (log2 domain); slots
    past ``ln`` and keys after a row's query position are masked."""
    kvalid = offs_n < ln  # a padding column (length 0) loads nothing
    k = tl.load((K + kvh * stride_kh + page * stride_kp + offs_n * stride_ks)[:, None] + offs_d[None, :],
                mask=kvalid[:, None], other=0.0)
    qk = tl.dot(qr, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    seen = kvalid[None, :] & (kpos0[:, None] + offs_n[None, :] <= qpos[:, None])
    qk = tl.where(seen, qk, float("-inf"))
    m_new = tl.maximum(m_i, _max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + _sum(p, 1)
    v = tl.load((V + kvh * stride_vh + page * stride_vp + offs_n * stride_vs)[:, None] + offs_d[None, :],
                mask=kvalid[:, None], other=0.0)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(V.dtype.element_ty), v, acc, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _shared_fwd(
    Q, QPos, K, V, InvFreq, Items, Pages, Members, PartO, PartLse,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    NUM_Q_HEADS: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, PAGE_SIZE: tl.constexpr,
    USE_ROPE: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr, APPROX: tl.constexpr,
):
    """Shared items; grid ``(num_kv_heads, n_items)``. Row ``r`` of the tile is member
    ``r // G``'s query head ``kvh * G + r % G``; an item with no member (padding of the
    grid) returns. The item's pages come from ``Pages`` (page, stored position, length) and
    each member's delta from ``Members``, so the query is rotated once, before the loop, and a
    step reads three scalars and one K/V tile. Each row writes its partial (normalized
    output, log2-sum-exp) to its member's slot."""
    kvh = tl.program_id(0)
    it = tl.program_id(1).to(tl.int64)
    m_off = tl.load(Items + it * 4)
    n_mem = tl.load(Items + it * 4 + 1)
    if n_mem == 0:
        return
    p_off = tl.load(Items + it * 4 + 2).to(tl.int64)
    n_pages = tl.load(Items + it * 4 + 3)

    rows = tl.arange(0, BLOCK_M)
    mem = rows // G
    row_ok = mem < n_mem
    head = kvh * G + rows % G
    mrow = (m_off + mem).to(tl.int64) * 4
    qi = tl.load(Members + mrow, mask=row_ok, other=0)
    qpos = tl.load(QPos + qi, mask=row_ok, other=0).to(tl.int32)
    delta = tl.load(Members + mrow + 3, mask=row_ok, other=0).to(tl.int32)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, PAGE_SIZE)
    q, qsw = _load_q(Q, Q + qi.to(tl.int64) * stride_qt + head * stride_qh, row_ok, offs_d, HALF, ROT, USE_ROPE)
    if USE_ROPE:
        in_rot = offs_d < ROT
        inv = tl.load(InvFreq + offs_d % HALF, mask=in_rot, other=0.0)
        qr = _rotate(q, qsw, delta, inv, in_rot, K.dtype.element_ty, APPROX)
    else:
        qr = q.to(K.dtype.element_ty)

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    for kk in range(0, n_pages):
        pe = (p_off + kk) * 3
        page = tl.load(Pages + pe)
        page = page.to(tl.int64) if IDX64 else page.to(tl.int32)
        kpos0 = tl.load(Pages + pe + 1) + delta  # each member's position of the page's slot 0
        m_i, l_i, acc = _page_step(qr, K, V, kvh, page, tl.load(Pages + pe + 2), kpos0, qpos, m_i, l_i, acc,
                                   qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                                   offs_n, offs_d, DOT_PREC)

    seen_any = l_i > 0.0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    slot = tl.load(Members + mrow + 2, mask=row_ok, other=0).to(tl.int64)
    part = slot * NUM_Q_HEADS + head
    tl.store(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
    lse = tl.where(seen_any, m_i + tl.math.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    tl.store(PartLse + part, lse, mask=row_ok)


@triton.jit
def _own_merge(
    Q, QPos, K, V, BT, BPos, BDelta, BLen, InvFreq, Own, Cols, Parts, PartO, PartLse, Out,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, TAIL: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, PAGE_SIZE: tl.constexpr,
    USE_ROPE: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr, APPROX: tl.constexpr,
):
    """A query's own pages and the merge of its shared slots; grid ``(total_q,
    num_kv_heads)``, rows the ``G`` query heads of the KV head. The own pages are read from
    the tables at the columns ``Cols`` names (the query rotated again where the delta
    changes); the shared slots' partials then join the same online softmax, and the row's
    output is written."""
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G
    head = kvh * G + rows % G
    trow = tl.load(Own + t * 3).to(tl.int64)
    c_off = tl.load(Own + t * 3 + 1)
    n_c = tl.load(Own + t * 3 + 2)
    qpos = tl.load(QPos + t + rows * 0).to(tl.int32)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, PAGE_SIZE)
    q, qsw = _load_q(Q, Q + t * stride_qt + head * stride_qh, row_ok, offs_d, HALF, ROT, USE_ROPE)
    if USE_ROPE:
        in_rot = offs_d < ROT
        inv = tl.load(InvFreq + offs_d % HALF, mask=in_rot, other=0.0)
    qr = q.to(K.dtype.element_ty)
    d_prev = tl.full([BLOCK_M], 0, dtype=tl.int32)  # q itself is R(0) q

    # columns of length 0 at the end of the list (the plan's room for pages the table has not
    # got yet) are skipped: the last TAIL columns are scanned for the last one in use
    tail = tl.maximum(n_c - TAIL, 0) + tl.arange(0, TAIL)
    t_ok = tail < n_c
    t_len = tl.load(BLen + trow * stride_bt + tl.load(Cols + c_off + tail, mask=t_ok, other=0), mask=t_ok, other=0)
    t_used = _max(tl.where(t_len > 0, tail + 1, 0), 0)
    n_c = tl.where(t_used > 0, t_used, tl.maximum(n_c - TAIL, 0))

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    for kk in range(0, n_c):
        ent = trow * stride_bt + tl.load(Cols + c_off + kk)
        page = tl.load(BT + ent)
        page = page.to(tl.int64) if IDX64 else page.to(tl.int32)
        if USE_ROPE:
            dl = tl.load(BDelta + ent) + rows * 0
            if _max(tl.where(dl != d_prev, 1, 0), 0) > 0:  # a new delta: rotate again
                qr = _rotate(q, qsw, dl, inv, in_rot, K.dtype.element_ty, APPROX)
                d_prev = dl
        m_i, l_i, acc = _page_step(qr, K, V, kvh, page, tl.load(BLen + ent), tl.load(BPos + ent) + rows * 0, qpos,
                                   m_i, l_i, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                                   stride_vh, offs_n, offs_d, DOT_PREC)

    first = tl.load(Parts + t * 2).to(tl.int64)
    n_s = tl.load(Parts + t * 2 + 1)
    for j in range(0, n_s):
        part = (first + j) * NUM_Q_HEADS + head
        lse = tl.load(PartLse + part, mask=row_ok, other=float("-inf"))
        o = tl.load(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.math.exp2(m_i - m_new)
        w = tl.math.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * w[:, None]
        l_i = l_i * alpha + w
        m_i = m_new
    res = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store((Out + t * stride_ot + head * stride_oh)[:, None] + offs_d[None, :], res.to(Out.dtype.element_ty),
             mask=row_ok[:, None])


def grouped_attention_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    block_pos: torch.Tensor,
    block_delta: torch.Tensor,
    block_len: torch.Tensor,
    inv_freq: torch.Tensor,
    sm_scale: float,
    plan,
    out: torch.Tensor | None = None,
    *,
    members_per_item: int,
    part_o: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    use_rope: bool = True,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Shared-chunk attention (``reference.grouped_attention_ref``) with the Triton kernels.

    ``plan``: ``GroupTensors`` (``GroupPlan.tensors(device)``), contiguous int32 on the
    device; ``block_*`` share one row stride (the engine's table planes). Two launches: the
    shared items (one program per item and KV head; items with no member are skipped, so a
    CUDA graph can be captured over fixed-size plan buffers whose unused items are zero),
    then one program per query and KV head for its own pages and the merge of its slots.
    ``members_per_item``: the plan's (the query tile holds that many members). ``part_o``
    ``(>= slots, heads, d)`` / ``part_lse`` ``(>= slots, heads)`` float32: scratch for the
    shared partial states (allocated when not given). ``use_rope=False``: no rotation
    (deltas ignored).
    """
    _validate(q, k_cache, v_cache, inv_freq)  # the shapes paged_attention_triton accepts
    total_q, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    if page_size < 16:
        raise ValueError(f"grouped attention needs pages of at least 16 tokens, got {page_size}")
    strides = {block_table.stride(0), block_pos.stride(0), block_delta.stride(0), block_len.stride(0)}
    if len(strides) != 1 or block_table.stride(1) != 1:
        raise ValueError("block_table/pos/delta/len must share one row stride and contiguous columns")
    for name in ("items", "pages", "members", "own", "cols", "parts"):
        t = getattr(plan, name)
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"plan.{name} must be a contiguous int32 tensor")
    if plan.own.shape[0] < total_q or plan.parts.shape[0] < total_q:
        raise ValueError(f"plan.own/parts have fewer rows than the {total_q} queries")
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if total_q == 0:
        return out
    n_slots = plan.members.shape[0]
    if part_o is None:
        part_o = torch.empty((max(1, n_slots), hq, d), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((max(1, n_slots), hq), device=q.device, dtype=torch.float32)
    half = int(inv_freq.numel())
    use_rope = bool(use_rope) and half > 0
    inv = (inv_freq.to(device=q.device, dtype=torch.float32).contiguous() if half
           else q.new_zeros(1, dtype=torch.float32))
    if q.stride(-1) != 1:
        q = q.contiguous()
    interp = _interpreting()
    common = dict(NUM_Q_HEADS=hq, G=group, HEAD_DIM=d, HALF=max(half, 1), ROT=2 * half, PAGE_SIZE=page_size,
                  USE_ROPE=use_rope, DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32",
                  IDX64=max(k_cache.numel(), v_cache.numel()) >= 2**31, APPROX=not interp,
                  num_warps=num_warps, num_stages=1 if interp else num_stages)
    kv_strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    scale = float(sm_scale) * _LOG2E
    if plan.items.shape[0]:
        _shared_fwd[(hkv, plan.items.shape[0])](
            q, q_pos, k_cache, v_cache, inv, plan.items, plan.pages, plan.members, part_o, part_lse, scale,
            *kv_strides, BLOCK_M=max(16, next_pow2(members_per_item * group)), **common)
    target = out if out.stride(-1) == 1 else torch.empty_like(q)
    _own_merge[(total_q, hkv)](
        q, q_pos, k_cache, v_cache, block_table, block_pos, block_delta, block_len, inv, plan.own, plan.cols,
        plan.parts, part_o, part_lse, target, scale, *kv_strides, block_table.stride(0), target.stride(0),
        target.stride(1), BLOCK_M=max(16, next_pow2(group)), TAIL=16, **common)
    if target is not out:
        out.copy_(target)
    return out
