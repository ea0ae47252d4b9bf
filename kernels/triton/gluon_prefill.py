"""Warp-specialized deferred-RoPE paged prefill for Hopper, in Gluon.

The same function as ``reference.paged_attention_ref`` for prefill (and as
``paged_attention_triton`` with ``KernelOptions(loop="halves")``), written with Gluon
(``triton.experimental.gluon``) so that the query rotation leaves the warps that issue the
tensor-core work. ``paged_attention_triton`` sends prefill here on Hopper when the caller
vouches that the pages hold finite values (``padding_finite=True``, as the engine does) and
the shape fits (see ``supported``). One program owns 128 query rows (a row is a (query,
q-head-in-group) pair) of one sequence and one KV head, and splits into four partitions
that talk through mbarriers:

* **two consumers** (4 warps each, 64 rows each, worker partitions): per tile of 128 keys
  ``S = Q_slot K^T`` (wgmma, the query from a shared-memory slot), online softmax with the
  scale folded into one multiply-add per score, ``O += P V`` (wgmma, P from registers).
  Padding and causal masks are built only for tiles that need them (a page shorter than
  its slots, a key past the table, or keys from the first one some row may not see), from
  the pages' lengths and positions, which a consumer fetches a tile ahead; elsewhere a
  score goes straight to the softmax. Over pages of 64, ``S`` is two products of 64 keys,
  one per page, each with its page's query: the same run's for both, or, where the second
  page starts a new run of deltas, the next run's (already rotated in the other slot). The
  two accumulators together are the 128-key tile's, so one softmax step serves both.
  Over pages of 64 the consumers run in FA3's intra-warpgroup order: the scores of tile
  ``j`` are issued together with ``P V`` of tile ``j - 1``, so that product runs during the
  wait for the scores and the masking after it; K and V then have stages of their own (K
  freed after the scores, V a step after its product). Each frees a query slot when its
  run ends; at a run start it only switches slots and reads the new run's end from shared
  memory (no global load on its path). The two consumers run out of step, so one's softmax
  overlaps the other's products.
* **loader** (1 warp): K and V by TMA (tensor descriptors over the caches viewed as
  ``(num_pages * page_size, num_kv_heads * head_dim)``), a page (or a whole tile, for
  pages of 128+) per copy, into a ring of ``stages`` stages (over pages of 64: K a tile
  ahead of V).
* **rotator** (the default partition, 4 warps, the registers the others leave): for each
  run, ``R(-delta) q`` into one of two query slots, in pieces of 16 rows, on pairs of
  16-bit values with cos/sin computed from the delta, by the Triton kernels' own helpers
  (``_common._fma2``, ``_mul2``, ``_cos_sin_of``), so it rounds as they do; and the run's
  end (a key index) into ``rend[slot]``.

In the Triton rotary-halves loop the run start sits on the MMA warps' path; here it is
another partition's work.

Limits: compiled Hopper kernels only (Gluon has no interpreter), head_dim 128, fully
rotary, 16-bit caches, pages of a multiple of 64 tokens, one key split. TMA reads whole
pages, so every slot of every page the table names must hold finite values, padding slots
included (``0 * nan`` would poison the output); the engine's pool is zero-initialized and
only ever written with K/V, which satisfies this. Callers say so with
``padding_finite=True``.
"""
from __future__ import annotations

import torch

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# the rotation's arithmetic is the Triton kernels' own (Gluon kernels call @triton.jit
# helpers), so both round alike
from ._common import _cos_sin_of, _fma2, _mul2
from .rope import delta_runs

__all__ = ["paged_prefill_gluon"]

_LOG2E = 1.4426950408889634
_PAGE_GRAIN = 64  # pages hold a multiple of this many tokens
# (BLOCK_M, warps per consumer, K/V stages, keys per tile)
_CONFIG = (128, 4, 2, 128)
_BLOCK_M = 128  # query rows per program: two consumers of 64
_NSLOT = 2  # rotated query slots (measured: 3 no faster)
_ROT_CHUNKS = 8  # the rotator loads and rotates a query tile in this many pieces (registers)
# registers per thread (setmaxnreg): each consumer, the loader; the rotator gets the rest (72).
# ptxas spills nothing anywhere with these; 216 for the consumers ran no faster on an H200
_REGS = (208, 24)


@gluon.jit
def _page_row(BT_row, key, max_blocks, PAGE_SIZE: gl.constexpr):
    """The pool row (``page * PAGE_SIZE + slot``) holding table key ``key`` (an entry past the
    table reads page 0: finite, and masked by its length 0)."""
    e = key // PAGE_SIZE
    return gl.load(BT_row + e, mask=e < max_blocks, other=0) * PAGE_SIZE + key % PAGE_SIZE


@gluon.jit
def _load_v(vd, v_smem, kv_ready, kv_empty, tt, r0, r1, col, STAGES: gl.constexpr, NCP: gl.constexpr,
            SUB: gl.constexpr):
    """V of tile ``tt`` (pool rows ``r0``, ``r1`` of its copies) into its stage once free."""
    s = tt % STAGES
    mbarrier.wait(kv_empty.index(STAGES + s), ((tt // STAGES) & 1) ^ 1)
    mbarrier.expect(kv_ready.index(STAGES + s), vd.block_type.nbytes * NCP)
    for j in gl.static_range(NCP):
        tma.async_copy_global_to_shared(vd, [r0 if j == 0 else r1, col], kv_ready.index(STAGES + s),
                                        v_smem.index(s).slice(j * SUB, SUB))


@gluon.jit
def _loader(kd, vd, k_smem, v_smem, kv_ready, kv_empty, BT_row, col, t_hi, max_blocks,
            PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT_KV: gl.constexpr):
    """Key tiles ``[0, t_hi)``: K and V of tile ``tt`` by TMA into stage ``tt % STAGES``
    once both consumers have freed it; a tile longer than a page takes one copy per page
    (an entry past the table reads page 0: finite, and masked by its length 0). With
    ``SPLIT_KV`` (the overlapped consumers) K and V have barriers of their own (V's at
    ``STAGES + s``) and K runs a tile ahead of V: K of tile ``tt`` is needed a step before
    V of tile ``tt`` is."""
    SUB: gl.constexpr = kd.block_type.shape[0]  # keys per copy: min(BLOCK_N, PAGE_SIZE)
    NCP: gl.constexpr = BLOCK_N // SUB
    pr0 = 0
    pr1 = 0
    for tt in range(0, t_hi):
        s = tt % STAGES
        ph = ((tt // STAGES) & 1) ^ 1  # a fresh stage passes
        # the pool rows of the tile's (at most two) copies
        r0 = _page_row(BT_row, tt * BLOCK_N, max_blocks, PAGE_SIZE)
        r1 = _page_row(BT_row, tt * BLOCK_N + SUB, max_blocks, PAGE_SIZE) if NCP > 1 else r0
        if SPLIT_KV:  # K of this tile, then V of the previous one (K runs a tile ahead)
            mbarrier.wait(kv_empty.index(s), ph)
            mbarrier.expect(kv_ready.index(s), kd.block_type.nbytes * NCP)
            for j in gl.static_range(NCP):
                tma.async_copy_global_to_shared(kd, [r0 if j == 0 else r1, col], kv_ready.index(s),
                                                k_smem.index(s).slice(j * SUB, SUB))
            if tt > 0:
                _load_v(vd, v_smem, kv_ready, kv_empty, tt - 1, pr0, pr1, col, STAGES, NCP, SUB)
            pr0 = r0
            pr1 = r1
        else:
            mbarrier.wait(kv_empty.index(s), ph)
            mbarrier.expect(kv_ready.index(s), (kd.block_type.nbytes + vd.block_type.nbytes) * NCP)
            for j in gl.static_range(NCP):
                row = r0 if j == 0 else r1
                tma.async_copy_global_to_shared(kd, [row, col], kv_ready.index(s), k_smem.index(s).slice(j * SUB, SUB))
                tma.async_copy_global_to_shared(vd, [row, col], kv_ready.index(s), v_smem.index(s).slice(j * SUB, SUB))
    if SPLIT_KV and t_hi > 0:  # V of the last tile
        _load_v(vd, v_smem, kv_ready, kv_empty, t_hi - 1, pr0, pr1, col, STAGES, NCP, SUB)


@gluon.jit
def _ld_q(Q, q_start, n_rows, r0, kvh, stride_qt, stride_qh, offs_h, G: gl.constexpr, RC: gl.constexpr,
          H2: gl.constexpr, blk: gl.constexpr, dt: gl.constexpr):
    rows = r0 + gl.arange(0, RC, layout=gl.SliceLayout(1, blk))
    row_ok = rows < n_rows
    q_row = Q + (q_start + rows // G).to(gl.int64) * stride_qt + (kvh * G + rows % G) * stride_qh
    p1 = q_row[:, None] + offs_h[None, :]
    return (gl.load(p1, mask=row_ok[:, None], other=0.0).to(dt),
            gl.load(p1 + H2, mask=row_ok[:, None], other=0.0).to(dt))


@gluon.jit
def _st_rot(buf, ch: gl.constexpr, a1, a2, c16, s16, ns16, RC: gl.constexpr, H2: gl.constexpr, USE_ROPE: gl.constexpr):
    part = buf.slice(ch * RC, RC, dim=0)
    if USE_ROPE:
        part.slice(0, H2, dim=1).store(_fma2(a1, c16, _mul2(a2, s16)))  # q1 c + q2 s
        part.slice(H2, H2, dim=1).store(_fma2(a2, c16, _mul2(a1, ns16)))  # q2 c - q1 s
    else:
        part.slice(0, H2, dim=1).store(a1)
        part.slice(H2, H2, dim=1).store(a2)


@gluon.jit
def _rotator(Q, q_smem, rend, q_ready, q_empty, Runs_row, Delta_row, InvFreq,
             q_start, n_rows, row0, kvh, stride_qt, stride_qh, k_end, k_hi,
             G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, PAGE_SIZE: gl.constexpr,
             USE_ROPE: gl.constexpr, NSLOT: gl.constexpr, NCH: gl.constexpr):
    """For run ``r`` of equal deltas (entry ``e`` on; the next at ``Runs_row[e]``), the
    rows' query rotated by ``R(-delta)`` into slot ``r % NSLOT`` and the run's end (a key
    index into the table's slots) into ``rend[slot]``: for the last run that begins before
    ``k_end`` (the end of the entries any row sees), ``k_hi`` (the end of the last tile,
    which may reach past the table), so no run is read past the entries. The query's loads
    are issued before the run's delta is needed. Always at least one run."""
    H2: gl.constexpr = HEAD_DIM // 2
    RC: gl.constexpr = BLOCK_M // NCH  # rows per chunk
    dt: gl.constexpr = q_smem.dtype
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    l1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs_h = gl.arange(0, H2, layout=gl.SliceLayout(0, blk))
    inv = gl.load(InvFreq + offs_h)
    e = 0
    r = 0
    while (e * PAGE_SIZE < k_end) | (r == 0):
        slot = r % NSLOT
        a1_0, a2_0 = _ld_q(Q, q_start, n_rows, row0, kvh, stride_qt, stride_qh, offs_h, G, RC, H2, blk, dt)
        if USE_ROPE:
            d = gl.load(Delta_row + e).to(gl.float32)
            e_next = gl.load(Runs_row + e)
        else:
            d = 0.0
            e_next = k_end // PAGE_SIZE  # a single run
        c, sn = _cos_sin_of(d * inv, True)
        c16 = c.to(dt)[None, :]
        ns16 = (-sn).to(dt)[None, :]
        s16 = sn.to(dt)[None, :]
        mbarrier.wait(q_empty.index(slot), ((r // NSLOT) & 1) ^ 1)
        buf = q_smem.index(slot)
        _st_rot(buf, 0, a1_0, a2_0, c16, s16, ns16, RC, H2, USE_ROPE)
        for ch in gl.static_range(1, NCH):
            a1, a2 = _ld_q(Q, q_start, n_rows, row0 + ch * RC, kvh, stride_qt, stride_qh, offs_h, G, RC, H2, blk, dt)
            _st_rot(buf, ch, a1, a2, c16, s16, ns16, RC, H2, USE_ROPE)
        end = gl.where(e_next * PAGE_SIZE < k_end, e_next * PAGE_SIZE, k_hi)
        rend.index(slot).store(gl.full([1], end, gl.int32, layout=l1))
        fence_async_shared()
        mbarrier.arrive(q_ready.index(slot), count=1)
        e = e_next
        r += 1


@gluon.jit
def _rd_end(rend, slot, NW: gl.constexpr):
    """The run end the rotator left in ``rend[slot]``, as a scalar."""
    l1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    return gl.max(rend.index(slot).load(l1), 0)


@gluon.jit
def _tile_pages(BLen_row, BPos_row, key0, max_blocks, STEP: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """The lengths and first positions of the page(s) keys ``[key0, key0 + STEP)`` lie in:
    two pages when a tile spans two, else the same one twice (an entry past the table:
    length 0). Consumers fetch them a tile ahead, so that no global load sits on a tile's
    path between its two products."""
    e0 = key0 // PAGE_SIZE
    e1 = e0 + (1 if STEP > PAGE_SIZE else 0)
    ok0 = e0 < max_blocks
    ok1 = e1 < max_blocks
    return (gl.load(BLen_row + e0, mask=ok0, other=0), gl.load(BLen_row + e1, mask=ok1, other=0),
            gl.load(BPos_row + e0, mask=ok0, other=0), gl.load(BPos_row + e1, mask=ok1, other=0))


@gluon.jit
def _needs_mask(bl0, bl1, key0, k_lo, STEP: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Whether keys ``[key0, key0 + STEP)`` (pages of lengths ``bl0``, ``bl1``, as
    ``_tile_pages``) need a mask: some of them are padding (an entry shorter than its page,
    or past the table), or some row may not see some of them (from ``k_lo`` on, the causal
    region)."""
    if STEP > PAGE_SIZE:
        return (key0 + STEP > k_lo) | (bl0 < PAGE_SIZE) | (bl1 < PAGE_SIZE)
    else:
        return (key0 + STEP > k_lo) | (bl0 < key0 % PAGE_SIZE + STEP)


@gluon.jit
def _score_halves(q_rows, q_next, k_tile, NW: gl.constexpr):
    """Issues (async) the score products of a tile's two halves of keys, the first scored
    by ``q_rows`` and the second by ``q_next``."""
    BM: gl.constexpr = q_rows.shape[0]
    H: gl.constexpr = k_tile.shape[0] // 2
    h_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, H, 16])
    qa = warpgroup_mma(q_rows, k_tile.slice(0, H).permute((1, 0)), gl.zeros([BM, H], gl.float32, layout=h_l),
                       use_acc=False, is_async=True)
    qb = warpgroup_mma(q_next, k_tile.slice(H, H).permute((1, 0)), gl.zeros([BM, H], gl.float32, layout=h_l),
                       use_acc=False, is_async=True)
    return qa, qb


@gluon.jit
def _joined(qa, qb, s_l: gl.constexpr):
    """The two halves' accumulators side by side: the full tile's accumulator (the same
    registers; ``assert_trivial`` proves no data moves)."""
    BM: gl.constexpr = qa.shape[0]
    qk = gl.reshape(gl.permute(gl.join(qa, qb), (0, 2, 1)), [BM, 2 * qa.shape[1]])
    return gl.convert_layout(qk, s_l, assert_trivial=True)


@gluon.jit
def _mask_scores(qk, qpos, bl0, bl1, bp0, bp1, key0, k_lo, STEP: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Scores of keys ``[key0, key0 + STEP)`` masked from the pages' scalars (``_tile_pages``):
    a column's slot in its page, and so its key position (a padding slot's: past every
    query), is known per register."""
    s_l: gl.constexpr = qk.type.layout
    col = gl.arange(0, STEP, layout=gl.SliceLayout(0, s_l))
    if STEP > PAGE_SIZE:
        hi = col >= PAGE_SIZE
        slot = gl.where(hi, col - PAGE_SIZE, col)
        kpos = gl.where(slot < gl.where(hi, bl1, bl0), gl.where(hi, bp1, bp0) + slot, 2147483647)
    else:
        slot = key0 % PAGE_SIZE + col
        kpos = gl.where(slot < bl0, bp0 + slot, 2147483647)
    # before k_lo every row sees every real key (rows past the end have qpos -1)
    lim = gl.where(key0 + STEP > k_lo, gl.convert_layout(qpos, gl.SliceLayout(1, s_l)), 2147483646)
    return gl.where(kpos[None, :] <= lim[:, None], qk, float("-inf"))


@gluon.jit
def _softmax_step(qk, m_i, l_i, qk_scale, row_o: gl.constexpr):
    """The online-softmax update for one tile's scores (log2 units, the scale folded into
    the row max and one multiply-add per score): the new row max and sum, the factor the
    accumulator is to be scaled by, and ``P`` (float32, in the scores' layout)."""
    row_s: gl.constexpr = gl.SliceLayout(1, qk.type.layout)
    m_new = gl.maximum(m_i, gl.convert_layout(gl.max(qk, 1), row_o) * qk_scale)
    p = gl.exp2(qk * qk_scale - gl.convert_layout(m_new, row_s)[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.convert_layout(gl.sum(p, 1), row_o)
    return m_new, l_i, alpha, p


@gluon.jit
def _attend(q_rows, k_tile, v_tile, m_i, l_i, acc, qpos, bl0, bl1, bp0, bp1, key0, k_lo,
            qk_scale, STEP: gl.constexpr, PAGE_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, NW: gl.constexpr):
    """One online-softmax step of a consumer's rows over keys ``[key0, key0 + STEP)`` of one
    page (K and V tiles in shared memory): ``S = Q K^T``, masked only where ``_needs_mask``
    says so, the running max and sum (``m_i``, ``l_i``, in log2 units) and ``acc += P V``."""
    BM: gl.constexpr = q_rows.shape[0]
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, STEP, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    qk = warpgroup_mma(q_rows, k_tile.permute((1, 0)), gl.zeros([BM, STEP], gl.float32, layout=s_l),
                       use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
    if _needs_mask(bl0, bl1, key0, k_lo, STEP, PAGE_SIZE):
        qk = _mask_scores(qk, qpos, bl0, bl1, bp0, bp1, key0, k_lo, STEP, PAGE_SIZE)
    m_new, l_i, alpha, p = _softmax_step(qk, m_i, l_i, qk_scale, gl.SliceLayout(1, o_l))
    acc = acc * alpha[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(v_tile.dtype), p_l), v_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return m_new, l_i, acc


@gluon.jit
def _rows_start(QPos, q_start, n_rows, row0, G: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                o_l: gl.constexpr):
    """A consumer's rows (``row0 ..``), which exist, their query positions (-1 past the
    end), and the online softmax's start: row max (finite: a row that saw nothing stays 0),
    row sum and accumulator."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_o)
    row_ok = rows < n_rows
    qpos = gl.load(QPos + q_start + rows // G, mask=row_ok, other=-1).to(gl.int32)
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=row_o)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=row_o)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_l)
    return rows, row_ok, qpos, m_i, l_i, acc


@gluon.jit
def _store_rows(Out, acc, l_i, rows, row_ok, q_start, kvh, stride_ot, stride_oh, G: gl.constexpr):
    """The normalized output rows."""
    o_l: gl.constexpr = acc.type.layout
    o = acc / gl.where(l_i > 0.0, l_i, 1.0)[:, None]
    optr = Out + (q_start + rows // G).to(gl.int64) * stride_ot + (kvh * G + rows % G) * stride_oh
    ocol = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_l))
    gl.store(optr[:, None] + ocol[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])


@gluon.jit
def _next_run(q_empty, q_ready, rend, r, WAIT: gl.constexpr, NSLOT: gl.constexpr, NW: gl.constexpr):
    """Run ``r``'s query slot freed, run ``r + 1`` taken (its slot waited for if ``WAIT``)
    and its end read: ``(r + 1, end)``."""
    mbarrier.arrive(q_empty.index(r % NSLOT), count=1)
    r += 1
    if WAIT:
        mbarrier.wait(q_ready.index(r % NSLOT), (r // NSLOT) & 1)
    return r, _rd_end(rend, r % NSLOT, NW)


@gluon.jit
def _consumer(q_smem, rend, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
              QPos, Out, BPos_row, BLen_row, q_start, n_rows, row0, kvh,
              stride_ot, stride_oh, k_lo, t_hi, max_blocks, qk_scale,
              G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr,
              HALF: gl.constexpr, NSLOT: gl.constexpr, OVERLAP: gl.constexpr):
    """Online softmax over key tiles ``[0, t_hi)`` (causal mask from key ``k_lo``) of rows
    ``HALF * BLOCK_M ..`` of the program's tile (``BLOCK_M`` is the consumer's share; two
    consumers, each its own partition), the query of run ``r`` in slot ``r % NSLOT``; writes
    the normalized output rows. Tiles of two pages (``OVERLAP``) go to ``_consumer_ov``;
    here a tile lies in one page, so one run."""
    if OVERLAP:
        _consumer_ov(q_smem, rend, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                     QPos, Out, BPos_row, BLen_row, q_start, n_rows, row0, kvh,
                     stride_ot, stride_oh, k_lo, t_hi, max_blocks, qk_scale,
                     G, HEAD_DIM, BLOCK_M, BLOCK_N, PAGE_SIZE, STAGES, NW, HALF, NSLOT)
        return
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    rows, row_ok, qpos, m_i, l_i, acc = _rows_start(QPos, q_start, n_rows, row0 + HALF * BLOCK_M, G, BLOCK_M,
                                                    HEAD_DIM, o_l)
    r = 0
    mbarrier.wait(q_ready.index(0), 0)
    r_end = _rd_end(rend, 0, NW)
    bl0, bl1, bp0, bp1 = _tile_pages(BLen_row, BPos_row, 0, max_blocks, BLOCK_N, PAGE_SIZE)
    for tt in range(0, t_hi):
        key0 = tt * BLOCK_N
        # the next tile's pages, fetched while this one is computed
        nl0, nl1, np0, np1 = _tile_pages(BLen_row, BPos_row, key0 + BLOCK_N, max_blocks, BLOCK_N, PAGE_SIZE)
        if key0 >= r_end:  # a run starts: free the slot, take the next (already rotated)
            r, r_end = _next_run(q_empty, q_ready, rend, r, True, NSLOT, NW)
        s = tt % STAGES
        mbarrier.wait(kv_ready.index(s), (tt // STAGES) & 1)
        q_rows = q_smem.index(r % NSLOT).slice(HALF * BLOCK_M, BLOCK_M, dim=0)
        m_i, l_i, acc = _attend(q_rows, k_smem.index(s), v_smem.index(s), m_i, l_i, acc, qpos,
                                bl0, bl1, bp0, bp1, key0, k_lo, qk_scale, BLOCK_N, PAGE_SIZE, HEAD_DIM, NW)
        mbarrier.arrive(kv_empty.index(s), count=1)
        bl0, bl1, bp0, bp1 = nl0, nl1, np0, np1
    mbarrier.arrive(q_empty.index(r % NSLOT), count=1)
    _store_rows(Out, acc, l_i, rows, row_ok, q_start, kvh, stride_ot, stride_oh, G)


@gluon.jit
def _consumer_ov(q_smem, rend, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                 QPos, Out, BPos_row, BLen_row, q_start, n_rows, row0, kvh,
                 stride_ot, stride_oh, k_lo, t_hi, max_blocks, qk_scale,
                 G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr,
                 HALF: gl.constexpr, NSLOT: gl.constexpr):
    """``_consumer`` for tiles of two pages with K and V staged separately, in FA3's
    intra-warpgroup order: the scores of tile ``j`` are issued with ``P V`` of tile ``j - 1``,
    which runs while the consumer waits for the scores and masks them (ptxas waits for it
    before the exponentials: it reuses the registers of the product's ``P`` operand)."""
    dt: gl.constexpr = q_smem.dtype
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    rows, row_ok, qpos, m_i, l_i, acc = _rows_start(QPos, q_start, n_rows, row0 + HALF * BLOCK_M, G, BLOCK_M,
                                                    HEAD_DIM, o_l)
    r = 0
    mbarrier.wait(q_ready.index(0), 0)
    r_end = _rd_end(rend, 0, NW)
    bl0, bl1, bp0, bp1 = _tile_pages(BLen_row, BPos_row, 0, max_blocks, BLOCK_N, PAGE_SIZE)
    if t_hi > 0:
        # tile 0: scores and softmax only (nothing to add to yet)
        mbarrier.wait(kv_ready.index(0), 0)
        split = r_end < BLOCK_N
        if split:
            mbarrier.wait(q_ready.index(1 % NSLOT), (1 // NSLOT) & 1)
        q_rows = q_smem.index(0).slice(HALF * BLOCK_M, BLOCK_M, dim=0)
        q_next = q_smem.index(split.to(gl.int32) % NSLOT).slice(HALF * BLOCK_M, BLOCK_M, dim=0)
        qa, qb = _score_halves(q_rows, q_next, k_smem.index(0), NW)
        qa, qb = warpgroup_mma_wait(num_outstanding=0, deps=(qa, qb))
        mbarrier.arrive(kv_empty.index(0), count=1)
        if split:  # the first run ended in this tile
            r, r_end = _next_run(q_empty, q_ready, rend, r, False, NSLOT, NW)
        qk = _joined(qa, qb, s_l)
        if _needs_mask(bl0, bl1, 0, k_lo, BLOCK_N, PAGE_SIZE):
            qk = _mask_scores(qk, qpos, bl0, bl1, bp0, bp1, 0, k_lo, BLOCK_N, PAGE_SIZE)
        m_i, l_i, alpha, p = _softmax_step(qk, m_i, l_i, qk_scale, row_o)
        p_prev = gl.convert_layout(p.to(dt), p_l)
        bl0, bl1, bp0, bp1 = _tile_pages(BLen_row, BPos_row, BLOCK_N, max_blocks, BLOCK_N, PAGE_SIZE)
        for tt in range(1, t_hi):
            key0 = tt * BLOCK_N
            nl0, nl1, np0, np1 = _tile_pages(BLen_row, BPos_row, key0 + BLOCK_N, max_blocks, BLOCK_N, PAGE_SIZE)
            if key0 >= r_end:  # a run starts: free the slot, take the next (already rotated)
                r, r_end = _next_run(q_empty, q_ready, rend, r, True, NSLOT, NW)
            s = tt % STAGES
            sp = (tt - 1) % STAGES
            mbarrier.wait(kv_ready.index(s), (tt // STAGES) & 1)  # K of this tile
            split = r_end < key0 + BLOCK_N
            if split:
                mbarrier.wait(q_ready.index((r + 1) % NSLOT), ((r + 1) // NSLOT) & 1)
            q_rows = q_smem.index(r % NSLOT).slice(HALF * BLOCK_M, BLOCK_M, dim=0)
            q_next = q_smem.index((r + split.to(gl.int32)) % NSLOT).slice(HALF * BLOCK_M, BLOCK_M, dim=0)
            mbarrier.wait(kv_ready.index(STAGES + sp), ((tt - 1) // STAGES) & 1)  # V of the previous one
            qa, qb = _score_halves(q_rows, q_next, k_smem.index(s), NW)
            acc = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
            qa, qb = warpgroup_mma_wait(num_outstanding=1, deps=(qa, qb))  # the scores; P V runs on
            mbarrier.arrive(kv_empty.index(s), count=1)
            if tt >= 2:  # V of tile tt - 2, whose product the last step waited for (freed here, so
                # that no barrier sits between this step's softmax and its wait for P V)
                mbarrier.arrive(kv_empty.index(STAGES + (tt - 2) % STAGES), count=1)
            if split:  # the run that ended in this tile frees its slot
                r, r_end = _next_run(q_empty, q_ready, rend, r, False, NSLOT, NW)
            qk = _joined(qa, qb, s_l)
            if _needs_mask(bl0, bl1, key0, k_lo, BLOCK_N, PAGE_SIZE):
                qk = _mask_scores(qk, qpos, bl0, bl1, bp0, bp1, key0, k_lo, BLOCK_N, PAGE_SIZE)
            m_i, l_i, alpha, p = _softmax_step(qk, m_i, l_i, qk_scale, row_o)
            p_next = gl.convert_layout(p.to(dt), p_l)
            acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev))
            acc = acc * alpha[:, None]
            p_prev = p_next
            bl0, bl1, bp0, bp1 = nl0, nl1, np0, np1
        if t_hi >= 2:
            mbarrier.arrive(kv_empty.index(STAGES + (t_hi - 2) % STAGES), count=1)
        sp = (t_hi - 1) % STAGES
        mbarrier.wait(kv_ready.index(STAGES + sp), ((t_hi - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(STAGES + sp), count=1)
    mbarrier.arrive(q_empty.index(r % NSLOT), count=1)
    _store_rows(Out, acc, l_i, rows, row_ok, q_start, kvh, stride_ot, stride_oh, G)


@gluon.jit
def _paged_prefill_ws(Q, QPos, CuQ, kd, vd, BT, BPos, BLen, Runs, Delta, InvFreq, Out,
                      qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_btb, stride_bpb, stride_blb, stride_bdb, max_blocks,
                      G: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      SCAN_BLOCK: gl.constexpr, USE_ROPE: gl.constexpr, NW: gl.constexpr,
                      CONS_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, ROT_CHUNKS: gl.constexpr,
                      NSLOT: gl.constexpr, OVERLAP: gl.constexpr):
    """Grid ``(q_tiles, num_kv_heads, batch)``; see the module docstring."""
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # heaviest (latest) query tiles first
    kvh = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(CuQ + b)
    n_rows = (gl.load(CuQ + b + 1) - q_start) * G
    row0 = pid_m * BLOCK_M
    if row0 < n_rows:
        BT_row = BT + b.to(gl.int64) * stride_btb
        BPos_row = BPos + b.to(gl.int64) * stride_bpb
        BLen_row = BLen + b.to(gl.int64) * stride_blb
        Runs_row = Runs + b.to(gl.int64) * max_blocks
        Delta_row = Delta + b.to(gl.int64) * stride_bdb
        # one scan of the table row: entries before lo_e are seen in full by every row, none
        # from hi_e on is seen at all (as the Triton prefill's scan)
        l1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        rr = row0 + gl.arange(0, BLOCK_M, layout=l1)
        rok = rr < n_rows
        qp = gl.load(QPos + q_start + rr // G, mask=rok, other=0).to(gl.int32)
        qmin = gl.min(gl.where(rok, qp, 2147483647), 0)
        qmax = gl.max(gl.where(rok, qp, -2147483647), 0)
        lo_e = max_blocks
        hi_e = 0
        for e0 in range(0, max_blocks, SCAN_BLOCK):
            e = e0 + gl.arange(0, SCAN_BLOCK, layout=l1)
            em = e < max_blocks
            ln = gl.load(BLen_row + e, mask=em, other=0).to(gl.int32)
            bp = gl.load(BPos_row + e, mask=em, other=0).to(gl.int32)
            used = ln > 0
            hi_e = gl.maximum(hi_e, gl.max(gl.where(used & (bp <= qmax), e + 1, 0), 0))
            lo_e = gl.minimum(lo_e, gl.min(gl.where(used & (bp + ln - 1 > qmin), e, max_blocks), 0))
        t_hi = (hi_e * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
        k_lo = gl.minimum(lo_e, hi_e) * PAGE_SIZE  # keys (table slots) from here on are masked causally

        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(kd.dtype, [NSLOT, BLOCK_M, HEAD_DIM], q_layout)
        rend = gl.allocate_shared_memory(gl.int32, [NSLOT, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        k_smem = gl.allocate_shared_memory(kd.dtype, [STAGES, BLOCK_N, HEAD_DIM], kd.layout)
        v_smem = gl.allocate_shared_memory(vd.dtype, [STAGES, BLOCK_N, HEAD_DIM], vd.layout)
        # stage s: [s] for K and V together, or with OVERLAP [s] for K and [STAGES + s] for V
        kv_ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers
        for i in gl.static_range(NSLOT):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        fence_async_shared()
        CM: gl.constexpr = BLOCK_M // 2
        # the rotator is the default partition (the kernel's 4 warps; it gets the registers
        # the workers leave), so that both consumers get the count they are given
        gl.warp_specialize([
            (_rotator, (Q, q_smem, rend, q_ready, q_empty, Runs_row, Delta_row, InvFreq,
                        q_start, n_rows, row0, kvh, stride_qt, stride_qh, hi_e * PAGE_SIZE, t_hi * BLOCK_N,
                        G, HEAD_DIM, BLOCK_M, PAGE_SIZE, USE_ROPE, NSLOT, ROT_CHUNKS)),
            (_consumer, (q_smem, rend, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                         QPos, Out, BPos_row, BLen_row, q_start, n_rows, row0, kvh,
                         stride_ot, stride_oh, k_lo, t_hi, max_blocks, qk_scale,
                         G, HEAD_DIM, CM, BLOCK_N, PAGE_SIZE, STAGES, NW, 0, NSLOT, OVERLAP)),
            (_consumer, (q_smem, rend, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                         QPos, Out, BPos_row, BLen_row, q_start, n_rows, row0, kvh,
                         stride_ot, stride_oh, k_lo, t_hi, max_blocks, qk_scale,
                         G, HEAD_DIM, CM, BLOCK_N, PAGE_SIZE, STAGES, NW, 1, NSLOT, OVERLAP)),
            (_loader, (kd, vd, k_smem, v_smem, kv_ready, kv_empty, BT_row, kvh * HEAD_DIM, t_hi, max_blocks,
                       PAGE_SIZE, BLOCK_N, STAGES, OVERLAP)),
        ], [NW, NW, 1], [CONS_REGS, CONS_REGS, LOAD_REGS])


def _unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 inv_freq: torch.Tensor) -> str | None:
    """Why ``paged_prefill_gluon`` cannot serve these tensors' shapes and dtypes (``None`` if
    it can): head_dim 128, fully rotary, 16-bit caches of equal shapes viewable as
    ``(pages * page_size, kv_heads * head_dim)``, pages of a multiple of 64 tokens, an int32
    block table. The one statement of these limits, for ``supported`` and the launcher."""
    d, (_, page_size, hkv, dk) = q.shape[-1], k_cache.shape
    if d != 128 or dk != d or 2 * inv_freq.numel() != d:
        return (f"paged_prefill_gluon needs head_dim 128 and a fully rotary head, got head_dim {d}, "
                f"cache head_dim {dk}, rotary_dim {2 * inv_freq.numel()}")
    if k_cache.dtype not in (torch.float16, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        return f"paged_prefill_gluon needs float16 or bfloat16 caches, got {k_cache.dtype}/{v_cache.dtype}"
    if page_size % _PAGE_GRAIN or tuple(v_cache.shape) != tuple(k_cache.shape):
        return (f"paged_prefill_gluon needs pages of a multiple of {_PAGE_GRAIN} tokens and equal K/V "
                f"cache shapes, got {tuple(k_cache.shape)}/{tuple(v_cache.shape)}")
    try:
        k_cache.view(-1, hkv * d), v_cache.view(-1, hkv * d)
    except RuntimeError:
        return "paged_prefill_gluon needs caches viewable as (pages * page_size, kv_heads * head_dim)"
    if block_table.dtype != torch.int32:  # TMA coordinates are 32-bit
        return f"paged_prefill_gluon needs an int32 block_table, got {block_table.dtype}"
    return None


def _on_hopper(t: torch.Tensor) -> bool:
    return bool(t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9)


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              inv_freq: torch.Tensor) -> bool:
    """Whether ``paged_prefill_gluon`` serves these arguments on this device: a Hopper GPU
    and the shapes and dtypes of ``_unsupported``. (The engine's prefill on an H100/H200
    with a Llama-like model; ``paged_attention_triton`` sends such batches here.)"""
    return _on_hopper(q) and _unsupported(q, k_cache, v_cache, block_table, inv_freq) is None


def paged_prefill_gluon(
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
    out: torch.Tensor | None = None,
    *,
    max_seqlen_q: int,
    padding_finite: bool,
    use_rope: bool = True,
    runs: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Deferred-RoPE paged prefill, warp-specialized (Gluon, Hopper); the arguments and
    result of ``paged_attention_triton`` (see there and the module
    docstring), with these differences:

    padding_finite : must be ``True``: the caller vouches that every slot of every page
        the table names holds finite values (TMA reads whole pages).
    block_table : int32 (TMA coordinates are 32-bit).
    max_seqlen_q : required (it sizes the grid; no host sync).

    Arguments it cannot serve raise ``ValueError`` (checked before the device), and any
    device but a Hopper GPU ``RuntimeError``.
    runs : optional ``delta_runs(block_delta)`` (``rope_table(...)[2]``), to build it once
        per step; derived here otherwise.
    config : ``(BLOCK_M, num_warps, stages[, block_n])``, for benchmarks: 128 rows per program,
        4 warps per consumer, 2 or 3 K/V stages of 64 keys or 2 of 128 (shared memory holds no
        more); the default is ``(128, 4, 2, 128)``.
    """
    total_q, hq, d = q.shape
    if not padding_finite:
        raise ValueError("paged_prefill_gluon reads whole pages by TMA: pass padding_finite=True only if every "
                         "slot of every page the table names holds finite values")
    _, page_size, hkv, _ = k_cache.shape
    problem = _unsupported(q, k_cache, v_cache, block_table, inv_freq)
    if problem:
        raise ValueError(problem)
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    config = tuple(config or _CONFIG)
    block_m, num_warps, stages, block_n = config if len(config) == 4 else (*config, 64)
    if (block_m, num_warps) != (_BLOCK_M, 4) or (block_n, stages) not in ((64, 2), (64, 3), (128, 2)):
        raise ValueError(f"config {config}: BLOCK_M {_BLOCK_M} with 4 warps per consumer, and 2 or 3 stages "
                         "of 64 keys or 2 of 128")
    batch = cu_seqlens_q.numel() - 1
    tables = (block_table, block_pos, block_delta, block_len)
    if any(t.dim() != 2 or t.shape != block_table.shape for t in tables) or block_table.shape[0] != max(batch, 0):
        raise ValueError(f"block tables of shapes {[tuple(t.shape) for t in tables]}, expected ({batch}, max_blocks)")
    if any(t.stride(-1) != 1 for t in (block_table, block_pos, block_len)):
        raise ValueError("block tables need a contiguous last dim")
    if runs is not None and (tuple(runs.shape) != tuple(block_table.shape) or not runs.is_contiguous()):
        raise ValueError(f"runs table of shape {tuple(runs.shape)}, expected {tuple(block_table.shape)} contiguous")
    if total_q > 0 and int(max_seqlen_q) <= 0:
        raise ValueError(f"max_seqlen_q {max_seqlen_q} must be the longest query count of a sequence (>= 1)")
    if not _on_hopper(q):
        raise RuntimeError("paged_prefill_gluon runs on Hopper GPUs (sm_90) only")
    if out is None:
        out = torch.empty_like(q)
    if total_q == 0 or batch <= 0:
        return out
    if block_table.shape[1] == 0:  # no keys at all: every query sees nothing
        return out.zero_()
    if q.stride(-1) != 1:
        q = q.contiguous()
    target = out if out.stride(-1) == 1 else torch.empty_like(q)
    block_delta = block_delta.contiguous()
    if not use_rope:
        runs = block_table  # never read without RoPE (one run); no table to build
    elif runs is None:
        runs = delta_runs(block_delta)
    gdt = gl.bfloat16 if k_cache.dtype == torch.bfloat16 else gl.float16
    sub = min(block_n, page_size)  # keys per TMA copy: a tile, or a page of a tile
    lay = gl.NVMMASharedLayout.get_default_for([sub, d], gdt)
    kd = TensorDescriptor.from_tensor(k_cache.view(-1, hkv * d), [sub, d], lay)
    vd = TensorDescriptor.from_tensor(v_cache.view(-1, hkv * d), [sub, d], lay)
    group = hq // hkv
    grid = (triton.cdiv(max_seqlen_q * group, block_m), hkv, batch)
    _paged_prefill_ws[grid](
        q, q_pos, cu_seqlens_q, kd, vd, block_table, block_pos, block_len, runs, block_delta,
        inv_freq.to(device=q.device, dtype=torch.float32).contiguous(), target, float(sm_scale) * _LOG2E,
        q.stride(0), q.stride(1), target.stride(0), target.stride(1),
        block_table.stride(0), block_pos.stride(0), block_len.stride(0), block_delta.stride(0), block_table.shape[1],
        G=group, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        SCAN_BLOCK=256, USE_ROPE=bool(use_rope), NW=num_warps, CONS_REGS=_REGS[0], LOAD_REGS=_REGS[1],
        ROT_CHUNKS=_ROT_CHUNKS, NSLOT=_NSLOT, OVERLAP=block_n == 2 * page_size,
        num_warps=num_warps,
    )
    if target is not out:
        out.copy_(target)
    return out
