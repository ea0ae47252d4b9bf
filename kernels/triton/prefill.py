"""The paged prefill kernel (``_paged_attn_fwd``) and its key-tile loops.

How the kernel applies the deferred rotation
--------------------------------------------
One program owns ``BLOCK_M`` rows of one sequence and one KV head. A row is a
(query, q-head-in-group) pair, so a GQA group shares every K/V tile it loads. The program
walks the sequence's page table in a flat loop over key tiles of ``BLOCK_N`` table slots
(a tile spans ``BLOCK_N / page_size`` pages, or part of one page). For each tile it loads
the rotary part of K as two halves ``k1 = K[:, :half]`` and ``k2 = K[:, half:rot]``, so the
rotate-half needs no register shuffle, and turns them into ``R(delta) k`` with the
per-row cos/sin of that row's page delta::

    k1' = k1 c - k2 s,   k2' = k2 c + k1 s,   score = q1 . k1' + q2 . k2' + q_pass . k_pass

The cos/sin of ``delta * inv_freq`` are one table of ``(batch, max_blocks, half)`` values
computed once per launch by torch (``rope.rope_table``; exactly the reference's arithmetic),
so the kernel does no trigonometry. The rotated tile is rounded to the cache's dtype, as
the reference does, and fed to ``tl.dot`` like any K tile; there is no branch on the
delta inside the loop, so the loop stays software-pipelined.

The loop has two phases, as in Triton's fused-attention tutorial: tiles that every row of
the program sees in full (only slot validity is applied, as an additive column bias), then
tiles that need the causal mask. The program finds both bounds with one scan of its
table row, and never visits tiles past the last entry any of its rows can see. This is
exact for any table order and tight for the usual order (entries by position).

With pages of at least the key tile (the engine's default on CUDA: pages of 64) a key
tile has one delta, and the kernel rotates the *query* instead, ``R(-delta) q``, once per
run of table entries with the same delta (a chunk's pages form one run; ``delta_runs``),
so K goes from global memory to the tensor cores untouched, as in a RoPE-free kernel.
The loops, by the constexpr ``QROT`` (``int(options.KeyLoop)``; ``KernelOptions.loop`` names them):

* ``0`` ``"per_tile"`` (``_attn_tiles``): the keys rotated in every tile (pages smaller
  than the key tile).
* ``1`` ``"per_run"`` (``_attn_runs``): an outer loop over runs around a pipelined inner
  loop (the pipeline restarts at each run); other head dims and partial rotary.
* ``2`` ``"flat_runs"`` (``_attn_runs`` with ``FLAT``): one flat loop on the whole head
  (decode and short prefills; the batch-invariant launch).
* ``3`` ``"halves"`` (``_attn_runs_h``), the default prefill for head_dim 128 in 16-bit:
  one loop over all key tiles, the causal ones included; when a run starts, a scalar
  branch reloads the query and rotates it. The score is two products of depth
  ``head_dim / 2``, one per rotary half, so no rotate-half shuffle is needed, and the
  rotated halves are carried in registers as dot operands. The K/V software pipeline runs
  across runs. The run starts rotate the query on pairs of 16-bit values (inline PTX;
  float32 in the interpreter).

Every loop loads in the cache's dtype and computes in float32 (but for that 16-bit query
rotation when compiled), so it runs in Triton's interpreter with float16/float32 tensors.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import _M_INIT, _cos_sin_of, _ctx_mask, _ctx_split, _fma2, _max, _min, _mul2, _sum


@triton.jit
def _load_cs(Cos_row, Sin_row, t, max_blocks,
             HALF: tl.constexpr, HALF_P: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
             NPG: tl.constexpr):
    """cos/sin rows ``(NPG, HALF_P)`` of the ``NPG`` table entries that key tile ``t`` spans."""
    offs_h = tl.arange(0, HALF_P)
    pe = (t * BLOCK_N) // PAGE_SIZE + tl.arange(0, NPG)
    pm = (pe < max_blocks)[:, None] & (offs_h[None, :] < HALF)
    pc = tl.load(Cos_row + pe[:, None] * HALF + offs_h[None, :], mask=pm, other=0.0)
    ps = tl.load(Sin_row + pe[:, None] * HALF + offs_h[None, :], mask=pm, other=0.0)
    return pc, ps


@triton.jit
def _attn_tiles(
    acc, l_i, m_i,
    q, q1, q2, qp, qpos,
    K, V, BT_row, BPos_row, BLen_row, Cos_row, Sin_row,
    stride_kp, stride_ks, stride_vp, stride_vs,
    max_blocks, t_start, t_end, qk_scale,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    PASS: tl.constexpr, PASS_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_ROPE: tl.constexpr, CS_PER_PAGE: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    DOT_PREC: tl.constexpr, IDX64: tl.constexpr, NPG: tl.constexpr, PREFETCH: tl.constexpr,
    WINDOW: tl.constexpr = 0, APE: tl.constexpr = False, ctx_c0=0, ctx_c1=0, ape_ctx=0,
):
    """Online-softmax update of ``acc/l_i/m_i`` over key tiles ``[t_start, t_end)``.

    ``PREFETCH``: the cos/sin rows of tile ``t + 1`` are loaded during tile ``t`` (they
    are not a dot operand, so the software pipeliner leaves them in the loop).
    ``APE``: every tile gets the causal mask and the mask of the program's key class
    (``_ctx_mask``: context positions ``[ctx_c0, ctx_c1)``, class ``ape_ctx``)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_h = tl.arange(0, HALF_P)
    offs_p = tl.arange(0, PASS_P)
    pc_n, ps_n = _load_cs(Cos_row, Sin_row, t_start, max_blocks * (USE_ROPE and CS_PER_PAGE and PREFETCH),
                          HALF, HALF_P, PAGE_SIZE, BLOCK_N, NPG)
    for t in range(t_start, t_end):
        idx = t * BLOCK_N + offs_n  # flat slot index in the table row
        ent = idx // PAGE_SIZE
        slot = idx % PAGE_SIZE
        ln = tl.load(BLen_row + ent, mask=ent < max_blocks, other=0)
        kvalid = slot < ln  # padding entries have length 0: never read below
        page = tl.load(BT_row + ent, mask=kvalid, other=0)
        page = page.to(tl.int64) if IDX64 else page.to(tl.int32)  # int32 offsets: fewer registers
        k_row = K + page * stride_kp + slot * stride_ks
        v_row = V + page * stride_vp + slot * stride_vs
        if USE_ROPE:
            hmask = kvalid[:, None] & (offs_h[None, :] < HALF)
            if CS_PER_PAGE:  # one row per page, broadcast over its slots
                if PREFETCH:
                    pc, ps = pc_n, ps_n
                    pc_n, ps_n = _load_cs(Cos_row, Sin_row, t + 1, max_blocks, HALF, HALF_P, PAGE_SIZE, BLOCK_N, NPG)
                else:
                    pc, ps = _load_cs(Cos_row, Sin_row, t, max_blocks, HALF, HALF_P, PAGE_SIZE, BLOCK_N, NPG)
                if NPG == 1:  # the tile lies in one page: one delta, a vector of cos/sin
                    c = pc
                    s = ps
                else:
                    c = tl.reshape(tl.broadcast_to(pc[:, None, :], (NPG, PAGE_SIZE, HALF_P)), (BLOCK_N, HALF_P))
                    s = tl.reshape(tl.broadcast_to(ps[:, None, :], (NPG, PAGE_SIZE, HALF_P)), (BLOCK_N, HALF_P))
            else:  # one row per slot (gathered; rows of a page hit the same lines)
                cs_off = ent[:, None] * HALF + offs_h[None, :]
                c = tl.load(Cos_row + cs_off, mask=hmask, other=0.0)
                s = tl.load(Sin_row + cs_off, mask=hmask, other=0.0)
            k1 = tl.load(k_row[:, None] + offs_h[None, :], mask=hmask, other=0.0).to(tl.float32)
            k2 = tl.load(k_row[:, None] + HALF + offs_h[None, :], mask=hmask, other=0.0).to(tl.float32)
            k1r = (k1 * c - k2 * s).to(K.dtype.element_ty)
            k2r = (k2 * c + k1 * s).to(K.dtype.element_ty)
            qk = tl.dot(q1, tl.trans(k1r), input_precision=DOT_PREC)
            qk = tl.dot(q2, tl.trans(k2r), qk, input_precision=DOT_PREC)
            if PASS > 0:
                pmask = kvalid[:, None] & (offs_p[None, :] < PASS)
                kp = tl.load(k_row[:, None] + 2 * HALF + offs_p[None, :], mask=pmask, other=0.0)
                qk = tl.dot(qp, tl.trans(kp), qk, input_precision=DOT_PREC)
        else:
            k = tl.load(k_row[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        qk = qk * qk_scale
        if CAUSAL_MASK or APE:
            kpos = tl.load(BPos_row + ent, mask=kvalid, other=0).to(tl.int32) + slot
            seen = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
            if WINDOW > 0:  # sliding window: keys at qpos - WINDOW and before are out
                seen = seen & (qpos[:, None] - kpos[None, :] < WINDOW)
            if APE:
                seen = _ctx_mask(seen, kpos, qpos, ctx_c0, ctx_c1, ape_ctx)
            qk = tl.where(seen, qk, float("-inf"))
        else:
            qk = qk + tl.where(kvalid, 0.0, float("-inf"))[None, :]
        m_new = tl.maximum(m_i, _max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + _sum(p, 1)
        v = tl.load(v_row[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(V.dtype.element_ty), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _run_head(Runs_row, Delta_row, e, max_blocks, FROM_DELTA: tl.constexpr):
    """Table entry ``e`` (clamped into the row): the entry after its run, and its delta as
    float32 when ``FROM_DELTA`` (else ``0.0``)."""
    e = tl.minimum(e, max_blocks - 1)
    r = tl.load(Runs_row + e).to(tl.int32)
    if FROM_DELTA:
        d = tl.load(Delta_row + e).to(tl.float32)
    else:
        d = 0.0
    return r, d


@triton.jit
def _first_run(Runs_row, Delta_row, e0, max_blocks, TPE: tl.constexpr, FD: tl.constexpr,
               LOOKAHEAD: tl.constexpr):
    """The run at table entry ``e0``, where a key range starts: its delta, its end in key
    tiles, and the head carried to the next run start (``_next_run``; with ``LOOKAHEAD`` the
    next run's, loaded now)."""
    r_nx, d = _run_head(Runs_row, Delta_row, e0, max_blocks, FD)
    r_end = r_nx * TPE
    if LOOKAHEAD:  # the next run's head, loaded a run ahead (two scalars)
        r_nx, d_nx = _run_head(Runs_row, Delta_row, r_nx, max_blocks, FD)
    else:
        d_nx = d
    return d, r_end, r_nx, d_nx


@triton.jit
def _next_run(Runs_row, Delta_row, e, r_nx, d_nx, max_blocks, TPE: tl.constexpr, FD: tl.constexpr,
              LOOKAHEAD: tl.constexpr):
    """At the start of the run at table entry ``e``: its delta, its end in key tiles, and the
    head carried to the next start. ``LOOKAHEAD``: ``(r_nx, d_nx)`` is this run's head,
    loaded a run ago, and the next run's is loaded now; otherwise this run's is loaded now."""
    if LOOKAHEAD:
        d = d_nx
        r_end = r_nx * TPE
        r_nx, d_nx = _run_head(Runs_row, Delta_row, r_nx, max_blocks, FD)
    else:
        r_nx, d = _run_head(Runs_row, Delta_row, e, max_blocks, FD)
        r_end = r_nx * TPE
    return d, r_end, r_nx, d_nx


@triton.jit
def _rot_q(q_row, row_ok, Cos_row, Sin_row, InvFreq, e, dlt, K,
           HEAD_DIM: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
           FROM_DELTA: tl.constexpr, APPROX: tl.constexpr):
    """The query group rotated by table entry ``e``'s delta, ``R(-delta) q``, in K's dtype:
    ``q * [c, c, 1] + [q2, -q1, 0] * [s, s, 0]`` (reloaded from global memory).
    ``FROM_DELTA``: cos/sin computed from the delta ``dlt`` (float32) and ``InvFreq``
    (``_cos_sin_of``) instead of loaded from the table row ``e``."""
    offs_d = tl.arange(0, HEAD_DIM)
    qv = tl.load(q_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if ROT > 0:
        is_lo = offs_d < HALF
        in_rot = offs_d < ROT
        sw_col = tl.where(is_lo, offs_d + HALF, offs_d - HALF)
        cs_col = tl.where(in_rot, offs_d % HALF, 0)
        if FROM_DELTA:
            c, s = _cos_sin_of(dlt * tl.load(InvFreq + cs_col), APPROX)
            c = tl.where(in_rot, c, 1.0)
            s = tl.where(in_rot, s, 0.0)
        else:
            c = tl.load(Cos_row + e * HALF + cs_col, mask=in_rot, other=1.0)
            s = tl.load(Sin_row + e * HALF + cs_col, mask=in_rot, other=0.0)
        qs = tl.load(q_row[:, None] + sw_col[None, :], mask=row_ok[:, None] & in_rot[None, :], other=0.0)
        qs = tl.where(is_lo[None, :], qs.to(tl.float32), -qs.to(tl.float32))
        return (qv.to(tl.float32) * c[None, :] + qs * s[None, :]).to(K.dtype.element_ty)
    else:
        return qv.to(K.dtype.element_ty)


@triton.jit
def _mask_scores(qk, kvalid, BPos_row, ent, slot, qpos, CAUSAL: tl.constexpr, WINDOW: tl.constexpr = 0,
                 APE: tl.constexpr = False, ctx_c0=0, ctx_c1=0, ape_ctx=0):
    """Scores of padding slots (and, ``CAUSAL``, of keys after a row's position, and with a
    ``WINDOW``, of keys ``WINDOW`` or more positions before it) to -inf. ``APE``: the causal
    mask whatever ``CAUSAL``, and the keys outside the program's class (``_ctx_mask``)."""
    if CAUSAL or APE:
        kpos = tl.load(BPos_row + ent).to(tl.int32) + slot
        seen = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        if WINDOW > 0:
            seen = seen & (qpos[:, None] - kpos[None, :] < WINDOW)
        if APE:
            seen = _ctx_mask(seen, kpos, qpos, ctx_c0, ctx_c1, ape_ctx)
        return tl.where(seen, qk, float("-inf"))
    else:
        return qk + tl.where(kvalid, 0.0, float("-inf"))[None, :]


@triton.jit
def _tile_update(acc, l_i, m_i, qa, qb, qpos, K, V, BT_row, BPos_row, BLen_row,
                 stride_kp, stride_ks, stride_vp, stride_vs, tt, t_lo, qk_scale,
                 HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL_MASK: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr,
                 HALVES: tl.constexpr, WINDOW: tl.constexpr = 0,
                 APE: tl.constexpr = False, ctx_c0=0, ctx_c1=0, ape_ctx=0):
    """Online-softmax update with key tile ``tt`` (which lies in one page).

    ``HALVES``: the query is given as its two halves ``qa, qb`` ``(BLOCK_M, HEAD_DIM // 2)``
    and scored with two products of depth ``HEAD_DIM // 2`` on the key tile's halves;
    otherwise ``qa`` is the whole ``(BLOCK_M, HEAD_DIM)`` query (``qb`` unused).
    ``CAUSAL_MASK``: ``0`` slot validity only, ``1`` the causal mask, ``2`` the causal mask
    on the tiles from ``t_lo`` on (a branch per tile). ``WINDOW``: the causal mask also
    masks keys ``WINDOW`` or more positions before the row (the launch then masks every
    tile it visits). ``APE``: every tile masked, with the key-class mask (``_mask_scores``)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    ent = (tt * BLOCK_N) // PAGE_SIZE
    slot = (tt * BLOCK_N) % PAGE_SIZE + offs_n
    ln = tl.load(BLen_row + ent)
    kvalid = slot < ln
    page = tl.load(BT_row + ent)
    page = page.to(tl.int64) if IDX64 else page.to(tl.int32)
    k_row = (K + page * stride_kp + slot * stride_ks)[:, None]
    if HALVES:
        H2: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, H2)
        k1 = tl.load(k_row + offs_h[None, :], mask=kvalid[:, None], other=0.0)
        k2 = tl.load(k_row + H2 + offs_h[None, :], mask=kvalid[:, None], other=0.0)
        qk = tl.dot(qa, tl.trans(k1), input_precision=DOT_PREC)
        qk = tl.dot(qb, tl.trans(k2), qk, input_precision=DOT_PREC) * qk_scale
    else:
        k = tl.load(k_row + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        qk = tl.dot(qa, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if CAUSAL_MASK == 2 and not APE:
        if tt >= t_lo:
            qk = _mask_scores(qk, kvalid, BPos_row, ent, slot, qpos, True, WINDOW)
        else:
            qk = _mask_scores(qk, kvalid, BPos_row, ent, slot, qpos, False, WINDOW)
    else:
        qk = _mask_scores(qk, kvalid, BPos_row, ent, slot, qpos, CAUSAL_MASK == 1, WINDOW, APE, ctx_c0, ctx_c1,
                          ape_ctx)
    m_new = tl.maximum(m_i, _max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + _sum(p, 1)
    v = tl.load((V + page * stride_vp + slot * stride_vs)[:, None] + offs_d[None, :],
                mask=kvalid[:, None], other=0.0)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(V.dtype.element_ty), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _attn_runs(
    acc, l_i, m_i,
    q_row, row_ok, qpos,
    K, V, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs_row, Delta_row, InvFreq,
    stride_kp, stride_ks, stride_vp, stride_vs,
    t_start, t_end, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr, FLAT: tl.constexpr,
    FROM_DELTA: tl.constexpr, LOOKAHEAD: tl.constexpr, APPROX: tl.constexpr, WINDOW: tl.constexpr = 0,
    APE: tl.constexpr = False, ctx_c0=0, ctx_c1=0, ape_ctx=0,
):
    """Online-softmax update over key tiles ``[t_start, t_end)``, the delta applied to the
    *query*, once per run of table entries that share one delta.

    Needs ``PAGE_SIZE >= BLOCK_N`` (a key tile lies in one page, so it has one delta).
    ``Runs_row[e]`` is the first entry after ``e`` whose delta differs (``delta_runs``).
    The query group is rotated once per run, ``R(-delta) q`` (reloaded from global memory,
    so only the rotated copy lives across tiles), and K goes from global to shared memory
    to the tensor cores untouched, as in the RoPE-free kernel. A chunk's pages form one
    run, so the rotation costs one ``(BLOCK_M, HEAD_DIM)`` FMA pass per chunk instead of one
    per key tile. ``FLAT=False``: an outer loop over runs around a plain, software-pipelined
    inner loop over the run's tiles (the pipeline restarts at each run). ``FLAT=True``: one
    loop over all tiles that rotates the query when a new run starts (a scalar branch).
    ``APE``: the key-class mask on every tile (``_tile_update``)."""
    TPE: tl.constexpr = PAGE_SIZE // BLOCK_N  # key tiles per table entry
    FD: tl.constexpr = FROM_DELTA and ROT > 0
    if FLAT:
        e0 = tl.maximum(tl.minimum(t_start, t_end - 1), 0) // TPE  # inside the row if the range is empty
        d_cur, r_end, r_nx, d_nx = _first_run(Runs_row, Delta_row, e0, max_blocks, TPE, FD, LOOKAHEAD)
        qr = _rot_q(q_row, row_ok, Cos_row, Sin_row, InvFreq, e0, d_cur, K, HEAD_DIM, HALF, ROT, FD, APPROX)
        for tt in range(t_start, t_end):
            if tt >= r_end:
                e = tt // TPE
                d, r_end, r_nx, d_nx = _next_run(Runs_row, Delta_row, e, r_nx, d_nx, max_blocks, TPE, FD, LOOKAHEAD)
                qr = _rot_q(q_row, row_ok, Cos_row, Sin_row, InvFreq, e, d, K, HEAD_DIM, HALF, ROT, FD, APPROX)
            acc, l_i, m_i = _tile_update(acc, l_i, m_i, qr, qr, qpos, K, V, BT_row, BPos_row, BLen_row,
                                         stride_kp, stride_ks, stride_vp, stride_vs, tt, t_start, qk_scale,
                                         HEAD_DIM, PAGE_SIZE, BLOCK_N, CAUSAL_MASK, DOT_PREC, IDX64, False, WINDOW,
                                         APE, ctx_c0, ctx_c1, ape_ctx)
    else:
        t = t_start
        while t < t_end:
            e = t // TPE
            r_nx, d = _run_head(Runs_row, Delta_row, e, max_blocks, FD)
            r_end = tl.minimum(r_nx * TPE, t_end)
            qr = _rot_q(q_row, row_ok, Cos_row, Sin_row, InvFreq, e, d, K, HEAD_DIM, HALF, ROT, FD, APPROX)
            for tt in range(t, r_end):
                acc, l_i, m_i = _tile_update(acc, l_i, m_i, qr, qr, qpos, K, V, BT_row, BPos_row, BLen_row,
                                             stride_kp, stride_ks, stride_vp, stride_vs, tt, t, qk_scale,
                                             HEAD_DIM, PAGE_SIZE, BLOCK_N, CAUSAL_MASK, DOT_PREC, IDX64, False, WINDOW,
                                         APE, ctx_c0, ctx_c1, ape_ctx)
            t = r_end
    return acc, l_i, m_i



@triton.jit
def _rot_q_h(q_row, row_ok, Cos_row, Sin_row, InvFreq, e, dlt, m_i, K, HALF: tl.constexpr,
             ROT: tl.constexpr, PACKED: tl.constexpr, FROM_DELTA: tl.constexpr, APPROX: tl.constexpr):
    """The query group's two rotary halves rotated by table entry ``e``'s delta,
    ``R(-delta) q = [q1 c + q2 s, q2 c - q1 s]``, each ``(BLOCK_M, HALF)`` in K's dtype
    (reloaded from global memory); ``ROT=False``: the halves as they are.

    ``PACKED``: the rotation runs on pairs of 16-bit values (a multiply and a fused
    multiply-add per two elements, rounding as transformers' ``apply_rotary_pos_emb`` does
    in the model's dtype); otherwise in float32 with one rounding (the interpreter, which
    runs no inline PTX). Compiled for sm_90 that is 64 instructions per thread instead of
    about 290 (float32 arithmetic plus unpacking and packing the 16-bit values).

    Adding ``0`` taken from ``m_i`` (which lives in the MMA row layout) gives the result
    that layout: the compiler then converts it to a dot operand here, once per run, and the
    loop carries it in registers; otherwise it is carried in a blocked layout and goes
    through shared memory before every key tile's product."""
    offs_h = tl.arange(0, HALF)
    dt = K.dtype.element_ty
    z = (m_i * 0.0).to(dt)[:, None]
    a1 = tl.load(q_row[:, None] + offs_h[None, :], mask=row_ok[:, None], other=0.0)
    a2 = tl.load(q_row[:, None] + HALF + offs_h[None, :], mask=row_ok[:, None], other=0.0)
    if ROT:
        if FROM_DELTA:
            c, s = _cos_sin_of(dlt * tl.load(InvFreq + offs_h), APPROX)
        else:
            c = tl.load(Cos_row + e * HALF + offs_h)
            s = tl.load(Sin_row + e * HALF + offs_h)
        if PACKED:
            a1 = a1.to(dt)
            a2 = a2.to(dt)
            c16 = c.to(dt)[None, :]
            r1 = _fma2(a1, c16, _mul2(a2, s.to(dt)[None, :]))
            r2 = _fma2(a2, c16, _mul2(a1, (-s).to(dt)[None, :]))
            return r1 + z, r2 + z
        else:
            a1 = a1.to(tl.float32)
            a2 = a2.to(tl.float32)
            c = c[None, :]
            s = s[None, :]
            return (a1 * c + a2 * s).to(dt) + z, (a2 * c - a1 * s).to(dt) + z
    else:  # RoPE off: the halves as they are
        return a1.to(dt) + z, a2.to(dt) + z


@triton.jit
def _attn_runs_h(
    acc, l_i, m_i,
    q_row, row_ok, qpos,
    K, V, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs_row, Delta_row, InvFreq,
    stride_kp, stride_ks, stride_vp, stride_vs,
    t_start, t_end, t_lo, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, USE_ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr,
    PACKED: tl.constexpr, FROM_DELTA: tl.constexpr, LOOKAHEAD: tl.constexpr, APPROX: tl.constexpr,
    WINDOW: tl.constexpr = 0, APE: tl.constexpr = False, ctx_c0=0, ctx_c1=0, ape_ctx=0, h0=0, hole=0,
):
    """The run loop as one loop over key tiles ``[t_start, t_end)`` on the query's two
    rotary halves (needs ``PAGE_SIZE >= BLOCK_N`` and, with RoPE, a fully rotary head).

    The query is reloaded and rotated when a run starts (a scalar branch), so the software
    pipeline of K/V loads runs across runs, and the causal tiles (from ``t_lo``) share the
    loop. The rotated halves are carried in registers as dot operands (``_rot_q_h``;
    ``_tile_update`` with ``HALVES``).
    Splitting the product into two halves is what makes that work: one 128-deep operand
    carried through the loop spills and serializes the tensor-core pipeline (``ptxas``:
    "wgmma.mma_async instructions are serialized").

    ``FROM_DELTA``: a run's cos/sin are computed from its delta (``_run_head``,
    ``_cos_sin_of``) instead of loaded from two table rows, a fresh line at every run start;
    ``LOOKAHEAD``: the next run's head (its end and delta) is loaded a run ahead, so a run
    start waits on no load but the query's (``_attn_runs`` FLAT does the same).

    Without RoPE the run never ends (``r_end = t_end``), but the halves are carried the
    same way: faster than letting the compiler keep a loop-invariant query in shared memory
    (measured on H200).

    ``APE``: the key-class mask on every tile (``_tile_update``), and ``[t_start, t_end)``
    are virtual tiles: from ``h0`` on, tile ``tt`` is ``tt + hole`` (``_ctx_split``); needs
    ``LOOKAHEAD`` off (the run after a run that ends in the hole is not the next one)."""
    TPE: tl.constexpr = PAGE_SIZE // BLOCK_N  # key tiles per table entry
    H2: tl.constexpr = HEAD_DIM // 2
    t0 = tl.maximum(tl.minimum(t_start, t_end - 1), 0)
    if APE:
        t0 = tl.where(t0 >= h0, t0 + hole, t0)
    e0 = t0 // TPE  # inside the row if the range is empty
    FD: tl.constexpr = FROM_DELTA and USE_ROPE
    if USE_ROPE:
        d_cur, r_end, r_nx, d_nx = _first_run(Runs_row, Delta_row, e0, max_blocks, TPE, FD, LOOKAHEAD)
    else:  # one run: the tables are not read
        d_cur = 0.0
        r_end = t_end
        r_nx = max_blocks
        d_nx = d_cur
    q1, q2 = _rot_q_h(q_row, row_ok, Cos_row, Sin_row, InvFreq, e0, d_cur, m_i, K, H2, USE_ROPE, PACKED, FD, APPROX)
    for tt in range(t_start, t_end):
        if APE:  # a virtual tile: past the hole
            tt = tl.where(tt >= h0, tt + hole, tt)
        if tt >= r_end:
            e = tt // TPE
            d, r_end, r_nx, d_nx = _next_run(Runs_row, Delta_row, e, r_nx, d_nx, max_blocks, TPE, FD, LOOKAHEAD)
            q1, q2 = _rot_q_h(q_row, row_ok, Cos_row, Sin_row, InvFreq, e, d, m_i, K, H2, USE_ROPE, PACKED, FD, APPROX)
        acc, l_i, m_i = _tile_update(acc, l_i, m_i, q1, q2, qpos, K, V, BT_row, BPos_row, BLen_row,
                                     stride_kp, stride_ks, stride_vp, stride_vs, tt, t_lo, qk_scale,
                                     HEAD_DIM, PAGE_SIZE, BLOCK_N, 2, DOT_PREC, IDX64, True, WINDOW,
                                     APE, ctx_c0, ctx_c1, ape_ctx)
    return acc, l_i, m_i


# The table's width and row strides are not specialized: a one-entry table (a short question
# alone, a one-page chunk's probe) would otherwise compile its own kernel (Triton makes an
# integer 1 a constant), which no warm-up shape can cover at every width.
@triton.jit(do_not_specialize=["stride_btb", "stride_bpb", "stride_blb", "stride_bdb", "max_blocks"])
def _paged_attn_fwd(
    Q, QPos, CuQ, K, V, BT, BPos, BLen, Cos, Sin, Runs, Delta, InvFreq, Out, PartO, PartLse,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_btb, stride_bpb, stride_blb, stride_bdb,
    max_blocks, num_splits,
    NUM_Q_HEADS: tl.constexpr, G: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    PASS: tl.constexpr, PASS_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_OUT: tl.constexpr, SCAN: tl.constexpr, SCAN_BLOCK: tl.constexpr,
    USE_ROPE: tl.constexpr, CS_PER_PAGE: tl.constexpr, DOT_PREC: tl.constexpr,
    IDX64: tl.constexpr, NPG: tl.constexpr, PREFETCH: tl.constexpr, QROT: tl.constexpr,
    PACKED_ROT: tl.constexpr, FROM_DELTA: tl.constexpr, LOOKAHEAD: tl.constexpr, APPROX: tl.constexpr,
    WINDOW: tl.constexpr = 0, APE: tl.constexpr = False, CtxRange=None, ctx_inv_t=None,
):
    """Grid ``(q_tiles, num_kv_heads * num_splits, batch)``; see the module docstring.

    ``WINDOW`` (``0``: none): a sliding window, a row at ``p`` sees keys at
    ``p - WINDOW < pos <= p`` (needs ``SCAN``). The scan also finds the first table entry any
    row's window reaches; the key range (and its splits) starts at its tile, and every tile
    visited gets the causal and window mask. Exact for any table order (entries outside the
    windows inside the range are masked), tight for the usual order.

    ``QROT``: the key-tile loop (module docstring). ``0`` rotates every key tile
    (``_attn_tiles``); ``1``-``3`` apply the deltas to the query once per run of equal
    deltas (need ``PAGE_SIZE >= BLOCK_N``): ``1`` a loop per run, ``2`` one flat loop
    (``_attn_runs``), ``3`` one loop on the query's rotary halves with the causal tiles
    inside it (``_attn_runs_h``; fully rotary heads), which rotates on pairs of 16-bit values
    with ``PACKED_ROT``. ``FROM_DELTA`` (run loops): a run's cos/sin computed from its delta
    (``Delta``, ``InvFreq``) instead of loaded from the tables.

    ``SPLIT_OUT``: write normalized partial outputs and their log2-sum-exp to
    ``PartO/PartLse`` for ``_merge_splits`` instead of the output.

    ``APE`` (APE-style context calibration; needs ``SPLIT_OUT``): ``CtxRange`` ``(batch, 2)``
    int32 holds each sequence's context key positions ``[c0, c1)``; a row at ``p >= c1``
    reads its context keys with logits divided by the temperature (``ctx_inv_t`` is its
    inverse). The splits ``[0, num_splits / 2)`` compute each row's keys but its context keys,
    the splits ``[num_splits / 2, num_splits)`` its context keys (none for a row before
    ``c1``), so the two softmax states stay apart for ``_merge_splits`` (``APE``), which scales
    the context's log-sum-exp. Each class visits only its tiles (``_ctx_split``) and masks
    every tile it visits."""
    n_qtiles = tl.num_programs(0)
    pid_m = n_qtiles - 1 - tl.program_id(0)  # heaviest (latest) query tiles first
    pid_hs = tl.program_id(1)
    b = tl.program_id(2)
    kvh = pid_hs // num_splits
    split = pid_hs % num_splits

    q_start = tl.load(CuQ + b).to(tl.int32)
    n_rows = (tl.load(CuQ + b + 1).to(tl.int32) - q_start) * G
    if pid_m * BLOCK_M >= n_rows:
        return

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    qi = q_start + rows // G
    head = kvh * G + rows % G
    qpos = tl.load(QPos + qi, mask=row_ok, other=-1).to(tl.int32)
    q_row = Q + qi.to(tl.int64) * stride_qt + head * stride_qh
    offs_d = tl.arange(0, HEAD_DIM)
    offs_h = tl.arange(0, HALF_P)
    offs_p = tl.arange(0, PASS_P)
    if QROT:
        q = qpos  # unused: _attn_runs loads the query itself
        q1 = qpos
        q2 = qpos
        qp = qpos
    elif USE_ROPE:
        hm = row_ok[:, None] & (offs_h[None, :] < HALF)
        q1 = tl.load(q_row[:, None] + offs_h[None, :], mask=hm, other=0.0).to(K.dtype.element_ty)
        q2 = tl.load(q_row[:, None] + HALF + offs_h[None, :], mask=hm, other=0.0).to(K.dtype.element_ty)
        if PASS > 0:
            qp = tl.load(q_row[:, None] + 2 * HALF + offs_p[None, :],
                         mask=row_ok[:, None] & (offs_p[None, :] < PASS), other=0.0).to(K.dtype.element_ty)
        else:
            qp = q1  # unused
        q = q1  # unused
    else:
        q = tl.load(q_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(K.dtype.element_ty)
        q1 = q  # unused
        q2 = q
        qp = q

    BT_row = BT + b.to(tl.int64) * stride_btb
    BPos_row = BPos + b.to(tl.int64) * stride_bpb
    BLen_row = BLen + b.to(tl.int64) * stride_blb
    Cos_row = Cos + b.to(tl.int64) * max_blocks * HALF
    Sin_row = Sin + b.to(tl.int64) * max_blocks * HALF
    Kh = K + kvh * stride_kh
    Vh = V + kvh * stride_vh

    if SCAN:
        # Entries [0, lo_e) are seen in full by every row; none past hi_e is seen at all.
        qmin = _min(tl.where(row_ok, qpos, 2147483647), 0)
        qmax = _max(tl.where(row_ok, qpos, -2147483647), 0)
        lo_e = max_blocks
        hi_e = 0
        w_e = max_blocks  # WINDOW: the first entry that any row's window reaches
        for e0 in range(0, max_blocks, SCAN_BLOCK):
            e = e0 + tl.arange(0, SCAN_BLOCK)
            em = e < max_blocks
            ln = tl.load(BLen_row + e, mask=em, other=0).to(tl.int32)
            bp = tl.load(BPos_row + e, mask=em, other=0).to(tl.int32)
            used = ln > 0
            hi_e = tl.maximum(hi_e, _max(tl.where(used & (bp <= qmax), e + 1, 0), 0))
            lo_e = tl.minimum(lo_e, _min(tl.where(used & (bp + ln - 1 > qmin), e, max_blocks), 0))
            if WINDOW > 0:
                reach = used & (bp <= qmax) & (bp + ln - 1 > qmin - WINDOW)
                w_e = tl.minimum(w_e, _min(tl.where(reach, e, max_blocks), 0))
        t_hi = (hi_e * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
        t_lo = tl.minimum((lo_e * PAGE_SIZE) // BLOCK_N, t_hi)
    else:
        t_hi = (max_blocks * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
        t_lo = 0

    if WINDOW > 0:
        # key tiles [t_lo, t_hi) from the first one a window reaches, all masked
        t_lo = tl.minimum((w_e * PAGE_SIZE) // BLOCK_N, t_hi)
        per_split = (t_hi - t_lo + num_splits - 1) // num_splits
        s_start = t_lo + split * per_split
        s_end = tl.minimum(s_start + per_split, t_hi)
    else:
        per_split = (t_hi + num_splits - 1) // num_splits
        s_start = split * per_split
        s_end = tl.minimum(s_start + per_split, t_hi)

    if APE:
        # this program's key class and its tiles: virtual [v0, v1), or [a0, a1) then [b0, b1)
        n_cls = num_splits // 2
        ape_ctx = (split >= n_cls).to(tl.int32)
        ctx_c0 = tl.load(CtxRange + b * 2).to(tl.int32)
        ctx_c1 = tl.load(CtxRange + b * 2 + 1).to(tl.int32)
        after = row_ok & (qpos >= ctx_c1)
        any_after = _max(after.to(tl.int32), 0)
        all_after = _min(tl.where(row_ok, after.to(tl.int32), 1), 0)
        v0, v1, h0, hole = _ctx_split(BLen_row, BPos_row, ctx_c0, ctx_c1, max_blocks, t_lo if WINDOW > 0 else 0, t_hi,
                                      split % n_cls, n_cls, ape_ctx, any_after, all_after,
                                      PAGE_SIZE, BLOCK_N, SCAN_BLOCK)
        a0 = v0
        a1 = tl.minimum(v1, h0)
        b0 = tl.maximum(v0, h0) + hole
        b1 = tl.maximum(v1, h0) + hole
        qk_scale = tl.where(ape_ctx != 0, qk_scale * ctx_inv_t, qk_scale)
    else:  # the key ranges below: the split's tiles before t_lo, then from t_lo on
        ctx_c0 = 0
        ctx_c1 = 0
        ape_ctx = 0

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    if QROT == 3 and APE:  # one loop over the virtual tiles (the run loop skips the hole itself)
        acc, l_i, m_i = _attn_runs_h(
            acc, l_i, m_i, q_row, row_ok, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs + b.to(tl.int64) * max_blocks,
            Delta + b.to(tl.int64) * stride_bdb, InvFreq,
            stride_kp, stride_ks, stride_vp, stride_vs,
            v0, v1, t_lo, max_blocks, qk_scale, HEAD_DIM, USE_ROPE, PAGE_SIZE, BLOCK_N, DOT_PREC, IDX64,
            PACKED_ROT, FROM_DELTA, LOOKAHEAD, APPROX, WINDOW, APE, ctx_c0, ctx_c1, ape_ctx, h0, hole,
        )
    elif QROT == 3:
        acc, l_i, m_i = _attn_runs_h(
            acc, l_i, m_i, q_row, row_ok, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs + b.to(tl.int64) * max_blocks,
            Delta + b.to(tl.int64) * stride_bdb, InvFreq,
            stride_kp, stride_ks, stride_vp, stride_vs,
            s_start, s_end, t_lo, max_blocks, qk_scale, HEAD_DIM, USE_ROPE, PAGE_SIZE, BLOCK_N, DOT_PREC, IDX64,
            PACKED_ROT, FROM_DELTA, LOOKAHEAD, APPROX, WINDOW,
        )
    elif QROT:
        ROT_Q: tl.constexpr = 2 * HALF if USE_ROPE else 0
        Runs_row = Runs + b.to(tl.int64) * max_blocks
        Delta_row = Delta + b.to(tl.int64) * stride_bdb
        acc, l_i, m_i = _attn_runs(
            acc, l_i, m_i, q_row, row_ok, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs_row, Delta_row, InvFreq,
            stride_kp, stride_ks, stride_vp, stride_vs,
            a0 if APE else s_start, a1 if APE else tl.minimum(s_end, t_lo), max_blocks, qk_scale,
            HEAD_DIM, HALF, ROT_Q, PAGE_SIZE, BLOCK_N, False, DOT_PREC, IDX64, QROT == 2,
            FROM_DELTA, LOOKAHEAD, APPROX, WINDOW, APE, ctx_c0, ctx_c1, ape_ctx,
        )
        acc, l_i, m_i = _attn_runs(
            acc, l_i, m_i, q_row, row_ok, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs_row, Delta_row, InvFreq,
            stride_kp, stride_ks, stride_vp, stride_vs,
            b0 if APE else tl.maximum(s_start, t_lo), b1 if APE else s_end, max_blocks, qk_scale,
            HEAD_DIM, HALF, ROT_Q, PAGE_SIZE, BLOCK_N, True, DOT_PREC, IDX64, QROT == 2,
            FROM_DELTA, LOOKAHEAD, APPROX, WINDOW, APE, ctx_c0, ctx_c1, ape_ctx,
        )
    else:
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q1, q2, qp, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row,
            stride_kp, stride_ks, stride_vp, stride_vs,
            max_blocks, a0 if APE else s_start, a1 if APE else tl.minimum(s_end, t_lo), qk_scale,
            HEAD_DIM, HALF, HALF_P, PASS, PASS_P, PAGE_SIZE, BLOCK_N,
            USE_ROPE, CS_PER_PAGE, False, DOT_PREC, IDX64, NPG, PREFETCH, WINDOW, APE, ctx_c0, ctx_c1, ape_ctx,
        )
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q1, q2, qp, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row,
            stride_kp, stride_ks, stride_vp, stride_vs,
            max_blocks, b0 if APE else tl.maximum(s_start, t_lo), b1 if APE else s_end, qk_scale,
            HEAD_DIM, HALF, HALF_P, PASS, PASS_P, PAGE_SIZE, BLOCK_N,
            USE_ROPE, CS_PER_PAGE, True, DOT_PREC, IDX64, NPG, PREFETCH, WINDOW, APE, ctx_c0, ctx_c1, ape_ctx,
        )

    seen_any = l_i > 0.0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]  # rows that saw nothing: acc == 0
    if not SPLIT_OUT:
        o_ptr = Out + qi.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(o_ptr[:, None] + offs_d[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (qi.to(tl.int64) * NUM_Q_HEADS + head) * num_splits + split
        tl.store(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(seen_any, m_i + tl.math.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + part, lse, mask=row_ok)

