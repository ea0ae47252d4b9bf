"""Triton kernels for deferred-RoPE paged attention, and their thin launchers.

Each launcher computes the same function as its ``*_ref`` twin in
``lazyllm.kernels.reference`` (the specification; see its module docstring for the
conventions: page layout, ``block_pos`` / ``block_delta`` / ``block_len``, rotate-half RoPE
on the first ``2 * len(inv_freq)`` dims, masking by position).

How the attention kernel applies the deferred rotation
------------------------------------------------------
One program owns ``BLOCK_M`` rows of one sequence and one KV head. A row is a
(query, q-head-in-group) pair, so a GQA group shares every K/V tile it loads. The program
walks the sequence's page table in a flat loop over key tiles of ``BLOCK_N`` table slots
(a tile spans ``BLOCK_N / page_size`` pages, or part of one page). For each tile it loads
the rotary part of K as two halves ``k1 = K[:, :half]`` and ``k2 = K[:, half:rot]``, so the
rotate-half needs no register shuffle, and turns them into ``R(delta) k`` with the
per-row cos/sin of that row's page delta::

    k1' = k1 c - k2 s,   k2' = k2 c + k1 s,   score = q1 . k1' + q2 . k2' + q_pass . k_pass

The cos/sin of ``delta * inv_freq`` are one table of ``(batch, max_blocks, half)`` values
computed once per launch by torch (``rope_table``; exactly the reference's arithmetic), so
the kernel does no trigonometry. The rotated tile is rounded to the cache's dtype, as
the reference does, and fed to ``tl.dot`` like any K tile; there is no branch on the
delta inside the loop, so the loop stays software-pipelined.

The loop has two phases, as in Triton's fused-attention tutorial: tiles that every row of
the program sees in full (only slot validity is applied, as an additive column bias), then
tiles that need the causal mask. The program finds both bounds with one scan of its
table row, and never visits tiles past the last entry any of its rows can see. This is
exact for any table order and tight for the usual order (entries by position).

With pages of at least the key tile (the engine's default on CUDA: pages of 64) a key
tile has one delta, and the kernels rotate the *query* instead, ``R(-delta) q``, once per
run of table entries with the same delta (a chunk's pages form one run; ``delta_runs``),
so K goes from global memory to the tensor cores untouched, as in a RoPE-free kernel.
Three loop forms (``QROT``):

* ``3``, the default prefill for head_dim 128 in 16-bit (``_attn_runs_h``): one loop over
  all key tiles, the causal ones included; when a run starts, a scalar branch reloads the
  query and rotates it. The score is two products of depth ``head_dim / 2``, one per rotary
  half, so no rotate-half shuffle is needed, and the rotated halves are carried in
  registers as dot operands. The K/V software pipeline runs across runs.
* ``1``: an outer loop over runs around a pipelined inner loop (the pipeline restarts at
  each run); other head dims and partial rotary.
* ``2``: one flat loop on the whole head (decode and short prefills, where it measured
  faster; the batch-invariant launch).

Decode with pages smaller than the key tile (``_paged_decode_fwd``) rotates the query per
page: a key tile spans ``PPT`` pages with their own deltas, so the program holds ``PPT``
copies of the query group, ``R(-delta_p) q``, as extra rows of the (anyway padded to 16)
MMA, and row group ``p`` sees only its page's keys.

Decode and short prefills split the key range of each sequence over ``num_splits``
programs (flash-decoding); ``_merge_splits`` merges the partial outputs (and decode's
page-slot row groups) by log-sum-exp.

Measured on an H200 (BENCHMARKS.md, "Kernels (issue 3)"): decode at batch >= 32 at
1.1-1.7x SDPA's bandwidth; prefill at q >= 512 (``QROT=3``) at 103-121% of SDPA (flash).
The run starts rotate the query on pairs of 16-bit values (inline PTX; float32 in the
interpreter). Against the same kernel with RoPE off the rotation costs -1.2 to +1.8%, and
+6.3% at q=2048 over 32k keys; against the same binary with a single run the run starts
cost 3.8-5.2%. In a run start the warps wait on the cos/sin table loads and on the
shared-memory move of the query into the dot-operand layout (profiled): taking that off the
softmax warps' path needs warp specialization (a warp that loads and rotates the next run's
query while the others compute), which Triton 3.6 does not build for this loop on sm_90;
running ahead inside the same warps (prefetch, registers) slowed the loop (measured).

Every kernel loads in the cache's dtype and computes in float32 (but for that 16-bit query
rotation when compiled), so it runs in Triton's interpreter (``TRITON_INTERPRET=1``, CPU)
with float16/float32 tensors.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

__all__ = [
    "paged_attention_triton",
    "rerotate_copy_triton",
    "write_kv_triton",
    "rope_table",
    "delta_runs",
]

_LOG2E = 1.4426950408889634
# Finite start of the running max: a row that has seen only masked keys keeps
# exp2(-inf - _M_INIT) == 0 instead of exp2(-inf + inf) == nan.
_M_INIT = tl.constexpr(-1.0e30)


def _interpreting() -> bool:
    """Whether this module's kernels run in Triton's interpreter: decided when it was
    imported (``TRITON_INTERPRET=1`` then), whatever the environment says later."""
    return _INTERPRETED


_INTERPRETED = bool(triton.knobs.runtime.interpret)


def _fix_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar into a loop bound with ``int(a)`` on a
    numpy array of shape ``(1,)``, which numpy >= 2.4 refuses, so any ``range`` over a
    run-time value fails there. Take the element instead. Interpreter only; idempotent."""
    try:
        from triton.runtime import interpreter as _ti

        orig = _ti._patch_lang_tensor
    except (ImportError, AttributeError):
        return
    if getattr(orig, "_lazyllm_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._lazyllm_fixed = True
    _ti._patch_lang_tensor = patched


if _interpreting():
    _fix_interpreter_scalars()


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


# Reductions spelled through tl.reduce with the standard combine functions: the same code
# as tl.max/min/sum when compiled, and in the interpreter they work even when triton was
# imported before TRITON_INTERPRET was set (the standard library's own jit wrappers then
# refuse to run there; these combine functions hit the interpreter's numpy fast path).
@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)



# ----------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------


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
):
    """Online-softmax update of ``acc/l_i/m_i`` over key tiles ``[t_start, t_end)``.

    ``PREFETCH``: the cos/sin rows of tile ``t + 1`` are loaded during tile ``t`` (they
    are not a dot operand, so the software pipeliner leaves them in the loop)."""
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
        if CAUSAL_MASK:
            kpos = tl.load(BPos_row + ent, mask=kvalid, other=0).to(tl.int32) + slot
            seen = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
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
def _mask_scores(qk, kvalid, BPos_row, ent, slot, qpos, CAUSAL: tl.constexpr):
    """Scores of padding slots (and, ``CAUSAL``, of keys after a row's position) to -inf."""
    if CAUSAL:
        kpos = tl.load(BPos_row + ent).to(tl.int32) + slot
        seen = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        return tl.where(seen, qk, float("-inf"))
    else:
        return qk + tl.where(kvalid, 0.0, float("-inf"))[None, :]


@triton.jit
def _tile_update(acc, l_i, m_i, qa, qb, qpos, K, V, BT_row, BPos_row, BLen_row,
                 stride_kp, stride_ks, stride_vp, stride_vs, tt, t_lo, qk_scale,
                 HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL_MASK: tl.constexpr, DOT_PREC: tl.constexpr, IDX64: tl.constexpr,
                 HALVES: tl.constexpr):
    """Online-softmax update with key tile ``tt`` (which lies in one page).

    ``HALVES``: the query is given as its two halves ``qa, qb`` ``(BLOCK_M, HEAD_DIM // 2)``
    and scored with two products of depth ``HEAD_DIM // 2`` on the key tile's halves;
    otherwise ``qa`` is the whole ``(BLOCK_M, HEAD_DIM)`` query (``qb`` unused).
    ``CAUSAL_MASK``: ``0`` slot validity only, ``1`` the causal mask, ``2`` the causal mask
    on the tiles from ``t_lo`` on (a branch per tile)."""
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
    if CAUSAL_MASK == 2:
        if tt >= t_lo:
            qk = _mask_scores(qk, kvalid, BPos_row, ent, slot, qpos, True)
        else:
            qk = _mask_scores(qk, kvalid, BPos_row, ent, slot, qpos, False)
    else:
        qk = _mask_scores(qk, kvalid, BPos_row, ent, slot, qpos, CAUSAL_MASK == 1)
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
    FROM_DELTA: tl.constexpr, LOOKAHEAD: tl.constexpr, APPROX: tl.constexpr,
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
    loop over all tiles that rotates the query when a new run starts (a scalar branch)."""
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
                                         HEAD_DIM, PAGE_SIZE, BLOCK_N, CAUSAL_MASK, DOT_PREC, IDX64, False)
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
                                             HEAD_DIM, PAGE_SIZE, BLOCK_N, CAUSAL_MASK, DOT_PREC, IDX64, False)
            t = r_end
    return acc, l_i, m_i


@triton.jit
def _fma2(a, b, c):
    """``a * b + c`` on pairs of 16-bit values (``fma.rn.{bf16,f16}x2``: one instruction
    per two elements; compiled kernels only, Triton's interpreter runs no inline PTX)."""
    if a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _mul2(a, b):
    """``a * b`` on pairs of 16-bit values (``mul.rn.{bf16,f16}x2``; see ``_fma2``)."""
    if a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _cos_sin_of(ang, APPROX: tl.constexpr):
    """cos and sin of float32 angles (``delta * inv_freq``, up to ~1e5 rad), without a table.

    The angle is reduced into [-pi, pi] with a two-constant Cody-Waite step (``k * 6.28125``
    is exact for ``|k| < 2**15``; the low part carries the rest of 2 pi), then ``APPROX``:
    the SFU's ``cos.approx.f32`` / ``sin.approx.f32`` (compiled kernels; absolute error about
    2**-21, far below the 16-bit rounding that follows), else ``tl.cos`` / ``tl.sin``."""
    k = tl.extra.cuda.libdevice.rint(ang * 0.15915494309189535) if APPROX else tl.floor(ang * 0.15915494309189535 + 0.5)
    r = tl.fma(-k, 6.28125, ang)
    r = tl.fma(-k, 0.0019353071795864769, r)
    if APPROX:
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
    else:
        c = tl.cos(r)
        s = tl.sin(r)
    return c, s


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
    same way: on the H200 that ran 2-4% faster than letting the compiler keep a
    loop-invariant query in shared memory."""
    TPE: tl.constexpr = PAGE_SIZE // BLOCK_N  # key tiles per table entry
    H2: tl.constexpr = HEAD_DIM // 2
    e0 = tl.maximum(tl.minimum(t_start, t_end - 1), 0) // TPE  # inside the row if the range is empty
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
        if tt >= r_end:
            e = tt // TPE
            d, r_end, r_nx, d_nx = _next_run(Runs_row, Delta_row, e, r_nx, d_nx, max_blocks, TPE, FD, LOOKAHEAD)
            q1, q2 = _rot_q_h(q_row, row_ok, Cos_row, Sin_row, InvFreq, e, d, m_i, K, H2, USE_ROPE, PACKED, FD, APPROX)
        acc, l_i, m_i = _tile_update(acc, l_i, m_i, q1, q2, qpos, K, V, BT_row, BPos_row, BLen_row,
                                     stride_kp, stride_ks, stride_vp, stride_vs, tt, t_lo, qk_scale,
                                     HEAD_DIM, PAGE_SIZE, BLOCK_N, 2, DOT_PREC, IDX64, True)
    return acc, l_i, m_i


@triton.jit
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
):
    """Grid ``(q_tiles, num_kv_heads * num_splits, batch)``; see the module docstring.

    ``QROT``: apply the deltas to the query once per run of equal deltas (needs
    ``PAGE_SIZE >= BLOCK_N``) instead of to every key tile (``_attn_tiles``): ``1`` a loop
    per run, ``2`` one flat loop (``_attn_runs``), ``3`` one loop on the query's rotary
    halves with the causal tiles inside it (``_attn_runs_h``; fully rotary heads), which
    rotates on pairs of 16-bit values with ``PACKED_ROT`` and, with ``FROM_DELTA``, computes
    a run's cos/sin from its delta (``Delta``, ``InvFreq``) instead of loading the tables.

    ``SPLIT_OUT``: write normalized partial outputs and their log2-sum-exp to
    ``PartO/PartLse`` for ``_merge_splits`` instead of the output."""
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
        for e0 in range(0, max_blocks, SCAN_BLOCK):
            e = e0 + tl.arange(0, SCAN_BLOCK)
            em = e < max_blocks
            ln = tl.load(BLen_row + e, mask=em, other=0).to(tl.int32)
            bp = tl.load(BPos_row + e, mask=em, other=0).to(tl.int32)
            used = ln > 0
            hi_e = tl.maximum(hi_e, _max(tl.where(used & (bp <= qmax), e + 1, 0), 0))
            lo_e = tl.minimum(lo_e, _min(tl.where(used & (bp + ln - 1 > qmin), e, max_blocks), 0))
        t_hi = (hi_e * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
        t_lo = tl.minimum((lo_e * PAGE_SIZE) // BLOCK_N, t_hi)
    else:
        t_hi = (max_blocks * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
        t_lo = 0

    per_split = (t_hi + num_splits - 1) // num_splits
    s_start = split * per_split
    s_end = tl.minimum(s_start + per_split, t_hi)

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    if QROT == 3:
        acc, l_i, m_i = _attn_runs_h(
            acc, l_i, m_i, q_row, row_ok, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs + b.to(tl.int64) * max_blocks,
            Delta + b.to(tl.int64) * stride_bdb, InvFreq,
            stride_kp, stride_ks, stride_vp, stride_vs,
            s_start, s_end, t_lo, max_blocks, qk_scale, HEAD_DIM, USE_ROPE, PAGE_SIZE, BLOCK_N, DOT_PREC, IDX64,
            PACKED_ROT, FROM_DELTA, LOOKAHEAD, APPROX,
        )
    elif QROT:
        ROT_Q: tl.constexpr = 2 * HALF if USE_ROPE else 0
        Runs_row = Runs + b.to(tl.int64) * max_blocks
        Delta_row = Delta + b.to(tl.int64) * stride_bdb
        acc, l_i, m_i = _attn_runs(
            acc, l_i, m_i, q_row, row_ok, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs_row, Delta_row, InvFreq,
            stride_kp, stride_ks, stride_vp, stride_vs,
            s_start, tl.minimum(s_end, t_lo), max_blocks, qk_scale,
            HEAD_DIM, HALF, ROT_Q, PAGE_SIZE, BLOCK_N, False, DOT_PREC, IDX64, QROT == 2,
            FROM_DELTA, LOOKAHEAD, APPROX,
        )
        acc, l_i, m_i = _attn_runs(
            acc, l_i, m_i, q_row, row_ok, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row, Runs_row, Delta_row, InvFreq,
            stride_kp, stride_ks, stride_vp, stride_vs,
            tl.maximum(s_start, t_lo), s_end, max_blocks, qk_scale,
            HEAD_DIM, HALF, ROT_Q, PAGE_SIZE, BLOCK_N, True, DOT_PREC, IDX64, QROT == 2,
            FROM_DELTA, LOOKAHEAD, APPROX,
        )
    else:
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q1, q2, qp, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row,
            stride_kp, stride_ks, stride_vp, stride_vs,
            max_blocks, s_start, tl.minimum(s_end, t_lo), qk_scale,
            HEAD_DIM, HALF, HALF_P, PASS, PASS_P, PAGE_SIZE, BLOCK_N,
            USE_ROPE, CS_PER_PAGE, False, DOT_PREC, IDX64, NPG, PREFETCH,
        )
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, q1, q2, qp, qpos,
            Kh, Vh, BT_row, BPos_row, BLen_row, Cos_row, Sin_row,
            stride_kp, stride_ks, stride_vp, stride_vs,
            max_blocks, tl.maximum(s_start, t_lo), s_end, qk_scale,
            HEAD_DIM, HALF, HALF_P, PASS, PASS_P, PAGE_SIZE, BLOCK_N,
            USE_ROPE, CS_PER_PAGE, True, DOT_PREC, IDX64, NPG, PREFETCH,
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
    PREFETCH: tl.constexpr,
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

    t_hi = (max_blocks * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
    per_split = (t_hi + num_splits - 1) // num_splits
    s_start = split * per_split
    s_end = tl.minimum(s_start + per_split, t_hi)

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    c_n, s_n = _load_qcs(Cos_row, Sin_row, s_start, max_blocks * (USE_ROPE and PREFETCH), row_ok, row_page,
                         cs_col, in_rot, HALF, PAGE_SIZE, BLOCK_N, PPT)
    for t in range(s_start, s_end):
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
        if PPT > 1:
            seen = seen & ((ent % PPT)[None, :] == row_page[:, None])
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
    HEAD_DIM: tl.constexpr,
):
    """Log-sum-exp merge of ``num_splits`` partial outputs; grid ``(total_q * heads,)``."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid // NUM_Q_HEADS
    h = pid % NUM_Q_HEADS
    s = tl.arange(0, SPLITS_P)
    sm = s < num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(PartLse + pid * num_splits + s, mask=sm, other=float("-inf"))
    m = _max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0
    w = tl.math.exp2(lse - m)
    den = _sum(w, 0)
    o = tl.load(PartO + (pid * num_splits + s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=sm[:, None], other=0.0)
    res = _sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d, res.to(Out.dtype.element_ty))


def delta_runs(block_delta: torch.Tensor) -> torch.Tensor:
    """For each table entry, the index of the next entry whose delta differs.

    Parameters
    ----------
    block_delta : ``(batch, max_blocks)`` int.

    Returns
    -------
    ``(batch, max_blocks)`` int32, contiguous: ``runs[b, e]`` is the smallest ``e' > e``
    with ``block_delta[b, e'] != block_delta[b, e]`` (``max_blocks`` if none). The query-
    rotating kernel walks a row's entries run by run with it. Device ops only (no host
    sync), so it can be built inside a CUDA graph.
    """
    bsz, n = block_delta.shape
    idx = torch.arange(n, device=block_delta.device, dtype=torch.int32).expand(bsz, n)
    starts = torch.ones((bsz, n), dtype=torch.bool, device=block_delta.device)
    starts[:, 1:] = block_delta[:, 1:] != block_delta[:, :-1]
    cand = torch.where(starts, idx, torch.full_like(idx, n))  # a run starts at e'
    nxt = torch.full_like(idx, n)
    if n > 1:
        # smallest run start strictly after e: a reverse running minimum of cand[e + 1:]
        nxt[:, :-1] = cand[:, 1:].flip(-1).cummin(-1).values.flip(-1)
    return nxt.contiguous()


def _cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor):
    ang = delta.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    return ang.cos().contiguous(), ang.sin().contiguous()


def rope_table(block_delta: torch.Tensor, inv_freq: torch.Tensor):
    """cos and sin of every table entry's delta rotation, and the runs of equal deltas.

    Parameters
    ----------
    block_delta : ``(batch, max_blocks)`` int, rotation of each entry in positions.
    inv_freq : ``(rotary_dim // 2,)`` float32.

    Returns
    -------
    cos, sin : ``(batch, max_blocks, rotary_dim // 2)`` float32, contiguous; the same
    arithmetic as ``reference.rope_cos_sin``.
    runs : ``delta_runs(block_delta)``.
    The table depends only on the step's metadata, so an engine can build it once per step
    and pass it to every layer's ``paged_attention_triton(..., rope=...)``.
    """
    return (*_cos_sin(block_delta, inv_freq), delta_runs(block_delta))


# Launch configurations, chosen on an H200 (bf16, d=128, page 16) by benchmarks/kernels.py.
# (BLOCK_M, BLOCK_N, num_warps, num_stages)
_PREFILL_CFG = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)}
_PREFILL_CFG_LONG: dict = {}  # (128, 128, 8, 2) is faster without RoPE but spills with it


# With pages of at least the key tile the query-rotating kernel runs; on the H200 its best
# tile for d=128 was 64x64, 4 warps, 3 stages (95% of SDPA at q=512 over 8k, 82% at q=2048
# over 32k; the 128x64 tile spills there).
_PREFILL_CFG_QROT = {128: (64, 64, 4, 3)}

# The one-loop kernel on the query's rotary halves (qrot=3), the default prefill for
# head_dim 128 in 16-bit with pages of at least 64: on the H200 96-115% of SDPA at
# q >= 512 with 2 stages (3 stages: 0-8% slower; BENCHMARKS.md, "Kernels (issue 3)").
_PREFILL_CFG_HALVES = {128: (64, 64, 4, 2)}


def _prefill_config(d: int, kv_slots: int, page_size: int = 0, halves: bool = False):
    if halves and d in _PREFILL_CFG_HALVES:
        return _PREFILL_CFG_HALVES[d]
    qc = _PREFILL_CFG_QROT.get(d)
    if qc is not None and page_size >= qc[1]:
        return qc
    if kv_slots >= _LONG_KV and d in _PREFILL_CFG_LONG:
        return _PREFILL_CFG_LONG[d]
    return _PREFILL_CFG.get(d, _PREFILL_CFG[256])


_LONG_KV = 16384
_DECODE_CFG = {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 4, 2)}  # BLOCK_N, warps, stages
# The short path (decode, a few queries per sequence) on the query's rotary halves (qrot=3,
# 16-bit rotation) for a fully rotary head in 16-bit: (few programs, at least one per SM).
# Opt-in (LAZYLLM_SHORT_HALVES below). On the H200 (BENCHMARKS.md, sessions 10-11; Llama-3.1-8B
# heads, pages of 64, CUDA graphs), decode at batch 32-128 over 4k-32k keys:
# - each row over its own pages: the 64-key tile 1-4% faster than the flat float32 loop
#   (qrot=2), the 32-key tile 2-6% faster up to batch 64 and up to 2% slower at 128;
# - all rows over the same pages (L2 serves the repeats): the 32-key tile 3-10% slower than
#   the flat loop; the 64-key tile 2-4% faster, except 2% slower over 4k at batch 64-128;
# - RoPE cost against the same loop with RoPE off: the 32-key tile -5.5 to +2.1%; the 64-key
#   tile +3 to +12% at batch 128 (at batch 32-64 its RoPE-off build is 15-32% slower than
#   its RoPE-on one); the flat loop +0.3 to +2.9% (two splits at batch 32 then).
# In the engine (benchmarks/engine.py, batch 64 over about 4.2k keys) the "auto" choice (32-key
# tiles there) made the step 12.25 ms against 11.80 ms flat when the requests share chunks,
# and 13.28 against 13.77 ms when each reads its own. No clear win, so the flat loop stays.
_DECODE_CFG_HALVES = {128: ((64, 4, 3), (32, 4, 3))}
# LAZYLLM_SHORT_HALVES: "auto" runs the short path on the rotary halves with the tile chosen
# above; "64" or "32" pins that tile; anything else ("0", the default) the flat loop
_SHORT_HALVES = os.environ.get("LAZYLLM_SHORT_HALVES", "0")
_CS_PER_PAGE = True
# compiled run loops: each run's cos/sin computed from its delta, the next run's delta loaded
# a run ahead. On the H200 that made decode's RoPE cost 1.0-3.1% (was 1.2-4.0%) and left
# prefill the same or slightly faster (BENCHMARKS.md, session 7)
_COEF_FROM_DELTA = True
_COEF_LOOKAHEAD = True
_PREFETCH = True  # measured faster on the H200 at all four shapes tried (BENCHMARKS.md)
_NUM_SMS: dict = {}
_QROT_FAILED: set = set()  # shapes whose query-rotating kernel did not compile
_GLUON_FAILED: set = set()  # shapes whose Gluon prefill failed (served by the Triton prefill)
# LAZYLLM_GLUON_PREFILL=0 keeps prefill on the Triton kernel (an escape hatch, and for A/B runs)
_GLUON_PREFILL = os.environ.get("LAZYLLM_GLUON_PREFILL", "1") != "0"
# The Gluon prefill's programs pay a fixed start (table scan, barriers, the partitions, the
# first rotation) and then run faster than the Triton kernel's: on the H200 it took 1.59x the
# Triton time for 8 sequences of 512 tokens over themselves, 1.19x at 1024, 1.01x at 4163,
# 0.98x for 2048 queries over 4k keys and 0.85-0.93x for 512 queries over 4k-32k
# (BENCHMARKS.md, session 9). So it serves a call only when a query tile sees about this many
# keys on average (the key slots, less half the queries: the causal part).
_GLUON_MIN_KEYS = 3072


_GLUON_MODULE: list = []  # [gluon_prefill], or [None] in a Triton without Gluon, once tried


def _gluon_module():
    """``lazyllm.kernels.gluon_prefill``, or ``None`` where this Triton has no Gluon; the
    import is tried once (the launcher asks on every prefill call)."""
    if not _GLUON_MODULE:
        try:
            from lazyllm.kernels import gluon_prefill
        except Exception:  # noqa: BLE001  (a Triton without Gluon)
            gluon_prefill = None
        _GLUON_MODULE.append(gluon_prefill)
    return _GLUON_MODULE[0]


def _gluon_supported(q, k_cache, v_cache, block_table, inv_freq) -> bool:
    """``gluon_prefill.supported`` where Gluon imports (Hopper only; never on CPU), unless
    ``LAZYLLM_GLUON_PREFILL=0``."""
    if not (q.is_cuda and _GLUON_PREFILL):
        return False
    gp = _gluon_module()
    return gp is not None and gp.supported(q, k_cache, v_cache, block_table, inv_freq)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def paged_attention_triton(
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
    max_seqlen_q: int | None = None,
    use_rope: bool = True,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    config: tuple[int, int, int, int] | None = None,
    cs_per_page: bool | None = None,
    prefetch: bool | None = None,
    qrot: bool | None = None,
    batch_invariant: bool = False,
    coef_from_delta: bool | None = None,
    coef_lookahead: bool | None = None,
    padding_finite: bool = False,
    prefill_kernel: str | None = None,
) -> torch.Tensor:
    """Deferred-RoPE attention of a varlen batch of queries over paged KV (Triton).

    Same function as ``reference.paged_attention_ref``; serves prefill and decode.

    Parameters
    ----------
    q : ``(total_q, num_q_heads, head_dim)``, RoPE already applied at ``q_pos``.
    q_pos : ``(total_q,)`` int.
    cu_seqlens_q : ``(batch + 1,)`` int.
    k_cache, v_cache : ``(num_pages, page_size, num_kv_heads, head_dim)``, last dim
        contiguous; float16, bfloat16 or float32. ``page_size`` a power of two.
    block_table, block_pos, block_delta, block_len : ``(batch, max_blocks)`` int; entries
        with ``block_len == 0`` are padding and never read.
    inv_freq : ``(rotary_dim // 2,)`` float32, ``rotary_dim <= head_dim``.
    sm_scale : softmax scale.
    out : optional ``(total_q, num_q_heads, head_dim)`` output buffer.
    max_seqlen_q : the longest query count of a sequence. Pass it: without it the
        launcher reads ``cu_seqlens_q`` on the host (a device sync, no CUDA graphs).
        1 (or a few rows per KV head) selects the decode path.
    use_rope : ``False`` ignores ``block_delta`` (no rotation in the kernel): for batches
        whose deltas are all 0, models without RoPE, and measuring the rotation's cost.
    rope : optional ``rope_table(block_delta, inv_freq)``, to build it once per step
        (a ``(cos, sin)`` pair is accepted too: the runs are then derived here).
    num_splits : key-range splits per sequence (flash-decoding); default by occupancy.
    config : ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, for benchmarks.
    cs_per_page : load the cos/sin table once per page and broadcast it over the page's
        slots (``True``) or gather it per slot (``False``); for benchmarks.
    prefetch : load the next key tile's cos/sin during this one (default on); for benchmarks.
    qrot : rotate the query once per run of equal deltas (default whenever a key tile lies
        in one page, ``page_size >= BLOCK_N``) instead of every key tile; ``1``: a loop per
        run, ``2``: the same in one flat loop (see ``_attn_runs``), ``3``: one loop on the
        query's rotary halves (``_attn_runs_h``; fully rotary heads; the default prefill
        for head_dim 128 in 16-bit); for benchmarks and tests.
    coef_from_delta : with ``qrot`` and RoPE, compute each run's cos/sin in the kernel from
        its delta and ``inv_freq`` (``_cos_sin_of``) instead of loading two ``rope`` table
        rows (default: compiled kernels; the interpreter loads the rows); for benchmarks
        and tests.
    coef_lookahead : with ``coef_from_delta``, load the next run's delta and end a run ahead,
        two scalars carried by the loop (default on); for benchmarks and tests.
    batch_invariant : one launch configuration for every call, prefill or decode, whatever
        the batch: the general kernel, 64-row query tiles, a fixed key tile, no split-K.
        A query row then sees its keys in the same tiles, in the same order, through the same
        instructions, so its output does not depend on the other rows of the batch, nor on
        whether it is decoded or prefilled (slower for decode; for reproducible serving).
    padding_finite : the caller vouches that every slot of every page the table names holds
        finite values, padding slots included (the engine's pool is zero-initialized and only
        written with K/V). On a Hopper GPU this lets prefill run the warp-specialized Gluon
        kernel (``gluon_prefill``), which reads whole pages by TMA, where it fits
        (``gluon_prefill.supported``; the query-rotating prefill with one key split and more
        than 64 query rows per KV head: never decode, whose rows would fill 4 of its 128) and
        where it is the faster: long key ranges (``_GLUON_MIN_KEYS``; BENCHMARKS.md).
        ``LAZYLLM_GLUON_PREFILL=0`` in the environment switches it off.
    prefill_kernel : ``"triton"`` or ``"gluon"`` forces that prefill kernel (``"gluon"``
        needs ``padding_finite`` too, and raises where it cannot serve the call); default: as
        above. For benchmarks and tests.

    Returns
    -------
    ``out``, ``(total_q, num_q_heads, head_dim)`` in ``q.dtype``; 0 for a query that sees
    no key.
    """
    total_q, hq, d = q.shape
    _, page_size, hkv, dk = k_cache.shape
    if prefill_kernel not in (None, "triton", "gluon"):
        raise ValueError(f"prefill_kernel must be None, 'triton' or 'gluon', got {prefill_kernel!r}")
    qrot_arg = qrot
    if dk != d or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim {d} must be a power of two >= 16")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size {page_size} must be a power of two")
    half = int(inv_freq.numel())
    if 2 * half > d:
        raise ValueError(f"rotary_dim {2 * half} exceeds head_dim {d}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous last dim")
    if out is None:
        out = torch.empty_like(q)
    batch = cu_seqlens_q.numel() - 1
    if total_q == 0 or batch <= 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    target = out if out.stride(-1) == 1 else torch.empty_like(q)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q <= 0:
        return out
    group = hq // hkv
    max_blocks = block_table.shape[1]
    use_rope = bool(use_rope) and half > 0
    pass_dim = d - 2 * half

    if batch_invariant:
        bn = 64 if d <= 128 else 32
        config, num_splits = (64, bn, 4, 2), 1
        qrot = 2 if page_size >= bn else 0
    rows = max_seqlen_q * group
    one_query = max_seqlen_q == 1 and not batch_invariant
    short = rows <= 64  # a few queries per sequence: small query tiles, no causal scan
    # the one-loop kernel on rotary halves needs a fully rotary head when it rotates
    halves_ok = (not use_rope or 2 * half == d) and d >= 32
    half16 = halves_ok and k_cache.dtype in (torch.float16, torch.bfloat16)
    short_halves = (short and config is None and half16 and d in _DECODE_CFG_HALVES
                    and _SHORT_HALVES in ("auto", "64", "32"))
    if short_halves:  # one query tile per sequence and KV head: batch * hkv programs before split-K
        short_cfg = next((c for c in _DECODE_CFG_HALVES[d] if str(c[0]) == _SHORT_HALVES),
                         _DECODE_CFG_HALVES[d][int(batch * hkv >= _num_sms(q.device))])
    else:
        short_cfg = _DECODE_CFG.get(d, _DECODE_CFG[256])
    dec_n = config[1] if config is not None else short_cfg[0]
    qkey = (d, k_cache.dtype, short, page_size, config)
    if qrot is None:
        halves = short_halves if short else (half16 and d in _PREFILL_CFG_HALVES)
        n_needed = dec_n if short else (config[1] if config is not None else _prefill_config(
            d, max_blocks * page_size, page_size, halves)[1])
        qrot = (3 if halves else 1) if page_size >= n_needed else 0
        qrot = qrot if qkey not in _QROT_FAILED else 0
    qrot = int(qrot) if qrot in (0, 1, 2, 3) else int(bool(qrot))
    if qrot == 3 and not halves_ok:
        raise ValueError(f"qrot=3 needs a fully rotary head (rotary_dim {2 * half} != head_dim {d})")
    if qrot == 1 and short:
        # the run loop as one flat loop (qrot=2, see _attn_runs). On the H200 (BENCHMARKS.md)
        # the flat loop made decode faster and its RoPE cost 1.4-2.9% (the run loop: 3.5-7.4%),
        # while for prefill the run loop was faster (83-97% of SDPA against 70-81%): flat for
        # the short path (decode and a few queries per sequence), runs for prefill
        qrot = 2
    # decode with pages smaller than the key tile: query rotated per page (_paged_decode_fwd);
    # with a tile inside one page the general kernel's run loop serves decode too
    decode_kernel = one_query and not qrot
    if decode_kernel:
        block_n, num_warps, num_stages = _DECODE_CFG.get(d, _DECODE_CFG[256])
        if config is not None:
            _, block_n, num_warps, num_stages = config
        ppt = max(1, block_n // page_size)
        block_m = max(16, _next_pow2(ppt * group))
    elif config is not None:
        block_m, block_n, num_warps, num_stages = config
        if block_m <= 0:  # a decode config (the tile of rows is derived)
            block_m = max(16, _next_pow2(rows))
    elif short:
        block_m = max(16, _next_pow2(rows))
        block_n, num_warps, num_stages = short_cfg if qrot == 3 else _DECODE_CFG.get(d, _DECODE_CFG[256])
    else:
        block_m, block_n, num_warps, num_stages = _prefill_config(d, max_blocks * page_size, page_size if qrot else 0,
                                                                  qrot == 3)
    if _interpreting():
        num_stages = 1
    if cs_per_page is None:
        cs_per_page = _CS_PER_PAGE
    if prefetch is None:
        prefetch = _PREFETCH
    if qrot and page_size < block_n:
        raise ValueError(f"qrot needs page_size >= BLOCK_N, got {page_size} < {block_n}")
    q_tiles = 1 if decode_kernel else triton.cdiv(rows, block_m)
    kv_tiles = triton.cdiv(max_blocks * page_size, block_n)
    if num_splits is None:
        # about one program per SM at least; split-K only while there are fewer
        ctas = q_tiles * batch * hkv
        sms = _num_sms(q.device)
        num_splits = 1
        if one_query and ctas < sms:
            # decode at small batch is latency-bound: about two programs per SM, at least two
            # key tiles each (H200, batch 1 over 4k-16k keys: 12-29 us against 14-38 us with
            # one program per SM; BENCHMARKS.md)
            num_splits = max(1, min(triton.cdiv(2 * sms, ctas), kv_tiles // 2, 64))
        elif ctas < sms:
            # a few queries per sequence (prefill of 64 tokens, say): about two programs per
            # SM, which these kernels' registers and shared memory allow. H200, 64 queries
            # over 4k-32k keys from a CUDA graph: 8 splits (256 programs) took 0.67-0.79x
            # the time of 5 (one per SM, 160 programs; BENCHMARKS.md, session 10)
            num_splits = max(1, min((2 * sms) // ctas, kv_tiles // 4, 64))
        # from one program per SM on, no split-K: two programs fit on an SM at once. H200,
        # decode at batch 17-32 (136-256 programs) over 4k-32k keys from CUDA graphs: one
        # split was 0-3% faster than two, with a RoPE cost of -0.5 to +2.1% against +1.1 to
        # +3.3% (BENCHMARKS.md, session 11)
    num_splits = max(1, min(int(num_splits), kv_tiles))

    if prefill_kernel == "gluon" or (
            prefill_kernel is None and padding_finite and not short and qrot == 3 and qrot_arg is None
            and num_splits == 1
            and config is None and not batch_invariant and not _interpreting()
            and max_blocks * page_size - max_seqlen_q // 2 >= _GLUON_MIN_KEYS):
        gkey = (d, k_cache.dtype, page_size)
        if prefill_kernel == "gluon" or (
                gkey not in _GLUON_FAILED and _gluon_supported(q, k_cache, v_cache, block_table, inv_freq)):
            try:
                gluon_prefill = _gluon_module()
                if gluon_prefill is None:  # only when forced: the routing above asked already
                    raise RuntimeError("prefill_kernel='gluon' needs a Triton with Gluon (triton.experimental.gluon)")
                return gluon_prefill.paged_prefill_gluon(
                    q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_delta, block_len,
                    inv_freq, sm_scale, out, max_seqlen_q=max_seqlen_q, padding_finite=padding_finite,
                    use_rope=use_rope, runs=rope[2] if use_rope and rope is not None and len(rope) > 2 else None)
            except Exception as e:  # noqa: BLE001
                if prefill_kernel == "gluon" or torch.cuda.is_current_stream_capturing():
                    raise
                # a Gluon build or launch failure (another Triton version, say): serve this
                # shape with the Triton prefill from now on, which computes the same function
                _GLUON_FAILED.add(gkey)
                warnings.warn(f"Gluon prefill failed for head_dim={d}, {k_cache.dtype}, pages of {page_size} "
                              f"({type(e).__name__}: {e}); using the Triton prefill", RuntimeWarning, stacklevel=2)

    if coef_from_delta is None:
        coef_from_delta = _COEF_FROM_DELTA and not _interpreting()
    from_delta = bool(use_rope and qrot and coef_from_delta)
    lookahead = bool(from_delta and (_COEF_LOOKAHEAD if coef_lookahead is None else coef_lookahead))
    rope_arg = rope
    if from_delta:  # the kernel reads the deltas and inv_freq, not the cos/sin table
        inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
        if block_delta.stride(-1) != 1:
            block_delta = block_delta.contiguous()
        if rope is None:
            rope = (inv_freq, inv_freq, delta_runs(block_delta))  # cos/sin never read
    runs = inv_freq  # never read unless qrot
    if use_rope:
        if rope is None:
            rope = rope_table(block_delta, inv_freq.to(q.device))
        cos, sin = rope[0], rope[1]
        if not from_delta and (cos.shape != (batch, max_blocks, half) or not (cos.is_contiguous() and sin.is_contiguous())):
            raise ValueError(f"rope table of shape {tuple(cos.shape)}, expected {(batch, max_blocks, half)} contiguous")
        if qrot:
            runs = rope[2] if len(rope) > 2 else delta_runs(block_delta)
            if runs.shape != (batch, max_blocks) or not runs.is_contiguous():
                raise ValueError(f"runs table of shape {tuple(runs.shape)}, expected {(batch, max_blocks)} contiguous")
    else:
        cos = sin = inv_freq  # never read
        if qrot in (1, 2):  # one run per row: no rotation at all
            runs = torch.full((1,), max_blocks, dtype=torch.int32, device=q.device).expand(batch, max_blocks)
            runs = runs.contiguous()
    n_parts = num_splits * (ppt if decode_kernel else 1)
    if n_parts > 1:
        part_o = torch.empty((total_q, hq, n_parts, d), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((total_q, hq, n_parts), device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = target  # never read

    dot_prec = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    idx64 = max(k_cache.numel(), v_cache.numel()) >= 2**31  # element offsets fit in int32 otherwise
    common = (
        float(sm_scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
    )
    tables = (block_table.stride(0), block_pos.stride(0), block_len.stride(0), max_blocks, num_splits)
    packed_rot = qrot == 3 and not _interpreting() and k_cache.dtype in (torch.float16, torch.bfloat16)
    if decode_kernel:
        _paged_decode_fwd[(hkv * num_splits, batch)](
            q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_len, cos, sin,
            target, part_o, part_lse, *common, target.stride(0), target.stride(1), *tables,
            NUM_Q_HEADS=hq, G=group, HEAD_DIM=d, HALF=half, ROT=2 * half, PAGE_SIZE=page_size,
            PPT=ppt, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_OUT=n_parts > 1, USE_ROPE=use_rope,
            DOT_PREC=dot_prec, IDX64=idx64, PREFETCH=prefetch,
            num_warps=num_warps, num_stages=num_stages,
        )
    else:
        half_p = max(16, _next_pow2(half)) if half else 16
        pass_p = max(16, _next_pow2(pass_dim)) if pass_dim else 16
        try:
            _paged_attn_fwd[(q_tiles, hkv * num_splits, batch)](
                q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_len, cos, sin, runs,
                block_delta, inv_freq, target, part_o, part_lse, *common, target.stride(0), target.stride(1),
                *tables[:3], block_delta.stride(0), *tables[3:],
                NUM_Q_HEADS=hq, G=group, HEAD_DIM=d, HALF=half, HALF_P=half_p,
                PASS=pass_dim, PASS_P=pass_p, PAGE_SIZE=page_size,
                BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_OUT=num_splits > 1,
                SCAN=not short or bool(qrot), SCAN_BLOCK=256, USE_ROPE=use_rope, CS_PER_PAGE=cs_per_page, DOT_PREC=dot_prec,
                IDX64=idx64, NPG=max(1, block_n // page_size), PREFETCH=prefetch, QROT=qrot,
                PACKED_ROT=packed_rot, FROM_DELTA=from_delta, LOOKAHEAD=lookahead, APPROX=not _interpreting(),
                num_warps=num_warps, num_stages=num_stages,
            )
        except Exception as e:  # noqa: BLE001
            if not qrot or _interpreting() or torch.cuda.is_current_stream_capturing():
                raise
            # A Triton compiler failure on this shape (seen for tiny head dims in float32):
            # remember it and serve the shape with the key-rotating kernel, which computes
            # the same function.
            _QROT_FAILED.add(qkey)
            warnings.warn(f"query-rotating attention kernel failed to compile for head_dim={d}, "
                          f"{k_cache.dtype}, pages of {page_size} ({type(e).__name__}); using the "
                          "key-rotating kernel for this shape", RuntimeWarning, stacklevel=2)
            return paged_attention_triton(
                q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_delta, block_len,
                inv_freq, sm_scale, out, max_seqlen_q=max_seqlen_q, use_rope=use_rope,
                rope=None if rope_arg is None else (rope_arg[0], rope_arg[1]), config=config, qrot=False,
                num_splits=num_splits if batch_invariant else None)
    if n_parts > 1:
        _merge_splits[(total_q * hq,)](
            part_o, part_lse, target, target.stride(0), target.stride(1), n_parts,
            NUM_Q_HEADS=hq, SPLITS_P=max(2, _next_pow2(n_parts)),
            HEAD_DIM=d, num_warps=4,
        )
    if target is not out:
        out.copy_(target)
    return out


def compiled_kernels(fn):
    """Every specialization of the jitted kernel ``fn`` compiled in this process, as
    ``(constexpr arguments by name, compiled kernel)`` pairs (diagnostics: which loop and
    launch configuration ran, registers, spills)."""
    for cache in getattr(fn, "device_caches", {}).values():
        for kern in cache[0].values():
            names = kern.src.fn.arg_names
            yield {names[k[0]] if isinstance(k, tuple) else k: v for k, v in kern.src.constants.items()}, kern


# ----------------------------------------------------------------------------------------
# Block-Attention baseline copy, and KV write
# ----------------------------------------------------------------------------------------


@triton.jit
def _rerotate_copy(
    K, V, Src, Dst, Cos, Sin,
    stride_kl, stride_kp, stride_ks, stride_kh,
    stride_vl, stride_vp, stride_vs, stride_vh,
    n_pages,
    ROWS: tl.constexpr, NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    PASS: tl.constexpr, PASS_P: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid ``(n_pages * row_blocks, num_layers)``: one block of one page of one layer."""
    n_rb: tl.constexpr = (ROWS + BLOCK_R - 1) // BLOCK_R
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    i = pid // n_rb
    rb = pid % n_rb
    src = tl.load(Src + i).to(tl.int64)
    dst = tl.load(Dst + i).to(tl.int64)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)  # row = slot * NUM_HEADS + head
    rm = r < ROWS
    slot = r // NUM_HEADS
    head = r % NUM_HEADS
    k_off = slot * stride_ks + head * stride_kh
    v_off = slot * stride_vs + head * stride_vh
    ks = K + layer * stride_kl + src * stride_kp + k_off
    kd = K + layer * stride_kl + dst * stride_kp + k_off
    vs = V + layer * stride_vl + src * stride_vp + v_off
    vd = V + layer * stride_vl + dst * stride_vp + v_off
    offs_d = tl.arange(0, HEAD_DIM)
    v = tl.load(vs[:, None] + offs_d[None, :], mask=rm[:, None])
    if HALF > 0:
        offs_h = tl.arange(0, HALF_P)
        hm = offs_h < HALF
        c = tl.load(Cos + i * HALF + offs_h, mask=hm, other=1.0)[None, :]
        s = tl.load(Sin + i * HALF + offs_h, mask=hm, other=0.0)[None, :]
        m2 = rm[:, None] & hm[None, :]
        k1 = tl.load(ks[:, None] + offs_h[None, :], mask=m2).to(tl.float32)
        k2 = tl.load(ks[:, None] + HALF + offs_h[None, :], mask=m2).to(tl.float32)
        if PASS > 0:
            offs_p = tl.arange(0, PASS_P)
            mp = rm[:, None] & (offs_p[None, :] < PASS)
            kp = tl.load(ks[:, None] + 2 * HALF + offs_p[None, :], mask=mp)
            tl.store(kd[:, None] + 2 * HALF + offs_p[None, :], kp, mask=mp)
        tl.store(kd[:, None] + offs_h[None, :], (k1 * c - k2 * s).to(K.dtype.element_ty), mask=m2)
        tl.store(kd[:, None] + HALF + offs_h[None, :], (k2 * c + k1 * s).to(K.dtype.element_ty), mask=m2)
    else:
        k = tl.load(ks[:, None] + offs_d[None, :], mask=rm[:, None])
        tl.store(kd[:, None] + offs_d[None, :], k, mask=rm[:, None])
    tl.store(vd[:, None] + offs_d[None, :], v, mask=rm[:, None])


def rerotate_copy_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Block-Attention baseline: copy pages ``src -> dst`` rotating keys by ``delta``.

    Same function as ``reference.rerotate_copy_ref``, one pass over the bytes.

    Parameters
    ----------
    k_cache, v_cache : ``(num_layers, num_pages, page_size, num_kv_heads, head_dim)``,
        last dim contiguous; written in place at ``dst_pages`` for every layer.
    src_pages, dst_pages : ``(n,)`` int page ids; no ``dst`` page may be another pair's
        ``src`` (each program reads its source and writes its destination).
    delta : ``(n,)`` int rotation in positions for each copied page.
    inv_freq : ``(rotary_dim // 2,)`` float32.
    """
    n_layers, _, page_size, hkv, d = k_cache.shape
    n = src_pages.numel()
    if n == 0 or n_layers == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous last dim")
    half = int(inv_freq.numel())
    pass_dim = d - 2 * half
    cos, sin = _cos_sin(delta.reshape(-1), inv_freq.to(k_cache.device))
    rows = page_size * hkv
    if block_rows is None:
        block_rows = min(_next_pow2(rows), max(16, 8192 // d))
    if num_warps is None:
        num_warps = 4
    n_rb = triton.cdiv(rows, block_rows)
    grid = (n * n_rb, n_layers)
    _rerotate_copy[grid](
        k_cache, v_cache, src_pages, dst_pages, cos, sin,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        n,
        ROWS=rows, NUM_HEADS=hkv, HEAD_DIM=d, HALF=half,
        HALF_P=max(1, _next_pow2(half)) if half else 1,
        PASS=pass_dim, PASS_P=max(1, _next_pow2(pass_dim)) if pass_dim else 1,
        BLOCK_R=block_rows, num_warps=num_warps,
    )


@triton.jit
def _write_kv(
    Kc, Vc, Slots, Kn, Vn,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        s = slot % PAGE_SIZE
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, HEAD_DIM)
        m = (h < NUM_HEADS)[:, None]
        k = tl.load(Kn + t * stride_knt + h[:, None] * stride_knh + d[None, :], mask=m)
        v = tl.load(Vn + t * stride_vnt + h[:, None] * stride_vnh + d[None, :], mask=m)
        tl.store(Kc + page * stride_kp + s * stride_ks + h[:, None] * stride_kh + d[None, :],
                 k.to(Kc.dtype.element_ty), mask=m)
        tl.store(Vc + page * stride_vp + s * stride_vs + h[:, None] * stride_vh + d[None, :],
                 v.to(Vc.dtype.element_ty), mask=m)


def write_kv_triton(k_cache, v_cache, slot_mapping, k, v) -> None:
    """Scatter new keys/values ``(n, num_kv_heads, head_dim)`` into one layer's pages
    ``(num_pages, page_size, num_kv_heads, head_dim)`` at flat slots ``slot_mapping``
    ``(n,)`` (``page * page_size + slot``). Same as ``reference.write_kv_ref``; a
    negative slot is skipped (padding)."""
    n = slot_mapping.numel()
    if n == 0:
        return
    _, page_size, hkv, d = k_cache.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _write_kv[(n,)](
        k_cache, v_cache, slot_mapping, k, v,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        PAGE_SIZE=page_size, NUM_HEADS=hkv, HEADS_P=_next_pow2(hkv), HEAD_DIM=d,
        num_warps=4,
    )
