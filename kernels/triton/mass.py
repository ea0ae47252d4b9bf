"""``paged_attention_mass_triton``: the attention mass each key slot receives (Triton).

The same function as ``reference.paged_attention_mass_ref``: the softmax probabilities of
``paged_attention_ref`` (same arguments, same masking, sliding window included), summed over
query heads and over each sequence's queries, per table slot. The engine reads it to choose
which cached chunk tokens a question attends to most (attention-guided recompute).

Two passes over the same scores:

* ``_mass_lse``: one program per (query tile, KV head, key split, sequence), rows ``(query,
  q-head of the group)`` as in the prefill kernel, walks its share of the key tiles of its
  table row with the online max/sum and writes each row's log2-sum-exp (``-inf`` for a row
  that sees no key); the splits (few query tiles: a long context and a short question) are
  merged on the host.
* ``_mass_sum``: one program per (key tile, KV head, sequence) loads its key tile once,
  walks all of the sequence's query rows of the group, and sums ``exp2(s - lse)`` over them
  into its slots: one partial per KV head, added up on the host side (deterministic).

A key tile spans ``BLOCK_N`` table slots (several pages, or part of one). Its keys are
rotated by their entry's delta, ``R(delta) k``, with the cos/sin table of ``rope.rope_table``
(the reference's arithmetic) and rounded to the cache's dtype, exactly as the reference
does; the score is one product per part of the head (the two rotary halves, the rest), so
the rotation needs no shuffle, and the scores match the reference's to float32 rounding.
Padding entries (``block_len == 0``) and slots past an entry's length are never read.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl
from lazyllm.intmath import next_pow2

from ._common import _LOG2E, _M_INIT, _interpreting, _max, _min, _sum
from .launcher import _num_sms
from .rope import _cos_sin

__all__ = ["paged_attention_mass_triton"]

# query rows (query, q-head) and key slots per tile: 64 each, 32 past head_dim 128 (registers
# and shared memory)
_BLOCK = {True: 64, False: 32}
_SCAN_BLOCK = 256  # table entries per step of the key-range scan


@triton.jit
def _key_tile(K, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, stride_kp, stride_ks, t, max_blocks,
              HALF: tl.constexpr, HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr,
              PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_ROPE: tl.constexpr, DOT_LOW: tl.constexpr,
              IDX64: tl.constexpr):
    """Key tile ``t`` of a table row: its rotary halves rotated by their entry's delta,
    ``k1' = k1 c - k2 s``, ``k2' = k2 c + k1 s`` (``(BLOCK_N, HALF_P)``, rounded to the cache's
    dtype as the reference rounds ``R(delta) k``), its other dims ``(BLOCK_N, PASS_P)`` (the
    whole head without RoPE), all float32 unless ``DOT_LOW``; the keys' positions and which
    slots are valid (padding entries and slots past ``block_len`` are not read). A tile
    inside one page (``PAGE_SIZE % BLOCK_N == 0``) loads one cos/sin row, else one per slot."""
    offs_n = tl.arange(0, BLOCK_N)
    idx = t * BLOCK_N + offs_n
    ent = idx // PAGE_SIZE
    slot = idx % PAGE_SIZE
    ln = tl.load(BLen_row + ent, mask=ent < max_blocks, other=0)
    kvalid = slot < ln
    page = tl.load(BT_row + ent, mask=kvalid, other=0)
    page = page.to(tl.int64) if IDX64 else page.to(tl.int32)
    k_row = (K + page * stride_kp + slot * stride_ks)[:, None]
    dt = K.dtype.element_ty if DOT_LOW else tl.float32
    if PASS > 0:
        offs_p = tl.arange(0, PASS_P)
        kp = tl.load(k_row + 2 * HALF + offs_p[None, :], mask=kvalid[:, None] & (offs_p < PASS)[None, :],
                     other=0.0).to(dt)
    if USE_ROPE:
        offs_h = tl.arange(0, HALF_P)
        hmask = kvalid[:, None] & (offs_h < HALF)[None, :]
        k1 = tl.load(k_row + offs_h[None, :], mask=hmask, other=0.0).to(tl.float32)
        k2 = tl.load(k_row + HALF + offs_h[None, :], mask=hmask, other=0.0).to(tl.float32)
        if PAGE_SIZE % BLOCK_N == 0:  # one entry, one delta
            e = (t * BLOCK_N) // PAGE_SIZE
            cm = (offs_h < HALF) & (e < max_blocks)
            c = tl.load(Cos_row + e * HALF + offs_h, mask=cm, other=1.0)[None, :]
            s = tl.load(Sin_row + e * HALF + offs_h, mask=cm, other=0.0)[None, :]
        else:
            cs_off = ent[:, None] * HALF + offs_h[None, :]
            c = tl.load(Cos_row + cs_off, mask=hmask, other=1.0)
            s = tl.load(Sin_row + cs_off, mask=hmask, other=0.0)
        k1r = (k1 * c - k2 * s).to(K.dtype.element_ty).to(dt)
        k2r = (k2 * c + k1 * s).to(K.dtype.element_ty).to(dt)
        if PASS == 0:
            kp = k1r  # unused
    else:
        k1r = kp  # unused
        k2r = kp
    kpos = tl.load(BPos_row + ent, mask=kvalid, other=0).to(tl.int32) + slot
    return k1r, k2r, kp, kpos, kvalid


@triton.jit
def _query_rows(Q, QPos, q_start, n_rows, r0, kvh, stride_qt, stride_qh,
                NUM_Q_HEADS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                PASS: tl.constexpr, PASS_P: tl.constexpr, BLOCK_M: tl.constexpr, USE_ROPE: tl.constexpr,
                DOT_LOW: tl.constexpr):
    """Rows ``r0 .. r0 + BLOCK_M`` of a sequence's group (row ``r`` is query ``r // G``, q
    head ``kvh * G + r % G``): which are rows, their queries split as the key tile is
    (rotary halves, other dims; float32 unless ``DOT_LOW``), positions, and flat
    ``(query, head)`` indices."""
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    qi = q_start + rows // G
    head = kvh * G + rows % G
    qpos = tl.load(QPos + qi, mask=row_ok, other=0).to(tl.int32)
    q_row = (Q + qi.to(tl.int64) * stride_qt + head * stride_qh)[:, None]
    dt = Q.dtype.element_ty if DOT_LOW else tl.float32
    if PASS > 0:
        offs_p = tl.arange(0, PASS_P)
        qp = tl.load(q_row + 2 * HALF + offs_p[None, :], mask=row_ok[:, None] & (offs_p < PASS)[None, :],
                     other=0.0).to(dt)
    if USE_ROPE:
        offs_h = tl.arange(0, HALF_P)
        hmask = row_ok[:, None] & (offs_h < HALF)[None, :]
        q1 = tl.load(q_row + offs_h[None, :], mask=hmask, other=0.0).to(dt)
        q2 = tl.load(q_row + HALF + offs_h[None, :], mask=hmask, other=0.0).to(dt)
        if PASS == 0:
            qp = q1  # unused
    else:
        q1 = qp  # unused
        q2 = qp
    return row_ok, q1, q2, qp, qpos, qi * NUM_Q_HEADS + head


@triton.jit
def _scores(q1, q2, qp, k1, k2, kp, row_ok, qpos, kpos, kvalid, qk_scale,
            PASS: tl.constexpr, USE_ROPE: tl.constexpr, DOT_PREC: tl.constexpr, WINDOW: tl.constexpr):
    """Scores in the log2 domain ``(BLOCK_M, BLOCK_N)``, one product per part of the head,
    and which of them a row sees (valid slot, causal by position, inside the window)."""
    if USE_ROPE:
        qk = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PREC)
        if PASS > 0:
            qk = tl.dot(qp, tl.trans(kp), qk, input_precision=DOT_PREC)
    else:
        qk = tl.dot(qp, tl.trans(kp), input_precision=DOT_PREC)
    qk = qk * qk_scale
    seen = row_ok[:, None] & kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
    if WINDOW > 0:
        seen = seen & (qpos[:, None] - kpos[None, :] < WINDOW)
    return qk, seen


# ``stride_split`` is the round's query rows times the heads: any integer, so not specialized
# (a round's odd row count would otherwise compile a second kernel while a request waits)
@triton.jit(do_not_specialize=["stride_split"])
def _mass_lse(
    Q, QPos, CuQ, K, BT, BPos, BLen, Cos, Sin, PartLse,
    qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh,
    stride_btb, stride_bpb, stride_blb,
    max_blocks, num_splits, stride_split,
    NUM_Q_HEADS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    PASS: tl.constexpr, PASS_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN_BLOCK: tl.constexpr,
    USE_ROPE: tl.constexpr, DOT_LOW: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Pass 1, grid ``(q_tiles, num_kv_heads * num_splits, batch)``: each row's log2-sum-exp
    over the keys it sees in split ``split`` of its key range, to ``PartLse[split]``
    ``(total_q, num_q_heads)`` (``-inf``: none seen); the splits are merged by the host.

    A scan of the table row bounds the key range: no entry past the last one whose start
    any row reaches is visited, nor (``WINDOW``) one before the first entry any row's
    window reaches; inside the range every tile is masked, so any table order is exact."""
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    b = tl.program_id(2)
    q_start = tl.load(CuQ + b).to(tl.int32)
    n_rows = (tl.load(CuQ + b + 1).to(tl.int32) - q_start) * G
    if pid_m * BLOCK_M >= n_rows:
        return
    row_ok, q1, q2, qp, qpos, flat = _query_rows(Q, QPos, q_start, n_rows, pid_m * BLOCK_M, kvh, stride_qt,
                                                 stride_qh, NUM_Q_HEADS, G, HALF, HALF_P, PASS, PASS_P, BLOCK_M,
                                                 USE_ROPE, DOT_LOW)
    BT_row = BT + b.to(tl.int64) * stride_btb
    BPos_row = BPos + b.to(tl.int64) * stride_bpb
    BLen_row = BLen + b.to(tl.int64) * stride_blb
    Cos_row = Cos + b.to(tl.int64) * max_blocks * HALF
    Sin_row = Sin + b.to(tl.int64) * max_blocks * HALF
    Kh = K + kvh * stride_kh

    qmin = _min(tl.where(row_ok, qpos, 2147483647), 0)
    qmax = _max(tl.where(row_ok, qpos, -2147483647), 0)
    lo_e = max_blocks
    hi_e = 0
    for e0 in range(0, max_blocks, SCAN_BLOCK):
        e = e0 + tl.arange(0, SCAN_BLOCK)
        em = e < max_blocks
        ln = tl.load(BLen_row + e, mask=em, other=0).to(tl.int32)
        bp = tl.load(BPos_row + e, mask=em, other=0).to(tl.int32)
        reach = (ln > 0) & (bp <= qmax)
        if WINDOW > 0:
            reach = reach & (bp + ln - 1 > qmin - WINDOW)
        hi_e = tl.maximum(hi_e, _max(tl.where(reach, e + 1, 0), 0))
        lo_e = tl.minimum(lo_e, _min(tl.where(reach, e, max_blocks), 0))
    t_hi = (hi_e * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
    t_lo = tl.minimum((lo_e * PAGE_SIZE) // BLOCK_N, t_hi)
    per_split = (t_hi - t_lo + num_splits - 1) // num_splits
    s_start = t_lo + split * per_split
    s_end = tl.minimum(s_start + per_split, t_hi)

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    for t in range(s_start, s_end):
        k1, k2, kp, kpos, kvalid = _key_tile(Kh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, stride_kp,
                                             stride_ks, t, max_blocks, HALF, HALF_P, PASS, PASS_P, PAGE_SIZE,
                                             BLOCK_N, USE_ROPE, DOT_LOW, IDX64)
        qk, seen = _scores(q1, q2, qp, k1, k2, kp, row_ok, qpos, kpos, kvalid, qk_scale, PASS, USE_ROPE, DOT_PREC,
                           WINDOW)
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, _max(qk, 1))
        l_i = l_i * tl.math.exp2(m_i - m_new) + _sum(tl.math.exp2(qk - m_new[:, None]), 1)
        m_i = m_new
    seen_any = l_i > 0.0
    lse = tl.where(seen_any, m_i + tl.math.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    tl.store(PartLse + split.to(tl.int64) * stride_split + flat, lse, mask=row_ok)


@triton.jit
def _mass_sum(
    Q, QPos, CuQ, K, BT, BPos, BLen, Cos, Sin, Lse, MassH,
    qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh,
    stride_btb, stride_bpb, stride_blb,
    max_blocks,
    NUM_Q_HEADS: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    PASS: tl.constexpr, PASS_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_ROPE: tl.constexpr, DOT_LOW: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Pass 2, grid ``(key_tiles, num_kv_heads, batch)``: the probability mass the key tile's
    slots get from every query row of the sequence's group, ``exp2(s - lse)`` summed over
    rows, to ``MassH`` ``(batch, num_kv_heads, max_blocks * page_size)`` (zero-initialized;
    a tile without a valid slot, or of a sequence without queries, writes nothing). Row
    tiles that see none of the tile's keys (all before it, or all past its window) are
    skipped."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CuQ + b).to(tl.int32)
    n_rows = (tl.load(CuQ + b + 1).to(tl.int32) - q_start) * G
    if n_rows == 0:
        return
    BT_row = BT + b.to(tl.int64) * stride_btb
    BPos_row = BPos + b.to(tl.int64) * stride_bpb
    BLen_row = BLen + b.to(tl.int64) * stride_blb
    Cos_row = Cos + b.to(tl.int64) * max_blocks * HALF
    Sin_row = Sin + b.to(tl.int64) * max_blocks * HALF
    k1, k2, kp, kpos, kvalid = _key_tile(K + kvh * stride_kh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row,
                                         stride_kp, stride_ks, t, max_blocks, HALF, HALF_P, PASS, PASS_P,
                                         PAGE_SIZE, BLOCK_N, USE_ROPE, DOT_LOW, IDX64)
    if _sum(kvalid.to(tl.int32), 0) == 0:
        return
    kmin = _min(tl.where(kvalid, kpos, 2147483647), 0)
    kmax = _max(tl.where(kvalid, kpos, -2147483647), 0)
    acc = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_M):
        row_ok, q1, q2, qp, qpos, flat = _query_rows(Q, QPos, q_start, n_rows, r0, kvh, stride_qt, stride_qh,
                                                     NUM_Q_HEADS, G, HALF, HALF_P, PASS, PASS_P, BLOCK_M,
                                                     USE_ROPE, DOT_LOW)
        qmax = _max(tl.where(row_ok, qpos, -2147483647), 0)
        reach = qmax >= kmin
        if WINDOW > 0:
            qmin = _min(tl.where(row_ok, qpos, 2147483647), 0)
            reach = reach & (qmin - kmax < WINDOW)
        if reach:
            lse = tl.load(Lse + flat, mask=row_ok, other=float("-inf"))
            qk, seen = _scores(q1, q2, qp, k1, k2, kp, row_ok, qpos, kpos, kvalid, qk_scale, PASS, USE_ROPE,
                               DOT_PREC, WINDOW)
            seen = seen & (lse > float("-inf"))[:, None]
            p = tl.where(seen, tl.math.exp2(qk - tl.where(seen, lse[:, None], 0.0)), 0.0)
            acc += _sum(p, 0)
    idx = t * BLOCK_N + tl.arange(0, BLOCK_N)
    out = MassH + (b.to(tl.int64) * tl.num_programs(1) + kvh) * (max_blocks * PAGE_SIZE)
    tl.store(out + idx, acc, mask=kvalid)


def paged_attention_mass_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    block_pos: torch.Tensor,
    block_delta: torch.Tensor,
    block_len: torch.Tensor,
    inv_freq: torch.Tensor,
    sm_scale: float,
    *,
    window: int | None = None,
    max_seqlen_q: int | None = None,
    rope: tuple[torch.Tensor, ...] | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention mass each key slot receives (Triton): the softmax probabilities of
    ``paged_attention_ref`` (same arguments, same masking), summed over query heads and over
    the sequence's queries. Same function as ``reference.paged_attention_mass_ref``.

    Parameters
    ----------
    q, q_pos, cu_seqlens_q, k_cache, block_table, block_pos, block_delta, block_len,
    inv_freq, sm_scale, window : as ``paged_attention_triton`` (any head_dim; ``k_cache``
        float16, bfloat16 or float32 with a contiguous last dim).
    v_cache : unused (signature parity with the reference).
    max_seqlen_q : the longest query count of a sequence; without it it is read from
        ``cu_seqlens_q`` on the host.
    rope : optional ``rope_table(block_delta, inv_freq)`` (or its ``(cos, sin)``), to share
        the table with the step's attention calls.
    num_splits : how many programs share a query tile's key range in the first pass
        (``None``: enough to fill the device when there are few query tiles).

    Returns
    -------
    ``(batch, max_blocks, page_size)`` float32; padding entries and invalid slots get 0.
    """
    total_q, hq, d = q.shape
    _, page_size, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"k_cache of shape {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    half = int(inv_freq.numel())
    if 2 * half > d:
        raise ValueError(f"rotary_dim {2 * half} exceeds head_dim {d}")
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache needs a contiguous last dim")
    batch, max_blocks = block_table.shape
    mass_h = torch.zeros((batch, hkv, max_blocks * page_size), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_blocks == 0:
        return mass_h.sum(1).view(batch, max_blocks, page_size)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q <= 0:
        return mass_h.sum(1).view(batch, max_blocks, page_size)
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_table, block_pos, block_len = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (block_table, block_pos, block_len))
    group = hq // hkv
    use_rope = half > 0
    if use_rope:
        if rope is None:
            rope = _cos_sin(block_delta, inv_freq.to(q.device))
        cos, sin = rope[0], rope[1]
        if cos.shape != (batch, max_blocks, half) or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"rope table of shape {tuple(cos.shape)}, expected {(batch, max_blocks, half)} contiguous")
    else:
        cos = sin = mass_h  # never read
    # 16-bit queries and keys of one dtype go to the dot as they are (exact products, float32
    # sums); otherwise both in float32 (the interpreter's 16-bit dot is not bf16-exact)
    dot_low = (not _interpreting() and q.dtype == k_cache.dtype
               and k_cache.dtype in (torch.float16, torch.bfloat16))
    block = _BLOCK[d <= 128]
    q_tiles = triton.cdiv(max_seqlen_q * group, block)
    kv_tiles = triton.cdiv(max_blocks * page_size, block)
    if window is not None:
        kv_tiles = min(kv_tiles, triton.cdiv(int(window) + max_seqlen_q, block) + 1)
    if num_splits is None:  # split the key range of pass 1 while there are fewer programs than SMs
        ctas, sms = q_tiles * hkv * batch, _num_sms(q.device)
        num_splits = max(1, min(triton.cdiv(2 * sms, ctas), kv_tiles // 4, 64)) if ctas < sms else 1
    num_splits = max(1, min(int(num_splits), kv_tiles))
    part_lse = torch.empty((num_splits, total_q, hq), dtype=torch.float32, device=q.device)
    pass_dim = d - 2 * half
    const = dict(NUM_Q_HEADS=hq, G=group, HALF=half, HALF_P=max(16, next_pow2(half)), PASS=pass_dim,
                 PASS_P=max(16, next_pow2(pass_dim)), PAGE_SIZE=page_size, BLOCK_M=block, BLOCK_N=block,
                 USE_ROPE=use_rope, DOT_LOW=dot_low, DOT_PREC="tf32" if dot_low else "ieee",
                 IDX64=k_cache.numel() >= 2**31, WINDOW=0 if window is None else int(window),
                 num_warps=4, num_stages=1 if _interpreting() else 2)
    tables = (q, q_pos, cu_seqlens_q, k_cache, block_table, block_pos, block_len, cos, sin)
    common = (float(sm_scale) * _LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
              k_cache.stride(2), block_table.stride(0), block_pos.stride(0), block_len.stride(0), max_blocks)
    _mass_lse[(q_tiles, hkv * num_splits, batch)](
        *tables, part_lse, *common, num_splits, total_q * hq, SCAN_BLOCK=_SCAN_BLOCK, **const)
    if num_splits == 1:
        lse = part_lse[0]
    else:  # log2-sum-exp over the splits (-inf where no split saw a key)
        m = part_lse.amax(0)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        lse = m + torch.exp2(part_lse - m).sum(0).log2()
    _mass_sum[(triton.cdiv(max_blocks * page_size, block), hkv, batch)](
        *tables, lse, mass_h, *common, **const)
    return mass_h.sum(1).view(batch, max_blocks, page_size)
